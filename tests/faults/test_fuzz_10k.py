"""10,000 fuzzed control frames against a live server, each reply awaited 30 s.

30 s is long enough that a silence means something: far beyond any pause a
loaded machine makes (GC, scheduling, a demotion pass), so a frame without a reply
is a server that dropped it or hung, not a slow one. Frames are seeded mutations of
valid requests (byte flips, truncations, fields replaced by random values) and raw
random bytes. Every one must be answered ``ok`` or with a typed error; after them
the server is alive, its store passes ``check_integrity`` and a real round trip is
exact.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from kvstore.core.errors import _BY_CODE
from tests.integration.test_fuzz_protocol import CORPUS

pytestmark = pytest.mark.timeout(600)

FRAMES = 10_000
REPLY_WAIT_MS = 30_000
FIELDS = ["v", "id", "op", "keys", "sizes", "tokens", "rid", "aid", "drop", "meta", "limit",
          "checksums", "claim", "corrupt", "lease_s", "tier", "cursor"]


def _random_value(rng: np.random.Generator):
    kind = int(rng.integers(0, 8))
    if kind == 0:
        return None
    if kind == 1:
        return bool(rng.integers(0, 2))
    if kind == 2:
        return int(rng.integers(-(1 << 62), 1 << 62))
    if kind == 3:
        return float(rng.standard_normal() * 1e6)
    if kind == 4:
        return rng.bytes(int(rng.integers(0, 40)))
    if kind == 5:
        return "x" * int(rng.integers(0, 12))
    if kind == 6:
        return [_random_value(rng) for _ in range(int(rng.integers(0, 4)))]
    return {"k": _random_value(rng)}


def _frame(rng: np.random.Generator, i: int) -> bytes:
    base = CORPUS[int(rng.integers(0, len(CORPUS)))]
    kind = i % 3
    if kind == 0:  # raw random bytes
        return rng.bytes(int(rng.integers(1, 300)))
    if kind == 1:  # a valid frame with flipped bytes, maybe truncated
        frame = bytearray(msgpack.packb({"v": 1, "id": i, **base}, use_bin_type=True))
        for _ in range(int(rng.integers(0, 7))):
            frame[int(rng.integers(0, len(frame)))] = int(rng.integers(0, 256))
        return bytes(frame[:max(1, int(rng.integers(1, len(frame) + 1)))])
    field = FIELDS[int(rng.integers(0, len(FIELDS)))]
    return msgpack.packb({"v": 1, "id": i, **base, field: _random_value(rng)},
                         use_bin_type=True)


def test_10k_fuzzed_frames_all_answered(server_factory, client_factory, fault_log):
    srv = server_factory()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.address)
    rng = np.random.default_rng(2026)
    answered = silent = 0
    try:
        for i in range(FRAMES):
            frame = _frame(rng, i)
            sock.send(frame)
            if not sock.poll(REPLY_WAIT_MS):
                silent += 1
                break  # a 30 s silence: the server hung or dropped it
            reply = msgpack.unpackb(sock.recv(), raw=False)
            assert reply["v"] == 1 and isinstance(reply["ok"], bool), reply
            if not reply["ok"]:
                assert reply["code"] in _BY_CODE and reply["code"] != "internal", (frame, reply)
            answered += 1
    finally:
        sock.close(0)
        ctx.term()
    alive = srv.proc.poll() is None
    fault_log("fuzzed control frames (10k, 30 s reply wait)", FRAMES, answered, 0)
    assert silent == 0 and answered == FRAMES and alive, srv.log()
    client = client_factory(srv)
    assert client.health(deep=True)["status"] == "ok"
    kv = np.random.default_rng(1).integers(0, 256, 128 * 9, dtype=np.uint8)
    client.insert(list(range(9)), kv)
    got = client.drop_select(list(range(9)))
    assert got.matched_tokens == 9 and np.array_equal(got.kv.numpy(), kv)
    assert "Traceback" not in srv.log()
