"""The two index environments: records naming NVMe bytes in the synced ``index``,
memory-only records in ``index-volatile`` (never synced, recreated on start).
Real LMDB on both sides; conftest integrity-checks every store at the end."""

import pytest

from kvstore.core.errors import TierFullError
from kvstore.store.index import Index
from kvstore.store.facade import Store
from tests.unit.conftest import data, key, put, store_config, toks, where


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
    with Store(cfg) as store:  # the volatile env is gone, 1 falls back to its copy
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
    store.check_integrity()  # both environments agree with memory


def test_a_refused_durable_write_undoes_the_volatile_one(make_store):
    """Demotion deletes from the volatile env and puts into the durable one; when
    the durable map is full the demotion fails and both envs are as before."""
    store = make_store(dram=64, nvme=64, index_map_bytes=64 << 10)
    demoted = 0
    with pytest.raises(TierFullError, match=r"index map is full \(.*/index\)"):
        for i in range(0, 64, 2):
            put(store, [i, i + 1], meta=[b"m" * 1000] * 2)
            store.demote([key(i), key(i + 1)])  # the durable env fills up first
            demoted += 2
    store.check_integrity()
    # the failed demotion changed nothing: its batch is still in DRAM, the rest on NVMe
    assert sorted(where(store).values()) == ["dram"] * 2 + ["nvme"] * demoted
