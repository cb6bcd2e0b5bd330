"""A flipped byte in the NVMe slab is a miss, counted, never served as data."""

import os

import pytest

from kvstore.core.errors import ChecksumError, InvalidRequestError, KVStoreError
from kvstore.store.types import CommitResult
from tests.unit.conftest import key, put, toks, where


def flip_byte(store, i: int, at: int = 100) -> None:
    """Corrupt entry ``i`` in the slab file behind the store's back."""
    rec = next(r for r in store.entries() if r.key == key(i))
    assert rec.tier == "nvme"
    fd = os.open(store.data_dir / "nvme.slab", os.O_RDWR)
    try:
        old = os.pread(fd, 1, rec.offset + at)
        os.pwrite(fd, bytes([old[0] ^ 0xFF]), rec.offset + at)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.fixture
def on_nvme(make_store):
    """DRAM 2, NVMe 8: entries 1..4 on NVMe, 5, 6 in DRAM."""
    store = make_store(dram=2, nvme=8)
    for batch in ([1, 2], [3, 4], [5, 6]):
        put(store, batch)
    assert [i for i, t in where(store).items() if t == "nvme"] == [1, 2, 3, 4]
    return store


def test_corrupt_entry_is_a_miss_and_counted(on_nvme):
    store = on_nvme
    flip_byte(store, 2)
    acq = store.acquire([key(i) for i in (1, 2, 3)], [toks(i) for i in (1, 2, 3)])
    assert len(acq.entries) == 1  # the prefix ends before the bad entry
    stats = store.stats()
    assert stats["checksum_failures"] == 1
    assert 2 not in where(store)  # dropped, its space returned
    store.release(acq.id)
    assert store.acquire([key(3)], [toks(3)]).matched_tokens == 16  # 3 itself is fine
    store.check_integrity()


def test_verify_reports_and_drops_the_bad_entry(on_nvme):
    store = on_nvme
    flip_byte(store, 4, at=4000)
    result = store.verify()
    assert result.checked == 6 and result.bad == [key(4)]
    assert sorted(where(store)) == [1, 2, 3, 5, 6]
    assert store.stats()["checksum_failures"] == 1
    assert store.verify().bad == []
    store.check_integrity()


def test_local_read_without_staging_verifies_too(make_store):
    store = make_store(dram=2, nvme=8, stage=False)
    put(store, [1, 2])
    put(store, [3, 4])
    acq = store.acquire([key(1), key(2)], [toks(1), toks(2)])
    assert [e.tier for e in acq.entries] == ["nvme", "nvme"]
    assert [e.address for e in acq.entries] == [None, None]
    flip_byte(store, 2)
    with pytest.raises(ChecksumError):
        store.read(acq.id, 1)
    store.release(acq.id)
    assert store.acquire([key(1), key(2)], [toks(1), toks(2)]).matched_tokens == 16


def test_index_records_that_overlap_are_dropped_at_restart(tmp_path):
    from kvstore.store.index import Index
    from kvstore.store.facade import Store
    from tests.unit.conftest import data, store_config

    cfg = store_config(tmp_path / "data", dram=4, nvme=8)
    with Store(cfg) as store:
        put(store, [1, 2, 3])
        store.demote([key(1), key(2), key(3)])
        offset_of_1 = next(r.offset for r in store.entries() if r.key == key(1))
    index = Index(tmp_path / "data" / "index", map_size=64 << 20)
    index.put_many([index.get(key(2))._replace(offset=offset_of_1),  # claims 1's bytes
                    index.get(key(3))._replace(offset=1 << 40)])  # outside the slab
    index.close()
    with Store(cfg) as store:
        assert where(store) == {1: "nvme"}
        acq = store.acquire([key(1)], [toks(1)])
        assert store.read(acq.id, 0) == data(1)
        store.release(acq.id)
        store.check_integrity()


