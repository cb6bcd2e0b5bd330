"""The same-node socket (kvstore/server/local.py, kvstore/client/local.py): a client on
the server's node sends its requests over the server's Unix socket; bad frames on it
get clear errors and change nothing; only the server's own user (or root) gets in;
a dead server is an error, never a hang. Real server processes, real sockets."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

from kvstore.core import protocol as p
from kvstore.core.errors import InvalidRequestError, PeerUnavailableError
from tests.integration.conftest import LAYOUT

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")]

HEADER = struct.Struct("<I")


def _kv(ntokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.nbytes(ntokens), dtype=np.uint8)


def _raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def _reply(sock: socket.socket) -> dict | None:
    """One reply frame off ``sock``, decoded; None when the server closed it."""
    buf = b""
    while len(buf) < HEADER.size or len(buf) < HEADER.size + HEADER.unpack_from(buf)[0]:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        buf += chunk
    n = HEADER.unpack_from(buf)[0]
    return msgpack.unpackb(buf[HEADER.size:HEADER.size + n], raw=False)


def test_a_same_node_client_talks_over_the_socket(server_factory, client_factory):
    srv = server_factory(dram="16MiB", nvme="0")
    client = client_factory(srv)
    path = client.hello()["local"]
    assert path and path.endswith(".sock") and os.path.exists(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert client._rpc.local
    tokens = list(range(100))
    kv = _kv(100)
    assert client.insert(tokens, kv=kv).new_blocks == -(-100 // LAYOUT.block_tokens)
    got = client.drop_select(tokens)
    assert got.matched_tokens == 100 and np.array_equal(got.kv.numpy(), kv)
    stats = client.stats()
    # reserve (or put), commit, acquire, release, stats: everything after hello
    assert stats["local_requests"] >= 4, stats
    assert stats["local_connections"] == 1
    srv.stop()
    assert not os.path.exists(path)  # a clean stop removes it


def test_off_the_client_uses_the_router(server_factory, client_factory):
    srv = server_factory(dram="16MiB", nvme="0", extra=("--no-local-socket",))
    client = client_factory(srv)
    assert client.hello()["local"] is None
    assert not client._rpc.local
    tokens = list(range(64))
    client.insert(tokens, kv=_kv(64))
    assert client.drop_select(tokens).matched_tokens == 64
    assert client.stats()["local_requests"] == 0


def test_a_client_with_no_shared_arena_uses_the_router(server_factory, client_factory):
    srv = server_factory(dram="16MiB", nvme="0")
    client = client_factory(srv, same_node=False)  # TE even on this node
    assert client.hello()["local"]
    assert not client._rpc.local
    client.insert(list(range(32)), kv=_kv(32))
    assert client.stats()["local_requests"] == 0


def test_bad_frames_get_errors_and_change_nothing(server_factory, client_factory):
    srv = server_factory(dram="16MiB", nvme="0")
    client = client_factory(srv)
    path = client.hello()["local"]
    tokens = list(range(64))
    client.insert(tokens, kv=_kv(64, seed=1))
    before = client.stats()["entries"]

    sock = _raw(path)
    try:
        for body in (b"", b"\xc1garbage", msgpack.packb({"v": p.VERSION, "op": "nope", "id": 7}),
                     msgpack.packb({"v": p.VERSION, "op": "reserve", "id": 8, "keys": [1]})):
            sock.sendall(HEADER.pack(len(body)) + body)
            reply = _reply(sock)
            assert reply is not None and reply["ok"] is False, (body, reply)
            assert reply["code"] == InvalidRequestError.code, reply
        # the connection still serves a good request
        sock.sendall(HEADER.pack(len(frame := p.encode_request(9, p.Health()))) + frame)
        reply = _reply(sock)
        assert reply["ok"] is True and reply["id"] == 9 and reply["status"] == "ok"
        # a length past the server's cap: an error, then the connection is closed
        sock.sendall(HEADER.pack(0xFFFFFFFF) + b"x" * 16)
        reply = _reply(sock)
        assert reply["ok"] is False and reply["code"] == InvalidRequestError.code
        assert "exceeds" in reply["message"]
        assert _reply(sock) is None
    finally:
        sock.close()

    # half a frame, then gone
    sock = _raw(path)
    sock.sendall(HEADER.pack(1000) + b"y" * 10)
    sock.close()

    assert client.stats()["entries"] == before
    got = client.drop_select(tokens)
    assert got.matched_tokens == 64
    assert srv.proc.poll() is None
    assert "Traceback" not in srv.log()


def test_a_one_way_send_keeps_its_order(server_factory, client_factory):
    """A one-way release, then a call: the call sees the release applied (one
    connection, one queue), and the release's reply is dropped, not taken for the
    call's."""
    srv = server_factory(dram="16MiB", nvme="0")
    client = client_factory(srv)
    tokens = list(range(64))
    client.insert(tokens, kv=_kv(64, seed=2))
    assert client._rpc.local
    prompt = client._prompt(tokens)
    acq = client._rpc.call(p.Acquire(keys=tuple(prompt.keys), tokens=tuple(prompt.tokens),
                                     claim=True))
    assert len(acq["entries"]) == len(prompt.keys)
    client._rpc.send(p.Release(aid=acq["aid"], drop=True))
    assert client.stats()["entries"] == 0


