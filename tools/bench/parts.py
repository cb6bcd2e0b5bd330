"""Where one insert / drop_select spends its time, by direct timers (one node).

    python -m tools.bench.parts [--layout large] [--tokens 2048] [--path shm|te|inline] [--reps 9]
                                [--compare-loops PAIRS]

Starts one kvstore-server on loopback (DRAM only, sized to two prompts), then
inserts and drop_selects (``into=`` a reused buffer) the same prompt size ``reps``
times and prints, per operation, the median of: the whole call, the prompt's keys
(the client hashing its tokens), the data move (``DataPath.write`` / ``read``: copy
or TE transfer plus the client's checksums), the control round trips the caller
waits for (reserve + commit, or the one ``put`` into a room; the ``acquire``) and,
inside those, the server's own time (its ``/metrics`` histogram
``kvstore_request_duration_seconds``: decoding, the store's work, encoding the
reply). What the round trips take beyond the server's time is the sockets and the
threads they wake on both sides. The first prompt is a warm-up and not counted.
``--path shm``: the same-node shared-memory path; ``te``: TE over loopback TCP;
``inline``: TE writes, and reads whose bytes come in the acquire's reply
(``client.inline_max_bytes`` as shipped; their copy out of it is the get's "move"). Not a benchmark of the network: both ends are on this machine.
``--compare-loops PAIRS``: PAIRS rounds of two runs, one with the client's C
extension copying and hashing (as shipped), one with Python's loops
(``kvstore.client.shm.python_loops``: each entry streamed, then hashed by the
xxhash binding), each on a server of its own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import ServerFactory, free_port
from tools.bench.cluster_worker import LAYOUTS, time_calls

MiB = 1 << 20
# The ops whose replies each call waits for (a drop_select's last release is
# one-way: the server handles it after the call has returned).
WAITED_OPS = {"insert": frozenset({"reserve", "commit", "put", "abort"}),
              "get": frozenset({"acquire"})}
# Between reading /metrics and the call: the server's HTTP thread is done with the
# scrape before the call starts, so the call never waits for it.
SETTLE_S = 0.002


def server_opts(layout: Any, nbytes: int) -> dict[str, Any]:
    """``ServerFactory`` options of a one-node bench server: DRAM only, room for two
    prompts of ``nbytes`` and a writer's room for a third (rooms may take half the
    tier), leases long enough for any round."""
    return dict(dram=str(4 * nbytes + 64 * MiB), nvme="0", block_tokens=layout.block_tokens,
                reservation_lease=60, read_lease=60)


def _server_seconds(port: int, ops: frozenset[str]) -> float:
    """The server's handling time of ``ops`` so far (its latency histogram's sums)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "kvstore_request_duration_seconds_sum"
               and s.labels.get("op") in ops)


def run(layout_name: str, ntokens: int, path: str, reps: int) -> dict[str, dict[str, float]]:
    """Median ms per part of insert and drop_select."""
    from kvstore.client.client import KVStoreClient
    from kvstore.core.config import ClientConfig

    layout = LAYOUTS[layout_name]
    nbytes = layout.nbytes(ntokens)
    base = Path(tempfile.mkdtemp(prefix="bench-parts-"))
    servers = ServerFactory(base)
    parts: dict[str, dict[str, list[float]]] = {"insert": defaultdict(list),
                                                "get": defaultdict(list)}
    try:
        port = free_port()
        srv = servers(**server_opts(layout, nbytes), extra=("--metrics-port", str(port)))
        client = KVStoreClient(srv.address, layout=layout, timeout_s=60,
                               same_node="auto" if path == "shm" else False,
                               staging_bytes=nbytes + 64 * MiB,
                               config=ClientConfig(inline_max_bytes=0) if path == "te"
                               else ClientConfig())
        sink: dict[str, float] = defaultdict(float)
        time_calls(client._data, "write", "move", sink)
        time_calls(client._data, "write_run", "move", sink)  # (a room's flat bytes)
        time_calls(client._data, "read", "move", sink)
        time_calls(client._data, "take_inline", "move", sink)
        # Inline bytes in parts are copied inside the acquire's call, as they arrive:
        # that copying, with the waits for the parts after the first, counts as move,
        # not as round trip.
        time_calls(client._data, "take_parts", "parts", sink)
        time_calls(client, "_prompt", "keys", sink)
        time_calls(client, "_call", "round trips", sink)
        kv = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        out = np.empty(nbytes + MiB, np.uint8)
        for rep in range(reps + 1):
            tokens = (np.arange(ntokens) + rep * ntokens) % 50_000
            for op, call, kwargs in (("insert", client.insert, {"kv": kv}),
                                     ("get", client.drop_select, {"into": out})):
                sink.clear()
                served = _server_seconds(port, WAITED_OPS[op])
                time.sleep(SETTLE_S)
                start = time.perf_counter()
                call(tokens, **kwargs)
                total = time.perf_counter() - start
                served = _server_seconds(port, WAITED_OPS[op]) - served
                if "parts" in sink:
                    sink["move"] += sink["parts"]
                    sink["round trips"] -= sink.pop("parts")
                if rep:  # the first round is a warm-up (TE start, first page faults)
                    parts[op]["total"].append(total)
                    for label, seconds in sink.items():
                        parts[op][label].append(seconds)
                    parts[op]["server"].append(served)
        client.close()
    finally:
        servers.stop_all()
        shutil.rmtree(base, ignore_errors=True)
    return {op: {k: statistics.median(v) * 1e3 for k, v in p.items()}
            for op, p in parts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="time the parts of insert / drop_select")
    parser.add_argument("--layout", default="large", choices=sorted(LAYOUTS))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--path", default="shm", choices=("shm", "te", "inline"))
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--compare-loops", type=int, default=0, metavar="PAIRS",
                        help="alternate runs with the C extension's copy loops and Python's")
    args = parser.parse_args(argv)
    mib = LAYOUTS[args.layout].nbytes(args.tokens) / MiB
    print(f"{args.layout} layout, {args.tokens} tokens ({mib:.0f} MiB), {args.path} path, "
          f"median of {args.reps}:")
    if not args.compare_loops:
        _show(run(args.layout, args.tokens, args.path, args.reps))
        return 0
    from kvstore.client import shm

    if shm.SCATTER is None:
        parser.error("--compare-loops: the client's C extension (with xxhash.h) is not built")
    for pair in range(args.compare_loops):
        print(f"round {pair + 1}, the extension's loops:")
        _show(run(args.layout, args.tokens, args.path, args.reps))
        print(f"round {pair + 1}, Python's loops:")
        with shm.python_loops():
            _show(run(args.layout, args.tokens, args.path, args.reps))
    return 0


def _show(result: dict[str, dict[str, float]]) -> None:
    for op, parts in result.items():
        print(f"  {op:6s} " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items())
              + f" (sockets and wake-ups: {parts['round trips'] - parts['server']:.2f} ms)")


if __name__ == "__main__":
    raise SystemExit(main())
