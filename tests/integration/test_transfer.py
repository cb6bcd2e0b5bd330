"""kvstore.transport.te: coalescing (pure, hypothesis) and real TE transfers over TCP
between this process and a te_peer process (loopback ports, no namespaces)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.core.errors import ConfigError, InvalidRequestError, PeerUnavailableError, TransferError
from kvstore.transport.te import (MAX_BATCH_ENTRIES, STREAM_NAP_S, STREAM_WINDOW, Transport,
                                  coalesce)
from tests.integration.te_peer import REPO, PeerProcess
from tools.etcd_proc import start_etcd

PEER_BYTES = 4 << 20
LOCAL_BYTES = 8 << 20


# ------------------------------------------------------------------ coalesce
def _byte_pairs(local, remote, lengths) -> Counter:
    return Counter((int(lo) + k, int(r) + k) for lo, r, n in zip(local, remote, lengths)
                   for k in range(int(n)))


entries = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200), st.integers(0, 12)),
                   max_size=40)


@given(entries)
def test_coalesce_moves_exactly_the_same_bytes(items):
    local, remote, lengths = (list(c) for c in zip(*items)) if items else ([], [], [])
    out = coalesce(local, remote, lengths)
    assert _byte_pairs(*out) == _byte_pairs(local, remote, lengths)
    assert len(out[2]) <= len(lengths) and (out[2] > 0).all()


@st.composite
def runs(draw):
    """Disjoint runs contiguous on both sides, cut into blocks and shuffled."""
    nruns = draw(st.integers(1, 8))
    local, remote, lengths, pos = [], [], [], 0
    for _ in range(nruns):
        blocks = draw(st.lists(st.integers(1, 64), min_size=1, max_size=10))
        loc0, rem0 = pos + draw(st.integers(1, 50)), 10_000 + pos * 3
        off = 0
        for n in blocks:
            local.append(loc0 + off), remote.append(rem0 + off), lengths.append(n)
            off += n
        pos = loc0 + off
    order = draw(st.permutations(range(len(lengths))))
    return [local[i] for i in order], [remote[i] for i in order], [lengths[i] for i in order], nruns


@given(runs())
def test_coalesce_merges_each_contiguous_run_into_one(case):
    local, remote, lengths, nruns = case
    _, _, out_len = coalesce(local, remote, lengths)
    assert len(out_len) == nruns
    assert int(out_len.sum()) == sum(lengths)


def test_coalesce_keeps_gaps_on_either_side_apart():
    # contiguous locally only, remotely only, and on both sides
    assert len(coalesce([0, 10], [0, 11], [10, 10])[2]) == 2
    assert len(coalesce([0, 11], [0, 10], [10, 10])[2]) == 2
    assert coalesce([0, 10], [100, 110], [10, 10])[2].tolist() == [20]


@settings(deadline=None)
@given(st.integers(1, 4096))
def test_coalesce_vectorised_over_a_long_prompt(nblocks):
    starts = np.arange(nblocks, dtype=np.int64) * 4096
    out = coalesce(starts + (1 << 40), starts + (1 << 41),
                   np.full(nblocks, 4096))
    assert out[2].tolist() == [nblocks * 4096]


def test_coalesce_rejects_bad_input():
    with pytest.raises(InvalidRequestError):
        coalesce([0, 1], [0], [1, 1])
    with pytest.raises(InvalidRequestError):
        coalesce([0], [0], [-1])
    with pytest.raises(InvalidRequestError):
        coalesce(["x"], [0], [1])
    with pytest.raises(InvalidRequestError):
        coalesce([0.5], [0], [1])  # never silently truncated to an address
    assert len(coalesce([], [], [])[2]) == 0


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def peer():
    proc = PeerProcess(PEER_BYTES, fill_seed=3, timeout_s=5)
    yield proc.info
    proc.kill()


@pytest.fixture(scope="module")
def te():
    transport = Transport(timeout_s=5)
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def local(te):
    return te.allocate_buffer(LOCAL_BYTES)


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _read_remote(te, local, peer, offset: int, n: int, scratch: int = 7 << 20) -> np.ndarray:
    te.read(peer.segment, [local.address + scratch], [peer.address + offset], [n])
    return local.array[scratch:scratch + n].copy()


# ----------------------------------------------------------------- transfers
@pytest.mark.timeout(60)
def test_write_then_read_back(te, local, peer):
    data = _random(1 << 20, 1)
    local.array[:len(data)] = data
    stats = te.write(peer.segment, [local.address], [peer.address], [len(data)])
    assert stats.nbytes == len(data) and stats.transfers == 1 and stats.seconds > 0
    local.array[1 << 20:2 << 20] = 0
    te.read(peer.segment, [local.address + (1 << 20)], [peer.address], [len(data)])
    assert np.array_equal(local.array[1 << 20:2 << 20], data)


@pytest.mark.timeout(60)
def test_many_scattered_blocks_in_one_call(te, local, peer):
    n, block = 3 * MAX_BATCH_ENTRIES + 5, 512  # more than one TE batch
    data = _random(n * block, 2)
    local.array[:len(data)] = data
    perm = np.random.default_rng(2).permutation(n)
    loc = local.address + np.arange(n) * block
    rem = peer.address + perm * (2 * block)  # gaps: nothing merges
    stats = te.write(peer.segment, loc, rem, np.full(n, block))
    assert stats.transfers == n and stats.nbytes == n * block

    back = _read_remote(te, local, peer, 0, 2 * n * block, scratch=4 << 20)
    for i in (0, 1, n // 2, n - 1):
        got = back[perm[i] * 2 * block: perm[i] * 2 * block + block]
        assert np.array_equal(got, data[i * block:(i + 1) * block])


@pytest.mark.timeout(60)
def test_contiguous_blocks_go_as_one_transfer_and_raw_mode_keeps_them(te, local, peer):
    n, block = 2048, 1024  # a 32k-token prompt at 16 tokens a block
    data = _random(n * block, 4)
    local.array[:len(data)] = data
    loc = local.address + np.arange(n) * block
    rem = peer.address + np.arange(n) * block
    assert te.write(peer.segment, loc, rem, [block] * n).transfers == 1
    assert np.array_equal(_read_remote(te, local, peer, 0, n * block, scratch=4 << 20), data)
    assert te.read(peer.segment, loc, rem, [block] * n, merge=False).transfers == n


@pytest.mark.timeout(60)
def test_remote_range_outside_registration_fails_and_changes_nothing(te, local, peer):
    tail = peer.nbytes - 4096
    before = _read_remote(te, local, peer, tail, 4096)
    local.array[:8192] = _random(8192, 5)
    for offset, n in ((peer.nbytes - 256, 512), (peer.nbytes + (1 << 30), 64)):
        with pytest.raises(TransferError, match=peer.segment) as err:
            te.write(peer.segment, [local.address], [peer.address + offset], [n])
        assert not isinstance(err.value, PeerUnavailableError)
        assert f"{n} bytes" in str(err.value)
    assert not te.is_dead(peer.segment)  # the peer is alive: no fail-fast
    assert np.array_equal(_read_remote(te, local, peer, tail, 4096), before)


@pytest.mark.timeout(60)
def test_threads_share_one_transport(te, local, peer):
    """Four threads, each its own 256 KiB slice: the lock serialises TE calls."""
    size = 256 << 10
    data = _random(4 * size, 6)
    local.array[:len(data)] = data

    def move(i: int) -> None:
        for _ in range(5):
            te.write(peer.segment, [local.address + i * size], [peer.address + i * size], [size])

    threads = [threading.Thread(target=move, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not any(t.is_alive() for t in threads)
    assert np.array_equal(_read_remote(te, local, peer, 0, 4 * size), data)


def test_local_range_must_be_registered(te, local, peer):
    junk = np.zeros(64, dtype=np.uint8)
    with pytest.raises(InvalidRequestError, match="not inside a region"):
        te.write(peer.segment, [junk.ctypes.data], [peer.address], [64])
    with pytest.raises(InvalidRequestError):  # runs past the end of the buffer
        te.write(peer.segment, [local.address + LOCAL_BYTES - 8], [peer.address], [64])
    with pytest.raises(InvalidRequestError):
        te.write(peer.segment, [local.address], [peer.address, peer.address], [8])
    with pytest.raises(InvalidRequestError, match="segment"):
        te.write(b"127.0.0.1:1", [local.address], [peer.address], [8])


def test_empty_transfer_is_a_no_op(te, peer):
    assert te.write(peer.segment, [], [], []).transfers == 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(20)
def test_unknown_segment_fails_fast_and_is_remembered(te, local):
    segment = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(PeerUnavailableError, match=segment):
        te.write(segment, [local.address], [4096], [64])
    assert te.is_dead(segment)
    with pytest.raises(PeerUnavailableError, match="failed earlier"):
        te.read(segment, [local.address], [4096], [64])
    te.mark_alive(segment)
    assert not te.is_dead(segment)


@pytest.mark.timeout(40)
def test_killed_peer_fails_in_bounded_time(te, local):
    with PeerProcess(1 << 20, timeout_s=5) as victim:
        info = victim.info
        te.write(info.segment, [local.address], [info.address], [4096])
        victim.kill()
        with pytest.raises(PeerUnavailableError, match=info.segment):
            te.write(info.segment, [local.address], [info.address], [1 << 20])
    assert te.is_dead(info.segment)
    with pytest.raises(PeerUnavailableError):
        te.read(info.segment, [local.address], [info.address], [64])


@pytest.mark.timeout(40)
def test_stalled_peer_fails_within_the_timeout():
    """SIGSTOP: the peer's port still accepts, nothing answers; TE's own timeout ends it."""
    with PeerProcess(16 << 20, timeout_s=3) as victim, Transport(timeout_s=3) as t:
        info = victim.info
        buf = t.allocate_buffer(16 << 20)
        t.write(info.segment, [buf.address], [info.address], [4096])
        os.kill(info.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(PeerUnavailableError, match="not answering"):
                t.write(info.segment, [buf.address], [info.address], [16 << 20])
            assert time.monotonic() - start < 30  # bounded (the bound here is ~3 s)
            assert t.is_dead(info.segment)
        finally:
            os.kill(info.pid, signal.SIGCONT)


# -------------------------------------------------------------- registration
def test_registration_books(te):
    buf = te.allocate_buffer(10_000)
    assert buf.address % 4096 == 0 and len(buf.array) == 10_000
    with pytest.raises(InvalidRequestError, match="overlap"):
        te.register(buf.address, 4096)
    with pytest.raises(InvalidRequestError, match="overlap"):
        te.register(buf.address + 4096, 4096)
    with pytest.raises(InvalidRequestError):
        te.register(0, 4096)
    te.unregister(buf.address)
    with pytest.raises(InvalidRequestError, match="no region"):
        te.unregister(buf.address)
    assert buf.address not in {r.address for r in te.regions()}


def test_register_many_is_all_or_nothing():
    with Transport(timeout_s=5) as t:
        arena = np.zeros(3 * 4096, dtype=np.uint8)
        base = arena.ctypes.data
        with pytest.raises(InvalidRequestError):
            t.register_many([(base, 4096), (base + 2048, 4096)])
        assert t.regions() == []
        regions = t.register_many([(base, 4096, "cpu:0"), (base + 4096, 8192)])
        assert [r.nbytes for r in t.regions()] == [4096, 8192] == [r.nbytes for r in regions]
    assert t.regions() == []


def test_close_twice_and_use_after_close():
    t = Transport(timeout_s=5)
    buf = t.allocate_buffer(4096)
    t.close()
    t.close()
    assert t.regions() == []
    with pytest.raises(InvalidRequestError, match="closed"):
        t.write("127.0.0.1:1", [buf.address], [0], [8])
    with pytest.raises(InvalidRequestError, match="closed"):
        t.register(buf.address, 4096)


def test_bad_configuration_is_refused(monkeypatch):
    with pytest.raises(ConfigError, match="metadata"):
        Transport(metadata="bogus")
    with pytest.raises(ConfigError, match="not an address of this machine"):
        Transport(host="192.0.2.1")
    with pytest.raises(ConfigError, match="timeout"):
        Transport(timeout_s=0)
    monkeypatch.setenv("MC_LOG_DIR", "/tmp")  # would abort the whole test process
    with pytest.raises(ConfigError, match="MC_LOG_DIR"):
        Transport()


# ------------------------------------------------------------ metadata server
@pytest.fixture(params=["http", "etcd"])
def metadata_url(request):
    """A throwaway TE metadata server on loopback: the bundled HTTP one, or etcd."""
    if request.param == "etcd":  # installed by the Makefile: missing is a failure
        with start_etcd() as etcd:
            yield etcd.url
        return
    server = shutil.which("mooncake_http_metadata_server", path=os.path.dirname(sys.executable))
    if server is None:
        pytest.skip("mooncake_http_metadata_server not installed")
    port = _closed_port()
    proc = subprocess.Popen([server, "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "ERROR"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port)
        yield f"http://127.0.0.1:{port}/metadata"
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_metadata_server_segments_are_names(metadata_url):
    _transfer_by_name(metadata_url)  # its engines are gone before the server stops


def _transfer_by_name(url: str) -> None:
    with PeerProcess(1 << 20, fill_seed=9, metadata=url, name="127.0.0.1:peer-a") as peer, \
            Transport(metadata=url, timeout_s=5) as mine:
        assert peer.info.segment == "127.0.0.1:peer-a" and mine.segment != peer.info.segment
        buf = mine.allocate_buffer(1 << 20)
        mine.read(peer.info.segment, [buf.address], [peer.info.address], [1 << 20])
        assert np.array_equal(buf.array, _random(1 << 20, 9))
        with pytest.raises(TransferError) as err:  # alive: refused, not "unavailable"
            mine.write(peer.info.segment, [buf.address], [peer.info.address + (2 << 20)], [8])
        assert not isinstance(err.value, PeerUnavailableError)
        with pytest.raises(PeerUnavailableError, match="unknown"):
            mine.write("no-such-name", [buf.address], [peer.info.address], [8])
        peer.kill()
        with pytest.raises(PeerUnavailableError):
            mine.write(peer.info.segment, [buf.address], [peer.info.address], [8])
        assert mine.is_dead(peer.info.segment)


def _wait_port(port: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"metadata server did not listen on {port} within {timeout_s}s")


# ------------------------------------------------------------------ streamed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nap_s", [STREAM_NAP_S, 0.0], ids=["sleep", "yield"])
def test_stream_keeps_a_window_in_flight_over_thousands_of_ranges(te, local, peer, nap_s):
    """More scattered ranges than TE's TCP transport takes outstanding at once
    (~2 000): all in flight together stalled, then wedged the peer; the window
    keeps STREAM_WINDOW in flight. Each range is reported landed in order, whether
    the wait sleeps between polls or only yields."""
    n, block = 3 * MAX_BATCH_ENTRIES, 512
    assert n > 8 * STREAM_WINDOW
    data = _random(n * block, 4)
    local.array[:len(data)] = data
    perm = np.random.default_rng(4).permutation(n)
    loc = local.address + np.arange(n) * block
    rem = peer.address + perm * (2 * block)  # gaps: nothing merges
    stats = te.stream("write", peer.segment, loc, rem, np.full(n, block), nap_s=nap_s)
    assert stats.transfers == n and stats.nbytes == n * block
    local.array[:len(data)] = 0
    landed: list[int] = []
    te.stream("read", peer.segment, loc, rem, np.full(n, block), on_landed=landed.append,
              nap_s=nap_s)
    assert landed == list(range(1, n + 1))
    assert np.array_equal(local.array[:len(data)], data)
    te.read(peer.segment, loc[:4], rem[:4], np.full(4, block))  # the peer still answers


@pytest.mark.timeout(60)
def test_stream_raises_a_callback_error_only_once_every_range_has_landed(te, local, peer):
    n, block = 64, 64 << 10
    data = _random(n * block, 5)
    local.array[:len(data)] = data
    te.write(peer.segment, [local.address], [peer.address], [len(data)])
    local.array[:len(data)] = 0
    calls: list[int] = []

    def bad(landed: int) -> None:
        calls.append(landed)
        raise RuntimeError("checksum of the first piece")

    loc = local.address + np.arange(n) * block
    rem = peer.address + np.arange(n) * block
    with pytest.raises(RuntimeError, match="first piece"):
        te.stream("read", peer.segment, loc, rem, np.full(n, block), on_landed=bad)
    assert calls == [1]  # not called again after it raised
    assert np.array_equal(local.array[:len(data)], data)  # yet every range had landed
    with pytest.raises(RuntimeError, match="overlap"):
        te.stream("write", peer.segment, loc, rem, np.full(n, block),
                  overlap=lambda: (_ for _ in ()).throw(RuntimeError("overlap")))
    assert not te.is_dead(peer.segment)
