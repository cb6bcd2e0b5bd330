"""Push-back: while kvstore-server is busy with slow work (here an admin verify
reading a whole NVMe tier), a request that cannot start within
``server.busy_after_s`` is answered ``busy`` at once — a clear miss — instead of
waiting until the client times out. Real server process, real NVMe slab."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore.core import protocol as p
from kvstore.core.errors import BusyError, KVStoreError
from kvstore.core.layout import KVLayout

pytestmark = pytest.mark.timeout(180)

BIG = KVLayout(num_layers=32, kv_heads=8, head_dim=128, dtype="float16", block_tokens=16)
PROMPT = 64  # tokens: 4 blocks of 2 MiB


def _tokens(pid: int) -> list[int]:
    return [1_000_000 + pid, *range(PROMPT - 1)]


def _kv(pid: int) -> np.ndarray:
    return np.random.default_rng(pid).integers(0, 256, BIG.nbytes(PROMPT), dtype=np.uint8)


def _patient(fn, *args):
    """Set-up calls: the reaper's demotions may make the server busy for a moment."""
    for _ in range(100):
        try:
            return fn(*args)
        except BusyError:
            time.sleep(0.05)
    raise AssertionError("busy for 5 s")


def test_a_request_behind_slow_work_is_answered_busy_at_once(server_factory, client_factory):
    srv = server_factory(dram="1GiB", nvme="2GiB",
                         env={"KVSTORE_SERVER_BUSY_AFTER_S": "0.1",
                              "KVSTORE_POLICY_BACKGROUND_WRITEBACK": "false"})
    admin = client_factory(srv, layout=BIG, timeout_s=120.0)
    for pid in range(96):  # 768 MiB
        res = _patient(admin.insert, _tokens(pid), _kv(pid))
        assert res.new_blocks == 4, (pid, res)
    moved = _patient(admin._rpc.call, p.Demote(tier="dram", everything=True))
    assert moved["demoted"] == 4 * 96, moved  # all of it on NVMe now
    start = time.monotonic()
    _patient(admin.verify)  # reads and checksums every NVMe byte
    alone = time.monotonic() - start
    assert alone > 0.3, f"verify took {alone:.2f} s: too short to be behind"

    other = client_factory(srv, layout=BIG, timeout_s=30.0)  # over the ZeroMQ port
    neighbour = client_factory(srv, layout=BIG, timeout_s=30.0)
    _patient(neighbour.hello)
    assert neighbour._rpc.local  # over the same-node socket
    done = threading.Event()
    worker = threading.Thread(target=lambda: (admin.verify(), done.set()))
    worker.start()
    time.sleep(0.2)  # the verify is in flight (it alone takes > 0.3 s)
    asked = time.monotonic()
    # the same-node socket's requests are pushed back the same way, meanwhile
    local_busy: list[BaseException] = []
    beside = threading.Thread(target=lambda: local_busy.append(
        pytest.raises(BusyError, neighbour._rpc.call, p.Stats()).value))
    beside.start()
    with pytest.raises(BusyError, match="busy"):
        other._rpc.call(p.Stats())
    answered = time.monotonic() - asked
    beside.join()
    worker.join()
    assert done.is_set()
    assert len(local_busy) == 1 and "busy" in str(local_busy[0])
    # At once: well before the verify in flight ended, and nowhere near the client's
    # 30 s timeout. (Not a speed target: the point is busy instead of a timeout.)
    assert answered < alone
    stats = _patient(other.stats)
    assert stats["busy"] >= 1 and stats["checksum_failures"] == 0
    # A release (or abort) is never refused, however long it waits: it only gives
    # back what the server holds, and drop_select sends its last release one-way.
    worker = threading.Thread(target=admin.verify)
    worker.start()
    time.sleep(0.2)  # the verify is in flight again
    with pytest.raises(KVStoreError) as refused:  # no such lease: answered, not busy
        other._rpc.call(p.Release(aid=12345, drop=False))
    assert not isinstance(refused.value, BusyError), refused.value
    worker.join()
    got = _patient(other.drop_select, _tokens(0))  # served normally again
    assert got.matched_tokens == PROMPT and np.array_equal(got.kv.numpy(), _kv(0))
