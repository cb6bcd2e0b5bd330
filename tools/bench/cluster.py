"""Two nodes, three systems, the same bytes: kvstore vs Mooncake Store vs raw TE.

Sections (registered in tools/bench/__init__.py):

* ``limits``: what the machine allows -- memcpy and plain file write/read GB/s;
* ``transfer``: prompts of growing length in two KV layouts. On node A a producer
  stores each prompt, on node B a consumer takes it (get + drop). Systems:
  ``kvstore`` (kvstore-server on A and on B, as deployed; the producer inserts into
  A's through the same-node shared arena, the consumer on B drop_selects from A's over
  TE), ``mooncake`` (mooncake_master on A, the
  producer's MooncakeDistributedStore mounts the segment, consumer get_into +
  remove), ``rawte`` (producer copies into a registered buffer, consumer reads it
  with TE alone, in each pattern of ``TRANSFER_PATTERNS``, tools/bench/rawte.py;
  the floor is the fastest pattern at each point). Nodes are network namespaces
  where allowed (tools.netns), else loopback ports;
  Prompts over ``INTERLEAVE_MAX_BYTES`` (``--full``: large layout, 16k and 32k
  tokens) run one system at a time, since all three at once would not fit in RAM;
* ``entries``: the same put/get at a fixed prompt length while the stores hold
  more and more other entries.

Every operation is timed inside the process doing it; its CPU time is summed over
every process of the system (server and master included, from /proc); peak memory
is each process's VmHWM. Rows go to ``bench-results/<section>.json`` (or ``--out``)
and plots to ``bench-results/img/``; only ``--plots DIR`` copies the plots to DIR
(``--plots docs/img`` makes the committed ones), see tools/bench/plots.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from tools.bench import BenchOptions, Row, measure
from tools.bench.cluster_procs import REPO, WorkerError, rss_mib
from tools.bench.cluster_run import (
    RAW,
    SYSTEMS,
    MiB,
    Samples,
    memory_rows,
    one_prompt,
    ratios,
    reps,
    start_systems,
)
from tools.bench.cluster_worker import LAYOUTS
from tools.netns import make_cluster

log = logging.getLogger(__name__)


def results_dir(opts: BenchOptions | None = None) -> Path:
    """Where sections write their JSON and plots: ``--out``, else $KVSTORE_BENCH_OUT,
    else bench-results/ (gitignored)."""
    if opts is not None and opts.out is not None:
        return opts.out
    return Path(os.environ.get("KVSTORE_BENCH_OUT", REPO / "bench-results"))


def save(section: str, rows: list[Row], opts: BenchOptions, extra: dict | None = None) -> None:
    """Rows as ``<results>/<section>.json``, their plots in ``<results>/img/``, and
    copies of the plots in ``opts.plots`` only when a run asks (``--plots docs/img``:
    how the committed plots are made; a plain run never touches docs/)."""
    from tools.bench import plots as bench_plots

    out = results_dir(opts)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"section": section, "quick": opts.quick, "time_utc": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_avg": os.getloadavg(), "rows": rows,
        **(extra or {})}
    (out / f"{section}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    for path in bench_plots.render(section, rows, out / "img"):
        log.info("wrote %s", path)
        if opts.plots is not None:
            opts.plots.mkdir(parents=True, exist_ok=True)
            log.info("wrote %s", shutil.copy2(path, opts.plots / path.name))


# ------------------------------------------------------------------ limits
def bench_limits(opts: BenchOptions) -> list[Row]:
    from tools.bench.store import _drop_cache

    nbytes = opts.pick(64, 256) * MiB
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    copy = measure(lambda: np.copyto(dst, src), opts.repeat)
    path = opts.workdir / "plain.bin"

    def write() -> None:
        with open(path, "wb") as f:
            f.write(src.data)
            f.flush()
            os.fsync(f.fileno())

    def read() -> None:
        with open(path, "rb") as f:
            f.readinto(dst.data)

    wr = measure(write, opts.repeat)
    rd = measure(read, opts.repeat, setup=lambda: _drop_cache(path))
    rows = [{"table": "machine", "op": op, "MiB": nbytes // MiB, "GB/s": nbytes / t.best / 1e9,
             "median GB/s": nbytes / t.median / 1e9}
            for op, t in (("memcpy (numpy copyto)", copy), ("file write + fsync", wr),
                          ("file read, cold", rd))]
    save("limits", rows, opts)
    return rows


# ------------------------------------------------------------------ sections
def _sizes(opts: BenchOptions) -> dict[str, list[int]]:
    return {"small": opts.pick([512, 4096], [512, 2048, 8192, 32768], [512, 2048, 8192, 32768]),
            "large": opts.pick([512], [512, 1024, 2048, 4096],
                               [512, 1024, 2048, 4096, 8192, 16384, 32768])}


# Prompts above this run one system at a time ("solo"): interleaved, all three
# systems hold ~3 copies of the prompt each at once (the producer's KV, the stored
# copy, the consumer's buffer), 36 GiB at 32k tokens of the large layout (4 GiB).
INTERLEAVE_MAX_BYTES = 1 << 30
SOLO_COPIES = 3.5  # a prompt's copies one system holds during a solo point, + slack


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# The raw-TE patterns the transfer section runs side by side (tools/bench/rawte.py);
# kvstore's ratios are against the fastest of them at each point. Measured here
# (docs/benchmarks.md, "Choosing the raw-TE patterns"): no slice count won
# consistently, 2 and 8 slices did best on average and bracket the rest; threads-N
# lost nearly everywhere (two cores), so it is left out.
TRANSFER_PATTERNS = ("coalesced", "per-block", "slices-2", "slices-8", "streamed")


def bench_transfer(opts: BenchOptions) -> list[Row]:
    """Prompt-length sweep, both layouts, all three systems interleaved."""
    return run_transfer(opts, _sizes(opts))


def bench_transfer_gpu(opts: BenchOptions) -> list[Row]:
    """``--gpu``: the KV lives in VRAM -- kvstore's device tier on node A (no DRAM
    tier), raw TE from and into GPU memory; Mooncake Store is left out (its segments
    are host memory). Needs CUDA and the CUDA build of mooncake-transfer-engine."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("--gpu needs a CUDA GPU (torch.cuda.is_available() is False here) "
                           "and the CUDA build of mooncake-transfer-engine; run without --gpu")
    return run_transfer(opts, _sizes(opts), device="cuda:0")


