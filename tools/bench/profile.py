"""Profile kvstore's two-node hot path next to raw TE.

    python -m tools.bench.profile [--layout large] [--tokens 2048] [--reps 8] [--out DIR]

pyinstrument runs inside the producer and consumer workers (text and HTML per
worker), py-spy records the kvstore-server process (raw format, one line per
stack); the printed GB/s are those of the profiled run, not a benchmark.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from tools.bench.cluster import results_dir
from tools.bench.cluster_run import MiB, Samples, one_prompt, start_systems
from tools.bench.cluster_worker import LAYOUTS
from tools.netns import make_cluster


def profile(layout: str, ntokens: int, reps: int, out: Path) -> None:
    """kvstore insert + drop_select under pyinstrument (producer, consumer) and
    py-spy (the server), ``reps`` prompts, next to raw TE under pyinstrument too;
    reports land in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    os.environ["KVSTORE_BENCH_PROFILE"] = str(out.resolve())
    nbytes = LAYOUTS[layout].nbytes(ntokens)
    with make_cluster(2) as cluster, ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="bench-profile-"))
        stack.callback(shutil.rmtree, workdir, True)
        systems = start_systems(stack, cluster, workdir, [layout], {layout: ntokens},
                                 2 * nbytes + 64 * MiB, systems=("kvstore", "rawte"))
        server = systems["kvstore"].others["server"]
        spy_log = out / "py-spy.log"
        with open(spy_log, "wb") as spy_out:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record",
                                    "--pid", str(server.pid), "--format", "raw",
                                    "--nonblocking", "-o", str(out / "kvstore-server.pyspy.txt")],
                                   stdout=spy_out, stderr=subprocess.STDOUT)
        stack.callback(_stop, spy)
        samples = Samples()
        for rep in range(reps):
            one_prompt(systems, samples, (layout, ntokens), layout, ntokens, rep)
        report = out / "kvstore-server.pyspy.txt"
        if _stop(spy) != 0:  # e.g. no ptrace permission: the workers' profiles still count
            print(f"py-spy on the server failed (exit {spy.returncode}): "
                  f"{spy_log.read_text(errors='replace')[-500:]}")
        elif not report.exists() or report.stat().st_size == 0:
            print("py-spy caught the server busy in none of its samples (too little work: "
                  "use more --reps or --tokens)")
        for name in systems:
            for op in ("put", "get"):
                row = samples.row((layout, ntokens, name, op), nbytes, 1)
                print(f"{name} {op}: {row['GB/s']:.3f} GB/s, p50 {row['p50 ms']:.1f} ms")
    print(f"profiles in {out}")


def _stop(spy: subprocess.Popen) -> int:
    """SIGINT makes py-spy write its report and exit; bounded, then killed."""
    if spy.poll() is None:
        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait(timeout=10)
    return spy.returncode


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="profile kvstore's two-node hot path")
    parser.add_argument("--layout", default="large", choices=sorted(LAYOUTS))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--out", default=str(results_dir() / "profile"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    profile(args.layout, args.tokens, args.reps, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
