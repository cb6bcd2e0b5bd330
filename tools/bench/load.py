"""Load test: many producer and consumer processes against one store, eviction and
demotion running all the time -- kvstore vs Mooncake Store under the same load.

    python -m tools.bench.load [--quick] [--seconds S] [--procs N] [--only kvstore]

Two nodes (network namespaces where allowed, else loopback ports; tools.netns). On
node A the store: one kvstore-server whose DRAM tier is small enough that demotion
to its NVMe slab, and eviction from the slab, never stop (background writeback on,
its default); or ``mooncake_master`` plus one MooncakeDistributedStore that mounts a
segment as big as kvstore's two tiers together (Mooncake has no NVMe tier here;
equal room, so both keep the same prompts and the hit rates compare). Also on A, N
producer processes insert prompts as fast as they can (kvstore: the same-node path);
on B, N consumers drop_select what their producer announced, over TE (Mooncake:
batch_get_into + batch_remove). A quarter of the prompts are never read, so they
leave only by eviction. The processes are tools/bench/load_worker.py.

Reported per system: inserts/s and drop_selects/s over the whole run (all processes
together; operations that answered, failed ones are counted apart), the MB/s they
moved (a miss moves nothing: for drop_select this is what consumers got), p50/p99
latency of each, what the selects found (whole prompt, a prefix, a miss, an error),
the wrong bytes among them (must be 0: the consumer checks every byte), and the
store's resident memory sampled through the run, first quarter vs last quarter. Nothing here asserts speed; tests/integration/test_load.py runs the
same harness smaller and asserts correctness.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tools.bench import BenchOptions, Row, print_rows
from tools.bench.cluster_procs import REPO, WorkerError, WorkerProc, rss_mib, worker_env
from tools.bench.cluster_worker import LAYOUTS
from tools.netns import make_cluster

log = logging.getLogger(__name__)

MiB = 1 << 20
LOAD_WORKER = [sys.executable, "-m", "tools.bench.load_worker"]
SYSTEMS = ("kvstore", "mooncake")
RSS_EVERY_S = 0.25
START_TIMEOUT_S = 300.0  # 2N+1 processes importing torch at once on a small machine
ANSWER_SLACK_S = 120.0  # a run's last operation may wait out a busy server


@dataclass(frozen=True)
class LoadSpec:
    """One load run. Producer i feeds consumer i (``procs`` pairs); prompts are
    ``min_tokens``..``max_tokens`` long in whole blocks of ``layout``; every
    ``abandon_every``-th prompt is never read; a consumer stays ``lag`` prompts
    behind its producer's newest. The server's tiers: ``dram_bytes``, ``nvme_bytes``."""

    procs: int = 8
    seconds: float = 60.0
    layout: str = "small"
    min_tokens: int = 128
    max_tokens: int = 512
    abandon_every: int = 4
    lag: int = 4
    dram_bytes: int = 64 * MiB
    nvme_bytes: int = 256 * MiB
    reservation_lease_s: float = 30.0
    read_lease_s: float = 30.0

    def __post_init__(self) -> None:
        if self.procs < 1 or self.seconds <= 0 or self.abandon_every < 2 or self.lag < 0:
            raise ValueError(f"bad load spec {self}")
        block = LAYOUTS[self.layout].block_tokens
        if not block <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"prompts of {self.min_tokens}..{self.max_tokens} tokens "
                             f"need at least one {block}-token block")

    @property
    def max_prompt_bytes(self) -> int:
        return LAYOUTS[self.layout].nbytes(self.max_tokens)


class LoadResult(NamedTuple):
    system: str
    producers: list[dict]  # each process's answer (tools/bench/load_worker.py Tally)
    consumers: list[dict]
    rss_mib: list[float]  # the store's processes' resident memory, every RSS_EVERY_S
    stats: dict  # kvstore: server stats once leases and reservations are gone; else {}
    settle_s: float  # how long after the run those took to reach 0
    killed: list[str]  # workers that did not answer in time and were killed
    load_avg: float  # the machine's 1-minute load average as the run ended


# ------------------------------------------------------------------ processes
class LoadProc(WorkerProc):
    """A tools/bench/load_worker.py process. Started without waiting, so that all of
    them start together; ``ready()`` waits for one."""

    def __init__(self, node, cfg: dict, log_path: Path) -> None:  # noqa: D107
        self.name = f"{cfg['system']}-{cfg['role']}{cfg.get('index', '')}"
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = node.popen([*LOAD_WORKER, json.dumps(cfg)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=self._log, cwd=REPO,
                               env=worker_env())

    def ready(self, timeout: float = START_TIMEOUT_S) -> None:
        self._read(timeout)

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def exit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
            except BrokenPipeError:
                pass

    def answer(self, timeout: float) -> dict:
        reply = self._read(timeout)
        if "error" in reply:
            raise WorkerError(f"{self.name}: {reply['error']}")
        return reply


def start_kvstore(node, workdir: Path, spec: LoadSpec) -> tuple[subprocess.Popen, str]:
    """kvstore-server on ``node`` with the spec's DRAM and NVMe tiers; (process, address)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = node.free_port()
    argv = [sys.executable, "-m", "kvstore.server", "--host", node.host, "--port", str(port),
            "--data-dir", str(workdir / "kvstore-data"), "--dram", str(spec.dram_bytes),
            "--nvme", str(spec.nvme_bytes), "--block-tokens",
            str(LAYOUTS[spec.layout].block_tokens),
            "--reservation-lease", str(spec.reservation_lease_s),
            "--read-lease", str(spec.read_lease_s), "--log-level", "warning"]
    with open(workdir / "kvstore-server.log", "ab") as log_file:
        proc = node.popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, cwd=REPO, env=worker_env())
    node.wait_port(node.host, port, 60, proc=proc)
    return proc, f"tcp://{node.host}:{port}"


