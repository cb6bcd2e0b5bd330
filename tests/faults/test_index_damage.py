"""A damaged durable index (``<data_dir>/index/data.mdb``): truncated or with bytes
overwritten, then a real server started on it.

Each start either refuses with one line on stderr and exit 2, leaving no /dev/shm
arena and no ``kvstore.lock`` behind, or comes up and serves only exact bytes (a
record it cannot trust is a miss, never wrong KV). Never a signal, never a traceback.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tests.faults.conftest import shm_files
from tests.integration.client_worker import prompt_kv, prompt_tokens

pytestmark = pytest.mark.timeout(240)

N = 64  # 16 blocks a prompt
PROMPTS = range(12)


def _populate(server_factory, client_factory):
    """A data dir whose index holds NVMe records: prompts inserted, the reaper
    demotes them (low watermarks), the server stopped cleanly. Returns the server
    (stopped), the NVMe keys, and each prompt's blocks that sit on NVMe."""
    # No background writeback: which DRAM entries hold an NVMe copy when the server
    # stops would race the listing below (tests/integration/test_writeback.py).
    srv = server_factory(dram="256KiB", nvme="8MiB",
                         extra=("--high-watermark", "0.3", "--low-watermark", "0.1"),
                         env={"KVSTORE_POLICY_BACKGROUND_WRITEBACK": "false"})
    client = client_factory(srv)
    for pid in PROMPTS:
        client.insert(prompt_tokens(pid, N), prompt_kv(pid, N))
    deadline = time.monotonic() + 20
    while client.stats()["tiers"]["dram"]["used"] > 0.3 * (256 << 10):
        assert time.monotonic() < deadline, "no demotion"
        time.sleep(0.2)
    nvme = {e["key"] for e in client.ls(tier="nvme")}
    on_nvme = {pid: _leading(client.keys_for(prompt_tokens(pid, N)), nvme) for pid in PROMPTS}
    assert srv.stop() == 0
    assert sum(on_nvme.values()) > 0
    return srv, nvme, on_nvme


def _leading(keys, present) -> int:
    return next((i for i, k in enumerate(keys) if k not in present), len(keys))


def _start(srv, timeout: float = 30.0) -> int | None:
    """Start ``srv``; None once it listens, else its exit code (negative: a signal)."""
    srv.start(wait=False)
    deadline = time.monotonic() + timeout
    marker = f"listening on tcp://{srv.host}:{srv.port}"
    while time.monotonic() < deadline:
        if marker in srv.log()[srv._log_start:]:
            return None
        if srv.proc.poll() is not None:
            return srv.proc.returncode
        time.sleep(0.05)
    raise AssertionError(f"server neither listened nor exited:\n{srv.log()}")


def _refused_cleanly(srv, code: int, before_shm: set[str]) -> None:
    out = srv.log()[srv._log_start:]
    assert code == 2, f"exit {code}:\n{out}"
    lines = [ln for ln in out.splitlines() if ln.startswith("kvstore-server:")]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert shm_files(srv.data_dir) == before_shm, "a failed start left a DRAM arena in /dev/shm"
    assert not (srv.data_dir / "kvstore.lock").exists(), "a failed start left kvstore.lock"


def _served_exact(client, on_nvme) -> tuple[int, int]:
    """(bytes of the indexed NVMe blocks that came back, wrong bytes served)."""
    served = wrong = 0
    for pid, blocks in on_nvme.items():
        got = client.get(prompt_tokens(pid, N))
        want = prompt_kv(pid, N)[:got.kv.numel()] if got.matched_tokens else None
        if got.matched_tokens:
            wrong += int(np.count_nonzero(got.kv.numpy() != want))
            served += got.kv.numel()
    return served, wrong


