"""Prefaulting the DRAM arena, against page faults on first use (one node).

    python -m tools.bench.prefault [--layout small] [--tokens 8192] [--reps 20]

Two kvstore-servers on loopback with a DRAM arena of ``--arena`` (default 1 GiB),
nothing else: one as shipped (``tiers.dram_prefault``: the server maps every page of
its arena in the background from start) and one with ``--no-dram-prefault``; a
same-node writer of each, with and without ``client.prefault_arena``, and a TE
reader of each (``same_node=False``, into a reused buffer). Once the prefaulted
server and writer have mapped their whole arena, round by round (the order
alternating) each writer inserts a new prompt and its reader ``get``s it at once;
nothing is dropped, so every prompt lands on arena pages no process has touched
since start, as in a server's first pass through its arena: the writer's copy and
the server's TE send fault page by page unless prefaulted. (A prompt read later
than ~1 s after its insert would find the server's pages mapped by the background
commit check, ``store.verify_commits``; the reader here comes at once, as a decode
engine does.)

Prints the median ms of each and the ratio no-prefault / prefault (> 1: prefault
faster). Both ends on this machine: TE's numbers are loopback's.
"""

from __future__ import annotations

import argparse
import glob
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from tests.integration.conftest import ServerFactory
from tests.unit.test_prefault import wait_mapped
from tools.bench.cluster_worker import LAYOUTS

MiB = 1 << 20
VARIANTS = ("prefault", "no prefault")


def _wait_mapped(path: str, pid: int | str, nbytes: int, within_s: float = 300) -> None:
    if wait_mapped(path, pid, nbytes // 1024, within_s) != nbytes // 1024:
        raise RuntimeError(f"{path} not mapped in {pid} after {within_s} s")


def run(layout_name: str, ntokens: int, reps: int, arena: int
        ) -> dict[str, dict[str, list[float]]]:
    """{"insert": {variant: [ms of each rep]}, "get": {...}}."""
    from kvstore.client.client import KVStoreClient
    from kvstore.core.config import ClientConfig

    layout = LAYOUTS[layout_name]
    nbytes = layout.nbytes(ntokens)
    if (reps + 2) * nbytes > arena * 0.8:
        raise SystemExit(f"{reps} reps of {nbytes >> 20} MiB do not fit a "
                         f"{arena >> 20} MiB arena below its watermark: fewer --reps")
    base = Path(tempfile.mkdtemp(prefix="bench-prefault-"))
    servers = ServerFactory(base)
    times: dict[str, dict[str, list[float]]] = {"insert": defaultdict(list),
                                                "get": defaultdict(list)}
    clients: list = []
    try:
        opts = dict(dram=str(arena), nvme="0", block_tokens=layout.block_tokens,
                    reservation_lease=60, read_lease=60)
        srv = {VARIANTS[0]: servers(**opts),
               VARIANTS[1]: servers(extra=("--no-dram-prefault",), **opts)}

        def client(name: str, same_node: bool) -> KVStoreClient:
            c = KVStoreClient(srv[name].address, layout=layout, timeout_s=60,
                              same_node=same_node, staging_bytes=nbytes + 64 * MiB,
                              config=ClientConfig(prefault_arena=name == VARIANTS[0],
                                                  inline_max_bytes=0))
            clients.append(c)
            return c

        writers = {name: client(name, True) for name in VARIANTS}
        readers = {name: client(name, False) for name in VARIANTS}
        kv = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        out = np.empty(nbytes + MiB, np.uint8)
        # Both writers connect (the first insert), then the prefaulted side finishes.
        for serial, name in enumerate(VARIANTS):
            tokens = (np.arange(ntokens) + serial * ntokens) % 50_000
            writers[name].insert(tokens, kv=kv)
            readers[name].get(tokens, into=out)
        (path,) = glob.glob(f"/dev/shm/kvstore-*-{srv[VARIANTS[0]].proc.pid}")
        start = time.monotonic()
        _wait_mapped(path, srv[VARIANTS[0]].proc.pid, arena)
        _wait_mapped(path, "self", arena)
        print(f"prefaulted {arena >> 20} MiB in the server and the writer "
              f"(waited {time.monotonic() - start:.1f} s after the first insert)")
        serial = len(VARIANTS)
        for rep in range(reps):
            for name in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                serial += 1
                tokens = (np.arange(ntokens) + serial * ntokens) % 50_000
                t0 = time.perf_counter()
                writers[name].insert(tokens, kv=kv)
                t1 = time.perf_counter()
                got = readers[name].get(tokens, into=out)
                t2 = time.perf_counter()
                if got.matched_tokens != ntokens or not np.array_equal(out[:nbytes], kv):
                    raise RuntimeError(f"{name}: prompt {serial} did not come back whole")
                times["insert"][name].append(t1 - t0)
                times["get"][name].append(t2 - t1)
    finally:
        for c in clients:
            c.close()
        servers.stop_all()
        shutil.rmtree(base, ignore_errors=True)
    return {op: {k: [x * 1e3 for x in v] for k, v in t.items()} for op, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="small")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--samples", action="store_true", help="print every rep's ms too")
    ap.add_argument("--arena", type=int, default=1 << 30, help="bytes of each server's DRAM")
    args = ap.parse_args(argv)
    res = run(args.layout, args.tokens, args.reps, args.arena)
    nbytes = LAYOUTS[args.layout].nbytes(args.tokens)
    print(f"{args.layout} layout, {args.tokens} tokens ({nbytes / MiB:.0f} MiB), "
          f"median of {args.reps}, every prompt on fresh arena pages:")
    for op, samples in res.items():
        on, off = (statistics.median(samples[v]) for v in VARIANTS)
        hi_on, hi_off = (max(samples[v]) for v in VARIANTS)
        print(f"  {op:6}  prefault {on:7.2f} ms (max {hi_on:7.2f})   no prefault "
              f"{off:7.2f} ms (max {hi_off:7.2f})   ratio of medians {off / on:.2f}x")
        if args.samples:
            for v in VARIANTS:
                print(f"    {v}: {' '.join(f'{x:.1f}' for x in samples[v])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