def run_transfer(opts: BenchOptions, layouts: dict[str, list[int]], device: str = "cpu",
                 raw_patterns: tuple[str, ...] = TRANSFER_PATTERNS) -> list[Row]:
    """``layouts``: layout name -> prompt lengths (tokens); one pair of nodes each.
    ``device``: where producer and consumer keep the KV (``cuda:N``: see --gpu).
    ``raw_patterns``: how raw TE moves each prompt, one system per pattern."""
    section = "transfer" if device == "cpu" else "transfer-gpu"
    systems_run = SYSTEMS if device == "cpu" else ("kvstore", "rawte")
    rows: list[Row] = []
    kind = ""
    for layout, sizes in layouts.items():
        lay = LAYOUTS[layout]
        shared = [n for n in sizes if lay.nbytes(n) <= INTERLEAVE_MAX_BYTES]  # sizes ascend
        if shared:
            kind = _run_points(opts, rows, layout, shared, systems_run, device, "interleaved",
                               raw_patterns)
        for ntokens in sizes[len(shared):]:
            nbytes = lay.nbytes(ntokens)
            need, have = int(SOLO_COPIES * nbytes), mem_available()
            if need > have:
                print(f"   {layout} layout, {ntokens} tokens: skipped, one system needs "
                      f"~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available", flush=True)
                rows.append({"table": "skipped", "layout": layout, "tokens": ntokens,
                             "need GiB": need / 2**30, "available GiB": have / 2**30})
                continue
            for name in systems_run:  # one at a time: their copies would not fit together
                try:
                    kind = _run_points(opts, rows, layout, [ntokens], (name,), device, "solo",
                                       raw_patterns)
                except WorkerError as exc:  # record it; the other systems still run
                    print(f"   {layout} layout, {ntokens} tokens, {name}: failed: {exc}")
                    rows.append({"table": "failed", "layout": layout, "tokens": ntokens,
                                 "system": name, "error": str(exc)[:300]})
    rows += ratios([r for r in rows if r["table"] == "prompts"], ("layout", "tokens"))
    save(section, rows, opts, {"nodes": kind, "device": device, "raw_patterns": raw_patterns,
                               "layouts": {n: LAYOUTS[n].describe() for n in layouts}})
    return rows


