"""Rooms: standing room a writer holds for its next insert, which ``put`` then
stores in one step ("DRAM holds 16, rooms may take half: grant 4, write [1, 2]
into it, put -> 1 and 2 stored, the other 2 pages free, a new room of 4").

Real tiers, real LMDB; every store is integrity-checked after each step that
changes placement and at the end of its test."""

import time

import pytest

from kvstore.core.errors import (
    ChecksumError,
    InvalidRequestError,
    LeaseExpiredError,
    NotFoundError,
    StorageError,
)
from kvstore.core.hashing import checksum
from kvstore.store.facade import Store
from tests.unit.conftest import ENTRY, data, key, put, store_config, toks, where


@pytest.fixture
def open_store(tmp_path):
    opened = []

    def make(dram=16, room_fraction=0.5, **kw) -> Store:
        cfg = store_config(tmp_path / f"data{len(opened)}", dram=dram, **kw)
        store = Store(cfg.replace(policy={"room_fraction": room_fraction}))
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.check_integrity()
        store.close()


def write(store, room, ids, at=None):
    """Copy entries ``ids`` into ``room`` back to back (or at ``at``), as a writer does."""
    offsets = at if at is not None else [j * ENTRY for j in range(len(ids))]
    held = store.holds.rooms.get(room.id)
    if held is None:  # spent or reclaimed: the put that follows must fail
        return offsets
    view = store.place.tiers[room.tier].view(held.extent)
    for i, off in zip(ids, offsets):
        view[off:off + ENTRY] = data(i)
    return offsets


def put_into(store, room, ids, at=None, skip=0, **kw):
    offsets = write(store, room, ids[skip:], at)
    return store.put(room.id, [key(i) for i in ids], [ENTRY] * len(ids),
                     [toks(i) for i in ids], offsets, [checksum(data(i)) for i in ids[skip:]],
                     skip=skip, **kw)


def read_back(store, ids):
    acq = store.acquire([key(i) for i in ids], [toks(i) for i in ids])
    try:
        return [store.read(acq.id, j) for j in range(len(acq.entries))]
    finally:
        store.release(acq.id)


def test_a_put_stores_what_was_written_into_the_room_and_frees_the_rest(open_store):
    store = open_store()
    room = store.grant_room(4 * ENTRY)
    assert (room.tier, room.nbytes, room.page, room.lease_s) == ("dram", 4 * ENTRY, 4096, 30.0)
    assert room.address == store.place.tiers["dram"].base_address + room.offset
    assert store.stats()["tiers"]["dram"]["used"] == 4 * ENTRY  # held, for no key yet
    store.check_integrity()

    res = put_into(store, room, [1, 2], next_room=3 * ENTRY)  # as the server asks it
    assert (res.new, res.deduped, res.lost, res.existing) == (2, 0, 0, ())
    assert read_back(store, [1, 2]) == [data(1), data(2)]
    nxt = res.room  # granted in the put's own locked step
    assert nxt is not None and nxt.id != room.id and nxt.nbytes == 3 * ENTRY
    # two entries and the next room: the room's other two pages went back
    assert store.stats()["tiers"]["dram"]["used"] == 5 * ENTRY
    assert store.stats()["rooms"] == 1 and store.stats()["room_bytes"] == 3 * ENTRY
    store.check_integrity()
    with pytest.raises(NotFoundError):  # a room is spent by its put
        put_into(store, room, [3])


def test_entries_may_lie_anywhere_in_the_room(open_store):
    store = open_store()
    room = store.grant_room(8 * ENTRY)
    res = put_into(store, room, [1, 2, 3], at=[6 * ENTRY, 0, 3 * ENTRY])
    assert res.new == 3
    assert read_back(store, [1, 2, 3]) == [data(1), data(2), data(3)]
    assert store.stats()["tiers"]["dram"]["used"] == 3 * ENTRY
    store.check_integrity()


def test_stored_keys_dedup_and_their_bytes_go_unused(open_store):
    store = open_store()
    put(store, [2])
    room = store.grant_room(3 * ENTRY)
    res = put_into(store, room, [1, 2, 3])
    assert (res.new, res.deduped, res.existing) == (2, 1, (1,))
    assert store.catalog.records[key(2)].pending == 2  # two consumers will take it
    assert read_back(store, [1, 2, 3]) == [data(1), data(2), data(3)]
    assert store.stats()["tiers"]["dram"]["used"] == 3 * ENTRY
    store.check_integrity()


