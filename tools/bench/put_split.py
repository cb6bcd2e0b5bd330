"""Where a same-node insert's time goes, back to back and after an idle pause (one node).

    python -m tools.bench.put_split [--layout small] [--tokens 512] [--reps 100]
                                    [--idle-ms 30]

The transfer benchmark's put is a producer's insert into the kvstore-server beside
it (the shared arena, then one ``Put`` over the same-node socket), timed between
other systems' work (``interleaved``): every process has idled and other work has
gone through the CPU caches in between. This measures both cases side by side, in
one run, against one kvstore-server on loopback: ``warm`` inserts back to back,
``idle`` ones each after ``--idle-ms`` of sleep and a pass over 64 MiB (the caches
full of other work), and, to tell those two apart, ``asleep`` (the sleep alone) and
``swept`` (the pass alone), the cases' order turned round every round. Each insert is split, around the
client's own calls, into ``keys`` (the prompt's keys and token bytes), ``copy``
(the copy into the arena, hashed as it goes) and ``put`` (the request's round trip:
the server's thread waking, its work, the reply, the client's thread waking);
the rest of the insert is ``other``.

Prints the median ms of each part and of the whole insert per case, and each case
over warm.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np

from tools.bench.cluster_worker import LAYOUTS, time_calls
from tools.bench.same_node import SWEEP, MiB, evict_whole, new_prompt, writer_beside_a_server

CASES = ("warm", "idle", "asleep", "swept")
PARTS = ("keys", "copy", "put", "other", "insert")


def run(layout_name: str, ntokens: int, reps: int, idle_s: float
        ) -> dict[str, dict[str, list[float]]]:
    """{case: {part: [ms of each rep]}}."""
    layout = LAYOUTS[layout_name]
    nbytes = layout.nbytes(ntokens)
    times: dict[str, dict[str, list[float]]] = {case: defaultdict(list) for case in CASES}
    split: dict[str, float] = {}
    with writer_beside_a_server(layout, nbytes, "bench-put-split-") as writer:
        time_calls(writer, "_prompt", "keys", split)
        time_calls(writer, "_call", "put", split)
        time_calls(writer._data, "write", "copy", split)
        time_calls(writer._data, "write_run", "copy", split)  # (a room's flat bytes)
        kv = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        sweep = np.ones(SWEEP, np.uint8)
        serial = 0
        for rep in range(reps + 5):  # the first 5: warm-up, not counted
            turn = rep % len(CASES)
            for case in CASES[turn:] + CASES[:turn]:
                serial += 1
                tokens = new_prompt(kv, ntokens, serial)
                if case in ("idle", "asleep"):
                    time.sleep(idle_s)
                if case in ("idle", "swept"):
                    sweep.sum()
                split.clear()
                start = time.perf_counter()
                res = writer.insert(tokens, kv=kv)
                whole = time.perf_counter() - start
                took = dict(split)  # (keys_for below goes through _prompt too)
                evict_whole(writer, tokens, res, serial)
                if rep < 5:
                    continue
                parts = {"keys": took.get("keys", 0.0), "copy": took.get("copy", 0.0),
                         "put": took.get("put", 0.0), "insert": whole}
                parts["other"] = whole - parts["keys"] - parts["copy"] - parts["put"]
                for part, seconds in parts.items():
                    times[case][part].append(seconds * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="small")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--idle-ms", type=float, default=30.0)
    args = ap.parse_args(argv)
    res = run(args.layout, args.tokens, args.reps, args.idle_ms / 1000)
    nbytes = LAYOUTS[args.layout].nbytes(args.tokens)
    print(f"{args.layout} layout, {args.tokens} tokens ({nbytes / MiB:.1f} MiB), same-node "
          f"insert, median ms of {args.reps}; before each: idle {args.idle_ms:g} ms "
          f"asleep and {SWEEP // MiB} MiB through the caches, asleep the sleep alone, "
          f"swept the pass alone")
    others = CASES[1:]
    print(f"  {'part':8} " + " ".join(f"{case:>8}" for case in CASES) + " "
          + " ".join(f"{case + '/warm':>12}" for case in others))
    for part in PARTS:
        ms = {case: statistics.median(res[case][part]) for case in CASES}
        ratios = " ".join(f"{ms[case] / ms['warm']:12.2f}" if ms["warm"] > 0 else f"{'-':>12}"
                          for case in others)
        print(f"  {part:8} " + " ".join(f"{ms[case]:8.3f}" for case in CASES) + " " + ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
