"""What a reader's checksum pass costs a TE read (one node, loopback).

    python -m tools.bench.verify_cost [--layout small] [--tokens 8192] [--reps 21]

Every drop_select and get verifies each entry it reads against the checksum it was
stored with (xxh3_64; a streamed TE read hashes each entry as soon as all of it has
landed, while the rest is on the wire). The raw-TE floor of the transfer benchmark
moves the same bytes and hashes nothing. This tool measures the difference inside
kvstore's own read: one kvstore-server, one TE reader (``same_node=False``, into a
reused buffer, nothing inline), and round by round, the order alternating:

* ``verified``: ``KVStoreClient.get`` as shipped;
* ``unverified``: the same call with ``DataPath.read``'s ``verify`` forced off, for
  this measurement only (the client has no such setting: a reader always verifies);
* ``hash alone``: the same entries' xxh3_64, one call per entry, over the bytes the
  reads left in the buffer (no transfer).

Prints the median ms of each and what verifying adds. Both ends on this machine.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.integration.conftest import ServerFactory
from tools.bench.cluster_worker import LAYOUTS, entry_sizes

MiB = 1 << 20
VARIANTS = ("verified", "unverified")


def run(layout_name: str, ntokens: int, reps: int) -> dict[str, list[float]]:
    """{variant or "hash alone": [ms of each rep]}."""
    from kvstore.client import datapath
    from kvstore.client.client import KVStoreClient
    from kvstore.core.config import ClientConfig
    from kvstore.core.hashing import checksum

    layout = LAYOUTS[layout_name]
    nbytes = layout.nbytes(ntokens)
    base = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    servers = ServerFactory(base)
    times: dict[str, list[float]] = {v: [] for v in (*VARIANTS, "hash alone")}
    shipped = datapath.DataPath.read

    def unverified(self: Any, seg: Any, entries: list, into: Any = None,
                   verify: bool = False) -> np.ndarray:
        return shipped(self, seg, entries, into, False)

    clients: list = []
    try:
        srv = servers(dram=str(2 * nbytes + 64 * MiB), nvme="0",
                      block_tokens=layout.block_tokens, reservation_lease=60, read_lease=60)
        writer = KVStoreClient(srv.address, layout=layout, timeout_s=60)
        clients.append(writer)
        reader = KVStoreClient(srv.address, layout=layout, timeout_s=60, same_node=False,
                               staging_bytes=nbytes + 64 * MiB,
                               config=ClientConfig(inline_max_bytes=0))
        clients.append(reader)
        kv = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        tokens = np.arange(ntokens) % 50_000
        writer.insert(tokens, kv=kv)
        out = np.empty(nbytes + MiB, np.uint8)
        sizes = entry_sizes(layout, ntokens)
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        reader.get(tokens, into=out)  # connects TE
        for rep in range(reps):
            for name in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                datapath.DataPath.read = shipped if name == "verified" else unverified
                try:
                    t0 = time.perf_counter()
                    got = reader.get(tokens, into=out)
                    times[name].append(time.perf_counter() - t0)
                finally:
                    datapath.DataPath.read = shipped
                if got.matched_tokens != ntokens or not np.array_equal(out[:nbytes], kv):
                    raise RuntimeError(f"{name}: the prompt did not come back whole")
            t0 = time.perf_counter()
            for start, size in zip(starts, sizes):
                checksum(out[start:start + size])
            times["hash alone"].append(time.perf_counter() - t0)
    finally:
        datapath.DataPath.read = shipped
        for c in clients:
            c.close()
        servers.stop_all()
        shutil.rmtree(base, ignore_errors=True)
    return {k: [x * 1e3 for x in v] for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="small")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args(argv)
    res = run(args.layout, args.tokens, args.reps)
    med = {k: statistics.median(v) for k, v in res.items()}
    nbytes = LAYOUTS[args.layout].nbytes(args.tokens)
    print(f"{args.layout} layout, {args.tokens} tokens ({nbytes / MiB:.0f} MiB, "
          f"{len(entry_sizes(LAYOUTS[args.layout], args.tokens))} entries), TE over "
          f"loopback, median of {args.reps}:")
    print(f"  get verified {med['verified']:8.2f} ms   unverified {med['unverified']:8.2f} ms"
          f"   verifying adds {med['verified'] - med['unverified']:6.2f} ms "
          f"({med['verified'] / med['unverified'] - 1:+.0%})   hash alone "
          f"{med['hash alone']:6.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
