"""Faults: a server killed or stalled under a client, a client killed mid-insert or
mid-drop_select."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvstore.client.client import KVStoreClient
from kvstore.core.errors import KVTimeoutError, MissError, PeerUnavailableError
from kvstore.core.layout import KVLayout
from tests.integration.client_worker import digest, prompt_kv, prompt_tokens
from tests.integration.conftest import LAYOUT, REPO, server_env, wait_for

# The test layout with 32-token (4 KiB) blocks.
BIG = KVLayout(num_layers=LAYOUT.num_layers, kv_heads=LAYOUT.kv_heads, head_dim=LAYOUT.head_dim,
               dtype=LAYOUT.dtype, block_tokens=32)

pytestmark = pytest.mark.timeout(150)


def _kill_when_called(client, method: str, srv, admin, open_field: str) -> dict:
    """Wrap ``client._data.<method>`` (the TE move between Reserve/Acquire and
    Commit/Release): once the server shows the open reservation/lease to ``admin`` (its
    own channel), SIGKILL it and let the move run against the dead peer."""
    real, seen = getattr(client._data, method), {}

    def move(*args, **kwargs):
        seen[open_field] = admin.stats()[open_field]
        seen["nvme_keys"] = {e["key"] for e in admin.ls(tier="nvme")}
        srv.kill()  # SIGKILL and reap: the peer is gone before the transfer goes out
        seen["killed_at"] = time.monotonic()
        return real(*args, **kwargs)

    setattr(client._data, method, move)
    return seen


def _expect_miss_soon(call, seen: dict, bound_s: float) -> None:
    with pytest.raises(MissError):  # PeerUnavailable / Transfer / Timeout: all documented
        call()
    assert "killed_at" in seen, "the call failed before its transfer started"
    assert time.monotonic() - seen["killed_at"] < bound_s


def test_server_killed_mid_transfer_then_restarted_serves_nvme(server_factory, client_factory):
    # Low watermarks: the reaper demotes older entries to NVMe, leaving room in DRAM
    # (below the high watermark) for the 1 MiB insert the kill interrupts.
    # 4 KiB blocks: a tier slot is a page, so smaller blocks would waste most of it.
    srv = server_factory(dram="4MiB", nvme="32MiB", block_tokens=BIG.block_tokens,
                         extra=("--high-watermark", "0.5", "--low-watermark", "0.2"))
    client = client_factory(srv, layout=BIG, same_node=False, timeout_s=3.0,
                            staging_bytes=2 << 20)
    admin = client_factory(srv, timeout_s=3.0)
    ids, n, big = range(10), 2048, 8192  # 10 x 256 KiB, then one 1 MiB prompt over TE
    nblocks, bt = n // BIG.block_tokens, BIG.block_tokens
    for pid in ids:
        client.insert(prompt_tokens(pid, n), prompt_kv(pid, n))
    wait_for(lambda: admin.stats()["tiers"]["nvme"]["entries"] >= 3 * nblocks, 15, "demotion")
    last = [-1]

    def settled() -> bool:  # no demotion for longer than a reaper tick (0.5 s here)
        time.sleep(0.6)
        now = admin.stats()["demotions"]
        same, last[0] = now == last[0], now
        return same
    wait_for(settled, 10, "demotion to settle")

    # 1) Killed while an insert's TE write is in flight: a documented miss, in bounded
    # time (client timeout 3 s; TE's own minimum is 5 s).
    seen = _kill_when_called(client, "write", srv, admin, "reservations")
    _expect_miss_soon(lambda: client.insert(prompt_tokens(99, big), prompt_kv(99, big)),
                      seen, 3.0 + 5.0)
    assert seen["reservations"] == 1
    del client._data.write
    srv.start()  # same data dir
    assert admin.lookup(prompt_tokens(99, big)).matched_tokens == 0  # never committed

    # 2) Killed while a drop_select reads an NVMe entry (staged to DRAM, lease open).
    nvme_keys = {e["key"] for e in admin.ls(tier="nvme")}

    def nvme_prefix(pid: int) -> int:  # leading blocks of ``pid`` that are on NVMe
        keys = client.keys_for(prompt_tokens(pid, n))
        return next((i for i, k in enumerate(keys) if k not in nvme_keys), len(keys))

    whole = [pid for pid in ids if nvme_prefix(pid) == nblocks]
    assert len(whole) >= 3, f"only {whole} are wholly on NVMe"
    seen = _kill_when_called(client, "read", srv, admin, "leases")
    _expect_miss_soon(lambda: client.drop_select(prompt_tokens(whole[0], n), timeout=3.0),
                      seen, 3.0 + 5.0)
    # The leased entries were staged into DRAM for the read; their NVMe copies stay.
    assert seen["leases"] == 1
    assert nvme_keys - seen["nvme_keys"] == set(client.keys_for(prompt_tokens(whole[0], n)))
    del client._data.read

    # 3) Restarted: every committed NVMe entry is served again, the interrupted
    # drop_select's too (its drop never happened); DRAM-only entries are gone.
    srv.start()
    assert {e["key"] for e in admin.ls()} == nvme_keys
    served = set()
    for pid in ids:
        blocks = nvme_prefix(pid)
        got = client.drop_select(prompt_tokens(pid, n), timeout=3.0)  # says hello again
        assert got.matched_tokens == bt * blocks, pid
        if blocks:
            assert np.array_equal(got.kv.numpy(), prompt_kv(pid, n)[:BIG.nbytes(bt * blocks)])
            served |= set(client.keys_for(prompt_tokens(pid, n))[:blocks])
    # From the reader: its last drop_select's release was one-way, and the server
    # answers this client's next request after it (another client's may come first).
    stats = client.stats()
    # Left: NVMe blocks behind a DRAM block that died with the old server.
    assert stats["entries"] == len(nvme_keys - served)
    assert stats["leases"] == 0 and stats["reservations"] == 0


def test_client_killed_mid_insert_leaves_nothing_visible(server, client_factory):
    admin = client_factory(server)
    job = {"job": "hang_after_reserve", "servers": [server.address], "pid": 7, "ntokens": 40}
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.client_worker",
                             json.dumps(job)], stdout=subprocess.PIPE, text=True,
                            env=server_env(), cwd=REPO)
    try:
        line = wait_for(lambda: proc.stdout.readline(), 30, "the worker's reservation")
        assert json.loads(line) == {"reserved": 10}
        assert admin.stats()["reservations"] == 1
        assert admin.stats()["tiers"]["dram"]["used"] > 0
        assert admin.lookup(prompt_tokens(7, 40)).matched_tokens == 0  # invisible
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    # lease 2 s + reaper tick
    wait_for(lambda: admin.stats()["reservations"] == 0, 10, "the lease to be reaped")
    stats = admin.stats()
    assert stats["reservations_expired"] == 1 and stats["tiers"]["dram"]["used"] == 0
    assert admin.lookup(prompt_tokens(7, 40)).matched_tokens == 0
    assert admin.insert(prompt_tokens(7, 40), prompt_kv(7, 40)).new_blocks == 10
    assert admin.health(deep=True)["status"] == "ok"


def test_client_killed_mid_drop_select_its_lease_is_reclaimed(server_factory, client_factory):
    # A lease long enough to outlast the worker's read and report and the checks below
    # on a loaded machine: the claim must still hold when the admin tries to take it.
    srv = server_factory(read_lease=5.0)
    admin = client_factory(srv)
    admin.insert(prompt_tokens(8, 40), prompt_kv(8, 40))
    job = {"job": "hang_after_acquire", "servers": [srv.address], "pid": 8, "ntokens": 40,
           "same_node": False}
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.client_worker",
                             json.dumps(job)], stdout=subprocess.PIPE, text=True,
                            env=server_env(), cwd=REPO)
    try:
        line = json.loads(wait_for(lambda: proc.stdout.readline(), 30, "the worker's acquire"))
        assert line == {"acquired": 10, "digest": digest(prompt_kv(8, 40))}  # bytes moved
        stats = admin.stats()
        assert stats["leases"] == 1 and stats["leased_entries"] == 10
        # Claimed by the (stopped) consumer: nobody else gets it meanwhile.
        assert admin.drop_select(prompt_tokens(8, 40), timeout=0.5).matched_tokens == 0
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # dies between acquire and release
        proc.wait(10)
        proc.stdout.close()
    wait_for(lambda: admin.stats()["leases"] == 0, 15, "the read lease to be reaped")
    stats = admin.stats()
    assert stats["leases_expired"] == 1 and stats["leased_entries"] == 0
    assert stats["entries"] == 10  # released, not dropped: the consumer never finished
    got = admin.drop_select(prompt_tokens(8, 40))  # another consumer, exactly once
    assert got.matched_tokens == 40 and np.array_equal(got.kv.numpy(), prompt_kv(8, 40))
    assert admin.drop_select(prompt_tokens(8, 40), timeout=0.5).matched_tokens == 0
    stats = admin.stats()
    assert stats["entries"] == 0 and stats["leases"] == 0 and stats["tiers"]["dram"]["used"] == 0


def test_stalled_server_times_out_then_recovers(server, client_factory):
    client = client_factory(server, timeout_s=1.0)
    client.insert(prompt_tokens(3, 8), prompt_kv(3, 8))
    os.kill(server.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(KVTimeoutError):
            client.lookup(prompt_tokens(3, 8))
        assert time.monotonic() - start < 2.5
    finally:
        os.kill(server.pid, signal.SIGCONT)
    # The abandoned request's late reply must not be taken for this call's.
    assert client.lookup(prompt_tokens(3, 8)).matched_tokens == 8
    got = client.drop_select(prompt_tokens(3, 8))
    assert np.array_equal(got.kv.numpy(), prompt_kv(3, 8))


def test_a_server_that_dies_holding_a_request_is_unavailable_at_once(server_factory,
                                                                   client_factory):
    """A request already in the ROUTER's connection when the server dies is lost with
    the connection: ZeroMQ drops what a dead pipe holds, so no reply can ever come. The
    caller hears that the server is gone as soon as the connection drops, not a
    timeout at the end of its whole wait; a restarted server is reached again."""
    srv = server_factory()
    client = client_factory(srv, timeout_s=30.0, same_node=False)
    client.insert(prompt_tokens(4, 8), prompt_kv(4, 8))
    assert not client._rpc.local  # its requests go over the ROUTER
    os.kill(srv.pid, signal.SIGSTOP)  # the request goes into a live connection...
    killer = threading.Timer(2.0, os.kill, (srv.pid, signal.SIGKILL))  # ...that then dies
    killer.start()
    try:
        start = time.monotonic()
        with pytest.raises(PeerUnavailableError, match="dropped while stats waited"):
            client.stats()
        assert time.monotonic() - start < 15.0  # of the 30 s it was allowed
    finally:
        killer.join()  # (a SIGKILL ends a stopped process too)
    srv.stop()  # (reaped, its arena and socket removed)
    srv.start()
    assert client.stats()["entries"] == 0  # the same channel, on the new process


@pytest.mark.parametrize("same_node", [True, False])
def test_a_drop_select_given_up_on_takes_nothing_when_the_server_goes_on(server_factory,
                                                                           client_factory,
                                                                           same_node):
    """The server is frozen with a drop_select in its socket; the reader times out.
    When the server goes on it reaches that acquire after its deadline: refused
    (counted in late_reads), nothing leased, so the next reader gets the prompt at
    once instead of a miss until the read lease (30 s here) runs out. Both the
    same-node socket and the ROUTER (over TE, the deadline on the server's clock as
    the client's hello measured it). (Where the freeze caught the serving thread at
    work, the frozen time counts as that work's: the acquire, which waits less than
    that (``wait_s``), is answered busy on arrival instead, counted in busy.)"""
    server = server_factory(read_lease=30.0)
    client = client_factory(server, timeout_s=5.0, same_node=same_node)
    tokens, kv = prompt_tokens(11, 40), prompt_kv(11, 40)
    client.insert(tokens, kv)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(KVTimeoutError):
            client.drop_select(tokens, timeout=1.0)
        time.sleep(0.5)  # past the deadline by this much more when the server goes on
    finally:
        os.kill(server.pid, signal.SIGCONT)
    with KVStoreClient(server.address, timeout_s=5.0) as admin:
        wait_for(lambda: (lambda s: s["late_reads"] + s["busy"])(admin.stats()) == 1, 10,
                 "the late acquire's refusal")
        stats = admin.stats()
        assert (stats["leases"], stats["leased_entries"]) == (0, 0), stats
    got = client.drop_select(tokens, timeout=5.0)
    assert got.matched_tokens == 40 and np.array_equal(got.kv.numpy(), kv)
