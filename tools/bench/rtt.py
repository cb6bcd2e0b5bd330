"""One control round trip, back to back and after the server sat idle (one node).

    python -m tools.bench.rtt [--calls 400] [--gaps 0,0.0005,0.002,0.01]

Starts one kvstore-server on loopback and times ``health`` requests from one
client over each of its doors, alternating call by call so both see the same
moments of this noisy machine: the ZeroMQ port (``router``, every client's) and
the same-node Unix socket (``local``, kvstore/server/local.py, what a client on the
server's node uses). For each gap, ``calls`` requests per door, each sent ``gap``
seconds after the last reply. A request does nothing in the store, so the times are
what the control plane itself costs: the sockets, the threads they wake and the
wake-ups. On a VM every thread woken from idle costs more the longer it slept, which
is what the gaps show. Prints the median ms per gap and door (the first tenth of the
calls is a warm-up).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tests.integration.conftest import ServerFactory


DOORS = ("router", "local")


def run(calls: int, gaps: list[float]) -> dict[float, dict[str, float]]:
    """{gap s: {door: median round trip ms}}."""
    from kvstore.client.local import LocalChannel
    from kvstore.client.rpc import Channel
    from kvstore.core import protocol as p

    base = Path(tempfile.mkdtemp(prefix="bench-rtt-"))
    servers = ServerFactory(base)
    try:
        srv = servers(dram="64MiB", nvme="0")
        router = Channel(srv.address, timeout_s=10.0)
        path = router.call(p.Hello())["local"]
        if path is None:
            raise RuntimeError("the server has no same-node socket (no /dev/shm?)")
        local = LocalChannel(path, timeout_s=10.0, max_bytes=router.max_bytes)
        out: dict[float, dict[str, float]] = {}
        try:
            for gap in gaps:
                times: dict[str, list[float]] = {door: [] for door in DOORS}
                for _ in range(calls):
                    for door, channel in zip(DOORS, (router, local)):
                        if gap:
                            time.sleep(gap)
                        start = time.perf_counter()
                        channel.call(p.Health())
                        times[door].append(time.perf_counter() - start)
                out[gap] = {door: statistics.median(t[calls // 10:]) * 1e3
                            for door, t in times.items()}
        finally:
            local.close()
            router.close()
        return out
    finally:
        servers.stop_all()
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="control round trips, hot and after idle")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--gaps", default="0,0.0005,0.002,0.01",
                        help="seconds of idle before each call, comma-separated")
    args = parser.parse_args(argv)
    gaps = [float(g) for g in args.gaps.split(",")]
    for gap, doors in run(args.calls, gaps).items():
        router, local = doors["router"], doors["local"]
        print(f"  idle {gap * 1e3:6.1f} ms before each call: round trip router {router:.3f} ms, "
              f"local socket {local:.3f} ms ({router / local:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
