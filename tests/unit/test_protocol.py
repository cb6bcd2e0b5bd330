"""The wire codec: every request round-trips, every bad frame is a typed rejection."""

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from kvstore.core import protocol as p
from kvstore.core.errors import ChecksumError, InvalidRequestError, KVStoreError

MAX = 1 << 20
K = [bytes([i]) * 16 for i in range(4)]


def frame(**fields) -> bytes:
    return msgpack.packb({"v": 1, "id": 7, **fields}, use_bin_type=True)


def test_reserve_round_trip():
    req = p.Reserve(keys=tuple(K[:2]), sizes=(4096, 100), tokens=(b"\0" * 64, b"\1" * 8),
                    meta=(None, b"\x81\xa1k\x01"),
                    lease_s=2.5, deadline=1_790_000_000.25)
    rid, back = p.decode_request(p.encode_request(42, req), MAX)
    assert rid == 42 and back == req


@pytest.mark.parametrize("req", [
    p.Hello(), p.Commit(rid=3, checksums=(0, (1 << 64) - 1)), p.Abort(rid=1),
    p.Commit(rid=3, checksums=(7,), next_room=4096, deadline=1_790_000_000.5),
    p.Put(room=5, keys=(K[0],), sizes=(8,), tokens=(b"abcd",), offsets=(0,), checksums=(1,),
          deadline=1_790_000_000.0),
    p.Lookup(keys=(K[0],), tokens=(b"",)), p.Acquire(keys=(K[0],), tokens=(b"abcd",)),
    p.Acquire(keys=(K[0],), tokens=(b"abcd",), lease_s=3.0, claim=True),
    p.Acquire(keys=tuple(K[:2]), tokens=(b"abcd", b"abcd"), optional_tail=True),
    p.Acquire(keys=(K[0],), tokens=(b"abcd",), claim=True, inline=4 << 20),
    p.Acquire(keys=(K[0],), tokens=(b"abcd",), inline=4 << 20, inline_part=64 << 10),
    p.Release(aid=9, drop=True), p.Pin(keys=(K[1],)), p.Unpin(keys=(K[1],)),
    p.Evict(tier="dram", fraction=0.5), p.Evict(everything=True, dry_run=True),
    p.Evict(keys=(K[2],)), p.Clear(), p.Stats(), p.Ls(tier="nvme", cursor=b"\x05" * 16, limit=10),
    p.Verify(), p.Health(deep=True)])
def test_every_op_round_trips(req):
    rid, back = p.decode_request(p.encode_request(1, req), MAX)
    assert (rid, back) == (1, req)


@pytest.mark.parametrize("raw, words", [
    (b"\xc1", "not a msgpack"),
    (msgpack.packb([1, 2]), "must be a map"),
    (frame(op="hello") .replace(b"\xa1v\x01", b"\xa1v\x02"), "version"),
    (msgpack.packb({"v": True, "id": 1, "op": "hello"}), "version"),
    (frame(op="explode"), "unknown op"),
    (frame(op=b"hello"), "unknown op"),
    (msgpack.packb({"v": 1, "id": -1, "op": "hello"}), "id"),
    (msgpack.packb({"v": 1, "id": True, "op": "hello"}), "id"),
    (frame(op="hello", extra=1), "unknown field"),
    (frame(op="abort"), "missing"),
    (frame(op="abort", rid="1"), "rid"),
    (frame(op="pin", keys=[b"short"]), "16 bytes"),
    (frame(op="pin", keys=[]), "empty"),
    (frame(op="pin", keys=["x" * 16]), "16 bytes"),
    (frame(op="reserve", keys=[K[0]], sizes=[0], tokens=[b""]), "sizes"),
    (frame(op="reserve", keys=[K[0]], sizes=[1 << 40], tokens=[b""]), "sizes"),
    (frame(op="reserve", keys=K[:2], sizes=[8], tokens=[b""]), "equal lengths"),
    (frame(op="reserve", keys=[K[0]], sizes=[8], tokens=[b"abc"]), "token bytes"),
    (frame(op="reserve", keys=[K[0]], sizes=[8], tokens=[b""], lease_s=float("nan")), "lease"),
    (frame(op="reserve", keys=[K[0]], sizes=[8], tokens=[b""], meta=[b"x" * 1025]), "meta"),
    (frame(op="release", aid=1, drop=1), "bool"),
    (frame(op="acquire", keys=[K[0]], tokens=[b""], optional_tail=1), "bool"),
    (frame(op="acquire", keys=[K[0]], tokens=[b""], inline=-1), "inline"),
    (frame(op="acquire", keys=[K[0]], tokens=[b""], inline=True), "inline"),
    (frame(op="acquire", keys=[K[0]], tokens=[b""], inline=p.MAX_INLINE_BYTES + 1), "inline"),
    (frame(op="acquire", keys=[K[0]], tokens=[b""], inline=1.5), "inline"),
    (frame(op="evict", tier="tape", everything=True), "tier"),
    (frame(op="evict"), "exactly one"),
    (frame(op="evict", everything=True, nbytes=5), "exactly one"),
    (frame(op="ls", limit=0), "limit"),
    (frame(op="commit", rid=1, checksums=[1], deadline="soon"), "deadline"),
    (frame(op="commit", rid=1, checksums=[1], deadline=float("inf")), "deadline"),
    (frame(op="commit", rid=1, checksums=[1], deadline=-1.0), "deadline"),
    (frame(op="reserve", keys=[b"k" * 16], sizes=[8], tokens=[b""], deadline="later"),
     "deadline"),
    (msgpack.packb({"v": 1, "id": 1, "op": "hello", 5: 1}), "not a msgpack"),
    (msgpack.packb({"v": 1, "id": 1, "op": "abort", "rid": msgpack.ExtType(1, b"x")}), "ext"),
    (msgpack.packb({"v": 1, "id": 1, "op": "abort", "rid": msgpack.Timestamp(1)},
                   datetime=False), "rid"),
])
def test_bad_frames_are_rejected(raw, words):
    with pytest.raises(InvalidRequestError, match=words):
        p.decode_request(raw, MAX)


