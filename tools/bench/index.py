"""How the store's per-entry costs grow with the number of entries it holds.

One store is filled to 10k, 100k (and, with ``--full``, 1M) small entries; at each
size it times single-entry reserve+commit and acquire+release (the per-request
book-keeping: locks, dict walks, one LMDB transaction), a 64-entry batch of each,
and records the process's anonymous memory and the LMDB file's size per entry.
The baseline is a plain LMDB transaction putting one record of the same size with
the same sync setting: what durability alone costs.

Entries are 256 bytes and never written: the arena is an anonymous mapping whose
untouched pages all read as the shared zero page, so 1M entries cost no DRAM and
the numbers show the index, not the copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import numpy as np

from kvstore.core.config import KVStoreConfig
from kvstore.core.hashing import checksum
from kvstore.store.facade import Store
from tools.bench import BenchOptions, Row, measure, ratio

ENTRY_BYTES = 256
PAGE = 4096  # the DRAM tier's page: every entry occupies at least one
FILL_BATCH = 256
_ZERO_SUM = checksum(bytes(ENTRY_BYTES))


def keys_at(start: int, count: int) -> tuple[list[bytes], list[bytes]]:
    """Keys ``start .. start+count-1`` (distinct 16 bytes, from a counter: cheap) and
    one 16-token block each."""
    ids = np.arange(start, start + count, dtype=np.uint64)
    keys = [k.tobytes() for k in np.stack([ids, ids ^ np.uint64(0x9E3779B97F4A7C15)], axis=1)]
    return keys, [k * 4 for k in keys]  # 64 bytes = 16 int32 tokens


def _reserve_commit(store: Store, keys: list[bytes], tokens: list[bytes]) -> None:
    res = store.reserve(keys, [ENTRY_BYTES] * len(keys), tokens)
    store.commit(res.id, [_ZERO_SUM] * len(keys))


def _acquire_release(store: Store, keys: list[bytes], tokens: list[bytes]) -> None:
    acq = store.acquire(keys, tokens)
    if len(acq.entries) != len(keys):
        raise RuntimeError(f"expected {len(keys)} hits, got {len(acq.entries)}")
    store.release(acq.id)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*.mdb"))


def bench_index(opts: BenchOptions) -> list[Row]:
    """Runs the measurement in a fresh interpreter: the RSS column is then the
    store's alone, not whatever earlier sections left in this process's heap."""
    args = json.dumps({"quick": opts.quick, "full": opts.full, "workdir": str(opts.workdir)})
    out = subprocess.run([sys.executable, "-m", "tools.bench.index", args],
                         capture_output=True, text=True, check=False,
                         timeout=opts.pick(300, 900, 3600), cwd=Path(__file__).parents[2])
    if out.returncode != 0:
        raise RuntimeError(f"index benchmark child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_index(opts: BenchOptions) -> list[Row]:
    sizes = opts.pick([10_000], [10_000, 100_000], [10_000, 100_000, 1_000_000])
    ops = opts.pick(200, 1000)
    data_dir = opts.workdir / "store"
    cfg = KVStoreConfig().replace(
        store={"data_dir": str(data_dir)},
        tiers={"dram_bytes": int(max(sizes) * PAGE * 1.3) + (64 << 20),
               "dram_shared": False, "nvme_bytes": 0})
    sync = cfg.tiers.nvme_fsync != "never"
    rss0 = _rss_anon()
    store = Store(cfg)
    rows, held = [], 0
    try:
        for n in sizes:
            start = time.perf_counter()
            for first in range(held, n, FILL_BATCH):
                _reserve_commit(store, *keys_at(first, min(FILL_BATCH, n - first)))
            fill_rate = (n - held) / (time.perf_counter() - start)
            held = n
            rss, disk = _rss_anon() - rss0, _disk_bytes(data_dir)
            rows.append({"table": f"store ops vs entries held (index sync={sync})",
                         "entries": n, "fill entries/s": fill_rate,
                         **_ops_at(store, n, ops, opts.workdir / f"lmdb-{n}", sync),
                         "RSS MiB": rss / 2**20, "RSS B/entry": rss / n,
                         "LMDB MiB": disk / 2**20, "LMDB B/entry": disk / n})
        store.check_integrity()
    finally:
        store.close()
    return rows


def _ops_at(store: Store, n: int, ops: int, lmdb_dir: Path, sync: bool) -> dict[str, float]:
    """Single-entry reserve+commit (new keys, removed again after) and acquire+release
    of random held keys, then 64-entry acquire+release batches. The LMDB baseline
    runs right before, so both see the same disk (fsync latency here is noisy)."""
    base = _lmdb_baseline(lmdb_dir, ops, sync)
    # a never-synced LMDB txn: what each DRAM record cost the store until 65ad191
    # (a second, volatile environment); since then memory records write no LMDB
    nosync = _lmdb_baseline(lmdb_dir.with_name(lmdb_dir.name + "-nosync"), ops, False)
    rng = np.random.default_rng(n)
    picks = iter(rng.integers(0, n, size=2 * ops + 1).tolist())
    fresh = iter(range(10**9, 10**9 + 2 * ops + 1))
    t_new = measure(lambda: _reserve_commit(store, *keys_at(next(fresh), 1)), repeat=ops)
    t_old = measure(lambda: _acquire_release(store, *keys_at(next(picks), 1)), repeat=ops)
    t_64 = measure(lambda: _acquire_release(store, *keys_at(int(rng.integers(0, n - 64)), 64)),
                   repeat=50)
    store.evict(keys=keys_at(10**9, ops + 1)[0])  # back to exactly n entries
    return {"reserve+commit /s": 1 / t_new.median, "lmdb txn /s": base,
            "store/lmdb": ratio(1 / t_new.median, base),
            "lmdb nosync txn /s": nosync, "store/nosync": ratio(1 / t_new.median, nosync),
            "acquire+release /s": 1 / t_old.median, "acquire x64 entries/s": 64 / t_64.median}


def _lmdb_baseline(path: Path, ops: int, sync: bool) -> float:
    """Transactions/s of a bare LMDB env putting one record of an index record's size."""
    env = lmdb.open(str(path), map_size=1 << 30, sync=sync, metasync=sync)
    try:
        value = os.urandom(160)
        keys = iter(keys_at(0, ops + 1)[0])

        def one() -> None:
            with env.begin(write=True) as txn:
                txn.put(next(keys), value)

        return 1 / measure(one, repeat=ops).median
    finally:
        env.close()


if __name__ == "__main__":
    _args = json.loads(sys.argv[1])
    _opts = BenchOptions(quick=_args["quick"], full=_args["full"], workdir=Path(_args["workdir"]))
    print(json.dumps(measure_index(_opts)))
