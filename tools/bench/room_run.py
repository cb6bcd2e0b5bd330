"""A same-node insert into its room with the one-call copy and without it, side by side.

    python -m tools.bench.room_run [--layout small] [--tokens 512,2048] [--reps 200]
                                   [--idle-ms 30]

One kvstore-server on loopback and one same-node writer. Each round makes four
inserts, a fresh prompt each: both cases (``warm``: right after the last insert;
``idle``: after ``--idle-ms`` asleep and a pass over 64 MiB, as the transfer
benchmark's interleaved put finds the processes), each with both copies: as shipped
(the prompt's flat KV laid out in the writer's room and copied and hashed by one
``scatter_run`` call per copying thread, ``shm.copy_run``) and with
``shm.SCATTER_RUN`` set to None (a view and a placement per entry, then
``scatter``: the path before). The cases' order turns round every round, the
copies' every other round. Every insert must be one ``put`` into the writer's room,
through the copy it names (else ``RuntimeError``: the two would time the same
path). Every prompt is evicted after its insert, so the arena never fills. Prints
the median ms of each copy and case, and the median of the per-round ratios (per
entry / one call: above 1, the one call is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from tools.bench.cluster_worker import LAYOUTS
from tools.bench.same_node import SWEEP, MiB, evict_whole, new_prompt, writer_beside_a_server

VARIANTS = ("one call", "per entry")
CASES = ("warm", "idle")


def run(layout_name: str, ntokens: int, reps: int, idle_s: float
        ) -> dict[str, dict[str, list[float]]]:
    """{case: {variant: [ms of each round]}}."""
    from kvstore.client import datapath, shm

    if shm.SCATTER_RUN is None:
        raise RuntimeError("kvstore.client._ntcopy was built without scatter_run "
                           "(no xxhash.h): nothing to compare")
    layout = LAYOUTS[layout_name]
    nbytes = layout.nbytes(ntokens)
    times: dict[str, dict[str, list[float]]] = {c: {v: [] for v in VARIANTS} for c in CASES}
    one_call, copy_run = shm.SCATTER_RUN, datapath.copy_run
    ran: list[bool] = []  # each copy_run of an insert: whether it copied (not None)
    ops: list[str] = []  # each request of an insert

    def counted(*args: Any, **kwargs: Any) -> Any:
        got = copy_run(*args, **kwargs)
        ran.append(got is not None)
        return got

    datapath.copy_run = counted
    try:
        with writer_beside_a_server(layout, nbytes, "bench-room-run-") as writer:
            call = writer._call

            def recorded(req: Any, *args: Any, **kwargs: Any) -> Any:
                ops.append(req.OP)
                return call(req, *args, **kwargs)

            writer._call = recorded  # type: ignore[method-assign]
            kv = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            sweep = np.ones(SWEEP, np.uint8)
            serial = 0
            for rnd in range(reps + 3):  # the first 3: warm-up, not counted
                for case in CASES if rnd % 2 else CASES[::-1]:
                    for variant in VARIANTS if (rnd // 2) % 2 else VARIANTS[::-1]:
                        serial += 1
                        shm.SCATTER_RUN = one_call if variant == "one call" else None
                        tokens = new_prompt(kv, ntokens, serial)
                        if case == "idle":
                            time.sleep(idle_s)
                            sweep.sum()
                        ran.clear()
                        ops.clear()
                        start = time.perf_counter()
                        res = writer.insert(tokens, kv=kv)
                        took = time.perf_counter() - start
                        how = (list(ops), list(ran))
                        if rnd >= 3 and how != (["put"], [variant == "one call"]):
                            raise RuntimeError(f"prompt {serial} ({variant}) was not one put "
                                               f"through that copy: requests {how[0]}, "
                                               f"copy_run copied {how[1]}")
                        evict_whole(writer, tokens, res, serial)
                        if rnd >= 3:
                            times[case][variant].append(took * 1e3)
    finally:
        shm.SCATTER_RUN, datapath.copy_run = one_call, copy_run
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="small")
    ap.add_argument("--tokens", default="512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--idle-ms", type=float, default=30.0)
    args = ap.parse_args(argv)
    print(f"{args.layout} layout, same-node insert into its room, median ms of {args.reps} "
          f"rounds; idle: {args.idle_ms:g} ms asleep and {SWEEP // MiB} MiB through the "
          f"caches before each")
    print(f"  {'tokens':>6} {'MiB':>6} {'case':>5} " + " ".join(f"{v:>10}" for v in VARIANTS)
          + f" {'per entry / one call':>21}")
    for ntokens in (int(n) for n in args.tokens.split(",")):
        res = run(args.layout, ntokens, args.reps, args.idle_ms / 1000)
        nbytes = LAYOUTS[args.layout].nbytes(ntokens)
        for case in CASES:
            ms = {v: statistics.median(res[case][v]) for v in VARIANTS}
            ratio = statistics.median(b / a for a, b in zip(res[case]["one call"],
                                                            res[case]["per entry"]))
            print(f"  {ntokens:6d} {nbytes / MiB:6.1f} {case:>5} "
                  + " ".join(f"{ms[v]:10.3f}" for v in VARIANTS) + f" {ratio:21.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
