"""Two nodes, three systems, the same bytes: kvstore vs Mooncake Store vs raw TE.

Sections (registered in tools/bench.py):

* ``limits``: what the machine allows -- memcpy and plain file write/read GB/s;
* ``transfer``: prompts of growing length in two KV layouts. On node A a producer
  stores each prompt, on node B a consumer takes it (get + drop). Systems:
  ``kvstore`` (kvstore-server on A; producer inserts through the same-node shared
  arena, consumer drop_selects over TE), ``mooncake`` (mooncake_master on A, the
  producer's MooncakeDistributedStore mounts the segment, consumer get_into +
  remove), ``rawte`` (producer copies into a registered buffer, consumer reads it
  in one TE batch: the floor). Nodes are network namespaces where allowed
  (tools.netns), else loopback ports;
* ``entries``: the same put/get at a fixed prompt length while the stores hold
  more and more other entries.

Every operation is timed inside the process doing it; its CPU time is summed over
every process of the system (server and master included, from /proc); peak memory
is each process's VmHWM. Rows go to ``bench-results/<section>.json`` and plots to
docs/img/ (``--quick`` runs: bench-results/img/), see tools/bench_plots.py.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from tools.bench import BenchOptions, Row, measure
from tools.bench_cluster_procs import (REPO, SystemProcs, WorkerProc, peak_rss_mib, rss_mib,
                                      worker_env)
from tools.bench_cluster_worker import LAYOUTS
from tools.netns import make_cluster

log = logging.getLogger(__name__)
SYSTEMS = ("kvstore", "mooncake", "rawte")
MiB = 1 << 20


def results_dir() -> Path:
    return Path(os.environ.get("KVSTORE_BENCH_OUT", REPO / "bench-results"))


def save(section: str, rows: list[Row], opts: BenchOptions, extra: dict | None = None) -> None:
    """Rows as JSON (bench-results/, gitignored) and their plots."""
    from tools import bench_plots

    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    doc = {"section": section, "quick": opts.quick, "time_utc": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_avg": os.getloadavg(), "rows": rows,
        **(extra or {})}
    (out / f"{section}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    img = out / "img" if opts.quick else REPO / "docs" / "img"
    for path in bench_plots.render(section, rows, img):
        log.info("wrote %s", path)


# ------------------------------------------------------------------ limits
def bench_limits(opts: BenchOptions) -> list[Row]:
    from tools.bench_store import _drop_cache

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


# ------------------------------------------------------------------ the systems
def _start_systems(stack: ExitStack, cluster, workdir: Path, layouts: list[str],
                   max_tokens: dict[str, int], store_bytes: int, systems=SYSTEMS,
                   device: str = "cpu") -> dict[str, SystemProcs]:
    a, b = cluster.nodes
    max_bytes = max(LAYOUTS[n].nbytes(t) for n, t in max_tokens.items())
    base = {"layouts": layouts, "max_tokens": max_tokens, "max_bytes": max_bytes,
            "profile": os.environ.get("KVSTORE_BENCH_PROFILE", ""), "device": device}
    out = {}

    def worker(node, system, role, **cfg) -> WorkerProc:
        w = WorkerProc(node, {**base, "system": system, "role": role, "host": node.host, **cfg},
                       workdir / f"{system}-{role}.log")
        stack.callback(w.close)
        return w

    if "kvstore" in systems:
        srv, address = _start_kvstore_server(a, workdir, store_bytes, device)
        cross = "auto" if cluster.kind == "netns" else False
        s = SystemProcs("kvstore", others={"server": srv})
        common = {"server": address, "staging_bytes": max_bytes}
        s.producer = worker(a, "kvstore", "producer", same_node="auto", **common)
        s.consumer = worker(b, "kvstore", "consumer", same_node=cross, **common)
        out["kvstore"] = s
    if "mooncake" in systems:
        from tools.bench_mooncake import start_master

        m = start_master(a, workdir / "mooncake_master.log")
        s = SystemProcs("mooncake", others={"master": m.proc})
        common = {"master": m.address, "metadata": m.metadata, "segment_bytes": store_bytes}
        s.producer = worker(a, "mooncake", "producer", **common)
        s.consumer = worker(b, "mooncake", "consumer", **common)
        out["mooncake"] = s
    if "rawte" in systems:
        s = SystemProcs("rawte")
        s.producer = worker(a, "rawte", "producer")
        s.consumer = worker(b, "rawte", "consumer", peer=s.producer.call({"op": "info"}))
        out["rawte"] = s
    return out


def _start_kvstore_server(node, workdir: Path, nbytes: int, device: str = "cpu"):
    port = node.free_port()
    tiers = (["--dram", str(nbytes)] if device == "cpu"
             else ["--dram", "0", "--gpu", str(nbytes), "--gpu-device", device])
    argv = [sys.executable, "-m", "kvstore.server", "--host", node.host, "--port", str(port),
            "--data-dir", str(workdir / "kvstore-data"), *tiers,
            "--nvme", "0", "--block-tokens", "16", "--log-level", "warning"]
    with open(workdir / "kvstore-server.log", "ab") as log_file:
        proc = node.popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, cwd=REPO, env=worker_env())
    node.wait_port(node.host, port, 60, proc=proc)
    return proc, f"tcp://{node.host}:{port}"


# ------------------------------------------------------------------ measuring
class Samples:
    """Per (key) lists of seconds, bytes and CPU seconds."""

    def __init__(self) -> None:
        self.s: dict[tuple, list[float]] = {}
        self.cpu: dict[tuple, float] = {}
        self.nbytes: dict[tuple, int] = {}

    def add(self, key: tuple, seconds: float, nbytes: int, cpu: float) -> None:
        self.s.setdefault(key, []).append(seconds)
        self.cpu[key] = self.cpu.get(key, 0.0) + cpu
        self.nbytes[key] = self.nbytes.get(key, 0) + nbytes

    def row(self, key: tuple, nbytes: int, blocks: int) -> Row:
        s = np.asarray(self.s[key])
        p50 = float(np.median(s))
        return {"GB/s": nbytes / p50 / 1e9, "p50 ms": p50 * 1e3,
                "p99 ms": float(np.percentile(s, 99)) * 1e3, "blocks/s": blocks / p50,
                "CPU s/GB": self.cpu[key] / (self.nbytes[key] / 1e9), "runs": len(s)}


_pids = itertools.count(1)


def _one_prompt(systems: dict[str, SystemProcs], samples: Samples, key: tuple, layout: str,
                ntokens: int, rotate: int) -> None:
    """Put then get one fresh prompt through every system, in rotating order."""
    names = list(systems)
    for name in names[rotate % len(names):] + names[:rotate % len(names)]:
        s = systems[name]
        cmd = {"layout": layout, "ntokens": ntokens, "pid": next(_pids)}
        put, put_cpu = s.timed(s.producer, {"op": "put", **cmd})
        get, get_cpu = s.timed(s.consumer, {"op": "get", "digest": put["digest"], **cmd})
        samples.add((*key, name, "put"), put["s"], put["nbytes"], put_cpu)
        samples.add((*key, name, "get"), get["s"], get["nbytes"], get_cpu)
        samples.add((*key, name, "put+get"), put["s"] + get["s"], put["nbytes"],
                    put_cpu + get_cpu)


def _reps(opts: BenchOptions, nbytes: int) -> int:
    budget = opts.pick(8 * MiB, 1024 * MiB, 2048 * MiB)
    return int(min(opts.pick(3, 20, 40), max(opts.pick(2, 5, 8), budget // nbytes)))


def _ratios(rows: list[Row], keys: tuple[str, ...]) -> list[Row]:
    """kvstore's GB/s over Mooncake's and raw TE's, for each key and op."""
    by = {(tuple(r[k] for k in keys), r["op"], r["system"]): r["GB/s"] for r in rows}
    out = []
    for (k, op, system), gbps in by.items():
        if system != "kvstore":
            continue
        row: Row = {"table": "ratios", **dict(zip(keys, k)), "op": op}
        for other, label in (("mooncake", "kv/mooncake"), ("rawte", "kv/rawte")):
            row[label] = gbps / by[(k, op, other)] if (k, op, other) in by else float("nan")
        out.append(row)
    return out