def _start_store(stack: ExitStack, node, workdir: Path, spec: LoadSpec, system: str,
                 base: dict) -> tuple[list[int], dict]:
    """The store's processes on ``node``: their pids (for RSS) and what clients need."""
    if system == "kvstore":
        srv, address = start_kvstore(node, workdir, spec)
        return [srv.pid], {"server": address, "staging_bytes": spec.max_prompt_bytes}
    from tools.bench.mooncake import start_master

    master = start_master(node, workdir / "mooncake_master.log")
    common = {"master": master.address, "metadata": master.metadata}
    # Mooncake has no NVMe tier here: its segment holds as much as both of kvstore's
    # tiers, so both stores keep the same prompts and their hit rates compare.
    holder = LoadProc(node, {**base, **common, "role": "holder", "host": node.host,
                             "segment_bytes": spec.dram_bytes + spec.nvme_bytes},
                      workdir / "mooncake-holder.log")
    stack.callback(holder.close)
    holder.ready()
    return [master.proc.pid, holder.pid], common


# ------------------------------------------------------------------ one run
def run_load(cluster, workdir: Path, spec: LoadSpec, system: str) -> LoadResult:
    """One system under the spec's load on ``cluster`` (1 node: all on it; 2: the
    store and producers on the first, consumers on the second). Every process this
    starts is stopped before it returns."""
    a, b = cluster.nodes[0], cluster.nodes[-1]
    workdir.mkdir(parents=True, exist_ok=True)
    base = {"system": system, "layout": spec.layout, "layouts": [spec.layout],
            "min_tokens": spec.min_tokens, "max_tokens": spec.max_tokens,
            "max_bytes": spec.max_prompt_bytes + 4096, "abandon_every": spec.abandon_every,
            "lag": spec.lag, "device": "cpu"}
    with ExitStack() as stack:
        store_pids, common = _start_store(stack, a, workdir, spec, system, base)
        cross = "auto" if cluster.kind == "netns" and a is not b else False
        procs = {"producer": [], "consumer": []}
        for role, node, same_node in (("producer", a, "auto"), ("consumer", b, cross)):
            for i in range(spec.procs):
                cfg = {**base, **common, "role": role, "index": i, "host": node.host,
                       "same_node": same_node, "announce": str(workdir / f"announce-{i}")}
                p = LoadProc(node, cfg, workdir / f"{role}{i}.log")
                stack.callback(p.close)
                procs[role].append(p)
        everyone = procs["producer"] + procs["consumer"]
        for p in everyone:
            p.ready()
        for p in everyone:
            p.send({"op": "run", "seconds": spec.seconds})
        rss = _sample_rss(store_pids, spec.seconds)
        load_avg = os.getloadavg()[0]
        answers, killed = _collect(everyone, ANSWER_SLACK_S)
        stats, settle = {}, 0.0
        if system == "kvstore":
            asker = next(p for p in everyone if p.proc.poll() is None)
            stats, settle = _settled_stats(asker, spec, bool(killed))
        for p in everyone:  # all at once; the stack's close() then only waits
            p.exit()
        return LoadResult(system, answers[:spec.procs], answers[spec.procs:], rss, stats,
                          settle, killed, load_avg)