def test_oversized_frame_rejected_before_parsing():
    big = frame(op="pin", keys=[K[0]] * 1000)
    with pytest.raises(InvalidRequestError, match="exceeds"):
        p.decode_request(big, len(big) - 1)


def test_too_many_keys_rejected():
    with pytest.raises(InvalidRequestError, match="at most"):
        p.decode_request(frame(op="pin", keys=[K[0]] * (p.MAX_KEYS + 1)), 1 << 24)


def test_replies_rebuild_error_classes():
    rid, res = p.decode_reply(p.encode_error(5, ChecksumError("bad bytes")), MAX)
    assert rid == 5 and type(res["error"]) is ChecksumError and "bad bytes" in str(res["error"])
    rid, res = p.decode_reply(p.encode_ok(6, {"n": 1}), MAX)
    assert rid == 6 and res == {"n": 1}


def test_unknown_error_code_becomes_base_error():
    raw = msgpack.packb({"v": 1, "id": 1, "ok": False, "code": "weird", "message": "m"})
    assert type(p.decode_reply(raw, MAX)[1]["error"]) is KVStoreError


def test_peek_id_survives_garbage():
    assert p.peek_id(b"\xc1", MAX) == 0
    assert p.peek_id(frame(op="nope"), MAX) == 7


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_reject(raw):
    try:
        p.decode_request(raw, MAX)
    except InvalidRequestError:
        pass


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 64), 1 << 64) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                               max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from(sorted(p.REQUESTS)), fields=st.dictionaries(
    st.sampled_from(["keys", "sizes", "tokens", "rid", "aid", "drop", "tier", "meta", "limit",
                     "lease_s", "checksums", "nbytes", "everything", "deep", "zzz"]), _values,
    max_size=5))
def test_structured_garbage_decodes_to_valid_request_or_rejects(op, fields):
    try:
        packed = msgpack.packb({"v": 1, "id": 1, "op": op, **fields}, use_bin_type=True)
    except (OverflowError, ValueError):
        return
    try:
        _, req = p.decode_request(packed, MAX)
    except InvalidRequestError:
        return
    assert isinstance(req, p.REQUESTS[op])


def test_a_reply_whose_inline_frame_does_not_match_falls_back_to_te(caplog):
    """The client never uses bytes that are not exactly what the reply says: it drops
    ``inline`` (the entries are then read over TE) and keeps the lease to release."""
    from kvstore.client.rpc import _inline_frame

    class Frame(bytes):
        @property
        def buffer(self):
            return memoryview(self)

    good = {"aid": 3, "entries": [], "inline": 4}
    _inline_frame(good, [Frame(b"map"), Frame(b"abcd")])
    assert bytes(good["inline_data"]) == b"abcd"
    for result, frames in (({"aid": 3, "inline": 5}, [Frame(b"m"), Frame(b"abcd")]),
                           ({"aid": 3, "inline": 4}, [Frame(b"m")]),
                           ({"aid": 3}, [Frame(b"m"), Frame(b"abcd")]),
                           ({"aid": 3, "inline": "4"}, [Frame(b"m"), Frame(b"abcd")])):
        _inline_frame(result, frames)
        assert result == {"aid": 3}


