"""An acquire that stages NVMe entries, in steps: begin (lock), read (no lock), finish.

Story: the server's request thread begins such an acquire and hands the NVMe reads
to its staging thread, so other requests go on meanwhile. While a staging is
pending, its prefix is held and claimed: nothing moves it, a concurrent
drop_select does not get it too, other work goes on; two readers staging the same
entry leak no memory; a staging given up (``abandon``) gives everything back; a
corrupt NVMe entry found while staging is dropped and counted, and the prefix ends
before it. Real tiers, real LMDB, real files.
"""

from __future__ import annotations

import pytest

from kvstore.core.errors import InvalidRequestError
from kvstore.core.hashing import checksum
from kvstore.store.reads import Staging
from kvstore.store.types import Acquisition

from tests.unit.conftest import data, key, put, toks
from tests.unit.test_store_corruption import flip_byte


def _on_nvme(store, ids):
    put(store, ids)
    store.demote([key(i) for i in ids])
    assert {r.tier for r in store.entries()} == {"nvme"}


def _keys(ids):
    return [key(i) for i in ids], [toks(i) for i in ids]


def test_a_pending_staging_holds_and_claims_while_other_work_goes_on(make_store):
    store = make_store(dram=4, nvme=8)
    _on_nvme(store, [1, 2])
    step = store.begin_acquire(*_keys([1, 2]), claim=True)
    assert isinstance(step, Staging) and step.nbytes == 2 * 4096
    store.check_integrity()
    # claimed: a second drop_select of the same prompt gets nothing of it
    other = store.begin_acquire(*_keys([1, 2]), claim=True)
    assert isinstance(other, Acquisition) and other.entries == []
    # held: no eviction or demotion takes them; the store goes on serving
    store.evict(everything=True)
    assert store.lookup(*_keys([1, 2])).matched_blocks == 2
    put(store, [7])
    assert store.lookup(*_keys([7])).matched_blocks == 1
    acq = step.finish(*step.read())
    assert [e.tier for e in acq.entries] == ["dram", "dram"]
    assert [store.read(acq.id, i) for i in range(2)] == [data(1), data(2)]
    store.release(acq.id, drop=True)
    assert store.lookup(*_keys([1, 2])).matched_blocks == 0
    store.check_integrity()


def test_two_readers_staging_one_entry_leak_nothing(make_store):
    store = make_store(dram=4, nvme=8)
    _on_nvme(store, [3])
    dram = store.place.tiers["dram"]
    first = store.begin_acquire(*_keys([3]))
    second = store.begin_acquire(*_keys([3]))
    assert isinstance(first, Staging) and isinstance(second, Staging)
    a = first.finish(*first.read())
    b = second.finish(*second.read())  # finds it staged by the first: serves that copy
    assert a.entries[0].offset == b.entries[0].offset
    assert dram.used == 4096
    assert store.read(a.id, 0) == store.read(b.id, 0) == data(3)
    store.release(a.id)
    store.release(b.id)
    store.check_integrity()


def test_an_abandoned_staging_gives_everything_back(make_store):
    store = make_store(dram=4, nvme=8)
    _on_nvme(store, [4, 5])
    dram = store.place.tiers["dram"]
    step = store.begin_acquire(*_keys([4, 5]), claim=True)
    assert dram.used == 2 * 4096  # the staging room
    step.abandon()
    assert dram.used == 0 and not store.holds.leased and not store.holds.claims
    store.check_integrity()
    got = store.acquire(*_keys([4, 5]), claim=True)  # still stored, still takeable
    assert [store.read(got.id, i) for i in range(2)] == [data(4), data(5)]
    store.release(got.id, drop=True)
    assert list(store.entries()) == []


def test_a_corrupt_nvme_entry_found_while_staging_ends_the_prefix(make_store):
    store = make_store(dram=4, nvme=8)
    _on_nvme(store, [8, 9])
    flip_byte(store, 9)  # in the slab file, behind the store's back
    step = store.begin_acquire(*_keys([8, 9]))
    acq = step.finish(*step.read())
    assert len(acq.entries) == 1 and store.read(acq.id, 0) == data(8)
    assert store.stats()["checksum_failures"] == 1
    assert store.lookup(*_keys([8, 9])).matched_blocks == 1  # the bad one is gone
    store.release(acq.id)
    assert checksum(data(8)) == acq.entries[0].checksum
    store.check_integrity()


def test_the_copy_a_second_staging_reads_is_not_dropped_under_it(make_store):
    """A finished first staging leaves the entry in DRAM with its NVMe bytes as a
    copy; NVMe room-making drops copies first, but not one a staging under way is
    still to read (it would read a freed extent)."""
    store = make_store(dram=4, nvme=8)
    _on_nvme(store, [6])
    first = store.begin_acquire(*_keys([6]))
    second = store.begin_acquire(*_keys([6]))
    a = first.finish(*first.read())
    with store._lock:
        store.place.shed("nvme", 8 * 4096)  # every copy it may take
    assert {r.key: r for r in store.entries()}[key(6)].nvme_copy is not None
    b = second.finish(*second.read())
    assert store.read(b.id, 0) == data(6) and b.entries[0].offset == a.entries[0].offset
    store.release(a.id)
    store.release(b.id)
    with store._lock:
        store.place.shed("nvme", 8 * 4096)  # now nothing reads it: the copy may go
    assert {r.key: r for r in store.entries()}[key(6)].nvme_copy is None
    store.check_integrity()


def test_a_staging_is_finished_or_abandoned_once(make_store):
    store = make_store(dram=4, nvme=8)
    _on_nvme(store, [10])
    step = store.begin_acquire(*_keys([10]))
    acq = step.finish(*step.read())
    step.abandon()  # after finish: nothing happens (the staged entry keeps its room)
    with pytest.raises(InvalidRequestError, match="already"):
        step.finish({}, {})
    assert store.read(acq.id, 0) == data(10)
    store.release(acq.id)
    store.check_integrity()