def _run_points(opts: BenchOptions, rows: list[Row], layout: str, sizes: list[int],
                systems_run: tuple[str, ...], device: str, mode: str,
                raw_patterns: tuple[str, ...]) -> str:
    """One pair of nodes running ``systems_run``; every prompt length of ``sizes``
    put + get through them in rotating order. Appends rows; returns the node kind."""
    lay = LAYOUTS[layout]
    max_bytes = lay.nbytes(max(sizes))
    # interleaved: room for a prompt and the next (drops free space behind the
    # get); solo: one prompt at a time, sized to the prompt so 32k tokens fit.
    store_bytes = (2 * max_bytes if mode == "interleaved" else max_bytes + max_bytes // 4)
    with make_cluster(2) as cluster, ExitStack() as stack:
        workdir = opts.workdir / f"{layout}-{max(sizes)}-{'-'.join(systems_run)}"
        workdir.mkdir()
        systems = start_systems(stack, cluster, workdir, [layout], {layout: max(sizes)},
                                 store_bytes + 64 * MiB, systems_run, device, raw_patterns)
        samples = Samples()
        one_prompt(systems, Samples(), ("warm-up",), layout, min(*sizes, 512), 0)
        for ntokens in sizes:
            nbytes = lay.nbytes(ntokens)
            count = reps(opts, nbytes) if mode == "interleaved" else opts.pick(1, 2, 3)
            for rep in range(count):
                one_prompt(systems, samples, (layout, ntokens), layout, ntokens, rep)
            print(f"   {layout} layout, {ntokens} tokens ({mode}: {', '.join(systems)}): "
                  f"done, load {os.getloadavg()[0]:.1f}", flush=True)
            blocks = len(lay.entry_sizes(ntokens))
            for name in systems:
                for op in ("put", "get", "put+get"):
                    rows.append({"table": "prompts", "layout": layout, "tokens": ntokens,
                                 "MiB": nbytes / MiB, "system": name, "op": op, "mode": mode,
                                 **samples.row((layout, ntokens, name, op), nbytes, blocks)})
        rows += memory_rows(systems, f"peak memory, {layout} layout up to {max(sizes)} tokens")
        return cluster.kind


def bench_entries(opts: BenchOptions) -> list[Row]:
    """Put/get of one prompt length while the stores hold more and more entries."""
    layout, ntokens = "small", opts.pick(512, 2048)
    levels = opts.pick([0, 1024], [0, 8192, 32768], [0, 8192, 32768, 131072])
    per_fill = 8192  # tokens per filler prompt: 512 tiny entries in one insert
    lay, tiny = LAYOUTS[layout], LAYOUTS["tiny"]
    store_bytes = 2 * lay.nbytes(ntokens) + 4 * tiny.nbytes(max(levels) + per_fill) + 256 * MiB
    rows: list[Row] = []
    with make_cluster(2) as cluster, ExitStack() as stack:
        workdir = opts.workdir / "entries"
        workdir.mkdir()
        systems = start_systems(stack, cluster, workdir, [layout, "tiny"],
                                 {layout: ntokens, "tiny": per_fill}, store_bytes)
        samples = Samples()
        one_prompt(systems, Samples(), ("warm-up",), layout, ntokens, 0)
        held, fill_pid = 0, 10_000_000
        for level in levels:
            count = (level - held) // (per_fill // tiny.block_tokens)
            for name, s in systems.items():
                if count and not name.startswith(RAW):
                    took = s.producer.call({"op": "fill", "start": fill_pid, "count": count,
                                            "layout": "tiny", "ntokens": per_fill}, 600)["s"]
                    rows.append({"table": "fill", "system": name, "entries": level,
                                 "entries/s": count * per_fill / tiny.block_tokens / took})
            fill_pid += count
            held = level
            for rep in range(opts.pick(3, 10)):
                one_prompt(systems, samples, (level,), layout, ntokens, rep)
            print(f"   {level} entries held: done", flush=True)
            for name, s in systems.items():
                for op in ("put", "get"):
                    store = s.others.get("server") or s.others.get("master") or s.producer.proc
                    rows.append({"table": "entries", "entries": level, "system": name, "op": op,
                                 **samples.row((level, name, op), lay.nbytes(ntokens),
                                               len(lay.entry_sizes(ntokens))),
                                 "store RSS MiB": rss_mib(store.pid)})
    rows += ratios([r for r in rows if r["table"] == "entries"], ("entries",))
    save("entries", rows, opts, {"nodes": cluster.kind, "layout": layout, "tokens": ntokens})
    return rows
