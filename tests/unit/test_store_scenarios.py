"""Store scenarios, told as stories ("DRAM holds 4: store [1..4], touch 1, store [5]
-> 2 goes down"). Real tiers, real LMDB; every store is integrity-checked at the end
of its test (conftest), and after each step that changes placement."""

import threading
import time

import pytest

from kvstore.core.errors import (
    ChecksumError,
    ConfigError,
    InvalidRequestError,
    LeaseExpiredError,
    NotFoundError,
    TierFullError,
)
from kvstore.core.hashing import checksum
from kvstore.store.facade import Store
from kvstore.store.types import CommitResult
from tests.unit.conftest import ENTRY, data, key, put, store_config, toks, where


def acquire(store, ids, **kw):
    return store.acquire([key(i) for i in ids], [toks(i) for i in ids], **kw)


def touch(store, ids):
    store.release(acquire(store, ids).id)


# ------------------------------------------------------------------ basics
def test_store_then_acquire_serves_the_bytes(make_store):
    store = make_store(dram=4)
    assert put(store, [1, 2, 3]) == CommitResult(3, 0, 0)
    lk = store.lookup([key(i) for i in (1, 2, 3, 4)], [toks(i) for i in (1, 2, 3, 4)])
    assert (lk.matched_blocks, lk.matched_tokens, lk.tiers) == (3, 48, ["dram"] * 3)
    acq = acquire(store, [1, 2, 3, 4])
    assert acq.matched_tokens == 48 and [e.tier for e in acq.entries] == ["dram"] * 3
    assert [store.read(acq.id, j) for j in range(3)] == [data(i) for i in (1, 2, 3)]
    assert all(e.address is not None and e.checksum == checksum(data(i))
               for e, i in zip(acq.entries, (1, 2, 3)))
    assert store.release(acq.id) == 0  # get: nothing freed
    assert set(where(store)) == {1, 2, 3}
    stats = store.stats()
    assert stats["hits"] == 3 and stats["misses"] == 1 and stats["bytes_in"] == 3 * ENTRY
    store.check_integrity()


def test_full_miss_gives_an_empty_acquisition(make_store):
    store = make_store()
    acq = acquire(store, [9])
    assert acq.id == 0 and acq.entries == [] and acq.matched_tokens == 0
    assert store.release(acq.id) == 0


def test_prefix_stops_at_first_missing_block(make_store):
    store = make_store()
    put(store, [1, 3])
    assert store.lookup([key(i) for i in (1, 2, 3)], [toks(i) for i in (1, 2, 3)]).matched_blocks == 1


def test_fill_without_nvme_evicts_lru(make_store):
    # DRAM holds 4: store [1,2,3,4], touch 1, store [5] -> evicts [2]
    store = make_store(dram=4)
    put(store, [1, 2, 3, 4])
    touch(store, [1])
    put(store, [5])
    assert sorted(where(store)) == [1, 3, 4, 5]
    assert store.stats()["evictions"] == 1
    store.check_integrity()


def test_a_read_sets_the_access_time_at_once_a_claim_when_its_lease_ends(make_store):
    """A get's entries get the acquire's time at once. A drop_select's claim sets it
    when the lease ends (held, they are nobody's victims meanwhile), on those still
    stored: at a drop that leaves them pending, a release without drop, an expiry."""
    store = make_store(dram=4)
    put(store, [1, 2, 3])

    def access(i: int) -> float:
        return next(r.last_access for r in store.entries() if r.key == key(i))

    was = access(1)
    time.sleep(0.01)
    acq = acquire(store, [1])
    read_at = access(1)
    assert was < read_at <= time.time()  # a get: at once
    store.release(acq.id)
    assert access(1) == read_at
    put(store, [2])  # a second consumer of entry 2: a drop_select leaves it pending
    time.sleep(0.01)
    acq = store.acquire([key(2)], [toks(2)], claim=True)
    assert access(2) == was  # not yet
    store.release(acq.id, drop=True)
    assert access(2) > read_at and [r.pending for r in store.entries()
                                    if r.key == key(2)] == [1]
    time.sleep(0.01)
    acq = store.acquire([key(3)], [toks(3)], claim=True)
    store.release(acq.id)  # given back: the claim's time, on the entry that stays
    assert access(3) > access(2)
    time.sleep(0.01)
    acq = store.acquire([key(3)], [toks(3)], claim=True, lease_s=0.01)
    at = access(3)
    time.sleep(0.03)
    assert store.reap() == 1
    assert access(3) > at
    store.check_integrity()