def test_records_of_a_slab_removed_before_a_restart_are_dropped(tmp_path, caplog):
    """A slab made anew at start (the old one removed, as the size refusal used to
    advise) holds none of the bytes the index names: those records went on as hits
    that failed every read, pins included, until evicted."""
    import logging

    from kvstore.store.facade import Store
    from tests.unit.conftest import data, store_config

    cfg = store_config(tmp_path / "data", dram=4, nvme=8)
    with Store(cfg) as store:
        put(store, [1, 2, 3])
        store.demote([key(1), key(2)])
        store.pin([key(1)])
    os.unlink(tmp_path / "data" / "nvme.slab")
    with caplog.at_level(logging.WARNING), Store(cfg) as store:
        assert where(store) == {}
        assert "dropping 2 index records of the nvme tier" in caplog.text
        assert store.acquire([key(1)], [toks(1)]).matched_tokens == 0
        put(store, [1])  # the key takes new bytes, and they are served
        acq = store.acquire([key(1)], [toks(1)])
        assert store.read(acq.id, 0) == data(1)
        store.release(acq.id)
        assert store.stats()["checksum_failures"] == 0
        store.check_integrity()
    with Store(cfg) as store:  # that slab is the one made last time: kept as it is
        assert where(store) == {}  # (key 1 was in DRAM: volatile)


def test_a_writer_deduping_onto_a_colliding_key_stores_nothing(make_store):
    store = make_store()
    put(store, [1])
    res = store.reserve([key(1)], [4096], [toks(2)])  # same key, other tokens
    assert res.placements == [None]
    assert store.commit(res.id, [0]) == CommitResult(0, 0, 1)
    assert [r.pending for r in store.entries()] == [1]


def test_a_reader_report_is_rechecked_fine_bytes_stay(make_store):
    # Bytes damaged on the way (fine at rest): counted as a transfer failure, kept.
    store = make_store(dram=4)
    put(store, [1, 2])
    acq = store.acquire([key(1), key(2)], [toks(1), toks(2)], claim=True)
    store.release(acq.id, drop=False, corrupt=[1])
    stats = store.stats()
    assert stats["transfer_checksum_failures"] == 1 and stats["checksum_failures"] == 0
    assert sorted(where(store)) == [1, 2]


def test_a_reader_report_drops_every_entry_bad_at_rest(make_store):
    store = make_store(dram=4)
    put(store, [1, 2, 3])
    for i in (2, 3):  # a stray writer overwrote two entries in the arena
        rec = next(r for r in store.entries() if r.key == key(i))
        store.place.tiers["dram"].view(store.place.io.extent(rec))[0] ^= 0xFF
    acq = store.acquire([key(1), key(2), key(3)], [toks(1), toks(2), toks(3)], claim=True)
    with pytest.raises(InvalidRequestError):
        store.release(acq.id, drop=False, corrupt=[7])  # not a position of the lease
    store.release(acq.id, drop=False, corrupt=[1])  # the reader stopped at the first
    assert store.stats()["checksum_failures"] == 2
    assert sorted(where(store)) == [1]


def test_a_reported_entry_that_others_hold_is_a_miss_until_it_goes(make_store):
    """A reader reports an entry bad at rest while another reader still holds it:
    it cannot go yet, but no acquire is served it again (a miss from there on), and
    it goes once the last holder lets go, counted once."""
    store = make_store(dram=4)
    put(store, [1, 2, 3])
    rec = next(r for r in store.entries() if r.key == key(2))
    store.place.tiers["dram"].view(store.place.io.extent(rec))[0] ^= 0xFF
    keys, tokens = [key(1), key(2), key(3)], [toks(1), toks(2), toks(3)]
    other = store.acquire(keys, tokens)  # still reading when the report comes
    mine = store.acquire(keys, tokens)
    assert store.release(mine.id, drop=False, corrupt=[1]) == 0  # held: not yet
    assert sorted(where(store)) == [1, 2, 3]
    again = store.acquire(keys, tokens)
    assert [e.key for e in again.entries] == [key(1)]  # a miss at the bad one
    store.release(again.id)
    store.release(other.id)
    assert store.reap() == 0  # (no lease ran out) but the bad entry is free to go now
    assert sorted(where(store)) == [1, 3]
    stats = store.stats()
    assert stats["checksum_failures"] == 1 and stats["commit_checksum_failures"] == 0
    store.check_integrity()


