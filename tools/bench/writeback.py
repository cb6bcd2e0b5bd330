"""Background writeback, measured: the store's request path under memory pressure
with the NVMe copies written ahead (``Store.writeback_step`` between requests, as
the server's writeback thread does) against the same store with writeback off
(every demotion writes and flushes NVMe inline, under the store's lock). With it on,
the thread also demotes ahead of the high watermark (``Store.demote_step``) and
evicts the last tier ahead of it (``Store.evict_step``), so the puts themselves
seldom demote or evict.

Each round puts one prompt into a DRAM tier held at its high watermark, so every
put demotes about a prompt's worth of LRU entries to NVMe; twice: with an NVMe tier
that has room for everything, and with one as large as DRAM, which is soon full and
evicts (a cache's steady state). Reported: the put's time (what every other request
waits behind) for both, side by side in one run, how many demotions and evictions
the puts made themselves, and the background's own time (spent off the request
path).

    python -m tools.bench --only writeback [--quick]
    python -m tools.bench.writeback
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvstore.core.config import KVStoreConfig
from kvstore.store.facade import Store
from tools.bench import BenchOptions, Row, ratio
from tools.bench.store import BIG, make_prompt, put


def _store(workdir: Path, on: bool, dram: int, nvme: int) -> Store:
    cfg = KVStoreConfig().replace(
        store={"data_dir": str(workdir)},
        tiers={"dram_bytes": dram, "nvme_bytes": nvme, "dram_shared": False,
               "nvme_fsync": "commit"},
        policy={"background_writeback": on})
    return Store(cfg)


def _run(workdir: Path, on: bool, prompts: list, dram: int, nvme: int) -> dict[str, float]:
    puts, rounds = [], []
    inline = evicted = 0  # demotions and evictions made by the puts themselves
    with _store(workdir, on, dram, nvme) as store:
        for p in prompts:
            start = time.perf_counter()
            if on:  # the thread's work, between requests: copies, then demotion and
                while store.writeback_step():  # eviction ahead
                    pass
                store.demote_step()
                store.evict_step()
            rounds.append(time.perf_counter() - start)
            before = store.stats()
            start = time.perf_counter()
            put(store, p)
            puts.append(time.perf_counter() - start)
            after = store.stats()
            inline += after["demotions"] - before["demotions"]
            evicted += after["evictions"] - before["evictions"]
        stats = store.stats()
    warm = puts[len(puts) // 4:]  # past the first fill: every put demotes
    return {"median": statistics.median(warm), "max": max(warm),  # (24 - 72 puts)
            "writeback_s": sum(rounds), "demotions": stats["demotions"],
            "inline": inline, "writebacks": stats["writebacks"],
            "evictions": stats["evictions"], "evicted inline": evicted,
            "entries": stats["entries"], "nvme entries": stats["tiers"]["nvme"]["entries"],
            "copies": stats["nvme_copies"]}


def bench_writeback(opts: BenchOptions) -> list[Row]:
    prompt_bytes = 8 << 20  # 4 blocks of 2 MiB
    dram = opts.pick(64 << 20, 256 << 20)
    n = opts.pick(32, 96)
    prompts = [make_prompt(BIG, prompt_bytes, seed) for seed in range(n)]
    root = Path(tempfile.mkdtemp(prefix="kvbench-writeback-", dir=opts.workdir))
    rows: list[Row] = []
    try:  # (run alone, its work directory is not a section's: gone with it)
        # NVMe with room for every prompt; then NVMe as large as DRAM, full after a
        # few rounds, as a cache's NVMe tier is in its steady state (every demotion
        # needs NVMe room: evicted ahead by the thread, or a tenth of NVMe shed inline).
        for nvme, what in ((2 * n * prompt_bytes, "NVMe with room"),
                           (dram, "NVMe full (evicting)")):
            results: dict[str, dict[str, float]] = {}
            for on in (False, True, False, True):  # interleaved: the machine is shared
                where = root / f"{nvme}-{'on' if on else 'off'}-{len(results)}"
                got = _run(where, on, prompts, dram, nvme)
                shutil.rmtree(where, ignore_errors=True)  # its NVMe slab: up to 1.5 GiB
                key = "on" if on else "off"
                best = results.get(key)
                if best is None or got["median"] < best["median"]:
                    results[key] = got
            off, on_ = results["off"], results["on"]
            rows += [{"table": f"put of an 8 MiB prompt into a full {dram >> 20} MiB DRAM tier "
                               f"(each put demotes to NVMe)",
                      "NVMe": f"{what}, {nvme >> 20} MiB",
                      "writeback": name, "put median ms": r["median"] * 1e3,
                      "put max ms": r["max"] * 1e3, "demotions": r["demotions"],
                      "demotions by the puts": r["inline"],
                      "evictions": r["evictions"], "evictions by the puts": r["evicted inline"],
                      "copies written ahead": r["writebacks"],
                      # What is held at the end: the copies are of entries served
                      # from DRAM (each the same bytes twice), so they take NVMe room
                      # that stored entries would otherwise have.
                      "entries at the end": r["entries"], "of them on NVMe": r["nvme entries"],
                      "NVMe copies at the end": r["copies"],
                      "writeback rounds s (off the request path)": r["writeback_s"],
                      "median x off": ratio(r["median"], off["median"]),
                      "max x off": ratio(r["max"], off["max"])}
                     for name, r in (("off (demotion writes inline)", off), ("on", on_))]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    from tools.bench import print_rows

    quick = "--quick" in sys.argv
    print_rows("writeback", bench_writeback(BenchOptions(quick=quick, workdir=Path(tempfile.gettempdir()))))