def test_entry_larger_than_every_tier_is_tier_full(make_store):
    store = make_store(dram=2)
    with pytest.raises(TierFullError):
        put(store, [1], nbytes=3 * ENTRY)
    store.check_integrity()


def test_dram_bytes_is_a_view_when_back_to_back_else_a_copy_and_none_off_dram(make_store):
    # (A server sends a small read's bytes so: Server._inline.)
    store = make_store(dram=8, nvme=8, stage=False)  # NVMe hits are read there
    put(store, [1, 2, 3])  # one reservation: back to back in the arena
    acq = acquire(store, [1, 2, 3])
    whole = data(1) + data(2) + data(3)
    view = store.dram_bytes(acq.entries)
    assert type(view) is memoryview and bytes(view) == whole
    back = store.dram_bytes(acq.entries[::-1])  # not in arena order: one copy
    assert type(back) is bytes and back == data(3) + data(2) + data(1)
    assert store.dram_bytes(acq.entries[::2]) == data(1) + data(3)  # a gap: a copy
    assert store.dram_bytes([acq.entries[0]._replace(tier="nvme")]) is None
    assert store.dram_bytes([]) == b""
    # Runs (the stream door): views of each, back-to-back ones joined; runs of a
    # page each are copied, unless a copy would be over ``copy_max``.
    runs = store.dram_bytes(acq.entries, runs=True)
    assert type(runs) is list and [bytes(v) for v in runs] == [whole]
    assert store.dram_bytes(acq.entries[::-1], runs=True) == data(3) + data(2) + data(1)
    runs = store.dram_bytes(acq.entries[::-1], runs=True, copy_max=2 * ENTRY)
    assert type(runs) is list and [bytes(v) for v in runs] == [data(3), data(2), data(1)]
    assert store.dram_bytes(acq.entries[::-1], copy_max=2 * ENTRY) is None
    assert store.dram_bytes(acq.entries[::-1], copy_max=3 * ENTRY) == data(3) + data(2) + data(1)
    assert type(store.dram_bytes(acq.entries, copy_max=0)) is memoryview  # no copy needed
    store.release(acq.id)
    store.demote_entries(tier="dram", keys=[key(2)])
    acq = acquire(store, [1, 2, 3])
    assert [e.tier for e in acq.entries] == ["dram", "nvme", "dram"]
    assert store.dram_bytes(acq.entries) is None
    store.release(acq.id)


def test_dram_bytes_without_a_dram_tier_is_none(make_store):
    assert make_store(dram=0, nvme=8, gpu=4).dram_bytes([]) is None


# ------------------------------------------------------------------ pins, leases
def test_pinned_entries_are_never_evicted_full_tier_says_so(make_store):
    store = make_store(dram=2)
    put(store, [1, 2])
    assert store.pin([key(1), key(2)]) == 2
    with pytest.raises(TierFullError):
        put(store, [3])
    assert sorted(where(store)) == [1, 2]
    store.unpin([key(2)])
    put(store, [3])
    assert sorted(where(store)) == [1, 3]
    with pytest.raises(InvalidRequestError):
        store.unpin([key(3)])  # never pinned: changes nothing
    with pytest.raises(NotFoundError):
        store.pin([key(1), key(99)])
    assert store.stats()["pinned_entries"] == 1
    store.check_integrity()


