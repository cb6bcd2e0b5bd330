"""Records naming NVMe bytes in the synced LMDB ``index``; records of memory tiers in
memory only (their bytes die with the process), so they cost no index write. Real
LMDB; conftest integrity-checks every store at the end (the index against memory)."""

import pytest

from kvstore.core.errors import TierFullError
from kvstore.store.index import Index
from kvstore.store.facade import Store
from tests.unit.conftest import data, fill_index_map, key, put, store_config, toks, where


def durable_keys(data_dir) -> set[int]:
    idx = Index(data_dir / "index", map_size=64 << 20)
    try:
        return {int.from_bytes(r.key, "little") for r in idx.records()}
    finally:
        idx.close()


def test_memory_records_stay_out_of_the_durable_index(tmp_path):
    cfg = store_config(tmp_path / "d", dram=4, nvme=8)
    with Store(cfg) as store:
        put(store, [1, 2, 3])
        store.demote([key(1)])  # 1 -> NVMe: now durable
        acq = store.acquire([key(1)], [toks(1)])  # staged back, keeps its NVMe copy
        store.release(acq.id)
        assert where(store) == {1: "dram", 2: "dram", 3: "dram"}
        store.check_integrity()
    assert durable_keys(tmp_path / "d") == {1}
    with Store(cfg) as store:  # DRAM records died with the store, 1 falls back to its copy
        assert where(store) == {1: "nvme"}
        acq = store.acquire([key(1)], [toks(1)])
        assert store.read(acq.id, 0) == data(1)
        store.release(acq.id)
        store.check_integrity()


def test_a_dropped_copy_leaves_the_durable_index(make_store, tmp_path):
    store = make_store(dram=4, nvme=8)
    put(store, [1])
    store.demote([key(1)])
    store.release(store.acquire([key(1)], [toks(1)]).id)  # staged, copy kept
    store.evict(tier="dram", keys=[key(1)])
    assert where(store) == {}
    store.check_integrity()  # the index agrees with memory


def test_a_copy_shed_from_nvme_leaves_the_durable_index(tmp_path):
    """A staged entry whose NVMe copy is shed (``Placement.shed``: NVMe room is
    made from copies first) is a memory record again: its durable row goes, though
    the change puts only memory records (whether it writes the index depends on
    the records they replace too)."""
    cfg = store_config(tmp_path / "d", dram=4, nvme=8)
    with Store(cfg) as store:
        put(store, [1, 2])
        store.demote([key(1)])
        store.release(store.acquire([key(1)], [toks(1)]).id)  # staged, copy kept
        assert store.catalog.records[key(1)].nvme_copy is not None
        assert store.place.shed("nvme", 1) > 0  # the copy goes first
        assert store.catalog.records[key(1)].nvme_copy is None
        assert where(store) == {1: "dram", 2: "dram"}
        store.check_integrity()
    assert durable_keys(tmp_path / "d") == set()


def test_a_refused_durable_write_changes_nothing(make_store):
    """Demotion puts records into the durable index; when its map is full the
    demotion fails and the store is as before."""
    store = make_store(dram=64, nvme=64, index_map_bytes=64 << 10)
    demoted = 0
    with pytest.raises(TierFullError, match=r"index map is full \(.*/index\)"):
        for i in range(0, 64, 2):
            put(store, [i, i + 1], meta=[b"m" * 1000] * 2)
            store.demote([key(i), key(i + 1)])  # the durable index fills up
            demoted += 2
    store.check_integrity()
    # the failed demotion changed nothing: its batch is still in DRAM, the rest on NVMe
    assert sorted(where(store).values()) == ["dram"] * 2 + ["nvme"] * demoted


def test_a_volatile_index_left_by_an_earlier_version_is_removed(tmp_path):
    """Earlier versions kept memory-tier records in ``index-volatile`` (recreated on
    every start anyway): opening a data dir that has one deletes it."""
    cfg = store_config(tmp_path / "d", dram=4)
    old = tmp_path / "d" / "index-volatile"
    old.mkdir(parents=True)
    (old / "data.mdb").write_bytes(b"x" * 4096)
    with Store(cfg) as store:
        put(store, [1])
        assert not old.exists()
        store.check_integrity()
    assert durable_keys(tmp_path / "d") == set()


