"""A TE peer process for tests and benchmarks.

Creates a ``Transport``, allocates and registers one buffer, prints
``{"segment", "address", "nbytes", "pid"}`` as one JSON line on stdout, then serves
(TE works in its own threads) until stdin closes or the process is killed.

    python -m tests.integration.te_peer --nbytes 16MiB [--fill-seed 7] [--timeout-s 5]

``PeerProcess`` starts one from a test or benchmark and stops it by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np

from kvstore.core.config import parse_size
from kvstore.transport.te import Transport

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0


class PeerInfo(NamedTuple):
    segment: str
    address: int
    nbytes: int
    pid: int


class PeerProcess:
    """A running te_peer. ``kill()`` (SIGKILL, as a crash) or ``stop()`` (close stdin)."""

    def __init__(self, nbytes: int | str = "16MiB", fill_seed: int | None = None,
                 timeout_s: float | None = None, metadata: str | None = None,
                 name: str | None = None) -> None:
        cmd = [sys.executable, "-m", "tests.integration.te_peer", "--nbytes", str(nbytes)]
        for flag, value in (("--fill-seed", fill_seed), ("--timeout-s", timeout_s),
                            ("--metadata", metadata), ("--name", name)):
            if value is not None:
                cmd += [flag, str(value)]
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"),
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # stderr to a file, not a pipe: TE's log lines must never fill a pipe and block it.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in _close_pipes
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr)
        try:
            self.info = PeerInfo(**json.loads(self._first_line()))
        except BaseException:
            self.kill()
            raise

    def _first_line(self) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self._stderr.seek(0)
            tail = self._stderr.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"te_peer did not start within {START_TIMEOUT_S}s "
                               f"(exit code {self.proc.poll()}): {tail}")
        return line.decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._close_pipes()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close stdin (the peer exits cleanly); kill it if it lingers."""
        self._close_pipes()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout, self._stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--nbytes", default="16MiB")
    parser.add_argument("--timeout-s", type=float, default=None)
    parser.add_argument("--metadata", default="P2PHANDSHAKE")
    parser.add_argument("--name", default=None, help="segment name (metadata-server mode)")
    parser.add_argument("--fill-seed", type=int, default=None,
                        help="fill the buffer with seeded random bytes (default zeros)")
    args = parser.parse_args(argv)
    transport = Transport(args.host, metadata=args.metadata, timeout_s=args.timeout_s,
                          name=args.name)
    buf = transport.allocate_buffer(parse_size(args.nbytes))
    if args.fill_seed is not None:
        buf.array[:] = np.random.default_rng(args.fill_seed).integers(
            0, 256, len(buf.array), dtype=np.uint8)
    print(json.dumps({"segment": transport.segment, "address": buf.address,
                      "nbytes": len(buf.array), "pid": os.getpid()}), flush=True)
    sys.stdin.read()  # returns at EOF: the parent closed our stdin or died
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
