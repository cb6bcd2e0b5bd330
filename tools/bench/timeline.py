"""Where a drop_select's time goes across the two nodes, from timestamps taken in
the consumer and in the kvstore-server it reads from.

    python -m tools.bench.timeline [--layout small] [--tokens 512] [--reps 100]
                                   [--no-raw] [--out DIR]

Runs the transfer benchmark's point (``tools.bench.cluster_run``: two network
namespaces, a kvstore-server on node A, the producer beside it, the consumer on node
B; raw TE's patterns interleaved with kvstore, so that the processes idle between
gets as they do there) with every process of kvstore stamping ``time.monotonic``
(one clock for every process of this machine) as it enters and leaves a few of its
functions (``HOOKS``). The stamps are installed by ``tools/bench/timeline_site``
(a ``sitecustomize`` on the children's ``PYTHONPATH``) and written per process to
``--out``; nothing of kvstore itself is changed. Prints the median of each phase of
a get (``PHASES``), and the get's p50 in the same run next to raw TE's fastest
pattern. The stamps cost ~1 us each: the phases add up to a little more than an
unstamped get.
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import collections
import functools
import importlib.abc
import importlib.machinery
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, NamedTuple

ENV = "KVSTORE_BENCH_TIMELINE"  # the directory the stamps go to; set: stamp
SITE = Path(__file__).resolve().parent / "timeline_site"

# (module, attribute, tag): "<tag>0" on entering the function, "<tag>1" on leaving.
HOOKS = (
    ("kvstore.client.client", "KVStoreClient._select", "sel"),
    ("kvstore.client.client", "KVStoreClient._prompt", "key"),
    ("kvstore.client.rpc", "Channel._exchange", "ex"),
    ("kvstore.client.rpc", "Channel._message", "msg"),
    ("kvstore.client.datapath", "copy_out", "cp"),
    ("kvstore.server.loop", "Server._serve", "srv"),  # with "arr": when it arrived
    ("kvstore.server.loop", "Server._respond", "rsp"),
    ("kvstore.server.loop", "Server._send", "snd"),
)
FLUSH_S = 0.2  # a stamping process appends its stamps to its file this often


# ------------------------------------------------------------------ stamping
class _Stamps:
    """This process's stamps, appended to ``<dir>/<pid>.txt`` every ``FLUSH_S`` by a
    thread of their own (a process the tool's cluster ends with SIGKILL keeps all
    but the last ``FLUSH_S``'s; the tool waits that long before it ends them)."""

    def __init__(self, where: str) -> None:
        self.path = Path(where) / f"{os.getpid()}.txt"
        self.items: collections.deque[tuple[str, float]] = collections.deque()
        atexit.register(self.flush)
        threading.Thread(target=self._run, name="bench-timeline", daemon=True).start()

    def add(self, tag: str, at: float | None = None) -> None:
        self.items.append((tag, time.monotonic() if at is None else at))

    def flush(self) -> None:
        items = [self.items.popleft() for _ in range(len(self.items))]
        if items:
            with open(self.path, "a") as f:
                f.write("".join(f"{tag} {at:.7f}\n" for tag, at in items))

    def _run(self) -> None:
        while True:
            time.sleep(FLUSH_S)
            self.flush()


def _wrap(func: Callable[..., Any], tag: str, stamps: _Stamps) -> Callable[..., Any]:
    add = stamps.add

    if tag == "srv":  # Server._serve(self, frames, arrived): also when it arrived
        @functools.wraps(func)
        def serve(self: Any, frames: Any, arrived: float, *args: Any) -> Any:
            add("arr", arrived)
            add("srv0")
            try:
                return func(self, frames, arrived, *args)
            finally:
                add("srv1")
        return serve

    @functools.wraps(func)
    def stamped(*args: Any, **kwargs: Any) -> Any:
        add(tag + "0")
        try:
            return func(*args, **kwargs)
        finally:
            add(tag + "1")
    return stamped


def patch(module: Any, stamps: _Stamps) -> list[str]:
    """Stamp ``module``'s functions named in ``HOOKS``; an attribute that is gone
    raises (the tool must follow kvstore's code, not silently time nothing)."""
    done = []
    for name, attr, tag in HOOKS:
        if name != module.__name__:
            continue
        owner: Any = module
        *path, last = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, last, _wrap(getattr(owner, last), tag, stamps))
        done.append(attr)
    return done


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the ``HOOKS`` modules as they are first imported."""

    def __init__(self, stamps: _Stamps) -> None:
        self.stamps = stamps
        self.names = {name for name, _, _ in HOOKS}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module
        stamps = self.stamps

        def exec_module(module: Any) -> None:
            run(module)
            patch(module, stamps)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """In a child of this tool (``timeline_site``): stamp the ``HOOKS`` when ``ENV``
    names a directory; else nothing."""
    where = os.environ.get(ENV)
    if not where or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder(_Stamps(where)))


# ------------------------------------------------------------------ reading
class Stamp(NamedTuple):
    at: float
    pid: int
    tag: str


def load(where: Path) -> list[Stamp]:
    stamps = []
    for path in where.glob("*.txt"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            tag, at = line.split()
            stamps.append(Stamp(float(at), pid, tag))
    stamps.sort()
    return stamps


# Each phase of a get: (name, from, to). An event is "C:<tag>" (the consumer) or
# "S:<tag>" (the server's serving of this get's acquire); "first part" / "last part"
# are the first and last messages of the reply the consumer had in hand (the reply
# with the first part of the bytes, the last part).
PHASES = (
    ("client: keys (hashing the tokens)", "C:key0", "C:key1"),
    ("client: keys and the request, until the acquire's call", "C:sel0", "C:ex0"),
    ("request until the serving thread has it", "C:ex0", "S:arr"),
    ("waiting in the server's queue", "S:arr", "S:srv0"),
    ("server: decode, acquire, encode", "S:rsp0", "S:rsp1"),
    ("server: reply and parts handed to ZeroMQ", "S:snd0", "S:snd1"),
    ("first part in transit (from the server's send)", "S:snd0", "first part"),
    ("the other parts, until the last is in", "first part", "last part"),
    ("after the last part: its copy and checks", "last part", "C:ex1"),
    ("release (one-way) and the result", "C:ex1", "C:sel1"),
    ("drop_select", "C:sel0", "C:sel1"),
)


def windows(stamps: list[Stamp], since: float = 0.0) -> tuple[list[dict[str, float]], int]:
    """The events of each get that began at ``since`` or later, relative to its start
    (ms), and how many gets were left out (the server's stamps of their acquire
    missing). The consumer is the process with the most ``sel0``; the server's
    stamps are those of the others."""
    sels = collections.Counter(s.pid for s in stamps if s.tag == "sel0")
    if not sels:
        return [], 0
    consumer = max(sels, key=sels.__getitem__)
    mine = [s for s in stamps if s.pid == consumer]
    server = [s for s in stamps if s.pid != consumer and s.tag in
              ("arr", "srv0", "srv1", "rsp0", "rsp1", "snd0", "snd1")]
    server_at = [s.at for s in server]
    out, missed = [], 0
    starts = [i for i, s in enumerate(mine) if s.tag == "sel0" and s.at >= since]
    for i in starts:
        t0 = mine[i].at
        ev: dict[str, float] = {}
        msgs: list[float] = []
        for s in mine[i:]:
            if s.tag == "sel0" and s.at != t0:
                break
            key = "C:" + s.tag
            if key == "C:msg1":
                msgs.append(s.at)
            ev.setdefault(key, s.at)  # the first of each: the acquire's call
            if key == "C:sel1":
                break
        if "C:sel1" not in ev or "C:ex1" not in ev:
            continue
        # The acquire's serving: the first that arrived after the call began.
        j = bisect.bisect_left(server_at, ev["C:ex0"])
        served: dict[str, float] = {}
        for s in server[j:]:
            if s.at > ev["C:sel1"] and "S:srv1" in served:
                break
            if s.tag == "arr" and "S:arr" in served:
                break
            served.setdefault("S:" + s.tag, s.at)
        if "S:snd0" not in served or "S:rsp1" not in served:
            missed += 1
            continue
        ev.update(served)
        parts = [m for m in msgs if served["S:snd0"] < m <= ev["C:ex1"]]
        if parts:
            ev["first part"], ev["last part"] = parts[0], parts[-1]
            ev["parts"] = len(parts)
        out.append({k: (v if k == "parts" else (v - t0) * 1e3) for k, v in ev.items()})
    return out, missed


def phases(wins: list[dict[str, float]]) -> dict[str, float]:
    """Median ms of each phase over the gets that have both of its ends."""
    result = {}
    for name, start, end in PHASES:
        spans = [w[end] - w[start] for w in wins if start in w and end in w]
        if spans and len(spans) >= len(wins) / 2:
            result[name] = statistics.median(spans)
    return result


# ------------------------------------------------------------------ the run
def run(layout: str = "small", ntokens: int = 512, reps: int = 100, raw: bool = True,
        out: Path | None = None) -> dict[str, Any]:
    from tools.bench.cluster import TRANSFER_PATTERNS
    from tools.bench.cluster_run import (
        MiB,
        RAW,
        Samples,
        one_prompt,
        start_systems,
    )
    from tools.bench.cluster_worker import LAYOUTS
    from tools.netns import make_cluster

    stamps_dir = Path(tempfile.mkdtemp(prefix="bench-timeline-"))
    nbytes = LAYOUTS[layout].nbytes(ntokens)
    saved = {k: os.environ.get(k) for k in (ENV, "PYTHONPATH")}
    os.environ[ENV] = str(stamps_dir)
    os.environ["PYTHONPATH"] = str(SITE) + os.pathsep + os.environ.get("PYTHONPATH", "")
    try:
        with make_cluster(2) as cluster, ExitStack() as stack:
            workdir = Path(tempfile.mkdtemp(prefix="bench-timeline-work-"))
            stack.callback(shutil.rmtree, workdir, True)
            systems = start_systems(stack, cluster, workdir, [layout], {layout: ntokens},
                                     2 * nbytes + 64 * MiB,
                                     ("kvstore", "rawte") if raw else ("kvstore",),
                                     raw_patterns=TRANSFER_PATTERNS)
            samples = Samples()
            one_prompt(systems, Samples(), ("warm-up",), layout, ntokens, 0)
            since = time.monotonic()  # (one clock for every process here)
            for rep in range(reps):
                one_prompt(systems, samples, (layout, ntokens), layout, ntokens, rep)
            gets = {name: samples.row((layout, ntokens, name, "get"), nbytes, 1)["p50 ms"]
                    for name in systems}
            time.sleep(3 * FLUSH_S)  # every stamp on disk before the processes end
        wins, missed = windows(load(stamps_dir), since)
        raws = {k[len(RAW):]: v for k, v in gets.items() if k.startswith(RAW)}
        best = min(raws, key=raws.__getitem__) if raws else None
        result = {"layout": layout, "tokens": ntokens, "MiB": nbytes / MiB, "gets": len(wins),
                  "left out": missed, "phases ms": phases(wins),
                  "parts": statistics.median(w.get("parts", 0) for w in wins) if wins else 0,
                  "kvstore get p50 ms": gets["kvstore"],
                  "raw TE fastest": best, "raw TE p50 ms": raws.get(best) if best else None}
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "timeline.json").write_text(json.dumps(result, indent=1) + "\n")
            for path in stamps_dir.glob("*.txt"):
                shutil.copy(path, out / f"stamps-{path.name}")
        return result
    finally:
        shutil.rmtree(stamps_dir, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="small")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--no-raw", action="store_true", help="kvstore alone, no raw TE")
    ap.add_argument("--out", type=Path, help="write timeline.json and the stamps here")
    args = ap.parse_args(argv)
    res = run(args.layout, args.tokens, args.reps, not args.no_raw, args.out)
    print(f"{args.layout} layout, {args.tokens} tokens ({res['MiB']:.1f} MiB), {res['gets']} "
          f"gets ({res['left out']} left out: no server stamps), "
          f"{res['parts']:g} parts; median ms:")
    for name, ms in res["phases ms"].items():
        print(f"  {name:58s} {ms:7.3f}")
    line = f"kvstore get p50 {res['kvstore get p50 ms']:.3f} ms"
    if res["raw TE fastest"]:
        line += (f"; raw TE's fastest ({res['raw TE fastest']}) {res['raw TE p50 ms']:.3f} ms: "
                 f"kvstore / raw TE {res['raw TE p50 ms'] / res['kvstore get p50 ms']:.2f}")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
