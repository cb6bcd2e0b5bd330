"""A writer's deadline: a reserve, commit or put the store reaches after it (a server
frozen with the request in its socket buffer reads it only when it goes on) is
refused busy and changes nothing the writer could not know of: no reservation is
left holding keys, no entry stored, the room given back ("deadline 1 s ago:
reserve -> busy, nothing reserved; key 1 is then stored by the next writer").

Real tiers, real LMDB; every store is integrity-checked at the end of its test."""

import threading
import time

import pytest

from kvstore.core.errors import BusyError
from kvstore.core.hashing import checksum
from kvstore.store.facade import Store
from tests.unit.conftest import ENTRY, data, key, put, store_config, toks, where


@pytest.fixture
def store(tmp_path):
    cfg = store_config(tmp_path / "data", dram=16)
    opened = Store(cfg.replace(policy={"room_fraction": 0.5}))
    yield opened
    opened.check_integrity()
    opened.close()


def reserve(store, ids, **kw):
    return store.reserve([key(i) for i in ids], [ENTRY] * len(ids), [toks(i) for i in ids],
                         **kw)


def commit(store, res, ids, **kw):
    for j, i in enumerate(ids):
        store.write(res.id, j, data(i))
    return store.commit(res.id, [checksum(data(i)) for i in ids], **kw)


def put_into(store, room, ids, **kw):
    view = store.place.tiers[room.tier].view(store.holds.rooms[room.id].extent)
    for j, i in enumerate(ids):
        view[j * ENTRY:(j + 1) * ENTRY] = data(i)
    return store.put(room.id, [key(i) for i in ids], [ENTRY] * len(ids),
                     [toks(i) for i in ids], [j * ENTRY for j in range(len(ids))],
                     [checksum(data(i)) for i in ids], **kw)


def test_a_late_reserve_reserves_nothing_and_the_next_writer_stores_its_keys(store):
    with pytest.raises(BusyError, match="reserve reached the store .* after its writer"):
        reserve(store, [1, 2], deadline=time.time() - 1.0)
    stats = store.stats()
    assert (stats["reservations"], stats["late_writes"]) == (0, 1)
    assert stats["tiers"]["dram"]["used"] == 0
    # Had it reserved, this writer would dedup onto it (nothing of its own to write)
    # and lose both keys once that reservation expired.
    res = reserve(store, [1, 2])
    assert all(pl is not None for pl in res.placements)
    assert commit(store, res, [1, 2]).new == 2
    assert where(store) == {1: "dram", 2: "dram"}


def test_a_late_commit_is_aborted_and_stores_nothing(store):
    res = reserve(store, [1])
    store.write(res.id, 0, data(1))
    with pytest.raises(BusyError, match="commit reached the store"):
        store.commit(res.id, [checksum(data(1))], deadline=time.time() - 0.5)
    stats = store.stats()
    assert (stats["reservations"], stats["late_writes"], stats["commits"]) == (0, 1, 0)
    assert where(store) == {} and stats["tiers"]["dram"]["used"] == 0


def test_a_late_put_gives_its_room_back_and_stores_nothing(store):
    room = store.grant_room(2 * ENTRY)
    with pytest.raises(BusyError, match="put reached the store"):
        put_into(store, room, [1], deadline=time.time() - 0.5)
    stats = store.stats()
    assert (stats["rooms"], stats["late_writes"], stats["commits"]) == (0, 1, 0)
    assert where(store) == {} and stats["tiers"]["dram"]["used"] == 0


def test_a_reserve_that_runs_late_making_room_holds_nothing(store, monkeypatch):
    """In time when it took the lock, late once room was made (making room can demote
    entries to NVMe, inline): refused, its extents freed, the stored key it deduped
    onto no longer held, the key it would have written free for the next writer."""
    put(store, [3])
    allocate = store.place.allocate_memory

    def slow(sizes):
        got = allocate(sizes)
        time.sleep(0.3)
        return got

    monkeypatch.setattr(store.place, "allocate_memory", slow)
    with pytest.raises(BusyError, match="reserve reached the store"):
        reserve(store, [3, 1], deadline=time.time() + 0.1)
    monkeypatch.undo()
    stats = store.stats()
    assert (stats["reservations"], stats["leased_entries"], stats["late_writes"]) == (0, 0, 1)
    assert stats["tiers"]["dram"]["used"] == ENTRY  # entry 3 alone
    res = reserve(store, [3, 1])
    assert res.placements[0] is None and res.placements[1] is not None
    store.write(res.id, 1, data(1))
    assert store.commit(res.id, [checksum(data(1))]).new == 1
    assert where(store) == {1: "dram", 3: "dram"}


@pytest.mark.parametrize("op", ["commit", "put"])
def test_a_write_that_runs_late_hashing_stores_nothing(tmp_path, monkeypatch, op):
    """Inline checks: a commit (or put) in time when it took the lock but late once
    its entries were hashed is refused; nothing of it is stored, its reservation
    (or room) given back once."""
    cfg = store_config(tmp_path / "data", dram=16, verify_commits="inline")
    store = Store(cfg.replace(policy={"room_fraction": 0.5}))
    try:
        if op == "commit":
            res = reserve(store, [1])
            store.write(res.id, 0, data(1))
        else:
            room = store.grant_room(2 * ENTRY)
        io = store._writes.io  # (what the commit hashes with)
        sums = io.checksums

        def slow(extents):
            got = sums(extents)
            time.sleep(0.3)
            return got

        monkeypatch.setattr(io, "checksums", slow)
        with pytest.raises(BusyError, match=f"{op} reached the store"):
            if op == "commit":
                store.commit(res.id, [checksum(data(1))], deadline=time.time() + 0.1)
            else:
                put_into(store, room, [1], deadline=time.time() + 0.1)
        stats = store.stats()
        assert (stats["reservations"], stats["rooms"], stats["late_writes"],
                stats["commits"]) == (0, 0, 1, 0)
        assert where(store) == {} and stats["tiers"]["dram"]["used"] == 0
        store.check_integrity()
    finally:
        store.close()


def test_requests_in_time_are_served_as_without_a_deadline(store):
    soon = time.time() + 30.0
    put(store, [3])
    res = reserve(store, [1, 3], deadline=soon)
    assert commit(store, res, [1], deadline=soon).new == 1
    room = store.grant_room(ENTRY)
    assert put_into(store, room, [2], deadline=soon).new == 1
    assert where(store) == {1: "dram", 2: "dram", 3: "dram"}
    assert store.stats()["late_writes"] == 0


def test_time_spent_waiting_for_the_store_lock_counts(store):
    """The deadline is checked once the store's lock is held: a commit that was in
    time when its handling began, but waited past its deadline for the lock (another
    request holding it), is refused too."""
    res = reserve(store, [1])
    store.write(res.id, 0, data(1))
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with store._lock:  # (what Writes takes)
            taken.set()
            done.wait(0.4)

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(10)
    try:
        with pytest.raises(BusyError):
            store.commit(res.id, [checksum(data(1))], deadline=time.time() + 0.1)
    finally:
        done.set()
        holder.join()
    assert where(store) == {} and store.stats()["reservations"] == 0
