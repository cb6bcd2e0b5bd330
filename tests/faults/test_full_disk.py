"""A full file system under the data dir (a real, small tmpfs, filled up).

Writes that need index space fail with ``StorageError`` (counted, logged); the
server stays up and serves every entry it committed; once space is back, writes
succeed again and a restart keeps the NVMe entries. ``kvstore evict`` works on the
full disk (the index's reserve), and the room it makes takes new entries.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvstore.core import protocol as p
from kvstore.core.errors import StorageError, TierFullError
from tests.faults.conftest import fill, needs_root
from tests.integration.client_worker import prompt_kv, prompt_tokens
from tests.integration.conftest import REPO, server_env

pytestmark = [needs_root, pytest.mark.timeout(180)]

N = 64  # tokens per prompt: 16 blocks of 512 B (a 4 KiB DRAM page each)


def _exact(client, pid: int, n: int = N) -> bool:
    got = client.get(prompt_tokens(pid, n))
    return got.matched_tokens == n and np.array_equal(got.kv.numpy(), prompt_kv(pid, n))


@pytest.mark.parametrize("path", ["shm", "te"])
def test_full_disk_fails_writes_clearly_and_loses_nothing(small_fs, server_factory,
                                                          client_factory, fault_log, path):
    mnt = small_fs("8m")
    # DRAM holds ~1000 entries: inserts past it demote to the NVMe slab (on the
    # small file system, fallocated at start), whose records go to the synced index.
    srv = server_factory(data_dir=mnt / "data", dram="4MiB", nvme="2MiB")
    client = client_factory(srv, same_node=(path == "shm"))
    stored = []
    for pid in range(20):
        client.insert(prompt_tokens(pid, N), prompt_kv(pid, N))
        stored.append(pid)
    filler = fill(mnt)

    failures, tries = 0, 0
    for pid in range(100, 170):  # 1120 entries more: DRAM overflows, demotes to NVMe
        tries += 1
        try:
            client.insert(prompt_tokens(pid, N), prompt_kv(pid, N))
            stored.append(pid)
        except StorageError as exc:
            failures += 1
            assert "No space left on device" in str(exc) or "file system full" in str(exc), exc
        except TierFullError:
            pass  # NVMe full too: a plain miss for the writer
        assert srv.proc.poll() is None, f"server died:\n{srv.log()}"
    assert failures > 0, "the file system never ran out"
    stats = client.stats()
    assert stats["storage_errors"] >= failures
    assert "index writes failed so far" in srv.log()
    assert "Traceback" not in srv.log()

    # Everything committed is still there, exact (DRAM + NVMe hold all of it).
    assert stats["evictions"] == 0
    lost = sum(not _exact(client, pid) for pid in stored)
    filler.unlink()
    client.insert(prompt_tokens(999, N), prompt_kv(999, N))  # space back: writes work
    assert _exact(client, 999)
    # A restart keeps every NVMe entry and every NVMe copy of a DRAM entry (staged by
    # the reads above, or written by the background writeback, which goes on until
    # the server stops): those come back from NVMe, and nothing that was not stored.
    stored_keys = {e["key"]: e for e in client.ls()}
    on_nvme = {k for k, e in stored_keys.items()
               if e["tier"] == "nvme" or e["nvme_copy"] is not None}
    srv.restart()
    back = {e["key"] for e in client.ls(tier="nvme")}
    assert on_nvme <= back <= set(stored_keys)
    fault_log(f"full file system under the data dir ({path} writes)", tries,
              tries if srv.proc.poll() is None else 0, lost * prompt_kv(0, N).nbytes)
    assert lost == 0


def test_restart_while_the_disk_is_still_full(small_fs, server_factory, client_factory,
                                              fault_log):
    """The issue's worst case: the disk stays full across a restart. The server must
    not crash: it starts and serves what it has, or refuses with one line; either
    way nothing committed is lost once space is back."""
    import time

    mnt = small_fs("8m")
    srv = server_factory(data_dir=mnt / "data", dram="4MiB", nvme="2MiB",
                         env={"KVSTORE_POLICY_BACKGROUND_WRITEBACK": "false"})
    client = client_factory(srv)
    for pid in range(20):
        client.insert(prompt_tokens(pid, N), prompt_kv(pid, N))
    # On NVMe (what a restart keeps): all 20 prompts, demoted before the disk fills.
    moved = client._rpc.call(p.Demote(tier="dram", everything=True))
    assert moved["demoted"] == 20 * N // 4, moved
    filler = fill(mnt)
    assert srv.stop() == 0
    srv.start(wait=False)
    deadline = time.monotonic() + 30
    marker = f"listening on tcp://{srv.host}:{srv.port}"
    while marker not in srv.log()[srv._log_start:] and srv.proc.poll() is None:
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.05)
    out = srv.log()[srv._log_start:]
    assert "Traceback" not in out and srv.proc.poll() in (None, 2), out
    started = srv.proc.poll() is None
    if not started:  # refused: exactly one line says why
        assert len([ln for ln in out.splitlines() if ln.startswith("kvstore-server:")]) == 1
    filler.unlink()
    if not started:
        srv.start()
    client = client_factory(srv)
    # What was committed to NVMe before the restart is served again, exact (DRAM
    # entries are volatile by design: a restart drops them).
    lost = sum(not _exact(client, pid) for pid in range(20))
    fault_log("restart with the data dir's file system still full "
              f"({'served' if started else 'refused with one line'})", 1, 1,
              lost * prompt_kv(0, N).nbytes)
    assert lost == 0


def _kvstore(*args: str) -> subprocess.CompletedProcess:
    """The operator's ``kvstore`` command line, as a separate process."""
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True,
                          text=True, timeout=120, env=server_env(), cwd=REPO)


