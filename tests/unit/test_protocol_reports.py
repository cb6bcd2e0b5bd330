"""The optional fields a client adds for the server's bookkeeping: the namespace tag on
reserve and the measured data move (xfer_s / xfer_bytes) on commit and release."""

from __future__ import annotations

import msgpack
import pytest

from kvstore.core import protocol as p
from kvstore.core.errors import InvalidRequestError

LIMIT = 1 << 20
KEY, TOK = b"k" * 16, b"\x01\x00\x00\x00"


def frame(op: str, **fields) -> bytes:
    return msgpack.packb({"v": 1, "op": op, "id": 7, **fields}, use_bin_type=True)


@pytest.mark.parametrize("ns", [bytes(16), bytes(8)])
def test_reserve_namespace_round_trips(ns):
    req = p.Reserve(keys=(KEY,), sizes=(4,), tokens=(TOK,), namespace=ns)
    assert p.decode_request(p.encode_request(1, req), LIMIT) == (1, req)


@pytest.mark.parametrize("ns", [b"", bytes(7), bytes(17), "0" * 16, 5])
def test_reserve_bad_namespace_is_rejected(ns):
    with pytest.raises(InvalidRequestError, match="namespace"):
        p.decode_request(frame("reserve", keys=[KEY], sizes=[4], tokens=[TOK],
                               namespace=ns), LIMIT)


def test_commit_and_release_carry_the_measured_move():
    for req in (p.Commit(rid=3, checksums=(1,), xfer_s=0.25, xfer_bytes=4096),
                p.Release(aid=3, drop=True, xfer_s=0.0, xfer_bytes=0),
                p.Release(aid=3, drop=False)):
        assert p.decode_request(p.encode_request(1, req), LIMIT) == (1, req)


@pytest.mark.parametrize("field,value", [
    ("xfer_s", -0.1), ("xfer_s", float("nan")), ("xfer_s", 1e9), ("xfer_s", True),
    ("xfer_s", "1"), ("xfer_bytes", -1), ("xfer_bytes", 1.5), ("xfer_bytes", False),
])
def test_bad_reports_are_rejected(field, value):
    for op, base in (("commit", {"rid": 3, "checksums": [1]}),
                     ("release", {"aid": 3, "drop": True})):
        with pytest.raises(InvalidRequestError, match=field):
            p.decode_request(frame(op, **base, **{field: value}), LIMIT)
