"""An NVMe read error while staging: a miss that leaves nothing held or allocated.

Story: entries demoted to NVMe, the disk returns EIO on the staging read -> the
acquire is a miss (MissError), no lease or hold stays, the staging extents go
back to DRAM, and once the disk reads again the same entries are served.
"""

import errno

import pytest

from kvstore.core.errors import MissError
from kvstore.core.hashing import checksum

from tests.unit.conftest import data, key, put, toks


def test_nvme_read_error_while_staging_is_a_clean_miss(make_store, monkeypatch):
    store = make_store(dram=2, nvme=8)
    put(store, [1, 2])
    store.demote([key(1), key(2)])
    assert {r.tier for r in store.entries()} == {"nvme"}
    nvme = store.place.tiers["nvme"]
    real_read = nvme.read_many

    def failing_read(*args, **kw):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(nvme, "read_many", failing_read)
    dram_used = store.place.tiers["dram"].used
    with pytest.raises(MissError, match="NVMe read failed"):
        store.acquire([key(1), key(2)], [toks(1), toks(2)])
    assert store.place.tiers["dram"].used == dram_used
    assert not store.holds.leased
    store.check_integrity()

    monkeypatch.setattr(nvme, "read_many", real_read)
    got = store.acquire([key(1), key(2)], [toks(1), toks(2)])
    assert [store.read(got.id, i) for i in range(2)] == [data(1), data(2)]
    store.release(got.id, drop=True)
    assert list(store.entries()) == []


def test_pinning_dedups_onto_one_in_flight_key_pin_it_once(make_store):
    store = make_store(dram=4)
    first = store.reserve([key(5)], [4096], [toks(5)])
    store.write(first.id, 0, data(5))
    second = store.reserve([key(5), key(5)], [4096, 4096], [toks(5), toks(5)])
    assert second.placements == [None, None]
    store.commit(second.id, [0, 0], pin=True)  # nothing new: checksums ignored
    store.commit(first.id, [checksum(data(5))])
    rec = {r.key: r for r in store.entries()}[key(5)]
    assert (rec.pins, rec.pending) == (1, 3)
    store.unpin([key(5)])


def test_release_whose_index_write_fails_changes_nothing(make_store, monkeypatch):
    """A failed LMDB write at release leaves the lease open and whole, so the
    caller can release again (before: lease gone, holds dropped, pending changed).
    The entry was on NVMe (staged for the read, its copy kept): its drop writes the
    durable index (a drop of memory records only writes nothing)."""
    store = make_store(dram=4, nvme=8)
    put(store, [1])
    store.demote([key(1)])
    got = store.acquire([key(1)], [toks(1)], claim=True)
    real_write = store.catalog._write_index

    def failing_write(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.catalog, "_write_index", failing_write)
    with pytest.raises(OSError):
        store.release(got.id, drop=True)
    assert store.holds.leased == {key(1): 1} and store.holds.claims == {key(1): 1}
    assert {r.key: r.pending for r in store.entries()} == {key(1): 1}
    store.check_integrity()
    monkeypatch.setattr(store.catalog, "_write_index", real_write)
    assert store.release(got.id, drop=True) == 1
    assert list(store.entries()) == [] and not store.holds.leased and not store.holds.claims


def test_a_release_of_memory_entries_never_writes_the_index(make_store, monkeypatch):
    """Memory records are not in LMDB: dropping them at release writes nothing there,
    so an index that would refuse every write does not stop the drop."""
    store = make_store(dram=4, nvme=8)
    put(store, [1, 2])
    got = store.acquire([key(1), key(2)], [toks(1), toks(2)], claim=True)

    def failing_write(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.catalog, "_write_index", failing_write)
    assert store.release(got.id, drop=True) == 2
    assert list(store.entries()) == [] and not store.holds.leased and not store.holds.claims
    store.check_integrity()
