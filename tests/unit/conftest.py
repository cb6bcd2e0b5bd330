"""Store fixtures: real tiers, real LMDB, in a per-test data dir.

``make_store(dram=4, nvme=16, ...)`` sizes tiers in *entries* of ``ENTRY`` bytes
(one DRAM page each), so scenario tests read like "DRAM holds 4 entries". Every
store a test opens is integrity-checked and closed at the end of the test.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.config import KVStoreConfig
from kvstore.core.hashing import checksum
from kvstore.store.facade import Store

ENTRY = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def toks(i: int) -> bytes:
    return np.full(16, i, dtype="<i4").tobytes()


def data(i: int, nbytes: int = ENTRY) -> bytes:
    return np.random.default_rng(i).bytes(nbytes)


def put(store: Store, ids: list[int], nbytes: int = ENTRY, **kw):
    """Reserve, write and commit entries ``ids``; returns the CommitResult."""
    res = store.reserve([key(i) for i in ids], [nbytes] * len(ids), [toks(i) for i in ids], **kw)
    for j, (i, place) in enumerate(zip(ids, res.placements)):
        if place is not None:
            store.write(res.id, j, data(i, nbytes))
    return store.commit(res.id, [checksum(data(i, nbytes)) for i in ids])


def where(store: Store) -> dict[int, str]:
    """id -> tier of every stored entry."""
    return {int.from_bytes(r.key, "little"): r.tier for r in store.entries()}


def fill_index_map(store: Store, upto: int = 256) -> list[int]:
    """Store and demote entries 8 at a time (with 1000-byte metas, so each takes
    index room) until the durable index's map refuses a demotion; the ids now on
    NVMe. The refused batch stays in DRAM. Fails if the map never fills."""
    from kvstore.core.errors import TierFullError

    on_nvme: list[int] = []
    with pytest.raises(TierFullError, match="index"):
        for i in range(0, upto, 8):
            ids = list(range(i, i + 8))
            put(store, ids, meta=[b"m" * 1000] * 8)
            store.demote([key(j) for j in ids])
            on_nvme += ids
    return on_nvme


def store_config(data_dir, dram: int = 4, nvme: int = 0, gpu: int = 0, high: float = 1.0,
                 low: float = 1.0, shared: bool = False, stage: bool = True,
                 **store_opts) -> KVStoreConfig:
    return KVStoreConfig().replace(
        tiers={"dram_bytes": dram * ENTRY, "nvme_bytes": nvme * ENTRY,
               "gpu_bytes": gpu * ENTRY, "gpu_device": "cpu", "dram_shared": shared,
               "nvme_fsync": "commit"},
        policy={"high_watermark": high, "low_watermark": low, "stage_nvme_hits": stage},
        store={"data_dir": str(data_dir), "index_map_bytes": 64 << 20, **store_opts})


@pytest.fixture
def make_store(tmp_path):
    opened: list[Store] = []

    def make(**kw) -> Store:
        store = Store(store_config(tmp_path / "data", **kw))
        opened.append(store)
        return store

    yield make
    for store in opened:
        if not store._closed:
            store.check_integrity()
            store.close()
