"""The project's benchmark runner: ``python -m tools.bench`` (``make bench``).

Every benchmark is a *section*: a function ``(BenchOptions) -> list[dict]`` whose
rows are printed as tables (rows with the same ``"table"`` value form one table)
and written as-is to ``--json``. A row compares kvstore against a plain baseline
doing the same work, so the interesting column is usually a ratio.

Adding a section: write the function in its own ``tools/bench_<area>.py`` and add
one ``Section`` line to ``SECTIONS`` below. Sections are imported lazily, so a
section whose module cannot import (a missing optional dependency) fails alone,
reported as an error, and the others still run.

Speed targets are only reported here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

Row = dict[str, Any]


@dataclass(frozen=True)
class BenchOptions:
    """What every section receives. ``quick``: smallest sizes (seconds, for CI and
    smoke runs); ``full``: also the expensive sizes (minutes). ``workdir``: an
    empty directory on the file system under test, removed after the run.
    ``out``: where sections that keep results write their JSON and plots (None:
    $KVSTORE_BENCH_OUT, else bench-results/). ``plots``: a directory the plots are
    also copied to, only when asked (``--plots docs/img`` makes the committed ones)."""

    quick: bool = False
    full: bool = False
    workdir: Path = Path(".")
    repeat: int = 5
    out: Path | None = None
    plots: Path | None = None

    def pick(self, quick: Any, normal: Any, full: Any = None) -> Any:
        """The value for this run's size: ``quick``, ``normal`` or ``full``."""
        if self.quick:
            return quick
        if self.full and full is not None:
            return full
        return normal


class Section(NamedTuple):
    name: str
    target: str  # "module:function", imported only when the section runs
    help: str


# Order is the print order. Others: add your section here (one line).
SECTIONS: list[Section] = [
    Section("hashing", "tools.bench.store:bench_hashing",
            "block keys of a 128k-token prompt; checksum vs memcpy"),
    Section("dram", "tools.bench.store:bench_dram",
            "store put/get on the DRAM tier vs numpy memcpy"),
    Section("nvme", "tools.bench.store:bench_nvme",
            "NVMe tier and store demote/stage vs plain file I/O"),
    Section("index", "tools.bench.index:bench_index",
            "ops/s and index size at 10k / 100k (/ 1M with --full) entries"),
    Section("victims", "tools.bench.victims:bench_victims",
            "single-entry insert into a full DRAM tier (victim choice) vs one with room"),
    Section("writeback", "tools.bench.writeback:bench_writeback",
            "puts into a full DRAM tier: demotion to copies written ahead vs inline writes"),
    Section("limits", "tools.bench.cluster:bench_limits",
            "the machine: memcpy and plain file write/read GB/s"),
    Section("transfer", "tools.bench.cluster:bench_transfer",
            "two nodes: kvstore vs Mooncake Store vs raw TE, prompts of growing length"),
    Section("entries", "tools.bench.cluster:bench_entries",
            "two nodes: put/get latency as the stores hold more entries"),
    Section("connector", "tools.bench.connector:bench_connector",
            "real vLLM engines: decode TTFT, exposed save, inter-token latency; "
            "kvstore vs recompute vs vLLM's ExampleConnector"),
    Section("load", "tools.bench.load:bench_load",
            "8 producer + 8 consumer processes on one server, eviction + demotion: "
            "kvstore vs Mooncake Store"),
    Section("spread", "tools.bench.spread:bench_spread",
            "cluster placement: per-node load of prompts sharing a 512-token template, per rule"),
]
# Run only when asked (--gpu, or --only by name): they need a CUDA GPU.
GPU_SECTIONS: list[Section] = [
    Section("transfer-gpu", "tools.bench.cluster:bench_transfer_gpu",
            "--gpu: the transfer section with KV in VRAM (device tier, TE from GPU memory)"),
]


# ------------------------------------------------------------------ timing helpers
class Timing(NamedTuple):
    best: float  # seconds
    median: float
    runs: int