def test_acquired_entries_are_protected_until_release(make_store):
    store = make_store(dram=2)
    put(store, [1, 2])
    acq = acquire(store, [1, 2])
    with pytest.raises(TierFullError):
        put(store, [3])
    result = store.evict(everything=True)
    assert result.keys == [] and sorted(result.skipped) == [key(1), key(2)]
    store.release(acq.id)
    put(store, [3])
    assert sorted(where(store)) == [2, 3]
    store.check_integrity()


def test_reservation_lease_expires_and_space_returns(make_store):
    store = make_store(dram=2)
    res = store.reserve([key(1), key(2)], [ENTRY] * 2, [toks(1), toks(2)], lease_s=0.05)
    store.write(res.id, 0, data(1))
    assert store.stats()["tiers"]["dram"]["used"] == 2 * ENTRY
    time.sleep(0.08)
    assert store.reap() == 1
    assert store.stats()["tiers"]["dram"]["used"] == 0
    with pytest.raises(LeaseExpiredError):
        store.commit(res.id, [checksum(data(1)), checksum(data(2))])
    assert store.lookup([key(1)], [toks(1)]).matched_blocks == 0
    put(store, [1, 2])  # the space is usable again
    store.check_integrity()


def test_expired_reservation_is_reaped_opportunistically(make_store):
    store = make_store(dram=2)
    store.reserve([key(1), key(2)], [ENTRY] * 2, [toks(1), toks(2)], lease_s=0.05)
    time.sleep(0.08)
    put(store, [3, 4])  # reserve reaps first, so the dead reservation's space is there
    assert sorted(where(store)) == [3, 4]


def test_read_lease_expires(make_store):
    store = make_store(dram=2)
    put(store, [1, 2])
    acq = acquire(store, [1, 2], lease_s=0.05)
    time.sleep(0.08)
    store.reap()
    with pytest.raises(LeaseExpiredError):
        store.release(acq.id, drop=True)
    put(store, [3])  # no longer protected
    assert sorted(where(store)) == [2, 3]


# ------------------------------------------------------------------ two-phase writes
def test_abort_leaves_nothing(make_store):
    store = make_store(dram=2)
    res = store.reserve([key(1), key(2)], [ENTRY] * 2, [toks(1), toks(2)])
    store.write(res.id, 0, data(1))
    store.abort(res.id)
    assert where(store) == {} and store.stats()["tiers"]["dram"]["used"] == 0
    with pytest.raises(NotFoundError):
        store.commit(res.id, [0, 0])
    store.check_integrity()


def test_uncommitted_entries_are_invisible(make_store):
    store = make_store(dram=2)
    res = store.reserve([key(1)], [ENTRY], [toks(1)])
    store.write(res.id, 0, data(1))
    assert store.lookup([key(1)], [toks(1)]).matched_blocks == 0
    assert acquire(store, [1]).entries == []
    store.commit(res.id, [checksum(data(1))])
    assert store.lookup([key(1)], [toks(1)]).matched_blocks == 1


def test_checksum_mismatch_aborts_the_whole_reservation(make_store):
    store = make_store(dram=4, verify_commits="inline")
    res = store.reserve([key(1), key(2)], [ENTRY] * 2, [toks(1), toks(2)])
    store.write(res.id, 0, data(1))
    store.write(res.id, 1, data(2)[:-1] + b"\x00")  # a torn transfer
    with pytest.raises(ChecksumError):
        store.commit(res.id, [checksum(data(1)), checksum(data(2))])
    assert where(store) == {} and store.stats()["tiers"]["dram"]["used"] == 0
    assert store.stats()["commit_checksum_failures"] == 1
    store.check_integrity()


