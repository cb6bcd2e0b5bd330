"""The same-node door in one process (kvstore/server/local.py, kvstore/client/local.py):
a user the door does not admit gets a clear refusal and the client goes over the
ZeroMQ port instead. Real Unix sockets; the door is driven by a thread as the
server's serving thread would."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from kvstore.client.local import Control, LocalChannel, Refused
from kvstore.client.rpc import Channel
from kvstore.core import protocol as p
from kvstore.server import local
from kvstore.server.local import LOCAL_TAG, LocalDoor


@pytest.fixture
def door(tmp_path):
    d = LocalDoor(str(tmp_path / "door.sock"), 1 << 20)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for envelope, body in d.read():
                rid, _ = p.decode_request(body, 1 << 20)
                d.send(envelope, p.encode_ok(rid, {"status": "ok"}))
            stop.wait(0.005)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield d
    stop.set()
    thread.join()
    d.close()


def test_an_admitted_user_is_served(door):
    channel = LocalChannel(door.path, timeout_s=5.0, max_bytes=1 << 20)
    assert channel.call(p.Health())["status"] == "ok"
    channel.close()


def test_a_user_not_admitted_is_refused_clearly(door):
    door.admitted = {12345}  # not this process's user, whoever runs the tests
    with pytest.raises(Refused, match="admits only user .* not user"):
        LocalChannel(door.path, timeout_s=5.0, max_bytes=1 << 20)


def test_a_refused_client_goes_over_zeromq_and_stops_trying(door):
    door.admitted = {12345}
    rpc = Channel("tcp://127.0.0.1:9", timeout_s=0.5)  # nothing listens: never reached
    control = Control(rpc)
    try:
        control.use_local(door.path)
        assert not control.local
        assert control._path is None  # refused: not tried again
    finally:
        control.close()


def _pending(conn) -> int:
    return sum(len(v) for v in conn.out)


def test_a_replys_bytes_are_out_only_when_their_last_byte_is(monkeypatch):
    """The door's books: what it queued less what it sent is exactly what waits in
    a connection's backlog, however many replies came before, and the ``Sent`` of an
    acquire's bytes is done only once their last byte went to the kernel (the store
    holds their entries until then). A peer that reads slowly takes every byte, in
    order; the views waiting do not count against the backlog's cap."""
    door = LocalDoor(None, 1 << 20, stream=("127.0.0.1", 0))
    peer = socket.create_connection(("127.0.0.1", door.stream_port), timeout=10)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    try:
        deadline = time.monotonic() + 10
        while not door._conns:
            assert time.monotonic() < deadline, "the door did not accept"
            list(door.read(listener_ready=True))
        (cid, conn), = door._conns.items()
        envelope = LOCAL_TAG + str(cid).encode()
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        replies = [p.encode_ok(i, {"n": i}) for i in range(1, 3001)]
        expected = bytearray()
        for body in replies:  # many small replies first: each one's header counts
            door.send(envelope, body)
            expected += struct.pack("<I", len(body)) + body
        data = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8)
        view = memoryview(data)
        body = p.encode_ok(9999, {"inline": data.nbytes})
        sent = door.send(envelope, body, [view[:1 << 20], view[1 << 20:]])
        expected += struct.pack("<I", len(body)) + body + data.tobytes()
        assert conn.queued - conn.done == _pending(conn)
        got = bytearray()
        while len(got) < len(expected):
            got += peer.recv(min(16 << 10, len(expected) - len(got)))
            door._flush()
            assert conn.queued - conn.done == _pending(conn)
            # Done exactly when nothing of the bytes waits in the backlog any more.
            assert sent.done is (not conn.out), (len(got), _pending(conn))
        assert bytes(got) == bytes(expected)
        # Views waiting, more than the cap (1 MiB here), do not close the connection;
        # the frames and copies a peer leaves unread do.
        monkeypatch.setattr(local, "_BACKLOG_CAP", 1 << 20)
        assert door.send(envelope, p.encode_ok(1, {}), memoryview(data)) is not None
        door.send(envelope, p.encode_ok(2, {}))
        assert cid in door._conns and _pending(conn) > 1 << 20
        assert door.send(envelope, p.encode_ok(3, {}), bytes(2 << 20)) is None
        assert cid not in door._conns
    finally:
        peer.close()
        door.close()


def test_a_request_the_door_could_not_send_asks_the_router_for_what_it_carries():
    """A client whose stream door is found closed sends the request it built for the
    door over the ROUTER: an acquire's ask for bytes in the reply is cut to what one
    ZeroMQ message carries (an older server there refuses more as out of range)."""
    from kvstore.client.local import _for_router

    keys, tokens = (b"k" * 16,), (b"\0" * 16,)
    big = p.Acquire(keys=keys, tokens=tokens, inline=4 << 30, inline_part=1 << 20)
    cut = _for_router(big)
    assert cut.inline == p.ROUTER_INLINE_BYTES and cut.inline_part == 1 << 20
    p.decode_request(p.encode_request(1, cut), 1 << 20)  # valid, and within the bound
    small = p.Acquire(keys=keys, tokens=tokens, inline=1 << 20)
    assert _for_router(small) is small
    assert _for_router(p.Health()) == p.Health()


def test_bytes_to_a_peer_that_has_closed_are_never_whole():
    """A peer that closed its side (FIN, nothing unread) still takes writes (its
    socket is in CLOSE_WAIT): the bytes go to the kernel, ``done``, but not
    ``whole``, so a server that ends a lease once its bytes are out
    (``Acquire.release_sent``) leaves it open. To a peer still there: whole."""
    door = LocalDoor(None, 1 << 20, stream=("127.0.0.1", 0))
    peers = [socket.create_connection(("127.0.0.1", door.stream_port), timeout=10)
             for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while len(door._conns) < 2:
            assert time.monotonic() < deadline, "the door did not accept"
            list(door.read(listener_ready=True))
        peers[0].close()
        time.sleep(0.1)  # (its FIN in)
        data = np.arange(64 << 10, dtype=np.uint8)
        sent = [door.send(LOCAL_TAG + str(cid).encode(), p.encode_ok(1, {"inline": data.size}),
                          memoryview(data)) for cid in sorted(door._conns)]
        assert [(s.done, s.whole) for s in sent] == [(True, False), (True, True)]
    finally:
        peers[1].close()
        door.close()
