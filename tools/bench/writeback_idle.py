"""What requests wait while the background writeback has nothing to copy.

    python -m tools.bench.writeback_idle [--entries 100000] [--seconds 5]

A store's DRAM tier holds ``--entries`` entries of 4 KiB, 90 % full, and the
writeback has copied its window (the entries the next demotions would take) to
NVMe: an idle server in the state a review found, where every writeback round
walks the whole window and finds nothing to copy. Lookups of one stored block,
one every 2 ms for ``--seconds``, are timed in three cases, one after another in
one run: ``off`` (no writeback thread), ``under lock`` (the rounds as they were
until this tool's change: the walk of the window under the store's lock, again
50 ms after each) and ``shipped`` (``Store.start_writeback``: the walk without the
lock, and a pause of ``WRITEBACK_IDLE_FACTOR`` times a round that wrote nothing).
Prints each case's lookup p50 / p99 / max and how many rounds ran.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvstore.core.config import KVStoreConfig
from kvstore.core.hashing import checksum
from kvstore.store.facade import Store

ENTRY = 4096
CASES = ("off", "under lock", "shipped")
IDLE_S = 0.05  # the writeback thread's pause after a round that wrote nothing


def _filled(where: Path, entries: int) -> tuple[Store, list[bytes], list[bytes]]:
    cfg = KVStoreConfig().replace(
        tiers={"dram_bytes": entries * ENTRY, "nvme_bytes": entries * ENTRY,
               "dram_shared": False, "nvme_fsync": "never"},
        store={"data_dir": str(where), "index_map_bytes": max(1 << 30, entries * 4096)})
    store = Store(cfg)
    blob = bytes(ENTRY)
    tokens = np.full(16, 1, "<i4").tobytes()
    fill, batch = int(entries * 0.9), 1024
    for first in range(0, fill, batch):
        keys = [i.to_bytes(16, "little") for i in range(first, min(fill, first + batch))]
        res = store.reserve(keys, [ENTRY] * len(keys), [tokens] * len(keys))
        store.commit(res.id, [checksum(blob)] * len(keys))
    while store.writeback_step():
        pass
    return store, [(0).to_bytes(16, "little")], [tokens]


def _old_rounds(store: Store, stop: threading.Event, rounds: list[int]) -> None:
    """The round before: its choice made whole under the store's lock."""
    limit = store.config.policy.writeback_batch_bytes
    while not stop.is_set():
        with store._lock:
            plan = store.place.plan_writeback(limit)
            store.place.finish_writeback(plan, False)
        rounds[0] += 1
        stop.wait(IDLE_S)


def _lookups(store: Store, keys: list[bytes], tokens: list[bytes], seconds: float
             ) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        store.lookup(keys, tokens)
        out.append((time.perf_counter() - start) * 1e3)
        time.sleep(0.002)
    return out


def run(entries: int, seconds: float) -> dict[str, dict[str, float]]:
    """{case: {"p50", "p99", "max" (ms), "rounds"}}."""
    from kvstore.store import facade

    where = Path(tempfile.mkdtemp(prefix="bench-writeback-idle-"))
    out: dict[str, dict[str, float]] = {}
    try:
        store, keys, tokens = _filled(where / "store", entries)
        try:
            if store.catalog.copied["dram"] == 0:
                raise RuntimeError("the writeback copied nothing: no window to walk")
            for case in CASES:
                rounds = [0]
                stop = threading.Event()
                thread = None
                if case == "under lock":
                    thread = threading.Thread(target=_old_rounds, args=(store, stop, rounds))
                    thread.start()
                elif case == "shipped":
                    real = store.writeback_step

                    def counted() -> int:
                        rounds[0] += 1
                        return real()

                    store.writeback_step = counted  # type: ignore[method-assign]
                    store.start_writeback(IDLE_S)
                ms = _lookups(store, keys, tokens, seconds)
                stop.set()
                if thread is not None:
                    thread.join()
                out[case] = {"p50": float(np.percentile(ms, 50)),
                             "p99": float(np.percentile(ms, 99)), "max": max(ms),
                             "rounds": rounds[0]}
            out["shipped"]["idle factor"] = facade.WRITEBACK_IDLE_FACTOR
        finally:
            store.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args(argv)
    res = run(args.entries, args.seconds)
    print(f"{args.entries} DRAM entries of {ENTRY // 1024} KiB, 90 % full, the window "
          f"copied; a lookup every 2 ms for {args.seconds:g} s")
    print(f"  {'case':12} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'rounds':>7}")
    for case in CASES:
        r = res[case]
        print(f"  {case:12} {r['p50']:8.3f} {r['p99']:8.2f} {r['max']:8.2f} "
              f"{int(r['rounds']):7d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
