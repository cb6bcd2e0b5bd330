"""``acquire(..., optional_tail=True)``: the last key is an optional extra (a prompt's
hidden-state entry), not a block: served or absent, it is neither a hit nor a miss,
so prompts stored without hidden state do not skew hit rates."""

from __future__ import annotations

from tests.unit.conftest import key, put, toks


def _acquire(store, ids, **kw):
    return store.acquire([key(i) for i in ids], [toks(i) for i in ids], **kw)


def _counts(store) -> tuple[int, int]:
    stats = store.stats()
    return stats["hits"], stats["misses"]


def test_absent_tail_is_no_miss(make_store):
    store = make_store(dram=8)
    put(store, [1, 2, 3])
    acq = _acquire(store, [1, 2, 3, 99], optional_tail=True)
    assert len(acq.entries) == 3
    store.release(acq.id)
    assert _counts(store) == (3, 0)


def test_served_tail_is_no_hit(make_store):
    store = make_store(dram=8)
    put(store, [1, 2, 3, 4])
    acq = _acquire(store, [1, 2, 3, 4], optional_tail=True)
    assert len(acq.entries) == 4  # the tail still comes back
    store.release(acq.id)
    assert _counts(store) == (3, 0)


def test_blocks_before_the_tail_still_count(make_store):
    store = make_store(dram=8)
    put(store, [1, 2])
    acq = _acquire(store, [1, 2, 3, 4, 99], optional_tail=True)  # blocks 3 and 4 missing
    store.release(acq.id)
    assert _counts(store) == (2, 2)
    assert _acquire(store, [7, 8, 99], optional_tail=True).id == 0  # a full miss: 2 blocks
    assert _counts(store) == (2, 4)


def test_without_the_flag_every_key_counts(make_store):
    store = make_store(dram=8)
    put(store, [1, 2])
    store.release(_acquire(store, [1, 2, 99]).id)
    assert _counts(store) == (2, 1)