def test_a_reported_entry_a_reply_still_sends_goes_when_the_send_is_over(make_store):
    """A reader's take fails in an early part of an inline reply and it reports the
    bad entry while the later parts are still being sent from the arena (hold_send):
    the entry is a miss from then on and goes with the send's end, not at a reap."""
    store = make_store(dram=4)
    put(store, [1, 2, 3])
    rec = next(r for r in store.entries() if r.key == key(2))
    store.place.tiers["dram"].view(store.place.io.extent(rec))[0] ^= 0xFF
    keys, tokens = [key(1), key(2), key(3)], [toks(1), toks(2), toks(3)]
    acq = store.acquire(keys, tokens, claim=True)
    store.hold_send(acq.id)
    assert store.release(acq.id, drop=False, corrupt=[1]) == 0  # the send holds it
    again = store.acquire(keys, tokens)
    assert [e.key for e in again.entries] == [key(1)]
    store.release(again.id)
    assert store.end_send(acq.id) == 1
    assert sorted(where(store)) == [1, 3]
    assert store.stats()["checksum_failures"] == 1
    store.check_integrity()


def test_a_report_on_a_lease_ended_once_sent_is_checked_where_it_can_be(make_store):
    """``end_sent``: the server ended the lease once its reply's bytes were out. A
    get's entries stay, so a report on one is checked at rest (the bad one goes);
    a drop_select's went with the drop, so a report is counted as unchecked. Either
    lease is over: a release ends nothing more, and a bad position is refused."""
    store = make_store(dram=8)
    put(store, [1, 2, 3])
    rec = next(r for r in store.entries() if r.key == key(2))
    store.place.tiers["dram"].view(store.place.io.extent(rec))[0] ^= 0xFF
    keys, tokens = [key(1), key(2), key(3)], [toks(1), toks(2), toks(3)]
    got = store.acquire(keys, tokens)
    assert store.end_sent(got.id, drop=False) == 0
    assert store.stats()["leases"] == 0 and sorted(where(store)) == [1, 2, 3]
    with pytest.raises(InvalidRequestError):
        store.release(got.id, drop=False, corrupt=[3])
    assert store.release(got.id, drop=False, corrupt=[1]) == 1  # bad at rest: dropped
    assert sorted(where(store)) == [1, 3]
    put(store, [4, 5])
    taken = store.acquire([key(4), key(5)], [toks(4), toks(5)], claim=True)
    store.hold_send(taken.id)
    store.end_send(taken.id)
    assert store.end_sent(taken.id, drop=True) == 2
    assert sorted(where(store)) == [1, 3]
    assert store.release(taken.id, drop=True, corrupt=[0]) == 0
    stats = store.stats()
    assert stats["checksum_failures"] == 1 and stats["unchecked_checksum_failures"] == 1
    assert stats["transfer_checksum_failures"] == 0
    with pytest.raises(KVStoreError):  # (no open lease of that id any more)
        store.end_sent(taken.id, drop=True)
    store.check_integrity()


def test_leases_ended_once_sent_are_remembered_within_bounds():
    """What the store keeps of leases it ended once sent (``Holds.ended_sent``): a
    get's keys, a drop_select's count, each until its lease would have run out, and
    never more than ``_ENDED_KEYS`` keys however many good reads go by."""
    from kvstore.store import holds as holds_module

    h = holds_module.Holds({})
    keys = tuple(bytes([i % 256]) * 16 for i in range(2048))  # a 32k-token prompt's
    for aid in range(1, 101):
        h.remember_ended_sent(aid, keys, expires_at=1000.0, now=10.0)
    assert h._ended_keys <= holds_module._ENDED_KEYS
    assert h.ended_sent(100) == keys and h.ended_sent(1) is None  # the oldest went
    h.remember_ended_sent(101, 33, expires_at=1000.0, now=10.0)  # a drop_select's
    assert h.ended_sent(101) == 33
    h.remember_ended_sent(102, 5, expires_at=2000.0, now=1500.0)  # the others ran out
    assert [h.ended_sent(a) for a in (100, 101, 102)] == [None, None, 5]
    assert h._ended_keys == 0
