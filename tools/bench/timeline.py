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
a directory of their own (copied to ``--out``); nothing of kvstore itself is
changed. Prints the median and the mean of each phase of a get (``PHASES``:
consecutive, so their means add up to the mean get; medians do not add up), a few
spans inside them (``INSIDE``), and the get's p50 in the same run next to raw TE's
fastest pattern. The stamps cost ~1 us each. Made for one consumer at a time, as
the benchmark runs it: a request of another client queued between a get's call
and its reply could be taken for its acquire.
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
    ("kvstore.client.rpc", "Channel._receive_parts", "rp"),
    ("kvstore.client.datapath", "copy_out", "cp"),
    # The stream door (kvstore.client.local): its reply frame, then the bytes after it.
    ("kvstore.client.local", "LocalChannel._exchange", "ex"),
    ("kvstore.client.local", "LocalChannel._read_frame", "msg"),
    ("kvstore.client.local", "LocalChannel._bytes_after", "rp"),
    ("kvstore.server.loop", "Server._serve", "srv"),  # with "arr": when it arrived
    ("kvstore.server.loop", "Server._respond", "rsp"),
    ("kvstore.server.loop", "Server._send", "snd"),
    ("kvstore.client.local", "Control.send", "ows"),  # a one-way send: the release
)
FLUSH_S = 0.2  # a stamping process appends its stamps to its file this often


# ------------------------------------------------------------------ stamping
class _Stamps:
    """This process's stamps, appended to ``<dir>/<pid>.txt`` every ``FLUSH_S`` by a
    thread of their own, started by ``start`` (a process that ends without its exit
    handlers, as kvstore-server does, keeps all but the last ``FLUSH_S``'s; the tool
    waits that long before it ends them)."""

    def __init__(self, where: str) -> None:
        self.path = Path(where) / f"{os.getpid()}.txt"
        self.items: collections.deque[tuple[str, float]] = collections.deque()
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            atexit.register(self.flush)
            threading.Thread(target=self._run, name="bench-timeline", daemon=True).start()

    def add(self, tag: str, at: float | None = None) -> None:
        self.items.append((tag, time.monotonic() if at is None else at))

    def flush(self) -> None:
        with self._lock:  # (the thread's and the exit handler's)
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
    if done:
        stamps.start()  # (a process that imports none of them writes nothing)
    return done


class _Loader(importlib.abc.Loader):
    """The module's own loader, then ``patch``."""

    def __init__(self, loader: Any, stamps: _Stamps) -> None:
        self.loader, self.stamps = loader, stamps

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        patch(module, self.stamps)


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
        spec.loader = _Loader(spec.loader, self.stamps)
        return spec


def install() -> None:
    """In a child of this tool (``timeline_site``): stamp the ``HOOKS`` when ``ENV``
    names a directory; else nothing. Runs before anything imports kvstore (at
    start-up): a ``HOOKS`` module imported already could not be stamped, and
    raises."""
    where = os.environ.get(ENV)
    if not where or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    early = sorted({name for name, _, _ in HOOKS} & set(sys.modules))
    if early:
        raise RuntimeError(f"tools.bench.timeline: {early} imported before the stamps")
    sys.meta_path.insert(0, _Finder(_Stamps(where)))


# ------------------------------------------------------------------ reading
class Stamp(NamedTuple):
    at: float
    pid: int
    tag: str