# ------------------------------------------------------------------ dedup
def test_dedup_two_consumers_each_get_it_then_it_goes(make_store):
    store = make_store(dram=4)
    put(store, [1, 2])
    res = store.reserve([key(i) for i in (1, 2, 3)], [ENTRY] * 3, [toks(i) for i in (1, 2, 3)])
    assert [p is None for p in res.placements] == [True, True, False]
    store.write(res.id, 2, data(3))
    assert store.commit(res.id, [0, 0, checksum(data(3))]) == CommitResult(1, 2, 0)
    first, second = acquire(store, [1, 2]), acquire(store, [1, 2])
    assert store.release(first.id, drop=True) == 0  # one consumer still to come
    assert store.read(second.id, 1) == data(2)
    assert store.release(second.id, drop=True) == 2
    assert sorted(where(store)) == [3]
    store.check_integrity()


def test_dedup_onto_an_in_flight_writer(make_store):
    store = make_store(dram=4)
    a = store.reserve([key(5)], [ENTRY], [toks(5)])
    b = store.reserve([key(5)], [ENTRY], [toks(5)])
    assert b.placements == [None]
    assert store.commit(b.id, [0]) == CommitResult(0, 1, 0)
    store.write(a.id, 0, data(5))
    store.commit(a.id, [checksum(data(5))])
    assert [r.pending for r in store.entries()] == [2]
    store.check_integrity()


def test_dedup_onto_a_writer_that_aborts_is_lost(make_store):
    store = make_store(dram=4)
    a = store.reserve([key(5)], [ENTRY], [toks(5)])
    b = store.reserve([key(5)], [ENTRY], [toks(5)])
    store.abort(a.id)
    assert store.commit(b.id, [0]) == CommitResult(0, 0, 1)
    assert where(store) == {}


def test_deduped_entry_is_not_evicted_to_make_room_for_its_own_batch(make_store):
    # vLLM regression story: store [1,2], touch 1, store [2,3] in a full tier of 2
    # -> 2 is already stored, so 1 goes, not 2
    store = make_store(dram=2)
    put(store, [1, 2])
    touch(store, [2])
    touch(store, [1])
    assert put(store, [2, 3]) == CommitResult(1, 1, 0)
    assert sorted(where(store)) == [2, 3]


def test_drop_is_deferred_while_another_reader_holds_it(make_store):
    store = make_store(dram=2)
    put(store, [1])
    a, b = acquire(store, [1]), acquire(store, [1])
    assert store.release(a.id, drop=True) == 0
    assert store.read(b.id, 0) == data(1)
    assert store.release(b.id) == 1  # last holder gone, pending already 0
    assert where(store) == {}


# ------------------------------------------------------------------ collisions, input
def test_same_key_different_tokens_is_a_miss_and_counted(make_store):
    store = make_store()
    put(store, [1, 2])
    assert store.acquire([key(1), key(2)], [toks(1), toks(7)]).matched_tokens == 16
    assert store.stats()["collisions"] == 1


def test_bad_input_is_refused_and_changes_nothing(make_store):
    store = make_store(dram=2)
    put(store, [1])
    before = store.stats()
    bad_calls = [
        lambda: store.reserve([b"short"], [ENTRY], [toks(1)]),
        lambda: store.reserve([key(2)], [0], [toks(2)]),
        lambda: store.reserve([key(2)], [ENTRY], [b"abc"]),
        lambda: store.reserve([key(2)], [ENTRY, ENTRY], [toks(2)]),
        lambda: store.reserve([key(2)], [ENTRY], [toks(2)], meta=[b"x" * 2000]),
        lambda: store.reserve([key(2)], [ENTRY], [toks(2)], lease_s=-1),
        lambda: store.evict(nbytes=1, everything=True),
        lambda: store.evict(tier="tape", everything=True),
        lambda: store.evict(fraction=2.0),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidRequestError):
            call()
    res = store.reserve([key(2)], [ENTRY], [toks(2)])
    with pytest.raises(InvalidRequestError):
        store.commit(res.id, [1, 2, 3])
    with pytest.raises(InvalidRequestError):
        store.write(res.id, 5, data(2))
    store.abort(res.id)
    after = store.stats()
    assert after["entries"] == before["entries"] and after["tiers"] == before["tiers"]
    store.check_integrity()


