"""The store's own cost of put / acquire / release, this checkout against another one,
side by side (in-process ``Store`` calls: no sockets, no copies, one thread).

    python -m tools.bench.store_ab --base /path/to/other/checkout [--this /path/to/another]
                                   [--entries 2048] [--reps 61] [--claim] [--server]
                                   [--procs 5]

Starts ``--procs`` worker processes per checkout (``PYTHONPATH`` set to it, so each
imports its own ``kvstore``), each with a DRAM-only store of its own, and has the
checkouts take turns, one round each, the order swapped every round, so both see
the same moments of a noisy machine; each checkout's rounds go to its processes in
turn (an odd number of them: each goes first in some rounds and second in others,
and none serves two rounds in a row). One process against one of the same
checkout came out anywhere from 0.64x to 1.12x at 32 entries, 2026-12-06: a
process keeps the speed of where its memory and CPU landed, so one process per
side measures the processes as much as the code (docs/benchmarks.md, "A prompt's
keys from one conversion"). A round: a room for ``entries`` blocks of 64 KiB, a
``put`` of fresh random keys into it (its book-keeping run at once when the store answers first), an
``acquire`` of them (with ``--claim``, claiming them as a drop_select's acquire
does), a ``release`` with drop. Both workers run with the garbage
collector as a server runs it (``server.gc_young``: start-up frozen, collections
rare), so that a collection set off by one step is not charged to another. Prints
the median ms of each step and of the whole round per checkout (each process's
first two rounds are warm-up) and base / this (> 1: this is faster).
``--this``: measure that checkout instead of this one. A checkout must have rooms
(``Store.grant_room``, from 6736e70 on). Make one with ``git worktree add /tmp/base
<commit>``.

``--server``: the serving thread's whole handling instead (``Server.handle``, with a
real server around the store: its TE engine started, no socket used): a same-node
writer's ``Put`` of entries in its room (``put reply``: until its reply; ``put``:
with the book-keeping the serving thread does right after), the acquire of a
drop_select from another node (claiming, its bytes asked in the reply, which come
as a view of the arena), then, as once its bytes are out, its one-way release with
drop. A request's decode, the store's work, the reply's encoding; not the sockets.
``--entries 32`` is the transfer benchmark's small 512-token prompt; at most 1 024
entries (the bytes of one reply).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ENTRY = 64 << 10
STEPS = ("put", "acquire", "release", "round")
# --server: also the put's time to its reply (its book-keeping comes after that).
SERVER_STEPS = (*STEPS, "put reply")
GC_YOUNG = 50_000  # server.gc_young's default (kvstore.server.loop.tune_gc)
WARMUP = 2


def worker(entries: int, claim: bool = False) -> None:
    """One store; a round per line on stdin, its step times (s) as JSON on stdout."""
    import time

    import numpy as np

    from kvstore.core.config import KVStoreConfig
    from kvstore.store.facade import Store

    with tempfile.TemporaryDirectory(prefix="store-ab-") as data_dir:
        cfg = KVStoreConfig().replace(
            tiers={"dram_bytes": 4 * entries * ENTRY, "nvme_bytes": 0, "gpu_bytes": 0,
                   "gpu_device": "cpu", "dram_shared": False},
            store={"data_dir": data_dir})
        store = Store(cfg)
        later = "later" in inspect.signature(store.put).parameters
        tokens = [np.full(16, i, dtype="<i4").tobytes() for i in range(entries)]
        sizes, offsets = [ENTRY] * entries, [i * ENTRY for i in range(entries)]
        gc.collect()  # as tune_gc does (a checkout from before it has none)
        gc.freeze()
        gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
        for _ in sys.stdin:
            keys = [os.urandom(16) for _ in range(entries)]
            room = store.grant_room(entries * ENTRY)
            work: list = []
            t0 = time.perf_counter()
            kw = {"later": work.append} if later else {}
            store.put(room.id, keys, sizes, tokens, offsets, [0] * entries, **kw)
            for step in work:
                step()
            t1 = time.perf_counter()
            acq = store.acquire(keys, tokens, claim=True) if claim else \
                store.acquire(keys, tokens)
            t2 = time.perf_counter()
            store.release(acq.id, drop=True)
            t3 = time.perf_counter()
            if len(acq.entries) != entries:
                raise SystemExit(f"acquired {len(acq.entries)} of {entries}")
            print(json.dumps([t1 - t0, t2 - t1, t3 - t2, t3 - t0]), flush=True)
        store.close()


def server_worker(entries: int) -> None:
    """``worker`` through ``Server.handle`` (``--server``): a round's put, acquire
    and release are request frames, answered as the serving thread answers them."""
    import time

    import numpy as np

    from kvstore.core import protocol as p
    from kvstore.core.config import KVStoreConfig
    from kvstore.server.cli import open_server
    from kvstore.transport.env import free_port

    with tempfile.TemporaryDirectory(prefix="store-ab-") as data_dir:
        cfg = KVStoreConfig().replace(
            tiers={"dram_bytes": 4 * entries * ENTRY, "nvme_bytes": 0, "gpu_bytes": 0,
                   "gpu_device": "cpu"},
            store={"data_dir": data_dir},
            server={"host": "127.0.0.1", "port": free_port("127.0.0.1"), "metrics_port": 0,
                    "inline_max_bytes": max(entries * ENTRY, 1 << 20)})
        server = open_server(cfg)
        store = server.store
        tokens = [np.full(16, i, dtype="<i4").tobytes() for i in range(entries)]
        sizes, offsets = [ENTRY] * entries, [i * ENTRY for i in range(entries)]
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
        try:
            for rid, _ in enumerate(sys.stdin):
                keys = [os.urandom(16) for _ in range(entries)]
                room = store.grant_room(entries * ENTRY)
                work: list = []
                put = p.encode_request(3 * rid + 1, p.Put(
                    room=room.id, keys=tuple(keys), sizes=tuple(sizes), tokens=tuple(tokens),
                    offsets=tuple(offsets), checksums=(0,) * entries))
                t0 = time.perf_counter()
                done = server.handle(put, defer=lambda *a: None, later=work.append)
                t_reply = time.perf_counter()
                for step in work:  # the put's book-keeping, right after its reply
                    step()
                t1 = time.perf_counter()
                if p.decode_reply(bytes(done), 1 << 20)[1].get("new") != entries:
                    raise SystemExit(f"the put did not store every entry: {bytes(done)[:200]!r}")
                reply = server.handle(
                    p.encode_request(3 * rid + 2, p.Acquire(
                        keys=tuple(keys), tokens=tuple(tokens), claim=True,
                        inline=entries * ENTRY)),
                    defer=lambda *a: None, inline=True)
                t2 = time.perf_counter()
                slot = getattr(reply, "data", None)
                if slot is None:
                    raise SystemExit(f"the acquire was not answered with its bytes: "
                                     f"{bytes(reply)[:200]!r}")
                slot.handed = False  # as if sent: the release settles its hold first
                server.handle(p.encode_request(3 * rid + 3, p.Release(aid=slot.aid,
                                                                      drop=True)))
                t3 = time.perf_counter()
                if store.stats()["entries"]:
                    raise SystemExit("the release left entries stored")
                print(json.dumps([t1 - t0, t2 - t1, t3 - t2, t3 - t0, t_reply - t0]),
                      flush=True)
        finally:
            server.close()


def _procs_ok(procs: int) -> bool:
    return procs == 1 or procs > 1 and procs % 2 == 1


def run(base: Path, entries: int, reps: int, this: Path | None = None,
        claim: bool = False, server: bool = False, procs: int = 5
        ) -> dict[str, dict[str, float]]:
    """Median ms per step for ``base`` and ``this`` (default: this checkout), taking
    turns; ``claim``: the acquire claims, as a drop_select's does. ``procs``: worker
    processes per checkout, taking rounds in turn (a process's own speed varies with
    where its memory and CPU landed: one against one of the same checkout measured
    0.64 - 1.12x at 32 entries). An odd number, so that each worker goes first in
    some rounds and second in others, and no worker serves two rounds in a row
    (its second would find its caches warm)."""
    if not _procs_ok(procs):
        raise ValueError(f"procs must be 1 or odd, got {procs}")
    here = Path(__file__).resolve().parents[2]
    trees = {"base": base.resolve(), "this": (this or here).resolve()}
    # run_path, not ``python FILE``: the script's folder on sys.path would shadow
    # modules (tools/bench/profile.py is also a stdlib module's name).
    flags = (", '--claim'" if claim else "") + (", '--server'" if server else "")
    start = (f"import runpy, sys; sys.argv = [{__file__!r}, '--worker', '{entries}'{flags}]; "
             f"runpy.run_path({__file__!r}, run_name='__main__')")
    workers = {name: [subprocess.Popen(
        [sys.executable, "-c", start], cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True) for _ in range(procs)]
        for name, tree in trees.items()}
    times: dict[str, list[list[float]]] = {name: [] for name in trees}
    try:
        for r in range(reps + WARMUP * procs):
            for name in (["base", "this"] if r % 2 else ["this", "base"]):
                proc = workers[name][r % procs]
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line:
                    raise SystemExit(f"the {name} worker ({trees[name]}) stopped")
                if r >= WARMUP * procs:  # (each process's first WARMUP rounds)
                    times[name].append(json.loads(line))
    finally:
        for proc in (proc for group in workers.values() for proc in group):
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
    steps = SERVER_STEPS if server else STEPS
    return {name: {step: statistics.median(t[i] for t in rows) * 1e3
                   for i, step in enumerate(steps)} for name, rows in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the store's put/acquire/release cost, "
                                                 "this checkout against another")
    parser.add_argument("--base", type=Path, help="the other checkout (its root)")
    parser.add_argument("--this", type=Path, help="measure this checkout instead of ours")
    parser.add_argument("--entries", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=61)
    parser.add_argument("--claim", action="store_true",
                        help="the acquire claims its entries, as a drop_select's does "
                             "(default: a get's acquire)")
    parser.add_argument("--server", action="store_true",
                        help="time Server.handle of a room's put, a drop_select's "
                             "acquire (bytes in the reply) and its release, not the "
                             "store's calls")
    parser.add_argument("--procs", type=int, default=5,
                        help="worker processes per checkout, taking rounds in turn "
                             "(one process's own speed is not the checkout's); 1 or odd")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        if args.server:
            server_worker(args.worker)
        else:
            worker(args.worker, args.claim)
        return 0
    if args.base is None:
        parser.error("--base is required")
    for flag, tree in (("--base", args.base), ("--this", args.this)):
        if tree is not None and not (tree / "kvstore" / "store" / "facade.py").is_file():
            parser.error(f"{flag} {tree}: not a kvstore checkout (no kvstore/store/facade.py)")
    if args.entries < 1 or args.reps < 1:
        parser.error("--entries and --reps must be >= 1")
    if not _procs_ok(args.procs):
        parser.error("--procs must be 1 or odd (each worker then goes first and second)")
    from kvstore.core.protocol import ROUTER_INLINE_BYTES

    if args.server and args.entries * ENTRY > ROUTER_INLINE_BYTES:
        parser.error(f"--server sends the acquire's bytes in its reply, as the ZeroMQ "
                     f"port does: at most {ROUTER_INLINE_BYTES // ENTRY} entries of 64 KiB")
    result = run(args.base, args.entries, args.reps, args.this, args.claim, args.server,
                 args.procs)
    what = "Server.handle of a put, a drop_select's acquire (bytes in the reply) and release" \
        if args.server else f"{'claiming' if args.claim else 'plain'} acquires"
    print(f"{args.entries} entries of 64 KiB, {what}, median ms of {args.reps} rounds "
          f"({args.procs} worker processes each):")
    for name, steps in result.items():
        print(f"  {name:4s} " + "  ".join(f"{s} {v:.3f}" for s, v in steps.items()))
    print("  base / this  " + "  ".join(f"{s} {result['base'][s] / result['this'][s]:.2f}x"
                                       for s in result["this"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