def _sample_rss(pids: list[int], seconds: float) -> list[float]:
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples.append(sum(rss_mib(pid) for pid in pids))
        time.sleep(RSS_EVERY_S)
    return samples


def _collect(procs: list[LoadProc], timeout: float) -> tuple[list[dict], list[str]]:
    """Every process's run answer; one that gives none in ``timeout`` is killed and
    answers ``{}`` (its lease, if it held one, expires on the server)."""
    deadline = time.monotonic() + timeout
    answers, killed = [], []
    for p in procs:
        try:
            answers.append(p.answer(max(1.0, deadline - time.monotonic())))
        except WorkerError as exc:
            log.warning("%s", exc)
            p.proc.kill()
            killed.append(p.name)
            answers.append({})
    return answers, killed


def _settled_stats(client: LoadProc, spec: LoadSpec, wait_out_leases: bool) -> tuple[dict, float]:
    """The server's stats once no lease or reservation is left, polled for up to the
    longer lease (+ slack when a worker was killed mid-operation, else a few seconds:
    clients that stopped cleanly leave nothing)."""
    limit = (max(spec.read_lease_s, spec.reservation_lease_s) + 5.0 if wait_out_leases else 5.0)
    start = time.monotonic()
    while True:
        client.send({"op": "stats"})
        stats = client.answer(30.0)
        took = time.monotonic() - start
        if (stats["leases"] == 0 and stats["reservations"] == 0) or took > limit:
            return stats, took
        time.sleep(0.25)


# ------------------------------------------------------------------ rows
def _latencies(answers: list[dict]) -> np.ndarray:
    return np.asarray([x for a in answers for x in a.get("lat", [])], dtype=np.float64)


def _count(answers: list[dict], key: str) -> int:
    return sum(a.get(key, 0) for a in answers)