@pytest.mark.parametrize("fields, words", [
    ({"inline_part": 512 << 10}, "inline_part without inline"),
    ({"inline": 1 << 20, "inline_part": (64 << 10) - 1}, "inline_part"),
    ({"inline": 1 << 20, "inline_part": (64 << 20) + 1}, "inline_part"),
    ({"inline": 1 << 20, "inline_part": True}, "inline_part"),
])
def test_an_acquire_asks_for_parts_only_with_inline_and_of_a_sane_size(fields, words):
    raw = frame(op="acquire", keys=[K[0]], tokens=[b"abcd"], **fields)
    with pytest.raises(InvalidRequestError, match=words):
        p.decode_request(raw, MAX)


def test_a_part_head_is_told_apart_from_a_reply_and_checked():
    assert p.decode_reply(p.encode_part(9, 3), MAX) == (9, {p.PART_HEAD: 3})
    for bad in (msgpack.packb({"v": 1, "id": 9, "part": 0}),
                msgpack.packb({"v": 1, "id": 9, "part": "1"}),
                msgpack.packb({"v": 1, "id": 9, "part": True}),
                msgpack.packb({"v": 1, "id": 9, "part": 1, "more": 2})):
        with pytest.raises(InvalidRequestError, match="part"):
            p.decode_reply(bad, MAX)
    # An ordinary reply may carry a field of that name and stays a reply.
    assert p.decode_reply(p.encode_ok(4, {"part": 1}), MAX) == (4, {"part": 1})


def test_inline_bytes_are_cut_in_parts_of_whole_entries():
    from kvstore.server.loop import MAX_INLINE_PARTS, _parts

    assert _parts([100] * 10, None) is None and _parts([100] * 10, 0) is None
    assert _parts([100] * 10, 1000) is None  # all of it fits one part
    assert _parts([100] * 10, 300) == [300, 300, 300, 100]
    assert _parts([100] * 10, 250) == [300, 300, 300, 100]  # closed once it holds enough
    assert _parts([700, 100, 100, 700, 50], 500) == [700, 900, 50]
    assert _parts([1000, 10], 500) == [1000, 10]
    assert _parts([1000], 500) is None  # one entry is one part
    # Never more than MAX_INLINE_PARTS: a client asking for small parts gets larger.
    assert len(_parts([1] * 10_000, 1)) == MAX_INLINE_PARTS
    assert _parts([1] * 10_000, 1)[0] == -(-10_000 // MAX_INLINE_PARTS)


def test_parts_that_do_not_add_up_fall_back_to_te(caplog):
    """The first part's frame must be as long as the first of ``parts``, and the parts
    must add up to ``inline``: else the bytes are not used (read over TE instead)."""
    from kvstore.client.rpc import _inline_frame

    class Frame(bytes):
        @property
        def buffer(self):
            return memoryview(self)

    good = {"aid": 3, "inline": 6, "parts": [4, 2]}
    _inline_frame(good, [Frame(b"map"), Frame(b"abcd")])
    assert bytes(good["inline_data"]) == b"abcd" and good["parts"] == [4, 2]
    for parts in ([4, 3], [4], [2, 4], [4, "2"], [4, 0, 2], "4,2", [4, True, 1]):
        result = {"aid": 3, "inline": 6, "parts": parts}
        _inline_frame(result, [Frame(b"m"), Frame(b"abcd")])
        assert result == {"aid": 3}, parts


def test_verify_batches_bound_keys_and_bytes():
    entries = [{"key": bytes([i]) * 16, "nbytes": n} for i, n in
               enumerate([10, 10, 10, 50, 5, 200, 1])]
    got = p.verify_batches(entries, most=2, most_bytes=60)
    assert [[k[0] for k in b] for b in got] == [[0, 1], [2, 3], [4], [5], [6]]
    # (an entry over the byte bound goes alone; every batch holds at least one key)
    assert p.verify_batches([], most=2) == []
    with pytest.raises(InvalidRequestError):
        p.verify_batches(entries, most=0)
