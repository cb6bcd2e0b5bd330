"""What choosing eviction victims costs as a tier fills with entries.

A DRAM-only store holding N small entries with ``high_watermark = low_watermark =
1.0`` and no room left: every single-entry insert must make room first, so it
evicts exactly one LRU entry. The baseline is the same insert into an equal store
with room to spare (no victim to choose), measured right before: the ratio is what
victim choice costs on top of an insert, and should not fall as N grows.

Entries are 256 bytes never written (untouched arena pages cost no memory), so
the numbers show book-keeping, not copies.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.core.config import KVStoreConfig
from kvstore.store.facade import Store
from tools.bench import BenchOptions, Row, measure, ratio
from tools.bench.index import FILL_BATCH, PAGE, _reserve_commit, keys_at


def _store(workdir: Path, entries: int, capacity: int) -> Store:
    cfg = KVStoreConfig().replace(
        store={"data_dir": str(workdir)},
        tiers={"dram_bytes": capacity * PAGE, "dram_shared": False, "nvme_bytes": 0},
        policy={"high_watermark": 1.0, "low_watermark": 1.0})
    store = Store(cfg)
    for first in range(0, entries, FILL_BATCH):
        _reserve_commit(store, *keys_at(first, min(FILL_BATCH, entries - first)))
    return store


def _inserts_per_s(store: Store, ops: int) -> float:
    fresh = iter(range(10**9, 10**9 + ops + 1))
    return 1 / measure(lambda: _reserve_commit(store, *keys_at(next(fresh), 1)),
                       repeat=ops).median


def bench_victims(opts: BenchOptions) -> list[Row]:
    rows: list[Row] = []
    ops = opts.pick(200, 500)
    for n in opts.pick([10_000], [10_000, 100_000], [10_000, 100_000, 1_000_000]):
        roomy = _store(opts.workdir / f"roomy-{n}", n, 2 * n + ops + 8)
        try:
            base = _inserts_per_s(roomy, ops)
        finally:
            roomy.close()
        full = _store(opts.workdir / f"full-{n}", n, n)
        try:
            evicting = _inserts_per_s(full, ops)
            if full.stats()["entries"] != n:
                raise RuntimeError("a full tier did not evict one entry per insert")
            full.check_integrity()
        finally:
            full.close()
        rows.append({"table": "single-entry insert into a full DRAM tier (evicts 1 LRU entry)",
                     "entries": n, "insert, full /s": evicting, "insert, room /s": base,
                     "full/room": ratio(evicting, base)})
    return rows
