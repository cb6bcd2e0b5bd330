"""What a reader's checksum pass costs a TE read.

    python -m tools.bench.verify_cost [--layout small] [--tokens 8192] [--reps 21]
                                      [--nodes loopback|netns]

Every drop_select and get verifies each entry it reads against the checksum it was
stored with (xxh3_64; a streamed TE read hashes each entry as soon as all of it has
landed, while the rest is on the wire). The raw-TE floor of the transfer benchmark
moves the same bytes and hashes nothing. This tool measures the difference inside
kvstore's own read: one kvstore-server, one TE reader (``same_node=False``, into a
reused buffer, nothing inline), and round by round, the order alternating:

* ``verified``: ``KVStoreClient.get`` as shipped (with the C extension's ``hashes``,
  every landed entry hashed on the nice-19 thread of kvstore/client/checks.py, up to
  ``checks.BATCH_BYTES`` of entries per call without the GIL; without it, entries of
  256 KiB or more there, smaller ones as they land);
* ``as landed``: the same call with every entry hashed on the reader's thread as
  soon as it has landed, one xxhash call each (``checks.HASHES`` off and
  ``checks.BACKGROUND_MIN_ENTRY_BYTES`` out of reach: the path before);
* ``unverified``: the same call with ``DataPath.read``'s ``verify`` forced off, for
  this measurement only (the client has no such setting: a reader always verifies);
* ``verified after``: the same call with the read unverified and every entry hashed
  and checked once all have landed (what a read did before it was streamed);
* ``low priority``: the same call with each landed entry, of any size, handed to the
  nice-19 hashing thread one at a time and hashed by the xxhash binding
  (``checks.HASHES`` off, ``checks.BACKGROUND_MIN_ENTRY_BYTES`` set to 0: it hashes
  while a core is idle, and what it has not reached when the move ends, the reader
  hashes itself); for entries under ~256 KiB the binding holds the GIL
  (docs/benchmarks.md, "What verifying costs a TE read");
* ``hash alone``: the same entries' xxh3_64, one call per entry, over the bytes the
  reads left in the buffer (no transfer).

``--nodes loopback`` (the default): server and reader in this process's network, TE
over loopback. ``--nodes netns``: the server on node A and the reader on node B of
``tools.netns`` (TCP over veth, as the transfer benchmark runs; both ends still share
this machine's cores). Prints the median ms of each and what verifying adds, then
each one's 90th percentile and slowest round.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.integration.conftest import ServerFactory, server_argv
from tools.bench.cluster_worker import LAYOUTS, entry_sizes

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("verified", "as landed", "unverified", "verified after", "low priority")


def rounds(address: str, layout_name: str, ntokens: int, reps: int,
           te_host: str = "127.0.0.1") -> dict[str, list[float]]:
    """The reader's side against the server at ``address``: {variant or "hash
    alone": [ms of each rep]}."""
    from kvstore.client import checks, datapath
    from kvstore.client.client import KVStoreClient
    from kvstore.core.config import ClientConfig
    from kvstore.core.hashing import checksum

    layout = LAYOUTS[layout_name]
    nbytes = layout.nbytes(ntokens)
    sizes = entry_sizes(layout, ntokens)
    times: dict[str, list[float]] = {v: [] for v in (*VARIANTS, "hash alone")}
    shipped = datapath.DataPath.read

    def unverified(self: Any, seg: Any, entries: list, into: Any = None,
                   verify: bool = False) -> np.ndarray:
        return shipped(self, seg, entries, into, False)

    def verified_after(self: Any, seg: Any, entries: list, into: Any = None,
                       verify: bool = False) -> np.ndarray:
        out = shipped(self, seg, entries, into, False)
        at = 0
        for e in entries:  # (wire layout: field 2 the size, 4 the checksum)
            if verify and checksum(out[at:at + e[2]]) != e[4]:
                raise RuntimeError("verified after: an entry arrived corrupt")
            at += e[2]
        return out

    def threshold(nbytes: int) -> Callable:
        """The shipped read without the C extension's ``hashes``, entries of
        ``nbytes`` or more hashed on the nice-19 thread one at a time
        (``checks.BACKGROUND_MIN_ENTRY_BYTES``, for this call only)."""
        def read(self: Any, seg: Any, entries: list, into: Any = None,
                 verify: bool = False) -> np.ndarray:
            shipped_min, shipped_hashes = checks.BACKGROUND_MIN_ENTRY_BYTES, checks.HASHES
            checks.BACKGROUND_MIN_ENTRY_BYTES, checks.HASHES = nbytes, None
            try:
                return shipped(self, seg, entries, into, verify)
            finally:
                checks.BACKGROUND_MIN_ENTRY_BYTES, checks.HASHES = shipped_min, shipped_hashes
        return read

    as_landed, low_priority = threshold(1 << 62), threshold(0)

    reads = {"verified": shipped, "as landed": as_landed, "unverified": unverified,
             "verified after": verified_after, "low priority": low_priority}
    config = ClientConfig(inline_max_bytes=0, te_host=te_host)
    with KVStoreClient(address, layout=layout, timeout_s=60, same_node=False,
                       te_host=te_host, config=config) as writer, \
            KVStoreClient(address, layout=layout, timeout_s=60, same_node=False,
                          te_host=te_host, staging_bytes=nbytes + 64 * MiB,
                          config=config) as reader:
        kv = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        tokens = np.arange(ntokens) % 50_000
        writer.insert(tokens, kv=kv)
        out = np.empty(nbytes + MiB, np.uint8)
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        reader.get(tokens, into=out)  # connects TE
        try:
            for rep in range(reps):
                for name in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                    datapath.DataPath.read = reads[name]  # type: ignore[method-assign]
                    try:
                        t0 = time.perf_counter()
                        got = reader.get(tokens, into=out)
                        times[name].append(time.perf_counter() - t0)
                    finally:
                        datapath.DataPath.read = shipped  # type: ignore[method-assign]
                    if got.matched_tokens != ntokens or not np.array_equal(out[:nbytes], kv):
                        raise RuntimeError(f"{name}: the prompt did not come back whole")
                t0 = time.perf_counter()
                for start, size in zip(starts, sizes):
                    checksum(out[start:start + size])
                times["hash alone"].append(time.perf_counter() - t0)
        finally:
            datapath.DataPath.read = shipped  # type: ignore[method-assign]
    return {k: [x * 1e3 for x in v] for k, v in times.items()}