def measure(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1,
            setup: Callable[[], Any] | None = None) -> Timing:
    """Time ``fn()`` ``repeat`` times after ``warmup`` untimed calls. ``setup`` runs
    before each call, untimed. On a shared, noisy machine the best run is the
    closest to the true cost; the median shows the noise."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    for _ in range(max(1, repeat)):
        if setup:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Timing(min(times), statistics.median(times), len(times))


def ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline else math.nan


# ------------------------------------------------------------------ running
def run_sections(names: list[str] | None, opts: BenchOptions) -> dict[str, Any]:
    """Run the chosen sections (all when ``names`` is empty); one failing section is
    recorded as ``{"error": ...}`` and does not stop the others."""
    results: dict[str, Any] = {}
    for section in _select(names):
        print(f"\n== {section.name}: {section.help}", flush=True)
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-{section.name}-", dir=opts.workdir))
        start = time.perf_counter()
        try:
            rows = _load(section.target)(_with_workdir(opts, workdir))
            results[section.name] = rows
            print_rows(section.name, rows)
        except Exception as exc:  # report it and go on with the next section
            log.debug("section %s failed", section.name, exc_info=True)
            traceback.print_exc()
            results[section.name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"!! section {section.name} failed: {type(exc).__name__}: {exc}")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)
    return results


def _select(names: list[str] | None) -> list[Section]:
    if not names:
        return list(SECTIONS)
    known = {s.name: s for s in [*SECTIONS, *GPU_SECTIONS]}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; one of {sorted(known)}")
    return [known[n] for n in names]


def _load(target: str) -> Callable[[BenchOptions], list[Row]]:
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def _with_workdir(opts: BenchOptions, workdir: Path) -> BenchOptions:
    return replace(opts, workdir=workdir)


# ------------------------------------------------------------------ printing
def print_rows(section: str, rows: list[Row]) -> None:
    tables: dict[str, list[Row]] = {}
    for row in rows:
        tables.setdefault(str(row.get("table", "")), []).append(row)
    for title, group in tables.items():
        cols: list[str] = []
        for row in group:
            cols += [c for c in row if c != "table" and c not in cols]
        cells = [[_fmt(row.get(c, "")) for c in cols] for row in group]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
        print(f"\n  {section}{' / ' + title if title else ''}")
        print("  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths)))
        print("  " + "  ".join("-" * w for w in widths))
        for r in cells:
            print("  " + "  ".join(v.rjust(w) for v, w in zip(r, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0 or 0.01 <= abs(value) < 1e6:
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return f"{value:.3g}"
    return str(value)


def machine_info() -> dict[str, Any]:
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(["python -m tools.bench", *sys.argv[1:]])}


def _gpu_problem() -> str:
    """Why ``--gpu`` cannot run here ("" when it can)."""
    try:
        import torch
    except ImportError as exc:
        return f"needs torch with CUDA ({exc})"
    if not torch.cuda.is_available():
        return ("needs a CUDA GPU (torch.cuda.is_available() is False here) and the CUDA "
                "build of mooncake-transfer-engine; run without --gpu")
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", metavar="SECTION",
                        help="run only this section (repeatable, or comma-separated); "
                             f"one of {[s.name for s in SECTIONS]}")
    parser.add_argument("--quick", action="store_true", help="smallest sizes (seconds)")
    parser.add_argument("--full", action="store_true", help="also the sizes that take minutes")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per measurement")
    parser.add_argument("--dir", default=None,
                        help="directory on the file system to benchmark (default: a temp dir)")
    parser.add_argument("--json", metavar="PATH", help="also write all rows as JSON here")
    parser.add_argument("--out", metavar="DIR", type=Path, default=None,
                        help="where the two-node sections write <section>.json and img/ "
                             "(default: $KVSTORE_BENCH_OUT, else bench-results/)")
    parser.add_argument("--plots", metavar="DIR", type=Path, default=None,
                        help="also copy the plots into DIR; only this writes docs/img "
                             "(--plots docs/img), a run without it never touches docs/")
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    parser.add_argument("--gpu", action="store_true",
                        help="also run the GPU sections (needs CUDA; fails clearly without)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.list:
        for s in [*SECTIONS, *GPU_SECTIONS]:
            print(f"{s.name:10} {s.help}")
        return 0
    names = [n.strip() for item in args.only or [] for n in item.split(",") if n.strip()]
    if args.gpu:
        problem = _gpu_problem()
        if problem:  # say so before minutes of CPU sections, not after them
            print(f"--gpu: {problem}", file=sys.stderr)
            return 2
        names = [*(names or [s.name for s in SECTIONS]), *(s.name for s in GPU_SECTIONS)]
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    opts = BenchOptions(quick=args.quick, full=args.full, workdir=base, repeat=args.repeat,
                        out=args.out, plots=args.plots)
    info = machine_info()
    print(f"kvstore bench on {info['cpus']} CPUs, load {info['load_avg'][0]:.1f}, "
          f"workdir {base} ({'quick' if opts.quick else 'full' if opts.full else 'normal'})")
    results = run_sections(names, opts)
    if args.json:
        doc = {"machine": info, "options": {**asdict(opts), "workdir": str(base)},
               "sections": results}
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"\nwrote {args.json}")
    failed = [name for name, rows in results.items() if isinstance(rows, dict)]
    return 1 if failed else 0