def test_a_key_being_written_by_a_reservation_dedups_onto_it(open_store):
    store = open_store()
    res = store.reserve([key(2)], [ENTRY], [toks(2)])
    room = store.grant_room(2 * ENTRY)
    assert put_into(store, room, [1, 2]).existing == (1,)
    store.write(res.id, 0, data(2))
    store.commit(res.id, [checksum(data(2))])
    assert store.catalog.records[key(2)].pending == 2
    store.check_integrity()


def test_skipped_blocks_must_be_stored_or_nothing_is(open_store):
    store = open_store()
    put(store, [1])
    room = store.grant_room(2 * ENTRY)
    with pytest.raises(NotFoundError, match="lacks block 1"):
        put_into(store, room, [1, 9, 3], skip=2)
    # nothing stored, and the room is spent (the writer reserves anew)
    assert where(store) == {1: "dram"} and store.stats()["rooms"] == 0
    assert store.stats()["tiers"]["dram"]["used"] == ENTRY
    room = store.grant_room(2 * ENTRY)
    res = put_into(store, room, [1, 3], skip=1)
    assert (res.new, res.deduped) == (1, 1) and set(where(store)) == {1, 3}
    store.check_integrity()


@pytest.mark.parametrize("at, why", [
    ([1024], "not page-aligned"),
    ([2 * ENTRY], "leaves the room"),
    ([0, 0], "two entries on one page"),
])
def test_a_bad_offset_changes_nothing(open_store, at, why):
    store = open_store()
    room = store.grant_room(2 * ENTRY)
    used = store.stats()["tiers"]["dram"]["used"]
    ids = [1, 2][:len(at)]
    with pytest.raises(InvalidRequestError):
        store.put(room.id, [key(i) for i in ids], [ENTRY] * len(ids), [toks(i) for i in ids],
                  at, [checksum(data(i)) for i in ids])
    assert where(store) == {} and store.stats()["tiers"]["dram"]["used"] == used, why
    assert put_into(store, room, [1]).new == 1  # the room is still there
    store.check_integrity()


def test_a_wrong_count_of_offsets_or_checksums_is_refused(open_store):
    store = open_store()
    room = store.grant_room(2 * ENTRY)
    args = ([key(1)], [ENTRY], [toks(1)])
    with pytest.raises(InvalidRequestError):
        store.put(room.id, *args, [0, ENTRY], [checksum(data(1))])
    with pytest.raises(InvalidRequestError):
        store.put(room.id, *args, [0], [])
    with pytest.raises(InvalidRequestError):
        store.put(room.id, *args, [-4096], [checksum(data(1))])
    assert store.stats()["rooms"] == 1


def test_rooms_come_from_free_space_only_and_share_a_cap(open_store):
    store = open_store(dram=16, room_fraction=0.25)
    assert store.grant_room(5 * ENTRY) is None  # over a quarter of the tier
    first = store.grant_room(3 * ENTRY)
    assert first is not None
    assert store.grant_room(2 * ENTRY) is None  # together over the quarter
    assert store.grant_room(1 * ENTRY) is not None
    for i in range(10):
        put(store, [i])
    # 14 of 16 pages used, the high watermark at 0.95: no room, and nothing evicted
    assert store.grant_room(1 * ENTRY) is None and len(where(store)) == 10
    store.check_integrity()


def test_rooms_off(open_store):
    store = open_store(room_fraction=0)
    assert store.grant_room(ENTRY) is None


def test_a_room_after_a_commit(open_store):
    store = open_store()
    res = store.reserve([key(1)], [ENTRY], [toks(1)])
    store.write(res.id, 0, data(1))
    store.commit(res.id, [checksum(data(1))])
    room = store.grant_room(2 * ENTRY)
    assert room is not None and room.nbytes == 2 * ENTRY
    assert put_into(store, room, [2, 3]).new == 2
    assert read_back(store, [1, 2, 3]) == [data(1), data(2), data(3)]


def test_an_unused_room_is_given_back_by_abort(open_store):
    store = open_store()
    room = store.grant_room(2 * ENTRY)
    store.abort(room.id)
    assert store.stats()["rooms"] == 0 and store.stats()["tiers"]["dram"]["used"] == 0
    store.check_integrity()


