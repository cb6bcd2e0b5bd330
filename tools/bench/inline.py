"""A drop_select's bytes in its acquire's reply against a TE read, side by side, over
two nodes.

    python -m tools.bench.inline [--tokens 256,512,1024,2048] [--reps 40] [--layout small]
                                 [--part 512KiB]

One kvstore-server on node A (``tools.netns``: two network namespaces, TCP over
veth; loopback ports where namespaces are not allowed), and on node B one process
with a producer (TE writes) and three consumers: one with ``client.inline_max_bytes =
0`` (the acquire names TE addresses and the consumer reads them: two round trips'
worth of latency), and two that ask for every prompt inline (``inline_max_bytes`` at
its largest; the server's own limit still decides, 4 GiB by default over the stream
door, 64 MiB over the ZeroMQ port): one takes the
bytes in one part (``client.inline_part_bytes = 0``), the other in parts of
``--part`` bytes, each copied while the next is on the wire. Round by round the
producer stores a prompt and one consumer drop_selects it into a reused buffer, then
the same for the others, the order rotated every round, so all see the same moments
of this noisy machine. Prints the median ms of each per prompt size, TE / inline
(> 1: inline in one part is faster) and one part / parts (> 1: parts are faster),
and how many prompts the server sent inline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kvstore.core.config import ClientConfig, format_size, parse_size
from kvstore.core.errors import ConfigError
from kvstore.core.protocol import MAX_INLINE_BYTES
from tests.integration.conftest import server_argv
from tools.netns import make_cluster

ROOT = Path(__file__).resolve().parents[2]


def consumer(address: str, host: str, layout_name: str, sizes: list[int], reps: int,
             part: int = 512 << 10) -> None:
    """Node B's side: the rounds; one JSON line per size on stdout."""
    import statistics
    import time

    import numpy as np

    from kvstore.client.client import KVStoreClient
    from tools.bench.cluster_worker import LAYOUTS

    layout = LAYOUTS[layout_name]
    for ntok in sizes:
        nbytes = layout.nbytes(ntok)

        def client(cap: int, part: int = 0) -> KVStoreClient:
            return KVStoreClient(address, layout=layout, timeout_s=60, same_node=False,
                                 te_host=host, staging_bytes=nbytes + (64 << 20),
                                 config=ClientConfig(inline_max_bytes=cap, te_host=host,
                                                     inline_part_bytes=part))

        producer = client(0)
        readers = {"te": client(0), "inline": client(MAX_INLINE_BYTES),
                   "parts": client(MAX_INLINE_BYTES, part)}
        kv = np.random.default_rng(ntok).integers(0, 256, nbytes, dtype=np.uint8)
        out = np.empty(nbytes + (1 << 20), np.uint8)
        times: dict[str, list[float]] = {name: [] for name in readers}
        sent = producer.stats()["inline_replies"]
        for rep in range(reps + 2):  # the first two rounds warm up
            names = list(readers)[rep % 3:] + list(readers)[:rep % 3]
            for i, name in enumerate(names):
                tokens = (np.arange(ntok) + (rep * 3 + i) * ntok) % 50_000
                producer.insert(tokens, kv)
                time.sleep(0.01)
                start = time.perf_counter()
                got = readers[name].drop_select(tokens, into=out)
                if rep >= 2:
                    times[name].append(time.perf_counter() - start)
                if got.matched_tokens != ntok or not np.array_equal(got.kv.numpy(), kv):
                    raise SystemExit(f"{name}: wrong bytes at {ntok} tokens")
        inline = producer.stats()["inline_replies"] - sent
        print(json.dumps({"tokens": ntok, "MiB": nbytes / (1 << 20),
                          **{name: statistics.median(t) * 1e3 for name, t in times.items()},
                          "inline_replies": inline}), flush=True)
        for c in [producer, *readers.values()]:
            c.close()


def run(sizes: list[int], reps: int, layout: str,
        part: int = 512 << 10) -> tuple[str, list[dict]]:
    # The cluster (and the server in it) ends first, then its log and data dir.
    with tempfile.TemporaryDirectory(prefix="bench-inline-") as d, \
            open(Path(d) / "server.log", "wb") as log, make_cluster(2) as cluster:
        a, b = cluster.nodes
        port = a.free_port()
        server = a.popen(server_argv(port, Path(d), host=a.host, dram="1GiB", nvme="0",
                                     reservation_lease=60, read_lease=60),
                         cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
        a.wait_port(a.host, port, timeout=60, proc=server)
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                f"from tools.bench.inline import consumer; "
                f"consumer('tcp://{a.host}:{port}', {b.host!r}, {layout!r}, {sizes!r}, {reps}, "
                f"{part})")
        res = b.run([sys.executable, "-c", code], timeout=1800)
        if res.returncode:
            raise SystemExit(f"consumer failed ({res.returncode}): {res.stderr[-2000:]}")
        return cluster.kind, [json.loads(line) for line in res.stdout.splitlines()
                              if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="inline drop_select bytes against TE reads")
    parser.add_argument("--tokens", default="256,512,1024,2048")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--layout", default="small")
    parser.add_argument("--part", default=format_size(ClientConfig().inline_part_bytes),
                        help="client.inline_part_bytes of the consumer taking parts "
                             "(default: the client's default)")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.tokens.split(",")]
    if args.reps < 1 or any(n < 1 for n in sizes):
        parser.error("--reps and every --tokens must be at least 1")
    try:
        part = parse_size(args.part)
    except ConfigError as exc:
        parser.error(f"--part: {exc}")
    kind, rows = run(sizes, args.reps, args.layout, part)
    print(f"{args.layout} layout, nodes: {kind}, median ms of {args.reps} drop_selects each:")
    for r in rows:
        print(f"  {r['tokens']:6d} tokens ({r['MiB']:.2f} MiB): TE {r['te']:.2f}, "
              f"inline {r['inline']:.2f}, parts of {args.part} {r['parts']:.2f}; "
              f"TE / inline {r['te'] / r['inline']:.2f}x, "
              f"one part / parts {r['inline'] / r['parts']:.2f}x "
              f"(sent inline: {r['inline_replies']} of {2 * (args.reps + 2)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