def test_a_dead_server_is_an_error_not_a_hang(server_factory, client_factory):
    """The socket of a dead server takes no request: it goes over the ROUTER, which
    says the server is unreachable within the timeout, as it did before the socket;
    a restarted server is reached the same way and its own socket taken at hello."""
    srv = server_factory(dram="16MiB", nvme="0")
    client = client_factory(srv, timeout_s=2.0)
    client.insert(list(range(32)), kv=_kv(32))
    assert client._rpc.local
    srv.kill()
    start = time.monotonic()
    with pytest.raises(PeerUnavailableError):
        client.stats()
    assert time.monotonic() - start < 2.0 + 1.0
    assert not client._rpc.local  # the ROUTER until the next hello
    srv.start()
    assert client.stats()["entries"] == 0  # the new process, over the ROUTER
    tokens = list(range(48))
    client.insert(tokens, kv=_kv(48))  # its reply names a new segment: hello again
    assert client._rpc.local
    assert client.drop_select(tokens).matched_tokens == 48
    assert client.stats()["local_requests"] > 0


def test_a_restart_between_two_calls_loses_no_request(server_factory, client_factory):
    """The old socket is dead after a restart: the next request goes over the ROUTER
    to the new process instead of failing."""
    srv = server_factory(dram="16MiB", nvme="0")
    client = client_factory(srv)
    client.insert(list(range(32)), kv=_kv(32))
    assert client._rpc.local
    srv.restart()
    assert client.health()["status"] == "ok"


def test_another_user_is_refused(server_factory, client_factory):
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another user")
    srv = server_factory(dram="16MiB", nvme="0")
    client = client_factory(srv)
    path = client.hello()["local"]
    os.chmod(path, 0o666)  # past the file's mode: the server's own check must refuse
    code = ("import os, socket, struct, sys, msgpack\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(10)\n"
            f"s.connect({path!r})\n"
            "got = b''\n"
            "while True:\n"
            "    chunk = s.recv(4096)\n"
            "    if not chunk: break\n"
            "    got += chunk\n"
            "reply = msgpack.unpackb(got[4:], raw=False)\n"
            "print(reply['code'], reply['message'])\n"
            "sys.exit(0 if reply['code'] == 'auth' and not reply['ok'] else 1)\n")
    done = subprocess.run([sys.executable, "-c", code], timeout=30, capture_output=True,
                          text=True)
    assert done.returncode == 0, done
    assert "admits only user 0 and root, not user 65534" in done.stdout, done.stdout
    deadline = time.monotonic() + 5
    while "refused: user 65534" not in srv.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "local connection from pid" in srv.log() and "refused: user 65534" in srv.log()
    assert client.stats()["local_connections"] == 1  # only this client's


def test_fuzzed_frames_on_the_socket_are_all_answered(server_factory, client_factory):
    """The fuzz corpus of tests/faults/test_fuzz_10k.py, over the same-node socket:
    every frame answered ok or with a typed error, the store intact after."""
    from kvstore.core.errors import _BY_CODE
    from tests.faults.test_fuzz_10k import _frame

    srv = server_factory()
    client = client_factory(srv)
    sock = _raw(client.hello()["local"])
    sock.settimeout(30)
    rng = np.random.default_rng(7)
    try:
        for i in range(2000):
            frame = _frame(rng, i)
            sock.sendall(HEADER.pack(len(frame)) + frame)
            reply = _reply(sock)
            assert reply is not None, f"connection closed after frame {i}"
            assert reply["v"] == 1 and isinstance(reply["ok"], bool), reply
            assert reply["ok"] or reply["code"] in _BY_CODE, reply
    finally:
        sock.close()
    client.health(deep=True)  # check_integrity
    tokens = list(range(40))
    kv = _kv(40, seed=3)
    client.insert(tokens, kv=kv)
    got = client.get(tokens)
    assert got.matched_tokens == 40 and np.array_equal(got.kv.numpy(), kv)
    assert "Traceback" not in srv.log()


def test_a_router_peer_cannot_pose_as_a_local_connection(server_factory, client_factory):
    """A ZeroMQ peer may choose its own routing id, the local envelope's included:
    its requests are dropped, never answered into a local connection, and the
    server goes on."""
    import zmq

    srv = server_factory(dram="16MiB", nvme="0")
    client = client_factory(srv)
    tokens = list(range(64))
    kv = _kv(64, seed=4)
    client.insert(tokens, kv=kv)
    assert client._rpc.local
    ctx = zmq.Context()
    try:
        for ident in (b"\x00kvstore-local:x", b"\x00kvstore-local:1", b"\x00kvstore-local:2"):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, ident)
            sock.connect(srv.address)
            prompt = client._prompt(tokens)
            for rid in range(1, 40):  # ids the local client uses too
                sock.send(p.encode_request(rid, p.Acquire(
                    keys=tuple(prompt.keys), tokens=tuple(prompt.tokens), claim=True)))
            assert not sock.poll(500)  # nothing comes back to it either
            sock.close(0)
    finally:
        ctx.term()
    assert "poses as a local connection" in srv.log()
    got = client.drop_select(tokens)  # nothing was leased or taken by them
    assert got.matched_tokens == 64 and np.array_equal(got.kv.numpy(), kv)
    assert client.stats()["leases"] == 0
    assert srv.proc.poll() is None and "Traceback" not in srv.log()


