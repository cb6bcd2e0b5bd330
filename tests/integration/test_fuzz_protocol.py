"""Fuzz a live server with random and mutated msgpack frames.

Every frame must be answered with ``ok`` or a typed error (a code kvstore.core.errors
knows), the server must stay up, and afterwards its store must pass
``check_integrity`` (``health deep``) and still serve a real round trip.
"""

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from kvstore.core.errors import _BY_CODE
from tests.integration.conftest import make_kv

pytestmark = pytest.mark.timeout(180)

KEY = bytes(range(16))
CORPUS = [
    {"op": "hello"},
    {"op": "reserve", "keys": [KEY, KEY[::-1]], "sizes": [512, 128], "tokens": [b"\0" * 16, b"\1" * 4],
     "meta": [None, b"m"], "lease_s": 1.0},
    {"op": "commit", "rid": 12345, "checksums": [1, 2]},
    {"op": "abort", "rid": 1},
    {"op": "lookup", "keys": [KEY], "tokens": [b"\0" * 16]},
    {"op": "acquire", "keys": [KEY], "tokens": [b"\0" * 16], "lease_s": 1.0},
    {"op": "release", "aid": 99, "drop": True},
    {"op": "pin", "keys": [KEY]},
    {"op": "unpin", "keys": [KEY]},
    {"op": "evict", "tier": "dram", "fraction": 0.5, "dry_run": True},
    {"op": "ls", "tier": None, "cursor": None, "limit": 5},
    {"op": "stats"},
    {"op": "verify"},
    {"op": "health", "deep": False},
]
_scalars = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
            | st.floats(allow_nan=True) | st.text(max_size=12) | st.binary(max_size=40))
_values = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=3)
                       | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=8)


class Wire:
    """One DEALER kept across examples; every send must get a reply within 5 s."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def exchange(self, frame: bytes) -> dict:
        self.sock.send(frame)
        assert self.sock.poll(5000), f"no reply to {frame[:60]!r}"
        reply = msgpack.unpackb(self.sock.recv(), raw=False)
        assert reply["v"] == 1 and isinstance(reply["ok"], bool)
        if not reply["ok"]:
            assert reply["code"] in _BY_CODE and reply["code"] != "internal", reply
        return reply

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def wire(shared_server):
    w = Wire(shared_server.address)
    yield w
    w.close()


SETTINGS = settings(max_examples=250, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(raw=st.binary(max_size=300))
def test_random_bytes(wire, raw):
    wire.exchange(raw)


@SETTINGS
@given(base=st.sampled_from(CORPUS), flips=st.lists(st.tuples(st.integers(0, 10_000),
                                                              st.integers(0, 255)), max_size=6),
       cut=st.integers(0, 10_000))
def test_mutated_valid_frames(wire, base, flips, cut):
    frame = bytearray(msgpack.packb({"v": 1, "id": 1, **base}, use_bin_type=True))
    for pos, byte in flips:
        frame[pos % len(frame)] = byte
    wire.exchange(bytes(frame[:max(1, cut % (len(frame) + 1))]))


@SETTINGS
@given(base=st.sampled_from(CORPUS), field=st.text(max_size=10) | st.sampled_from(
    ["v", "id", "op", "keys", "sizes", "tokens", "rid", "aid", "drop", "meta", "limit"]),
       value=_values)
def test_fields_replaced_by_random_values(wire, base, field, value):
    try:
        frame = msgpack.packb({"v": 1, "id": 1, **base, field: value}, use_bin_type=True)
    except (OverflowError, ValueError):
        return
    wire.exchange(frame)


def test_server_consistent_after_fuzzing(shared_server, wire, client_factory):
    # Runs last in this module (pytest keeps file order): the fuzzers above went first.
    assert wire.exchange(msgpack.packb({"v": 1, "id": 2, "op": "health", "deep": True}))["ok"]
    assert shared_server.proc.poll() is None
    client = client_factory(shared_server)
    client.insert(list(range(9)), make_kv(9, 8))
    got = client.drop_select(list(range(9)))
    assert got.matched_tokens == 9 and np.array_equal(got.kv.numpy(), make_kv(9, 8))
    assert client.health(deep=True)["status"] == "ok"