def test_nvme_hits_are_served_while_the_index_map_is_full(tmp_path, caplog):
    """The durable index keeps a staged entry as its NVMe copy (``on_disk``), so
    staging an NVMe hit into DRAM, and demoting it onto that copy again, write no
    row: with the map full, reads of NVMe entries are served, and the store starts
    again and finds them."""
    cfg = store_config(tmp_path / "d", dram=64, nvme=256, index_map_bytes=32 << 10)
    with Store(cfg) as store:
        on_nvme = fill_index_map(store)
        assert len(on_nvme) >= 8
        with pytest.raises(TierFullError, match="index"):  # the map is full now
            store.demote([key(j) for j, t in where(store).items() if t == "dram"][:1])
        first = on_nvme[:8]
        acq = store.acquire([key(i) for i in first], [toks(i) for i in first])
        assert len(acq.entries) == 8 and {e.tier for e in acq.entries} == {"dram"}
        assert [store.read(acq.id, j) for j in range(8)] == [data(i) for i in first]
        store.release(acq.id)
        assert store.stats()["stagings"] >= 8
        store.check_integrity()  # the index still holds them as their NVMe copies
        store.demote([key(i) for i in first])  # back onto their copies: no write either
        assert all(where(store)[i] == "nvme" for i in first)
        store.check_integrity()
    assert set(on_nvme) <= durable_keys(tmp_path / "d")
    with Store(cfg) as store:  # a full map does not keep it from starting either
        assert "not reopened for drop_select: index map is full" in caplog.text
        assert all(where(store)[i] == "nvme" for i in on_nvme)
        acq = store.acquire([key(i) for i in on_nvme], [toks(i) for i in on_nvme])
        assert [store.read(acq.id, j) for j in range(len(on_nvme))] == \
            [data(i) for i in on_nvme]
        store.release(acq.id)
        store.check_integrity()


def test_above_the_watermark_a_full_map_still_leaves_free_room_usable(make_store):
    """Over the high watermark an allocation first moves entries down, which needs
    index rows; with the map full that is refused, and the free room below the
    tier's capacity serves instead: new DRAM entries are stored, NVMe hits staged
    whole."""
    store = make_store(dram=64, nvme=256, index_map_bytes=32 << 10, high=0.5, low=0.3)
    on_nvme = fill_index_map(store)
    dram = [i for i, t in where(store).items() if t == "dram"]
    more = list(range(1000, 1000 + 40 - len(dram)))
    put(store, more)  # past the watermark: the demotion is refused, the room is free
    tier = store.stats()["tiers"]["dram"]
    assert tier["used"] > 0.5 * tier["capacity"]
    first = on_nvme[:8]
    acq = store.acquire([key(i) for i in first], [toks(i) for i in first], lease_s=0.05)
    assert len(acq.entries) == 8 and {e.tier for e in acq.entries} == {"dram"}
    assert [store.read(acq.id, j) for j in range(8)] == [data(i) for i in first]
    store.check_integrity()


def test_a_lease_expiring_while_the_map_is_full_ends_and_leaves_its_idle_entries(
        tmp_path, monkeypatch):
    """A lease's end drops the entries nobody needs any more (taken by another
    reader meanwhile). With the map full that drop is refused: the lease ends all
    the same and they stay, idle and evictable (before, the lease never ended)."""
    import time

    store = Store(store_config(tmp_path / "d", dram=64, nvme=256,
                               index_map_bytes=32 << 10))
    try:
        ids = list(range(500, 508))
        put(store, ids)
        store.demote([key(i) for i in ids])
        # A lease that outlives filling the map however slow the disk; then the clock
        # jumps past it (this store runs no thread of its own).
        reader = store.acquire([key(i) for i in ids], [toks(i) for i in ids], lease_s=30.0)
        taker = store.acquire([key(i) for i in ids], [toks(i) for i in ids], claim=True)
        store.release(taker.id, drop=True)  # taken: idle once the reader lets go
        fill_index_map(store)
        assert reader.id and store.stats()["leases"] == 1
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + 60.0)
        store.reap()
        assert store.stats()["leases"] == 0
        assert all(key(i) in store.catalog.records for i in ids)  # still stored, idle
        store.check_integrity()
    finally:
        store.close()