def load(where: Path) -> list[Stamp]:
    """Every process's stamps, in time order (each process's own order kept where
    two have the same time)."""
    stamps = []
    for path in where.glob("*.txt"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            tag, at = line.split()
            stamps.append(Stamp(float(at), pid, tag))
    stamps.sort(key=lambda s: s.at)
    return stamps


class Get(NamedTuple):
    """One drop_select: when each of its events happened (ms from its start), and
    how many messages its acquire's reply came in."""

    at: dict[str, float]
    parts: int


class Gets(NamedTuple):
    gets: list[Get]
    missed: int  # gets left out: the server's stamps of their acquire missing


# Each get is cut into these consecutive phases (name, from, to), which add up to
# the whole drop_select. An event is "C:<tag>" (the consumer), "S:<tag>" (the server
# serving this get's acquire), "reply" (the consumer has the acquire's reply, with
# the first part of the bytes when they come inline over the ZeroMQ port) or "last
# part" (it has the last of them: the last part's message; the reply itself when
# they come in one part; over the stream door, the end of reading the bytes that
# follow the reply, which includes checking all but the last entry as they land).
PHASES = (
    ("client: keys and the request, until the acquire's call", "C:sel0", "C:ex0"),
    ("request until the serving thread has it", "C:ex0", "S:arr"),
    ("server: queue, store lock, until the handling", "S:arr", "S:rsp0"),
    ("server: decode, acquire, encode", "S:rsp0", "S:rsp1"),
    ("reply (and first part): sent, in transit", "S:rsp1", "reply"),
    ("the bytes after it, until the last is in", "reply", "last part"),
    ("after the last byte: the last copy and checks", "last part", "C:ex1"),
    ("the release (one-way; none over the door) and the result", "C:ex1", "C:sel1"),
)
# Spans inside those, shown beside them (not added up).
INSIDE = (
    ("client: keys (hashing the tokens)", "C:key0", "C:key1"),
    ("server: reply and bytes handed to the socket", "S:snd0", "S:snd1"),
    # (Over the stream door the server ends the lease once the bytes are out, and
    # no release is sent: ``Acquire.release_sent``; this span is then left out.)
    ("client: the release's one-way send", "C:ows0", "C:ows1"),
)
TOTAL = ("drop_select", "C:sel0", "C:sel1")
_SERVED = ("srv0", "rsp0", "rsp1", "snd0", "snd1", "srv1")


def windows(stamps: list[Stamp], since: float = 0.0) -> Gets:
    """The gets that began at ``since`` or later. The consumer is the process with
    the most ``sel0``. A get's acquire is the first exchange of its ``_select``, its
    reply the last message the consumer took before the reply's other parts (or,
    in one part, before the exchange ended): a stale reply read first is not it.
    The serving of that acquire is the request some other process queued (``arr``)
    between the call and the reply, and sent (``snd0``) before the reply came; a
    get for which no such serving was stamped is left out (``missed``)."""
    sels = collections.Counter(s.pid for s in stamps if s.tag == "sel0")
    if not sels:
        return Gets([], 0)
    consumer = max(sels, key=sels.__getitem__)
    mine = [s for s in stamps if s.pid == consumer]
    by_pid: dict[int, list[Stamp]] = collections.defaultdict(list)
    for s in stamps:
        if s.pid != consumer and (s.tag == "arr" or s.tag in _SERVED):
            by_pid[s.pid].append(s)
    others = [(events, [s.at for s in events]) for events in by_pid.values()]
    gets, missed = [], 0
    for i, first in enumerate(mine):
        if first.tag != "sel0" or first.at < since:
            continue
        at: dict[str, float] = {}
        messages: list[float] = []  # msg1 of the acquire's exchange
        for s in mine[i:]:
            key = "C:" + s.tag
            if key == "C:sel0" and s is not first:
                break
            if key == "C:msg1" and "C:ex0" in at and "C:ex1" not in at:
                if "C:rp0" in at:
                    messages.append(s.at)  # a part after the reply
                else:
                    at["reply"] = s.at  # the latest before the parts: the reply
            at.setdefault(key, s.at)  # the first of each: the acquire's call
            if key == "C:sel1":
                break
        if "C:sel1" not in at or "C:ex1" not in at or "reply" not in at:
            continue
        # (Over the stream door the bytes follow the reply in no message of their
        # own: the last of them is in when its reading ends.)
        at["last part"] = messages[-1] if messages else at.get("C:rp1", at["reply"])
        served = _serving(others, at["C:ex0"], at["reply"])
        if served is None:
            missed += 1
            continue
        at.update(served)
        gets.append(Get({k: (v - first.at) * 1e3 for k, v in at.items()}, 1 + len(messages)))
    return Gets(gets, missed)


def _serving(others: list[tuple[list[Stamp], list[float]]], call: float,
             reply: float) -> dict[str, float] | None:
    """The server's stamps of the request queued first between ``call`` and
    ``reply`` whose reply was sent before ``reply``; None if none was stamped.
    ``others``: each other process's stamps, and their times."""
    for events, times in others:
        for j in range(bisect.bisect_left(times, call), len(events)):
            if events[j].at > reply:
                break
            if events[j].tag != "arr":
                continue
            served = {"S:arr": events[j].at}
            want = iter(_SERVED)
            tag = next(want)
            for s in events[j + 1:]:  # in order: srv0, rsp0, rsp1, snd0 (the reply's)...
                if s.tag == tag:
                    served["S:" + tag] = s.at
                    tag = next(want, "")
                    if not tag:
                        break
            if len(served) == 1 + len(_SERVED) and served["S:snd0"] < reply:
                return served
    return None


def phases(gets: list[Get]) -> dict[str, tuple[float, float]]:
    """Median and mean ms of each phase (``PHASES``, ``INSIDE``, ``TOTAL``) over the
    gets that have both of its ends; the means of ``PHASES`` add up to the mean of
    ``TOTAL``."""
    result = {}
    for name, start, end in (*PHASES, *INSIDE, TOTAL):
        spans = [g.at[end] - g.at[start] for g in gets if start in g.at and end in g.at]
        if spans:
            result[name] = (statistics.median(spans), statistics.fmean(spans))
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
        found = windows(load(stamps_dir), since)
        raws = {k[len(RAW):]: v for k, v in gets.items() if k.startswith(RAW)}
        best = min(raws, key=raws.__getitem__) if raws else None
        result = {"layout": layout, "tokens": ntokens, "MiB": nbytes / MiB,
                  "gets": len(found.gets), "left out": found.missed,
                  "phases ms": phases(found.gets),  # name -> [median, mean]
                  "parts": statistics.median(g.parts for g in found.gets) if found.gets else 0,
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
          f"gets ({res['left out']} left out: no server stamps), {res['parts']:g} parts")
    inside = {name for name, _, _ in INSIDE}
    print(f"  {'phase (the means add up to the mean drop_select)':60s} {'median':>7s} "
          f"{'mean':>7s} ms")
    for name, (median, mean) in res["phases ms"].items():
        label = f"  (inside) {name}" if name in inside else name
        print(f"  {label:60s} {median:7.3f} {mean:7.3f}")
    line = f"kvstore get p50 {res['kvstore get p50 ms']:.3f} ms"
    if res["raw TE fastest"]:
        line += (f"; raw TE's fastest ({res['raw TE fastest']}) {res['raw TE p50 ms']:.3f} ms: "
                 f"kvstore / raw TE {res['raw TE p50 ms'] / res['kvstore get p50 ms']:.2f}")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
