"""``KeyPages``: the key order ``ls`` pages through. Pages from any cursor are the
keys after it in sorted order, whatever the keys (hashes, short keys, keys that all
share one bucket), and adds / discards keep it exact."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store.keypages import BUCKETS, KeyPages, bucket_of


def pages(kp: KeyPages, limit: int, after: bytes | None = None) -> list[bytes]:
    out: list[bytes] = []
    while True:
        page = kp.after(after, limit)
        out += page
        if len(page) < limit:
            return out
        after = page[-1]


@settings(max_examples=200, deadline=None)
@given(keys=st.sets(st.binary(min_size=0, max_size=4)), gone=st.data(),
       limit=st.integers(1, 7), cursor=st.binary(max_size=3))
def test_pages_are_the_sorted_keys_after_any_cursor(keys, gone, limit, cursor):
    kp = KeyPages(keys)
    dropped = gone.draw(st.sets(st.sampled_from(sorted(keys))) if keys else st.just(set()))
    kp.discard_many(dropped)
    kp.discard_many([b"\xff\xff never added"])
    left = sorted(keys - dropped)
    assert len(kp) == len(left) and sorted(kp) == left
    assert pages(kp, limit) == left
    assert pages(kp, limit, cursor) == [k for k in left if k > cursor]


def test_bucket_order_is_key_order():
    keys = sorted(os.urandom(16) for _ in range(2000)) + [b"", b"\x00", b"\xff", b"\xff\xff"]
    keys.sort()
    assert [bucket_of(k) for k in keys] == sorted(bucket_of(k) for k in keys)
    assert bucket_of(b"\xff" * 16) == BUCKETS - 1


def test_hash_keys_page_in_order_and_a_page_looks_at_few_buckets():
    keys = {os.urandom(16) for _ in range(5000)}
    kp = KeyPages(keys)
    assert pages(kp, 100) == sorted(keys)
    first = kp.after(None, 10)
    assert first == sorted(keys)[:10]
    assert bucket_of(first[-1]) < BUCKETS // 8  # ~1 key a bucket: it stopped early


def test_keys_in_one_bucket_still_page_exactly():
    keys = {bytes([0, 0]) + i.to_bytes(14, "big") for i in range(300)}
    kp = KeyPages(keys)
    assert len({bucket_of(k) for k in keys}) == 1
    assert pages(kp, 7) == sorted(keys)
