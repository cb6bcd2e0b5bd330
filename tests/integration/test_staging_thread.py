"""The request thread never waits on NVMe: an acquire whose prefix lives on NVMe is
staged by the server's staging thread, and the requests behind it are served
meanwhile; one that cannot start in time is answered ``busy`` and gives back all it
held. A real server (sockets, threads, store, NVMe slab, TE) run in this process, so
that the test can hold the NVMe tier's own I/O lock: every NVMe read waits on it,
as it would on a slow disk."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from kvstore.client.client import KVStoreClient
from kvstore.core.config import KVStoreConfig
from kvstore.core.errors import BusyError
from kvstore.server.cli import open_server

from tests.integration.conftest import LAYOUT, free_port, make_kv

pytestmark = pytest.mark.timeout(120)
TOKENS = 64  # 16 blocks of 512 B


def _tokens(pid: int) -> list[int]:
    return [10_000 + pid, *range(TOKENS - 1)]


@contextmanager
def _serving(data_dir: Path, busy_after_s: float = 5.0):
    cfg = KVStoreConfig().replace(
        tiers={"dram_bytes": 4 << 20, "nvme_bytes": 8 << 20, "nvme_fsync": "never"},
        server={"host": "127.0.0.1", "port": free_port(), "busy_after_s": busy_after_s},
        store={"data_dir": str(data_dir), "block_tokens": LAYOUT.block_tokens})
    server = open_server(cfg)
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    clients: list[KVStoreClient] = []

    def client() -> KVStoreClient:
        c = KVStoreClient(f"tcp://127.0.0.1:{cfg.server.port}", layout=LAYOUT, timeout_s=30,
                          same_node=False)
        clients.append(c)
        return c

    try:
        yield server, client
    finally:
        for c in clients:
            c.close()
        server.stop()
        loop.join(10)
        server.close()


def _store_on_nvme(server, client, pids) -> None:
    for pid in pids:
        client.insert(_tokens(pid), make_kv(TOKENS, seed=pid))
    server.store.demote_entries(tier="dram", everything=True)
    assert client.stats()["tiers"]["nvme"]["entries"] == len(pids) * TOKENS // 4


def _until(pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _in_thread(fn, *args):
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_requests_are_served_while_an_acquire_waits_on_nvme(tmp_path):
    with _serving(tmp_path / "data") as (server, client):
        reader, other = client(), client()
        _store_on_nvme(server, other, [1])
        nvme = server.store.place.tiers["nvme"]
        with nvme._io_lock:  # every NVMe read waits: a disk that does not answer
            t, box = _in_thread(reader.drop_select, _tokens(1))
            _until(lambda: server.store.place.staging_in_flight)  # begun, handed over
            # The request thread goes on: a lookup, an insert, stats, all answered.
            assert other.lookup(_tokens(1)).matched_tokens == TOKENS
            other.insert(_tokens(2), make_kv(TOKENS, seed=2))
            assert other.lookup(_tokens(2)).matched_tokens == TOKENS
            assert other.stats()["entries"] >= TOKENS // 4
            assert t.is_alive()  # the drop_select still waits on NVMe
        t.join(30)
        got = box["value"]
        assert got.matched_tokens == TOKENS
        assert np.array_equal(got.kv.numpy(), make_kv(TOKENS, seed=1)[:got.kv.numel()])
        # Asked by the reader: its drop_select's last release is one-way, applied before
        # its own next request, not necessarily before another client's.
        assert reader.lookup(_tokens(1)).matched_tokens == 0  # taken: dropped there
        assert other.drop_select(_tokens(2)).matched_tokens == TOKENS
        other.health(deep=True)  # the store's integrity check: nothing held or leaked
        assert other.stats()["entries"] == 0


def test_an_acquire_that_cannot_start_in_time_is_busy_and_gives_back_all(tmp_path):
    with _serving(tmp_path / "data", busy_after_s=0.3) as (server, client):
        first, second, other = client(), client(), client()
        _store_on_nvme(server, other, [3, 4])
        nvme = server.store.place.tiers["nvme"]
        with nvme._io_lock:
            t1, box1 = _in_thread(first.drop_select, _tokens(3))
            _until(lambda: len(server.store.place.staging_in_flight) == 1)
            t2, box2 = _in_thread(second.drop_select, _tokens(4))  # queued behind it
            _until(lambda: len(server.store.place.staging_in_flight) == 2)
            time.sleep(0.5)  # past busy_after_s before the second can start
        t1.join(30)
        t2.join(30)
        assert box1["value"].matched_tokens == TOKENS  # started in time: served
        assert isinstance(box2.get("error"), BusyError), box2
        other.health(deep=True)  # the busy one's holds, claim and staging room are back
        assert not server.store.place.staging_in_flight
        got = other.drop_select(_tokens(4))  # still stored, still takeable
        assert got.matched_tokens == TOKENS
        assert np.array_equal(got.kv.numpy(), make_kv(TOKENS, seed=4)[:got.kv.numel()])
        assert other.stats()["busy"] >= 1
