"""Answer first (``store.answer_first``): a commit or put whose caller takes its
in-memory book-keeping (``later``) is answered once everything that can fail is
done, the index write included, and nothing of it is visible until that work ran
("put 1, 2 into a room with 3 stored and 4 in flight elsewhere: answered new 2,
deduped 2 at once, as a store that books first answers; lookup misses until the
work handed over runs, then finds them"). The caller holds the store's lock across
(the server does); these tests peek in between only to show nothing leaks.

Real tiers, real LMDB; every store is integrity-checked after the work ran and at
the end of its test."""

import pytest

from kvstore.core.errors import ChecksumError, StorageError, TierFullError
from kvstore.core.hashing import checksum
from tests.unit.conftest import ENTRY, data, fill_index_map, key, put, toks, where
from tests.unit.test_store_rooms import open_store, put_into, read_back  # noqa: F401


def put_ids(store, ids, later=None, **kw):
    """Copy ``ids`` into a fresh room back to back and ``put`` them."""
    return put_into(store, store.grant_room(len(ids) * ENTRY), ids, later=later, **kw)


def reserve_written(store, ids):
    res = store.reserve([key(i) for i in ids], [ENTRY] * len(ids), [toks(i) for i in ids])
    for j, (i, place) in enumerate(zip(ids, res.placements)):
        if place is not None:
            store.write(res.id, j, data(i))
    return res


def matched(store, ids) -> int:
    return store.lookup([key(i) for i in ids], [toks(i) for i in ids]).matched_blocks


def scene(store):
    """3 stored, 4 being written by another reservation (returned)."""
    put(store, [3])
    return reserve_written(store, [4])


def test_a_put_is_answered_first_and_booked_by_the_work_it_hands_over(open_store):
    store, sync = open_store(), open_store()
    other, sync_other = scene(store), scene(sync)
    work = []
    res = put_ids(store, [1, 2, 3, 4], later=work.append, next_room=2 * ENTRY)
    expected = put_ids(sync, [1, 2, 3, 4], next_room=2 * ENTRY)
    assert len(work) == 1
    assert (res.new, res.deduped, res.lost, res.existing) == \
        (expected.new, expected.deduped, expected.lost, expected.existing) == (2, 2, 0, (2, 3))
    assert res.room is not None and res.room.nbytes == 2 * ENTRY
    assert matched(store, [1, 2]) == 0  # nothing of it is visible before the book-keeping
    work[0]()
    store.check_integrity()
    assert matched(store, [1, 2, 3]) == 3
    assert read_back(store, [1, 2, 3]) == [data(1), data(2), data(3)]
    for s, o in ((store, other), (sync, sync_other)):
        s.commit(o.id, [checksum(data(4))])
    assert store.catalog.records[key(4)].pending == sync.catalog.records[key(4)].pending == 2
    assert store.catalog.records[key(3)].pending == sync.catalog.records[key(3)].pending
    assert store.stats()["unchecked_entries"] == sync.stats()["unchecked_entries"] == 4


def test_a_commit_is_answered_first_with_the_counts_it_books(open_store):
    store, sync = open_store(), open_store()
    for s in (store, sync):
        scene(s)
    work = []
    res = reserve_written(store, [1, 3, 4])
    got = store.commit(res.id, [checksum(data(i)) for i in (1, 3, 4)], pin=True,
                       later=work.append)
    want_res = reserve_written(sync, [1, 3, 4])
    want = sync.commit(want_res.id, [checksum(data(i)) for i in (1, 3, 4)], pin=True)
    assert got == want == (1, 2, 0, None)
    assert matched(store, [1]) == 0
    work[0]()
    assert matched(store, [1]) == 1
    assert store.catalog.records[key(1)].pins == sync.catalog.records[key(1)].pins == 1
    assert store.catalog.records[key(3)].pins == sync.catalog.records[key(3)].pins == 1


def test_a_key_twice_in_a_put_and_one_in_flight_elsewhere_count_as_booked(open_store):
    store = open_store()
    other = reserve_written(store, [4])
    work = []
    res = put_ids(store, [1, 1, 4], later=work.append)
    assert (res.new, res.deduped, res.lost, res.existing) == (1, 2, 0, (1, 2))
    work[0]()
    store.abort(other.id)  # then the writer of 4 gives up: 4 is not stored
    assert matched(store, [1]) == 1 and matched(store, [4]) == 0
    assert store.catalog.records[key(1)].pending == 2


def test_inline_checks_answer_first_once_the_bytes_are_checked(open_store):
    store = open_store(verify_commits="inline")
    work = []
    res = reserve_written(store, [1, 2])
    store.write(res.id, 1, data(9))  # torn: the check refuses it before any answer
    with pytest.raises(ChecksumError):
        store.commit(res.id, [checksum(data(1)), checksum(data(2))], later=work.append)
    assert work == [] and where(store) == {}
    res = put_ids(store, [1, 2], later=work.append)
    assert (res.new, len(work)) == (2, 1) and matched(store, [1]) == 0
    work[0]()
    assert matched(store, [1, 2]) == 2 and store.stats()["unchecked_entries"] == 0


def test_with_the_switch_off_the_answer_comes_after_booking(open_store):
    store = open_store(answer_first=False)
    work = []
    res = put_ids(store, [1, 2], later=work.append)
    assert work == [] and res.new == 2 and matched(store, [1, 2]) == 2
    res = reserve_written(store, [5])
    store.commit(res.id, [checksum(data(5))], later=work.append)
    assert work == [] and matched(store, [5]) == 1


def test_an_index_that_refuses_the_write_fails_the_put_before_any_answer(
        open_store, monkeypatch):
    """(The index write is patched to fail: a put of DRAM entries writes no index
    for real, one that dedups onto NVMe entries does; the next test has that.)"""
    store = open_store()
    put(store, [3])
    work = []

    def refuse(*args, **kw):
        raise StorageError("disk full")

    monkeypatch.setattr(store.catalog, "_write_index", refuse)
    with pytest.raises(StorageError):
        put_ids(store, [1, 2, 3], later=work.append)
    monkeypatch.undo()
    assert work == []  # nothing handed over: the writer heard the failure itself
    assert where(store) == {3: "dram"} and store.catalog.records[key(3)].pending == 1
    assert store.stats()["storage_errors"] == 1
    store.check_integrity()
    put_ids(store, [1, 2], later=work.append)
    work[0]()
    assert matched(store, [1, 2]) == 2


def test_a_full_index_map_is_refused_to_the_writer_and_loses_nothing(open_store):
    """The real thing: the durable index's map fills up (no monkeypatch). A put of
    new DRAM entries needs no index space and is stored; one that dedups onto NVMe
    entries must rewrite their records, and is refused before any answer."""
    store = open_store(dram=64, nvme=256, index_map_bytes=32 << 10)
    on_nvme = fill_index_map(store)
    assert on_nvme and set(where(store).values()) == {"dram", "nvme"}
    work = []
    res = put_ids(store, list(range(1000, 1008)), later=work.append)
    assert res.new == 8 and len(work) == 1
    work.pop()()
    assert matched(store, list(range(1000, 1008))) == 8
    before = {k: r.pending for k, r in store.catalog.records.items()}
    with pytest.raises(TierFullError, match="index"):
        put_ids(store, on_nvme[:8], later=work.append)
    assert work == []
    assert {k: r.pending for k, r in store.catalog.records.items()} == before
    assert store.verify(keys=[key(i) for i in on_nvme[:8]]) == (8, [])  # bytes intact
    store.check_integrity()
