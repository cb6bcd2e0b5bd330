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
    code = ("import os, socket, struct, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(10)\n"
            f"s.connect({path!r})\n"
            "f = b'\\x81\\xa1v\\x01'\n"
            "try:\n"
            "    s.sendall(struct.pack('<I', len(f)) + f)\n"
            "    got = s.recv(100)\n"
            "except OSError as exc:\n"
            "    got = b''\n"
            "sys.exit(0 if got == b'' else 1)\n")
    done = subprocess.run([sys.executable, "-c", code], timeout=30, capture_output=True)
    assert done.returncode == 0, done
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