def _memory_rows(systems: dict[str, SystemProcs], table: str) -> list[Row]:
    return [{"table": table, "system": name, "process": proc, "peak MiB": peak_rss_mib(pid)}
            for name, s in systems.items() for proc, pid in s.pids().items()]


# ------------------------------------------------------------------ sections
def _sizes(opts: BenchOptions) -> dict[str, list[int]]:
    return {"small": opts.pick([512, 4096], [512, 2048, 8192, 32768], [512, 2048, 8192, 32768]),
            "large": opts.pick([512], [512, 1024, 2048, 4096], [512, 1024, 2048, 4096, 8192])}


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


def run_transfer(opts: BenchOptions, layouts: dict[str, list[int]],
                 device: str = "cpu") -> list[Row]:
    """``layouts``: layout name -> prompt lengths (tokens); one pair of nodes each.
    ``device``: where producer and consumer keep the KV (``cuda:N``: see --gpu)."""
    section = "transfer" if device == "cpu" else "transfer-gpu"
    systems_run = SYSTEMS if device == "cpu" else ("kvstore", "rawte")
    rows: list[Row] = []
    kind = ""
    for layout, sizes in layouts.items():
        lay = LAYOUTS[layout]
        max_bytes = lay.nbytes(max(sizes))
        with make_cluster(2) as cluster, ExitStack() as stack:
            kind = cluster.kind
            workdir = opts.workdir / layout
            workdir.mkdir()
            systems = _start_systems(stack, cluster, workdir, [layout], {layout: max(sizes)},
                                     2 * max_bytes + 64 * MiB, systems_run, device)
            samples = Samples()
            _one_prompt(systems, Samples(), ("warm-up",), layout, min(sizes), 0)
            for ntokens in sizes:
                nbytes = lay.nbytes(ntokens)
                for rep in range(_reps(opts, nbytes)):
                    _one_prompt(systems, samples, (layout, ntokens), layout, ntokens, rep)
                print(f"   {layout} layout, {ntokens} tokens: done, load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
                blocks = len(lay.entry_sizes(ntokens))
                for name in systems:
                    for op in ("put", "get", "put+get"):
                        rows.append({"table": "prompts", "layout": layout, "tokens": ntokens,
                                     "MiB": nbytes / MiB, "system": name, "op": op,
                                     **samples.row((layout, ntokens, name, op), nbytes, blocks)})
            rows += _memory_rows(systems, f"peak memory, {layout} layout up to "
                                          f"{max(sizes)} tokens")
    rows += _ratios([r for r in rows if r["table"] == "prompts"], ("layout", "tokens"))
    save(section, rows, opts, {"nodes": kind, "device": device, "layouts": {
        n: LAYOUTS[n].describe() for n in layouts}})
    return rows


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
        systems = _start_systems(stack, cluster, workdir, [layout, "tiny"],
                                 {layout: ntokens, "tiny": per_fill}, store_bytes)
        samples = Samples()
        _one_prompt(systems, Samples(), ("warm-up",), layout, ntokens, 0)
        held, fill_pid = 0, 10_000_000
        for level in levels:
            count = (level - held) // (per_fill // tiny.block_tokens)
            for name, s in systems.items():
                if count and name != "rawte":
                    took = s.producer.call({"op": "fill", "start": fill_pid, "count": count,
                                            "layout": "tiny", "ntokens": per_fill}, 600)["s"]
                    rows.append({"table": "fill", "system": name, "entries": level,
                                 "entries/s": count * per_fill / tiny.block_tokens / took})
            fill_pid += count
            held = level
            for rep in range(opts.pick(3, 10)):
                _one_prompt(systems, samples, (level,), layout, ntokens, rep)
            print(f"   {level} entries held: done", flush=True)
            for name, s in systems.items():
                for op in ("put", "get"):
                    store = s.others.get("server") or s.others.get("master") or s.producer.proc
                    rows.append({"table": "entries", "entries": level, "system": name, "op": op,
                                 **samples.row((level, name, op), lay.nbytes(ntokens),
                                               len(lay.entry_sizes(ntokens))),
                                 "store RSS MiB": rss_mib(store.pid)})
    rows += _ratios([r for r in rows if r["table"] == "entries"], ("entries",))
    save("entries", rows, opts, {"nodes": cluster.kind, "layout": layout, "tokens": ntokens})
    return rows


# ------------------------------------------------------------------ profiling
def profile(layout: str, ntokens: int, reps: int, out: Path) -> None:
    """kvstore insert + drop_select under pyinstrument (producer, consumer) and
    py-spy (the server), ``reps`` prompts, next to raw TE under pyinstrument too;
    reports land in ``out``."""
    import shutil
    import tempfile

    out.mkdir(parents=True, exist_ok=True)
    os.environ["KVSTORE_BENCH_PROFILE"] = str(out.resolve())
    nbytes = LAYOUTS[layout].nbytes(ntokens)
    with make_cluster(2) as cluster, ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="bench-profile-"))
        stack.callback(shutil.rmtree, workdir, True)
        systems = _start_systems(stack, cluster, workdir, [layout], {layout: ntokens},
                                 2 * nbytes + 64 * MiB, systems=("kvstore", "rawte"))
        server = systems["kvstore"].others["server"]
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record",
                                "--pid", str(server.pid), "--format", "raw", "--nonblocking",
                                "-o", str(out / "kvstore-server.pyspy.txt")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples = Samples()
        for rep in range(reps):
            _one_prompt(systems, samples, (layout, ntokens), layout, ntokens, rep)
        spy.send_signal(2)  # SIGINT: py-spy writes its report and exits
        spy.wait(timeout=60)
        for name in systems:
            for op in ("put", "get"):
                row = samples.row((layout, ntokens, name, op), nbytes, 1)
                print(f"{name} {op}: {row['GB/s']:.3f} GB/s, p50 {row['p50 ms']:.1f} ms")
    print(f"profiles in {out}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="profile kvstore's two-node hot path")
    parser.add_argument("--layout", default="large", choices=sorted(LAYOUTS))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--out", default=str(results_dir() / "profile"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    profile(args.layout, args.tokens, args.reps, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
