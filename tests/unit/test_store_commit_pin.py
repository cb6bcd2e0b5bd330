"""A pinning commit: entries are pinned in the step that makes them visible.

Story: the v0 lookup buffer inserts, then pinned with a separate call; a writer
making room in between could evict the fresh entry, and its consumer never got it.
"""

from kvstore.core.hashing import checksum

from tests.unit.conftest import data, key, put, toks, where


def _reserve_and_write(store, ids):
    res = store.reserve([key(i) for i in ids], [4096] * len(ids), [toks(i) for i in ids])
    for j, (i, place) in enumerate(zip(ids, res.placements)):
        if place is not None:
            store.write(res.id, j, data(i))
    return res


def test_pinned_commit_survives_pressure_that_evicts_unpinned(make_store):
    store = make_store(dram=2)
    res = _reserve_and_write(store, [1])
    store.commit(res.id, [checksum(data(1))], pin=True)
    put(store, [2])
    put(store, [3])  # DRAM holds 2: must evict the unpinned 2, never the pinned 1
    assert where(store) == {1: "dram", 3: "dram"}
    assert {r.key: r.pins for r in store.entries()}[key(1)] == 1


def test_pin_on_commit_covers_entries_deduped_onto_committed_ones(make_store):
    store = make_store(dram=4)
    put(store, [1])
    res = _reserve_and_write(store, [1, 2])  # 1 dedups, 2 is new
    store.commit(res.id, [checksum(data(1)), checksum(data(2))], pin=True)
    pins = {r.key: (r.pins, r.pending) for r in store.entries()}
    assert pins == {key(1): (1, 2), key(2): (1, 1)}


def test_pin_waits_for_an_in_flight_writer_of_the_same_key(make_store):
    store = make_store(dram=4)
    first = _reserve_and_write(store, [5])
    second = _reserve_and_write(store, [5])  # dedups onto the in-flight entry
    assert second.placements == [None]
    store.commit(second.id, [checksum(data(5))], pin=True)
    store.commit(first.id, [checksum(data(5))])
    rec = {r.key: r for r in store.entries()}[key(5)]
    assert (rec.pins, rec.pending) == (1, 2)


def test_commit_without_pin_pins_nothing(make_store):
    store = make_store(dram=4)
    put(store, [1, 2])
    assert all(r.pins == 0 for r in store.entries())