def test_a_peer_that_does_not_read_holds_up_nobody(server_factory, client_factory):
    """Replies a local peer does not read wait in its connection's buffer; the
    serving thread never blocks on them, and the peer that reads at last gets them
    all, in order."""
    # A patient server: 3000 requests at once on a busy machine may be estimated to
    # start after busy_after_s (2 s), and those get ``busy`` at once, ahead of the
    # queued ones (tests/integration/test_busy.py); here every one is served in order.
    srv = server_factory(dram="16MiB", nvme="0", extra=("--busy-after", "60"))
    client = client_factory(srv)
    path = client.hello()["local"]
    sleeper = _raw(path)
    try:
        n = 3000  # ~2 KiB of stats each: more than the socket's buffer holds
        frames = b"".join(HEADER.pack(len(f)) + f for f in
                          (p.encode_request(i, p.Stats()) for i in range(1, n + 1)))
        sleeper.sendall(frames)
        other = client_factory(srv)  # over the ZeroMQ port
        other.stats()  # queued behind them: all of them are answered (and unread) now
        for _ in range(20):  # (a serving thread stuck on the sleeper would hold each
            start = time.monotonic()  # until the sleeper reads: never, in this block)
            other.health()
            assert time.monotonic() - start < 3.0
        assert client.health()["status"] == "ok"  # another local connection
        buf, ids = bytearray(), []
        while len(ids) < n:
            chunk = sleeper.recv(1 << 20)
            assert chunk, f"closed after {len(ids)} replies"
            buf += chunk
            while len(buf) >= HEADER.size and \
                    len(buf) >= HEADER.size + (size := HEADER.unpack_from(buf)[0]):
                ids.append(msgpack.unpackb(bytes(buf[HEADER.size:HEADER.size + size]))["id"])
                del buf[:HEADER.size + size]
        assert ids == list(range(1, n + 1)) and not buf
    finally:
        sleeper.close()


def test_a_forked_child_never_shares_the_parents_connection(server_factory, client_factory):
    srv = server_factory(dram="16MiB", nvme="0")
    client = client_factory(srv)
    client.hello()
    parent_channel = client._rpc._local
    assert parent_channel is not None and parent_channel.open
    child = os.fork()
    if child == 0:  # the child: its own connection, never the parent's
        code = 1
        try:
            if not parent_channel.open and client._rpc.local is False:
                code = 2
                stats = client._rpc.call(p.Stats())  # opens its own
                if client._rpc._local is not parent_channel and client._rpc.local \
                        and stats["stats"]["local_connections"] >= 2:
                    code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent_channel.open
    assert client.health()["status"] == "ok"  # the parent's still works


def test_a_failed_socket_is_opened_again(server_factory, client_factory):
    """After the local connection failed (here: closed under the client), requests
    go over the ZeroMQ port, and the socket is opened again a moment later."""
    from kvstore.client.local import Control

    srv = server_factory(dram="16MiB", nvme="0")
    client = client_factory(srv)
    client.hello()
    client._rpc._local.close()
    assert not client._rpc.local
    before = client.stats()["local_requests"]  # over the ZeroMQ port
    assert client.stats()["local_requests"] == before
    time.sleep(Control.RETRY_S + 0.1)
    client.stats()
    assert client._rpc.local
    assert client.stats()["local_requests"] > before


def test_a_drop_select_is_seen_by_the_next_reader_on_another_connection(server_factory,
                                                                         client_factory):
    """Client A's drop_select ends with a one-way release; client B's acquire, sent
    after it on its own connection, must find the prompt gone. The server is frozen
    while both are sent, so it reads them in one pass, B's connection first: it
    queues the release first."""
    import signal
    import threading

    srv = server_factory(dram="16MiB", nvme="0")
    b = client_factory(srv)  # connected first: its connection is read first
    a = client_factory(srv)
    b.hello()
    a.hello()
    assert a._rpc.local and b._rpc.local
    tokens = list(range(32))
    a.insert(tokens, kv=_kv(32))
    prompt = a._prompt(tokens)
    acquire = p.Acquire(keys=tuple(prompt.keys), tokens=tuple(prompt.tokens), claim=True)
    lease = a._rpc.call(acquire)
    assert len(lease["entries"]) == 32 // LAYOUT.block_tokens
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        a._rpc.send(p.Release(aid=lease["aid"], drop=True))
        got: list = []
        peek = p.Acquire(keys=acquire.keys, tokens=acquire.tokens)  # a get: no claim
        reader = threading.Thread(target=lambda: got.append(b._rpc.call(peek)))
        reader.start()
        time.sleep(0.3)  # both are in the server's sockets now
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    reader.join(timeout=30)
    assert got and got[0]["entries"] == [], got
    assert b.stats()["entries"] == 0