# ------------------------------------------------------------------ admin
def test_evict_by_bytes_fraction_keys_and_dry_run(make_store):
    store = make_store(dram=8)
    for i in range(1, 9):
        put(store, [i])  # one commit each: 1 is the least recently used
    store.pin([key(2)])
    dry = store.evict(tier="dram", nbytes=2 * ENTRY, dry_run=True)
    assert dry.keys == [key(1), key(3)] and dry.skipped == [key(2)]
    assert len(where(store)) == 8
    assert store.evict(tier="dram", nbytes=2 * ENTRY).keys == [key(1), key(3)]
    assert store.evict(keys=[key(8), key(2), key(99)]).keys == [key(8)]
    # left: 2 (pinned), 4, 5, 6, 7; half of those 5 entries' bytes is 2.5 entries
    assert store.evict(fraction=0.5).keys == [key(4), key(5), key(6)]
    assert store.clear().keys == [key(2), key(7)]  # clear takes pinned entries too
    assert where(store) == {}
    store.check_integrity()


def test_second_store_on_the_same_dir_is_refused(make_store, tmp_path):
    make_store()
    with pytest.raises(ConfigError, match="in use"):
        Store(store_config(tmp_path / "data"))


def test_config_without_a_memory_tier_is_refused(tmp_path):
    with pytest.raises(ConfigError):
        Store(store_config(tmp_path / "d", dram=0, nvme=4))
    Store(store_config(tmp_path / "d")).close()  # and the lock was released


def test_shared_dram_arena_is_named_for_the_dir_and_removed(make_store):
    import os

    store = make_store(shared=True)
    path = store.dram_shared_path
    assert path.startswith("/dev/shm/kvstore-") and path.endswith(f"-{os.getpid()}")
    assert os.path.getsize(path) == store.stats()["tiers"]["dram"]["capacity"]
    store.close()
    assert not os.path.exists(path)