def test_evict_frees_room_on_a_full_disk(small_fs, server_factory, client_factory,
                                         tmp_path, fault_log):
    """``kvstore evict`` is the operator's remedy for a full disk, but LMDB copies every
    page it changes, so even a delete needs free pages: on a full file system the
    evict failed with ENOSPC, as did the server's own eviction. Now the index lends
    a delete its reserve, and an evict the index still refuses at once goes in
    chunks; the entries left are intact, and the room it made takes new entries
    while the disk is still full."""
    mnt = small_fs("64m")
    # The slab is off the small file system (it is preallocated anyway), so the index
    # on it can grow past its reserve: half of its rows are more than the reserve can
    # copy in one transaction.
    srv = server_factory(data_dir=mnt / "data", dram="4MiB", nvme="512MiB",
                         extra=("--nvme-path", str(tmp_path / "nvme.slab")),
                         env={"KVSTORE_POLICY_BACKGROUND_WRITEBACK": "false"})
    client = client_factory(srv)
    n = 256  # tokens per prompt: 64 entries; DRAM holds 16 such prompts
    demote = p.Demote(tier="dram", everything=True)
    pid = 0
    for _ in range(80):  # ~77,000 NVMe entries: an index of ~24 MB
        for _ in range(15):
            client.insert(prompt_tokens(pid, n), prompt_kv(pid, n))
            pid += 1
        client._rpc.call(demote)
    filler = fill(mnt)
    give_up = pid + 300
    while True:  # until the index cannot grow: its free pages are used up too
        assert pid < give_up, "the index never ran out of room"
        for _ in range(15):
            client.insert(prompt_tokens(pid, n), prompt_kv(pid, n))
            pid += 1
        try:
            client._rpc.call(demote)
        except StorageError as exc:
            assert "No space left on device" in str(exc), exc
            break
    before = {e["key"] for e in client.ls(tier="nvme")}

    proc = _kvstore("evict", "--server", srv.address, "--tier", "nvme", "--fraction", "0.5",
                    "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in srv.log() and srv.proc.poll() is None, srv.log()
    assert "at a time" in srv.log()  # half the index was too much for one transaction
    after = {e["key"] for e in client.ls(tier="nvme")}
    [evicted] = json.loads(proc.stdout)
    assert evicted["count"] == len(before - after)
    assert {bytes.fromhex(k) for k in evicted["keys"]} <= before - after  # (the first ones)
    assert len(after) == len(before) - len(before) // 2, (len(before), len(after))
    # What is left is intact (every checksum re-checked from NVMe) ...
    checked = client_factory(srv, timeout_s=120).verify()  # (all of them, in one call)
    assert checked["bad"] == [] and checked["checked"] >= len(after), checked
    # ... and the room it made takes new NVMe entries, the disk still full: what DRAM
    # kept from the refused demotions, then new prompts.
    assert client._rpc.call(demote)["evicted"] == 0
    first_new = pid
    for _ in range(15):
        client.insert(prompt_tokens(pid, n), prompt_kv(pid, n))
        pid += 1
    moved = client._rpc.call(demote)
    assert (moved["demoted"], moved["evicted"]) == (15 * n // 4, 0)
    assert all(_exact(client, q, n) for q in range(first_new, pid))
    # (those reads staged the new entries into DRAM: each keeps its NVMe copy)
    stored = {e["key"] for e in client.ls() if e["tier"] == "nvme" or e["nvme_copy"] is not None}
    assert after < stored

    # A restart (the disk made roomy again) brings back exactly what was stored.
    filler.unlink()
    srv.restart()
    assert {e["key"] for e in client.ls(tier="nvme")} == stored
    assert all(_exact(client, q, n) for q in range(first_new, pid))
    from kvstore.store.index import RESERVE_BYTES, RESERVE_NAME

    reserve = mnt / "data" / "index" / RESERVE_NAME  # spent by the evict, made again
    assert reserve.stat().st_size == RESERVE_BYTES
    fault_log("kvstore evict on a full file system under the data dir", 1,
              int(srv.proc.poll() is None), 0)


def test_the_server_evicts_from_nvme_on_a_full_disk(small_fs, server_factory, client_factory,
                                                    tmp_path, fault_log):
    """A full NVMe tier makes room by evicting its least recently used entries, which
    deletes index rows: on a full file system that delete failed, so the tier stayed
    full and the newest entries were dropped instead (or the demotion failed). With
    the index's reserve the oldest go, as always, and every demotion goes on."""
    mnt = small_fs("32m")
    srv = server_factory(data_dir=mnt / "data", dram="4MiB", nvme="64MiB",
                         extra=("--nvme-path", str(tmp_path / "nvme.slab")),
                         env={"KVSTORE_POLICY_BACKGROUND_WRITEBACK": "false"})
    client = client_factory(srv)
    n = 256  # tokens per prompt: 64 entries, a 4 KiB NVMe page each
    demote = p.Demote(tier="dram", everything=True)

    def round_(first: int) -> dict:
        for q in range(first, first + 15):
            client.insert(prompt_tokens(q, n), prompt_kv(q, n))
        return client._rpc.call(demote)

    for r in range(16):  # 15,360 of the tier's 16,384 pages: just under its high watermark
        round_(15 * r)
    assert client.stats()["evictions"] == 0
    filler = fill(mnt)
    for r in range(16, 26):  # over the high watermark: the tier sheds its LRU to the low one
        moved = round_(15 * r)  # (its "evicted": the NVMe entries shed for them)
        assert moved["demoted"] == 15 * n // 4, (moved["demoted"], moved["evicted"])
        assert srv.proc.poll() is None and "Traceback" not in srv.log(), srv.log()
    assert client.stats()["evictions"] > 0
    assert all(_exact(client, q, n) for q in range(15 * 21, 15 * 26))  # the newest stay
    assert client.lookup(prompt_tokens(0, n)).matched_tokens == 0  # the oldest went
    assert client_factory(srv, timeout_s=120).verify()["bad"] == []
    filler.unlink()
    fault_log("NVMe tier evicting on a full file system under the data dir", 10,
              10 if srv.proc.poll() is None else 0, 0)
