"""One control round trip, back to back and after the server sat idle (one node).

    python -m tools.bench.rtt [--calls 400] [--gaps 0,0.0005,0.002,0.01]

Starts one kvstore-server on loopback and times ``health`` requests from one
client: for each gap, ``calls`` requests each sent ``gap`` seconds after the last
reply. A request does nothing in the store, so the times are what the control plane
itself costs: ZeroMQ, the server's threads and their wake-ups. On a VM every thread
woken from idle costs more the longer it slept, which is what the gaps show.
Prints the median ms per gap (the first tenth of the calls is a warm-up).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tests.integration.conftest import ServerFactory


def run(calls: int, gaps: list[float]) -> dict[float, float]:
    """{gap s: median round trip ms}."""
    from kvstore.client.rpc import Channel
    from kvstore.core import protocol as p

    base = Path(tempfile.mkdtemp(prefix="bench-rtt-"))
    servers = ServerFactory(base)
    try:
        srv = servers(dram="64MiB", nvme="0")
        channel = Channel(srv.address, timeout_s=10.0)
        out = {}
        try:
            for gap in gaps:
                times = []
                for _ in range(calls):
                    if gap:
                        time.sleep(gap)
                    start = time.perf_counter()
                    channel.call(p.Health())
                    times.append(time.perf_counter() - start)
                out[gap] = statistics.median(times[calls // 10:]) * 1e3
        finally:
            channel.close()
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
    for gap, ms in run(args.calls, gaps).items():
        print(f"  idle {gap * 1e3:6.1f} ms before each call: round trip {ms:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
