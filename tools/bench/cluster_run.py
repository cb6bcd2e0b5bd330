"""Running the two-node workload: start each system's processes on the nodes, put
and get prompts through all of them in rotating order, and turn the samples into
rows (GB/s, p50/p99, blocks/s, CPU s/GB), ratios and peak-memory rows.

Used by the sections in tools/bench/cluster.py and by tools/bench/profile.py.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from tools.bench import BenchOptions, Row
from tools.bench.cluster_procs import REPO, SystemProcs, WorkerProc, peak_rss_mib, worker_env
from tools.bench.cluster_worker import LAYOUTS

SYSTEMS = ("kvstore", "mooncake", "rawte")
RAW = "rawte-"  # raw TE runs as one system per transfer pattern: "rawte-coalesced", ...
MiB = 1 << 20
P99_MIN_RUNS = 100  # fewer runs than this: report the max, not a "p99"


def start_systems(stack: ExitStack, cluster, workdir: Path, layouts: list[str],
                   max_tokens: dict[str, int], store_bytes: int, systems=SYSTEMS,
                   device: str = "cpu", raw_patterns: tuple[str, ...] = ("coalesced",)
                   ) -> dict[str, SystemProcs]:
    """The processes of ``systems`` on the cluster's two nodes, by system name.
    ``"rawte"`` becomes one system per pattern of ``raw_patterns``
    (tools/bench/rawte.py), ``"rawte-<pattern>"``, all on one producer/consumer pair:
    every pattern reads the same registered buffers over the same connections."""
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
        # As deployed, every node runs kvstore-server. The consumer on B takes the
        # prompt from A's server over TE (the disaggregated flow: the KV lives where
        # it was produced); B's own server runs beside it, as in production, holding
        # nothing here, and its CPU time and memory are counted with the system's.
        srv, address = start_kvstore_server(a, workdir / "node-a", store_bytes, device)
        srv_b, _ = start_kvstore_server(b, workdir / "node-b", store_bytes, device)
        cross = "auto" if cluster.kind == "netns" else False
        s = SystemProcs("kvstore", others={"server": srv, "server-b": srv_b})
        common = {"server": address, "staging_bytes": max_bytes}
        s.producer = worker(a, "kvstore", "producer", same_node="auto", **common)
        s.consumer = worker(b, "kvstore", "consumer", same_node=cross, **common)
        out["kvstore"] = s
    if "mooncake" in systems:
        from tools.bench.mooncake import start_master

        m = start_master(a, workdir / "mooncake_master.log")
        s = SystemProcs("mooncake", others={"master": m.proc})
        common = {"master": m.address, "metadata": m.metadata, "segment_bytes": store_bytes}
        s.producer = worker(a, "mooncake", "producer", **common)
        s.consumer = worker(b, "mooncake", "consumer", **common)
        out["mooncake"] = s
    if "rawte" in systems:
        producer = worker(a, "rawte", "producer")
        consumer = worker(b, "rawte", "consumer", peer=producer.call({"op": "info"}))
        for pattern in raw_patterns:
            out[RAW + pattern] = SystemProcs(RAW + pattern, producer, consumer,
                                             get_options={"pattern": pattern})
    return out


def start_kvstore_server(node, workdir: Path, nbytes: int, device: str = "cpu"):
    """kvstore-server on ``node``, data and log under ``workdir``; (process, address)."""
    workdir.mkdir(parents=True, exist_ok=True)
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
        self.transfers: dict[tuple, int] = {}  # TE entries per operation (raw TE's gets)
        # kvstore's gets: seconds of each part of each run (cluster_worker.KVStoreSide)
        self.split: dict[tuple, dict[str, list[float]]] = {}

    def add(self, key: tuple, seconds: float, nbytes: int, cpu: float,
            transfers: int | None = None, split: dict[str, float] | None = None) -> None:
        self.s.setdefault(key, []).append(seconds)
        self.cpu[key] = self.cpu.get(key, 0.0) + cpu
        self.nbytes[key] = self.nbytes.get(key, 0) + nbytes
        if transfers is not None:
            self.transfers[key] = transfers
        for part, value in (split or {}).items():
            self.split.setdefault(key, {}).setdefault(part, []).append(value)

    def row(self, key: tuple, nbytes: int, blocks: int) -> Row:
        """GB/s and blocks/s of the median run. ``p99 ms`` only from ``P99_MIN_RUNS``
        runs up (None below: with 5 - 20 runs the 99th percentile is just the
        slowest run, so that is reported as ``max ms``, always)."""
        s = np.asarray(self.s[key])
        p50 = float(np.median(s))
        p99 = float(np.percentile(s, 99)) * 1e3 if len(s) >= P99_MIN_RUNS else None
        row = {"GB/s": nbytes / p50 / 1e9, "p50 ms": p50 * 1e3, "p99 ms": p99,
               "max ms": float(s.max()) * 1e3, "blocks/s": blocks / p50,
               "CPU s/GB": self.cpu[key] / (self.nbytes[key] / 1e9), "runs": len(s)}
        if key in self.transfers:
            row["TE transfers"] = self.transfers[key]
        for part, values in self.split.get(key, {}).items():  # "acquire ms", "move ms"
            row[f"{part} ms"] = float(np.median(values)) * 1e3
        return row


_pids = itertools.count(1)


def one_prompt(systems: dict[str, SystemProcs], samples: Samples, key: tuple, layout: str,
                ntokens: int, rotate: int) -> None:
    """Put then get one fresh prompt through every system, in rotating order."""
    names = list(systems)
    for name in names[rotate % len(names):] + names[:rotate % len(names)]:
        s = systems[name]
        cmd = {"layout": layout, "ntokens": ntokens, "pid": next(_pids)}
        put, put_cpu = s.timed(s.producer, {"op": "put", **cmd})
        get, get_cpu = s.timed(s.consumer, {"op": "get", "digest": put["digest"], **cmd,
                                            **s.get_options})
        samples.add((*key, name, "put"), put["s"], put["nbytes"], put_cpu)
        samples.add((*key, name, "get"), get["s"], get["nbytes"], get_cpu,
                    get.get("transfers"), get.get("split"))
        samples.add((*key, name, "put+get"), put["s"] + get["s"], put["nbytes"],
                    put_cpu + get_cpu)


def reps(opts: BenchOptions, nbytes: int) -> int:
    """Runs at a point: as many as fit the budget of prompt bytes, within bounds.
    Enough that the medians hold still between runs of the benchmark: the median of
    20 runs of a small prompt, or of 5 of a large one, moved here by as much as the
    targets' margins, and the raw-TE floor, the best of several patterns' medians,
    gains from each one's noise."""
    budget = opts.pick(8 * MiB, 2048 * MiB, 2048 * MiB)
    return int(min(opts.pick(3, 60, 80), max(opts.pick(2, 8, 8), budget // nbytes)))


def ratios(rows: list[Row], keys: tuple[str, ...]) -> list[Row]:
    """kvstore's GB/s over Mooncake's and over the raw-TE floor, for each key and op.
    The floor is the fastest raw-TE pattern at that key and op (``rawte floor``
    names it, ``rawte GB/s`` is its speed): the best use of TE, not one use of it."""
    by = {(tuple(r[k] for k in keys), r["op"], r["system"]): r["GB/s"] for r in rows}
    out = []
    for (k, op, system), gbps in by.items():
        if system != "kvstore":
            continue
        mooncake = by.get((k, op, "mooncake"))
        raw = {s[len(RAW):]: g for (k2, op2, s), g in by.items()
               if k2 == k and op2 == op and s.startswith(RAW)}
        best = max(raw, key=raw.__getitem__) if raw else None
        out.append({"table": "ratios", **dict(zip(keys, k)), "op": op,
                    "kv/mooncake": gbps / mooncake if mooncake else float("nan"),
                    "kv/rawte": gbps / raw[best] if best else float("nan"),
                    "rawte floor": best, "rawte GB/s": raw[best] if best else float("nan")})
    return out


def memory_rows(systems: dict[str, SystemProcs], table: str) -> list[Row]:
    """Peak memory of every process once: the raw-TE patterns share one pair of
    workers, reported as system ``rawte``."""
    rows, seen = [], set()
    for name, s in systems.items():
        for proc, pid in s.pids().items():
            if pid not in seen:
                seen.add(pid)
                rows.append({"table": table, "system": "rawte" if name.startswith(RAW)
                             else name, "process": proc, "peak MiB": peak_rss_mib(pid)})
    return rows