def run(layout_name: str, ntokens: int, reps: int, nodes: str = "loopback"
        ) -> dict[str, list[float]]:
    """{variant or "hash alone": [ms of each rep]}."""
    nbytes = LAYOUTS[layout_name].nbytes(ntokens)
    dram = str(2 * nbytes + 64 * MiB)
    base = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    try:
        if nodes == "loopback":
            servers = ServerFactory(base)
            try:
                srv = servers(dram=dram, nvme="0", block_tokens=LAYOUTS[layout_name].block_tokens,
                              reservation_lease=60, read_lease=60)
                return rounds(srv.address, layout_name, ntokens, reps)
            finally:
                servers.stop_all()
        return _run_netns(base, dram, layout_name, ntokens, reps)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run_netns(base: Path, dram: str, layout_name: str, ntokens: int, reps: int
               ) -> dict[str, list[float]]:
    from tools.netns import make_cluster

    # The cluster (and the server in it) ends first, then the log.
    with open(base / "server.log", "wb") as log, make_cluster(2) as cluster:
        if cluster.kind != "netns":
            raise SystemExit("--nodes netns: network namespaces are not available here "
                             "(needs root and `ip netns`)")
        a, b = cluster.nodes
        port = a.free_port()
        server = a.popen(server_argv(port, base, host=a.host, dram=dram, nvme="0",
                                     block_tokens=LAYOUTS[layout_name].block_tokens,
                                     reservation_lease=60, read_lease=60),
                         cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
        a.wait_port(a.host, port, timeout=60, proc=server)
        code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); "
                f"from tools.bench.verify_cost import rounds; "
                f"print(json.dumps(rounds('tcp://{a.host}:{port}', {layout_name!r}, "
                f"{ntokens}, {reps}, {b.host!r})))")
        res = b.run([sys.executable, "-c", code], timeout=1800)
        if res.returncode:
            raise SystemExit(f"reader failed ({res.returncode}): {res.stderr[-2000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="small")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--nodes", choices=("loopback", "netns"), default="loopback")
    args = ap.parse_args(argv)
    res = run(args.layout, args.tokens, args.reps, args.nodes)
    med = {k: statistics.median(v) for k, v in res.items()}
    nbytes = LAYOUTS[args.layout].nbytes(args.tokens)
    print(f"{args.layout} layout, {args.tokens} tokens ({nbytes / MiB:.0f} MiB, "
          f"{len(entry_sizes(LAYOUTS[args.layout], args.tokens))} entries), TE over "
          f"{args.nodes}, median of {args.reps}:")
    base = med["unverified"]
    print(f"  get unverified {base:8.2f} ms   verified {med['verified']:8.2f} ms "
          f"({med['verified'] / base - 1:+.0%})   as landed {med['as landed']:8.2f} ms "
          f"({med['as landed'] / base - 1:+.0%})   verified after {med['verified after']:8.2f} "
          f"ms ({med['verified after'] / base - 1:+.0%})   low priority "
          f"{med['low priority']:8.2f} ms ({med['low priority'] / base - 1:+.0%})   "
          f"hash alone {med['hash alone']:6.2f} ms")
    # The tail: a reader that waits on the hashing thread (a lock, or the GIL, held by
    # a nice-19 thread the kernel put aside) shows in the slowest rounds, not the median.
    for name, pick in (("p90", lambda v: sorted(v)[int(0.9 * (len(v) - 1))]), ("max", max)):
        print(f"  {name}: " + "   ".join(f"{k} {pick(v):8.2f} ms" for k, v in res.items()
                                           if k != "hash alone"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
