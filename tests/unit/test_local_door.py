"""The same-node door in one process (kvstore/server/local.py, kvstore/client/local.py):
a user the door does not admit gets a clear refusal and the client goes over the
ZeroMQ port instead. Real Unix sockets; the door is driven by a thread as the
server's serving thread would."""

from __future__ import annotations

import threading

import pytest

from kvstore.client.local import Control, LocalChannel, Refused
from kvstore.client.rpc import Channel
from kvstore.core import protocol as p
from kvstore.server.local import LocalDoor


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