def test_truncated_index_refuses_with_one_line(server_factory, client_factory, fault_log):
    srv, _, on_nvme = _populate(server_factory, client_factory)
    data = srv.data_dir / "index" / "data.mdb"
    pristine = data.read_bytes()
    indexed = sum(on_nvme.values()) * prompt_kv(0, 4).nbytes
    sizes = [0, 100, 4096, len(pristine) // 2, len(pristine) - 4096]
    survived = 0
    for size in sizes:
        data.write_bytes(pristine[:size])
        before = shm_files(srv.data_dir)
        code = _start(srv)
        assert code is not None, f"started on an index truncated to {size} bytes"
        _refused_cleanly(srv, code, before)
        assert "truncated" in srv.log()[srv._log_start:]
        survived += 1
    data.write_bytes(pristine)  # restored: every NVMe entry is served again
    assert _start(srv) is None
    client = client_factory(srv)
    served, wrong = _served_exact(client, on_nvme)
    assert wrong == 0 and served == indexed
    fault_log("truncated index/data.mdb (server start)", len(sizes), survived, 0)


def test_corrupted_index_never_crashes_or_serves_wrong_bytes(server_factory, client_factory,
                                                            fault_log):
    srv, _, on_nvme = _populate(server_factory, client_factory)
    data = srv.data_dir / "index" / "data.mdb"
    pristine = data.read_bytes()
    indexed = sum(on_nvme.values()) * prompt_kv(0, 4).nbytes
    rng = np.random.default_rng(13)
    tries, survived, lost = 12, 0, 0
    for _ in range(tries):
        damaged = bytearray(pristine)
        at = int(rng.integers(0, len(pristine) - 64))
        damaged[at:at + 16] = rng.bytes(16)
        data.write_bytes(bytes(damaged))
        before = shm_files(srv.data_dir)
        code = _start(srv)
        if code is not None:
            _refused_cleanly(srv, code, before)
            lost += indexed
        else:
            client = client_factory(srv)
            served, wrong = _served_exact(client, on_nvme)
            assert wrong == 0, f"damage at {at}: {wrong} wrong bytes served"
            lost += indexed - served
            assert srv.stop() == 0
        survived += 1
    fault_log("16 bytes overwritten in index/data.mdb (server start)", tries, survived, lost)


def test_a_start_whose_full_index_cannot_delete_rows_still_serves(tmp_path, server_factory,
                                                                  client_factory, fault_log):
    """A start deletes the index rows it will not serve: here every NVMe row, since
    the server comes back without its NVMe tier. With the index map full LMDB refuses
    that delete; before, the start ended with exit 2 ("MDB_MAP_FULL"). Now it leaves
    the rows in place (ignored), starts and serves; a start with a larger map
    deletes them. (The data dir is filled by a store in this process, as in
    tests/unit/test_store_index_split.py: rows with 1000-byte metas until the map
    refuses, which leaves LMDB no page to delete with.)"""
    from kvstore.store.facade import Store
    from kvstore.store.index import Index
    from tests.unit.conftest import fill_index_map, store_config

    data_dir = tmp_path / "data"
    with Store(store_config(data_dir, dram=64, nvme=256, index_map_bytes=32 << 10)) as store:
        rows = len(fill_index_map(store))
    small_map = {"KVSTORE_STORE_INDEX_MAP_BYTES": "32KiB"}
    srv = server_factory(data_dir=data_dir, dram="4MiB", nvme="0", env=small_map)
    out = srv.log()[srv._log_start:]
    assert f"{rows} index rows" in out and "left in place" in out, out
    client = client_factory(srv)
    assert client.ls() == []  # nothing of the old NVMe tier is served
    client.insert(prompt_tokens(500, N), prompt_kv(500, N))
    got = client.get(prompt_tokens(500, N))
    assert got.matched_tokens == N and np.array_equal(got.kv.numpy(), prompt_kv(500, N))
    assert srv.stop() == 0
    assert "Traceback" not in srv.log()
    roomy = server_factory(data_dir=data_dir, dram="4MiB", nvme="0",
                           env={"KVSTORE_STORE_INDEX_MAP_BYTES": "1MiB"})
    assert "left in place" not in roomy.log()[roomy._log_start:]
    assert roomy.stop() == 0
    idx = Index(data_dir / "index", map_size=1 << 20)
    try:
        assert len(idx) == 0  # deleted by the roomier start
    finally:
        idx.close()
    fault_log("start with the index map full and rows to delete (served)", 1, 1, 0)