def test_concurrent_writers_readers_and_reaper(make_store):
    store = make_store(dram=16)
    stop = threading.Event()
    errors = []

    def reaper():
        while not stop.is_set():
            store.reap()
            time.sleep(0.001)

    def worker(base):
        try:
            for n in range(30):
                ids = [base + n, base + n + 1000]
                put(store, ids)
                acq = acquire(store, ids)
                store.release(acq.id, drop=True)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reaper)] + [
        threading.Thread(target=worker, args=(b,)) for b in (10_000, 20_000, 30_000)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(timeout=30)
    stop.set()
    threads[0].join(timeout=5)
    assert errors == []
    assert where(store) == {}
    store.check_integrity()


# ------------------------------------------------------------------ tiers: demote, stage
def test_full_dram_demotes_lru_to_nvme(make_store):
    # DRAM holds 4: store [1,2,3,4], touch 1, store [5] -> 2 goes down to NVMe
    store = make_store(dram=4, nvme=8)
    put(store, [1, 2, 3, 4])
    touch(store, [1])
    put(store, [5])
    assert where(store) == {1: "dram", 2: "nvme", 3: "dram", 4: "dram", 5: "dram"}
    assert store.stats()["demotions"] == 1
    store.check_integrity()


def test_watermarks_demote_down_to_low(make_store):
    # DRAM 4, high 75%, low 50%: [1,2,3] fit; storing 4 would pass 75%, so LRU
    # entries go down until 4 lands at 50%: 1 and 2 demote
    store = make_store(dram=4, nvme=8, high=0.75, low=0.5)
    for i in (1, 2, 3):
        put(store, [i])
    assert set(where(store).values()) == {"dram"}
    put(store, [4])
    assert where(store) == {1: "nvme", 2: "nvme", 3: "dram", 4: "dram"}


def test_reap_restores_watermarks(make_store):
    store = make_store(dram=4, nvme=8, high=0.5, low=0.25)
    put(store, [1, 2])  # exactly 50%: not over
    store.pin([key(1), key(2)])
    put(store, [3])  # would pass 50%, but nothing is movable: lands anyway at 75%
    assert set(where(store).values()) == {"dram"}
    store.unpin([key(1), key(2)])
    store.reap()  # back to 25%: the two least recently used go down
    assert where(store) == {1: "nvme", 2: "nvme", 3: "dram"}


def test_nvme_full_evicts_lru_for_good(make_store):
    # DRAM 2, NVMe 2: store 1..6 one by one -> 5,6 in DRAM, 3,4 on NVMe, 1,2 gone
    store = make_store(dram=2, nvme=2)
    for i in range(1, 7):
        put(store, [i])
        store.check_integrity()
    assert where(store) == {3: "nvme", 4: "nvme", 5: "dram", 6: "dram"}
    assert store.stats()["evictions"] == 2 and store.stats()["demotions"] == 4


def test_nvme_hit_is_staged_into_dram_and_served(make_store):
    store = make_store(dram=2, nvme=4)
    put(store, [1, 2])
    put(store, [3, 4])  # 1, 2 go down
    assert where(store) == {1: "nvme", 2: "nvme", 3: "dram", 4: "dram"}
    acq = acquire(store, [1, 2])
    assert [e.tier for e in acq.entries] == ["dram", "dram"]
    assert all(e.address is not None for e in acq.entries)
    assert [store.read(acq.id, j) for j in (0, 1)] == [data(1), data(2)]
    assert where(store) == {1: "dram", 2: "dram", 3: "nvme", 4: "nvme"}
    stats = store.stats()
    assert stats["stagings"] == 2 and stats["tiers"]["nvme"]["hits"] == 2
    store.release(acq.id)
    store.check_integrity()


def test_staging_stops_the_prefix_when_dram_is_all_held(make_store):
    store = make_store(dram=1, nvme=4)
    put(store, [1])
    put(store, [2])  # 1 goes down
    held = acquire(store, [2])
    acq = acquire(store, [1])  # DRAM's only slot is leased: 1 cannot be staged
    assert acq.entries == [] and where(store) == {1: "nvme", 2: "dram"}
    store.release(held.id)
    assert [e.tier for e in acquire(store, [1]).entries] == ["dram"]
    store.check_integrity()


@pytest.mark.parametrize("inserts", [1, 2])
def test_rest_of_a_taken_prompt_with_no_room_to_stage_is_spent_not_stranded(make_store,
                                                                             inserts):
    store = make_store(dram=3, nvme=4)
    for _ in range(inserts):
        put(store, [1, 2, 3])
    assert store.demote([key(3)]) == 1
    put(store, [4])
    store.pin([key(4)])  # DRAM: 1, 2 and the pinned 4
    first = acquire(store, [1, 2, 3], claim=True)  # 3 cannot be staged: two of three
    assert len(first.entries) == 2 and first.short == "no_room_to_stage"
    store.release(first.id, drop=True)
    put(store, [5, 6])
    store.pin([key(5), key(6)])  # the room the first round freed is taken again
    rest = acquire(store, [3], claim=True, spend_rest=True)
    assert rest.entries == [] and rest.short == "no_room_to_stage" and rest.spent == 1
    assert store.stats()["staging_spent"] == 1 and store.stats()["leases"] == 0
    if inserts == 1:  # its head gone, 3 could never be read whole again: spent, freed
        assert where(store) == {4: "dram", 5: "dram", 6: "dram"}
    else:  # the second insert's consumer still gets the whole prompt
        store.unpin([key(4), key(5), key(6)])  # room for all three again
        again = acquire(store, [1, 2, 3], claim=True)
        assert len(again.entries) == 3 and again.short == ""
        store.release(again.id, drop=True)
        assert not {1, 2, 3} & set(where(store))  # both consumers had it: gone
    store.check_integrity()


def test_a_later_round_that_stages_nothing_keeps_the_rest_without_spend_rest(make_store):
    store = make_store(dram=3, nvme=4)
    put(store, [1, 2, 3])
    store.demote([key(3)])
    put(store, [4, 5, 6])
    store.pin([key(4), key(5), key(6)])  # 1, 2 went down: DRAM is all pinned
    acq = acquire(store, [1, 2, 3], claim=True, spend_rest=False)
    assert acq.entries == [] and acq.spent == 0 and acq.short == "no_room_to_stage"
    assert sorted(where(store)) == [1, 2, 3, 4, 5, 6]  # a plain shortfall keeps them


def test_pinned_entry_stays_in_dram_under_pressure(make_store):
    store = make_store(dram=2, nvme=4)
    put(store, [1])
    store.pin([key(1)])
    for i in (2, 3, 4):
        put(store, [i])
    assert where(store) == {1: "dram", 2: "nvme", 3: "nvme", 4: "dram"}


def test_demote_moves_entries_down_now(make_store):
    store = make_store(dram=4, nvme=4)
    put(store, [1, 2, 3])
    store.pin([key(3)])
    assert store.demote([key(1), key(3), key(99)]) == 1
    assert where(store) == {1: "nvme", 2: "dram", 3: "dram"}
    assert store.demote([key(1)]) == 0  # nowhere lower than the last tier


def test_gpu_tier_first_then_dram(make_store):
    pytest.importorskip("tiers.gpu")
    store = make_store(gpu=2, dram=2, nvme=2)
    put(store, [1, 2])
    assert set(where(store).values()) == {"gpu"}
    put(store, [3])
    assert where(store) == {1: "dram", 2: "gpu", 3: "gpu"}
    put(store, [4, 5])
    assert where(store) == {1: "nvme", 2: "dram", 3: "dram", 4: "gpu", 5: "gpu"}
    # all five leased at once cannot work: 1 needs a DRAM slot that 2 and 3 hold
    assert acquire(store, [1, 2, 3, 4, 5]).entries == []
    acq = acquire(store, [1])  # staged into DRAM: 2 (LRU there) goes down to NVMe
    assert [e.tier for e in acq.entries] == ["dram"] and store.read(acq.id, 0) == data(1)
    store.release(acq.id, drop=True)
    assert where(store) == {2: "nvme", 3: "dram", 4: "gpu", 5: "gpu"}
    acq = acquire(store, [2, 3, 4, 5])
    assert [e.tier for e in acq.entries] == ["dram", "dram", "gpu", "gpu"]
    assert [store.read(acq.id, j) for j in range(4)] == [data(i) for i in range(2, 6)]
    store.release(acq.id, drop=True)
    assert where(store) == {}
    store.check_integrity()


def test_staged_entry_keeps_its_nvme_copy_and_goes_back_to_it(make_store):
    store = make_store(dram=2, nvme=4)
    put(store, [1, 2])
    put(store, [3, 4])
    touch(store, [1])  # staged; 3 (LRU in DRAM) goes down to make room
    assert where(store) == {1: "dram", 2: "nvme", 3: "nvme", 4: "dram"}
    stats = store.stats()
    assert stats["nvme_copies"] == 1 and stats["tiers"]["nvme"]["used"] == 3 * ENTRY
    assert store.demote([key(1)]) == 1  # back onto its copy: no NVMe space, no write
    stats = store.stats()
    assert stats["nvme_copies"] == 0 and stats["tiers"]["nvme"]["used"] == 3 * ENTRY
    assert where(store)[1] == "nvme"
    store.check_integrity()


def test_nvme_pressure_drops_a_copy_before_an_entry(make_store):
    store = make_store(dram=2, nvme=2)
    put(store, [1, 2])
    put(store, [3, 4])  # 1, 2 on NVMe (full)
    touch(store, [1])  # staged: 1 served from DRAM, its copy still on NVMe
    # 3 went down to NVMe, which had to free a slot: 2, the LRU there, went
    assert where(store) == {1: "dram", 3: "nvme", 4: "dram"}
    touch(store, [1])
    put(store, [5])  # 4 goes down; NVMe makes room by dropping 1's copy, not 3
    assert where(store) == {1: "dram", 3: "nvme", 4: "nvme", 5: "dram"}
    assert store.stats()["nvme_copies"] == 0
    store.check_integrity()


def test_full_index_is_a_clean_tier_full(make_store):
    """DRAM overflows onto NVMe, whose records need index space: when the map is
    full the commit that needs it is a clean ``TierFullError``."""
    store = make_store(dram=8, nvme=64, index_map_bytes=32 << 10)
    with pytest.raises(TierFullError, match="index"):
        for i in range(0, 64, 8):
            put(store, list(range(i, i + 8)), meta=[b"m" * 1000] * 8)
    store.check_integrity()  # whichever step was refused, the books balance


def test_memory_entries_need_no_index_space(make_store):
    """Records of memory tiers are not written to LMDB: a map too small for one
    of them holds no DRAM commit back."""
    store = make_store(dram=64, index_map_bytes=32 << 10)
    for i in range(0, 64, 8):
        put(store, list(range(i, i + 8)), meta=[b"m" * 1000] * 8)
    assert len(where(store)) == 64 and len(store.catalog.index) == 0
    store.check_integrity()


@pytest.mark.parametrize("seed,stage", [(1, True), (2, True), (3, True), (4, False),
                                        (5, True), (6, False)])
def test_random_operations_keep_the_books_and_the_bytes(make_store, seed, stage):
    """Random mixes of every operation on small tiers; after each, the books
    balance and every served byte is the one written under that key."""
    import random

    rng = random.Random(seed)
    import importlib.util

    sizes = {"dram": 6, "nvme": 8}
    if importlib.util.find_spec("tiers.gpu"):
        sizes["gpu"] = 3
    store = make_store(high=0.8, low=0.5, stage=stage, **sizes)
    open_acqs, open_res = [], []
    for _ in range(250):
        op = rng.choice(["put", "put", "reserve", "finish", "acquire", "release", "pin",
                         "unpin", "evict", "demote", "reap"])
        # (up to 6: a release of more than 4 keys takes the C-level passes too)
        ids = rng.sample(range(20), rng.randint(1, 6))
        try:
            if op == "put":
                put(store, ids)
            elif op == "reserve":
                open_res.append((store.reserve([key(i) for i in ids], [ENTRY] * len(ids),
                                               [toks(i) for i in ids]), ids))
            elif op == "finish" and open_res:
                res, rids = open_res.pop(rng.randrange(len(open_res)))
                for j, (i, place) in enumerate(zip(rids, res.placements)):
                    if place is not None:
                        store.write(res.id, j, data(i))
                if rng.random() < 0.2:
                    store.abort(res.id)
                else:
                    store.commit(res.id, [checksum(data(i)) for i in rids])
            elif op == "acquire":
                acq = acquire(store, sorted(ids), claim=rng.random() < 0.5)
                for j, entry in enumerate(acq.entries):
                    assert store.read(acq.id, j) == data(int.from_bytes(entry.key, "little"))
                if acq.id:
                    open_acqs.append(acq.id)
            elif op == "release" and open_acqs:
                store.release(open_acqs.pop(rng.randrange(len(open_acqs))),
                              drop=rng.random() < 0.5)
            elif op == "pin":
                store.pin([key(i) for i in ids])
            elif op == "unpin":
                store.unpin([key(i) for i in ids])
            elif op == "evict":
                store.evict(tier=rng.choice([None, "dram", "nvme"]), fraction=0.3)
            elif op == "demote":
                store.demote([key(i) for i in ids])
            elif op == "reap":
                store.reap()
        except (TierFullError, NotFoundError, InvalidRequestError):
            pass  # refused cleanly: nothing may have changed, which the audit checks
        store.check_integrity()
    for acq_id in open_acqs:
        store.release(acq_id, drop=True)
    for res, _ in open_res:
        store.abort(res.id)
    store.check_integrity()