def _errors(answers: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in answers:
        for name, n in a.get("errors", {}).items():
            out[name] = out.get(name, 0) + n
    return out


def rss_growth(samples: list[float]) -> tuple[float, float]:
    """Mean resident MiB of the first and the last quarter of the samples."""
    quarter = max(1, len(samples) // 4)
    return float(np.mean(samples[:quarter])), float(np.mean(samples[-quarter:]))


def load_rows(spec: LoadSpec, results: list[LoadResult]) -> list[Row]:
    rows: list[Row] = []
    rates: dict[tuple[str, str], Row] = {}
    for r in results:
        for op, answers in (("insert", r.producers), ("drop_select", r.consumers)):
            lat = _latencies(answers)
            errors = _errors(answers)
            row = {"table": "throughput", "system": r.system, "op": op,
                   "ops/s": len(lat) / spec.seconds,
                   "MB/s": _count(answers, "bytes") / spec.seconds / 1e6,
                   "p50 ms": float(np.median(lat)) * 1e3 if lat.size else float("nan"),
                   "p99 ms": float(np.percentile(lat, 99)) * 1e3 if lat.size else float("nan"),
                   "max ms": float(lat.max()) * 1e3 if lat.size else float("nan"),
                   "ops": int(lat.size), "errors": sum(errors.values()),
                   "load": r.load_avg}
            rows.append(row)
            rates[(r.system, op)] = row
        selects = r.consumers
        whole, done = _count(selects, "hits"), len(_latencies(selects))
        rows.append({"table": "outcomes", "system": r.system,
                     "whole": whole, "whole %": 100 * whole / done if done else float("nan"),
                     "prefix": _count(selects, "partial"),
                     "miss": _count(selects, "misses"),
                     "wrong selects": _count(selects, "wrong_selects"),
                     "wrong bytes": _count(selects, "wrong_bytes"),
                     "insert errors": json.dumps(_errors(r.producers)),
                     "select errors": json.dumps(_errors(selects)),
                     "killed": len(r.killed)})
        first, last = rss_growth(r.rss_mib) if r.rss_mib else (float("nan"),) * 2
        store = {"table": "store", "system": r.system, "RSS first 1/4 MiB": first,
                 "RSS last 1/4 MiB": last, "RSS max MiB": max(r.rss_mib, default=float("nan")),
                 "growth MiB": last - first}
        for key in ("demotions", "evictions", "stagings", "writebacks", "leases",
                    "reservations"):
            if key in r.stats:
                store[key] = r.stats[key]
        rows.append(store)
    for op in ("insert", "drop_select"):
        kv, mc = rates.get(("kvstore", op)), rates.get(("mooncake", op))
        if kv and mc:
            rows.append({"table": "ratios", "op": op,
                         "kv/mooncake ops/s": _ratio(kv["ops/s"], mc["ops/s"]),
                         "kv/mooncake MB/s": _ratio(kv["MB/s"], mc["MB/s"]),
                         "mooncake/kv p50": _ratio(mc["p50 ms"], kv["p50 ms"]),
                         "mooncake/kv p99": _ratio(mc["p99 ms"], kv["p99 ms"])})
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# ------------------------------------------------------------------ section
def quick_spec(quick: bool) -> LoadSpec:
    """The bench's load: 8 + 8 processes, 60 s (15 s quick). DRAM holds ~1/6 of
    what is inserted in a second or so of the run, NVMe a few times DRAM: demotion
    starts in the first seconds and eviction soon after."""
    if quick:
        return LoadSpec(seconds=15.0, dram_bytes=32 * MiB, nvme_bytes=96 * MiB)
    return LoadSpec()


def bench_load(opts: BenchOptions, spec: LoadSpec | None = None,
               systems: tuple[str, ...] = SYSTEMS) -> list[Row]:
    from tools.bench.cluster import save

    spec = spec or quick_spec(opts.quick)
    results = []
    with make_cluster(2) as cluster:
        for system in systems:
            print(f"   {system}: {spec.procs} producers + {spec.procs} consumers, "
                  f"{spec.seconds:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
            results.append(run_load(cluster, opts.workdir / system, spec, system))
        kind = cluster.kind
    rows = load_rows(spec, results)
    save("load", rows, opts, {"nodes": kind, "spec": asdict(spec)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="15 s and smaller tiers")
    parser.add_argument("--seconds", type=float, help="run length per system")
    parser.add_argument("--procs", type=int, help="producers (and as many consumers)")
    parser.add_argument("--only", choices=SYSTEMS, help="one system only")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), help="the prompts' KV layout")
    parser.add_argument("--tokens", metavar="MIN:MAX",
                        help="prompt lengths (whole blocks of the layout)")
    parser.add_argument("--dram-mib", type=int, help="kvstore's DRAM tier (MiB)")
    parser.add_argument("--nvme-mib", type=int, help="kvstore's NVMe tier (MiB)")
    parser.add_argument("--out", type=Path, help="where load.json goes "
                        "(default $KVSTORE_BENCH_OUT, else bench-results/)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = quick_spec(args.quick)
    spec = replace(spec, seconds=args.seconds or spec.seconds, procs=args.procs or spec.procs,
                   layout=args.layout or spec.layout,
                   dram_bytes=args.dram_mib * MiB if args.dram_mib else spec.dram_bytes,
                   nvme_bytes=args.nvme_mib * MiB if args.nvme_mib else spec.nvme_bytes)
    if args.tokens:
        low, _, high = args.tokens.partition(":")
        spec = replace(spec, min_tokens=int(low), max_tokens=int(high or low))
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        opts = BenchOptions(quick=args.quick, workdir=Path(tmp), out=args.out)
        print(f"load: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
        rows = bench_load(opts, spec, (args.only,) if args.only else SYSTEMS)
    print_rows("load", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
