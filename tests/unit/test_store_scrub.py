"""Commits hashed off the request path (``store.verify_commits = "background"``, the
default): the commit answers without hashing, ``Store.scrub_step`` hashes the
entries just after, and until then every server-side read of such an entry
verifies it. A bad entry is never served, and is counted and dropped."""

from __future__ import annotations

import pytest

from kvstore.core.errors import ChecksumError
from kvstore.core.hashing import checksum
from tests.unit.conftest import ENTRY, data, key, put, toks, where


def torn_commit(store, ids: list[int], bad: int):
    """Commit ``ids`` with entry ``bad``'s bytes torn after its checksum was taken."""
    res = store.reserve([key(i) for i in ids], [ENTRY] * len(ids), [toks(i) for i in ids])
    for j, i in enumerate(ids):
        store.write(res.id, j, data(i) if i != bad else data(i)[:-1] + b"\x00")
    return store.commit(res.id, [checksum(data(i)) for i in ids])


def test_a_commit_is_not_hashed_then_the_scrub_drops_the_torn_entry(make_store):
    store = make_store(dram=4)
    result = torn_commit(store, [1, 2, 3], bad=2)
    assert result.new == 3  # answered without hashing
    assert store.stats()["unchecked_entries"] == 3
    assert store.scrub_step() == 3
    assert where(store) == {1: "dram", 3: "dram"}
    stats = store.stats()
    assert stats["commit_checksum_failures"] == 1 and stats["unchecked_entries"] == 0
    assert store.scrub_step() == 0  # nothing left to check
    store.check_integrity()


def test_an_unchecked_entry_is_verified_when_read(make_store):
    store = make_store(dram=4)
    torn_commit(store, [1, 2], bad=2)
    acq = store.acquire([key(1), key(2)], [toks(1), toks(2)])
    assert store.read(acq.id, 0) == data(1)
    with pytest.raises(ChecksumError):
        store.read(acq.id, 1)
    # Leased: the scrub finds it bad but leaves it to the lease (its reader holds it).
    assert store.scrub_step() == 2
    assert 2 in where(store) and store.stats()["unchecked_entries"] == 1
    assert store.scrub_step() == 0  # nothing more to hash: the thread idles, no spin
    with pytest.raises(ChecksumError):
        store.read(acq.id, 1)  # condemned: still verified on every read
    store.release(acq.id)
    assert store.scrub_step() == 0
    assert where(store) == {1: "dram"}
    assert store.stats()["commit_checksum_failures"] == 1
    assert store.stats()["unchecked_entries"] == 0


def test_entries_that_go_or_move_before_the_scrub_leave_its_list(make_store):
    store = make_store(dram=4, nvme=4)
    for i in (1, 2, 3):
        put(store, [i])
    acq = store.acquire([key(1)], [toks(1)], claim=True)
    store.release(acq.id, drop=True)  # the consumer took entry 1: it is gone
    assert store.demote([key(2)]) == 1  # on NVMe, every read verifies it
    assert store.stats()["unchecked_entries"] == 1
    assert store.scrub_step() == 1  # only entry 3 is hashed
    assert where(store) == {2: "nvme", 3: "dram"}
    assert store.stats()["unchecked_entries"] == 0
    assert store.stats()["commit_checksum_failures"] == 0


def test_a_record_replaced_while_it_was_hashed_is_not_judged_by_the_old_bytes(make_store):
    """The scrub hashes without the lock: if the entry is dropped and its key stored
    again meanwhile (here with other, good bytes at the same place), the stale hash
    must not drop the new record."""
    store = make_store(dram=4)
    put(store, [1])
    batch = store._writes.unchecked_batch(1 << 20)
    acq = store.acquire([key(1)], [toks(1)], claim=True)
    store.release(acq.id, drop=True)
    put(store, [1])
    # The hash (here a wrong one) was of the old record: the new one, stored since
    # (same key, same bytes, maybe the same place), is neither judged nor cleared.
    assert store._writes.finish_check(batch, [0]) == []
    assert where(store) == {1: "dram"} and store.stats()["unchecked_entries"] == 1
    assert store.scrub_step() == 1  # its own check
    assert store.stats()["unchecked_entries"] == 0
    assert store.stats()["commit_checksum_failures"] == 0


def test_a_hash_taken_while_the_bytes_changed_is_confirmed_under_the_lock(make_store):
    store = make_store(dram=4)
    put(store, [1])
    batch = store._writes.unchecked_batch(1 << 20)
    assert store._writes.finish_check(batch, [0]) == []  # hashed again: the bytes are good
    assert where(store) == {1: "dram"} and store.stats()["unchecked_entries"] == 0


def test_inline_mode_fails_the_commit_and_stores_nothing(make_store):
    store = make_store(dram=4, verify_commits="inline")
    with pytest.raises(ChecksumError):
        torn_commit(store, [1, 2], bad=2)
    assert where(store) == {} and store.stats()["unchecked_entries"] == 0
    assert store.stats()["commit_checksum_failures"] == 1


def test_verify_commits_refuses_other_values(tmp_path):
    from kvstore.core.config import KVStoreConfig
    from kvstore.core.errors import ConfigError

    with pytest.raises(ConfigError, match="verify_commits"):
        KVStoreConfig().replace(store={"verify_commits": "never"})


def test_the_scrub_leaves_young_entries_to_their_consumer(make_store):
    store = make_store(dram=4)
    put(store, [1])
    assert store.scrub_step(min_age_s=60) == 0  # committed just now: not yet
    assert store.stats()["unchecked_entries"] == 1
    acq = store.acquire([key(1)], [toks(1)], claim=True)
    store.release(acq.id, drop=True)  # its consumer took (and verified) it
    assert store.stats()["unchecked_entries"] == 0 and store.scrub_step() == 0