def test_a_start_that_cannot_delete_index_rows_leaves_them_and_deletes_them_later(
        tmp_path, caplog):
    """A start deletes the rows it will not serve: here every NVMe row, since the
    store comes back without its NVMe tier. With the map full the index refuses that
    delete; the store starts all the same, leaves the rows in place (ignored), and
    deletes them once the index takes it (the operator grew the map here; a later
    reap retries). Before, such a start ended with ``ConfigError``."""
    import logging

    data_dir = tmp_path / "d"
    full = store_config(data_dir, dram=64, nvme=256, index_map_bytes=32 << 10)
    with Store(full) as store:
        on_nvme = fill_index_map(store)
    assert set(on_nvme) <= durable_keys(data_dir)
    without_nvme = store_config(data_dir, dram=64, nvme=0, index_map_bytes=32 << 10)
    with caplog.at_level(logging.WARNING), Store(without_nvme) as store:
        assert "left in place, to delete once the index has room" in caplog.text
        assert where(store) == {}
        assert store.catalog.index.strays == {key(i) for i in on_nvme}
        store.check_integrity()  # the strays are not records: index and memory agree
        put(store, [on_nvme[0]])  # a new DRAM entry under a stray's key: served from DRAM
        acq = store.acquire([key(on_nvme[0])], [toks(on_nvme[0])])
        assert store.read(acq.id, 0) == data(on_nvme[0])
        store.release(acq.id)
        assert store.reap() == 0 and store.catalog.index.strays  # still full: kept
        store.check_integrity()
    assert set(on_nvme) <= durable_keys(data_dir)  # left in place
    with Store(without_nvme) as store:  # the same again; then room appears
        index = store.catalog.index
        assert index.strays == {key(i) for i in on_nvme}
        index._env.set_mapsize(1 << 20)  # (what a restart with more does)
        store.reap()  # refused a moment ago: not tried again yet
        assert index.strays
        index.stray_retry_s = index._stray_retry_at = 0.0
        store.reap()
        assert store.catalog.index.strays == set()
        store.check_integrity()
    assert durable_keys(data_dir) == set()
    with Store(full) as store:  # and the store holds them no more
        assert where(store) == {}


def test_a_start_with_more_map_deletes_the_rows_at_once(tmp_path):
    data_dir = tmp_path / "d"
    with Store(store_config(data_dir, dram=64, nvme=256, index_map_bytes=32 << 10)) as store:
        on_nvme = fill_index_map(store)
    assert set(on_nvme) <= durable_keys(data_dir)
    with Store(store_config(data_dir, dram=64, nvme=0, index_map_bytes=1 << 20)) as store:
        assert store.catalog.index.strays == set()
        store.check_integrity()
    assert durable_keys(data_dir) == set()


def test_a_write_under_a_stray_key_keeps_its_row(tmp_path):
    """A row written under a stray's key (``Index.forget`` refused by a full map) is
    a record again, not deleted with the strays; ``drop_strays`` deletes the rest."""
    idx = Index(tmp_path / "index", map_size=64 << 20)
    try:
        store = Store(store_config(tmp_path / "d", dram=4, nvme=8))
        try:
            put(store, [1, 2])
            store.demote([key(1), key(2)])
            recs = {r.key: r for r in store.catalog.index.records()}
        finally:
            store.close()
        idx.put_many(recs.values())
        idx.strays.update(recs)  # as if forget had been refused
        assert list(idx.records()) == []
        idx.put_many([recs[key(2)]])  # written again: a row like any other
        assert idx.strays == {key(1)}
        assert idx.drop_strays() == 0
        assert [r.key for r in idx.records()] == [key(2)]
    finally:
        idx.close()