def test_an_expired_room_is_reclaimed_and_a_late_put_stores_nothing(open_store):
    store = open_store(reservation_lease_s=0.05)
    room = store.grant_room(2 * ENTRY)
    write(store, room, [1])
    time.sleep(0.1)
    assert store.reap() == 1
    assert store.stats()["rooms"] == 0 and store.stats()["rooms_expired"] == 1
    assert store.stats()["tiers"]["dram"]["used"] == 0
    with pytest.raises(LeaseExpiredError):
        put_into(store, room, [1])
    assert where(store) == {}


def test_inline_checks_store_nothing_of_a_bad_put_and_spend_the_room(open_store):
    store = open_store(verify_commits="inline")
    room = store.grant_room(2 * ENTRY)
    write(store, room, [1, 2])
    with pytest.raises(ChecksumError):
        store.put(room.id, [key(1), key(2)], [ENTRY] * 2, [toks(1), toks(2)], [0, ENTRY],
                  [checksum(data(1)), checksum(data(3))])
    assert where(store) == {} and store.stats()["tiers"]["dram"]["used"] == 0
    assert store.stats()["commit_checksum_failures"] == 1
    store.check_integrity()


def test_background_checks_condemn_a_bad_put_like_a_bad_commit(open_store):
    store = open_store()
    room = store.grant_room(ENTRY)
    write(store, room, [1])
    store.put(room.id, [key(1)], [ENTRY], [toks(1)], [0], [checksum(data(2))])
    assert store.catalog.unchecked == {key(1): checksum(data(2))}
    store.scrub_step(min_age_s=0)
    assert where(store) == {} and store.stats()["commit_checksum_failures"] == 1


def test_a_put_the_index_refuses_leaves_no_trace_on_other_writers(open_store, monkeypatch):
    """The index refuses the put's records (a full or failing disk; patched here,
    as a put of DRAM entries only writes the index when it dedups onto NVMe ones):
    nothing is stored, the room's space comes back, and the writer whose in-flight
    key the put deduped onto is not left counting a consumer (or a pin) that never
    came."""
    store = open_store()
    other = store.reserve([key(2)], [ENTRY], [toks(2)])
    room = store.grant_room(2 * ENTRY)
    write(store, room, [1, 2])

    def refuse(*args, **kw):
        raise StorageError("index full")

    monkeypatch.setattr(store.catalog, "_write_index", refuse)
    with pytest.raises(StorageError):
        store.put(room.id, [key(1), key(2)], [ENTRY] * 2, [toks(1), toks(2)], [0, ENTRY],
                  [checksum(data(1)), checksum(data(2))], pin=True)
    monkeypatch.undo()
    assert where(store) == {} and store.stats()["rooms"] == 0
    assert store.stats()["tiers"]["dram"]["used"] == ENTRY  # the other reservation's
    store.check_integrity()
    store.write(other.id, 0, data(2))
    store.commit(other.id, [checksum(data(2))])
    rec = store.catalog.records[key(2)]
    assert (rec.pending, rec.pins) == (1, 0)


def test_a_commit_grants_the_next_room_and_a_refused_put_grants_none(open_store):
    """``next_room`` is granted in the same locked step as the commit or put that
    asks for it, and only when that stored: a put refused (its room spent, a
    skipped block missing) leaves no room behind for a writer that reserves anew."""
    store = open_store()
    res = store.reserve([key(1)], [ENTRY], [toks(1)])
    store.write(res.id, 0, data(1))
    done = store.commit(res.id, [checksum(data(1))], next_room=2 * ENTRY)
    assert (done.new, done.deduped, done.lost) == (1, 0, 0)
    assert done.room is not None and done.room.nbytes == 2 * ENTRY
    assert store.stats()["rooms"] == 1

    with pytest.raises(NotFoundError):  # skips block 9, which was never stored
        store.put(done.room.id, [key(9), key(2)], [ENTRY] * 2, [toks(9), toks(2)],
                  [0], [checksum(data(2))], skip=1, next_room=2 * ENTRY)
    assert store.stats()["rooms"] == 0 and store.stats()["room_bytes"] == 0
    store.check_integrity()
    assert read_back(store, [1]) == [data(1)]
