"""Processes of the two-node benchmark: workers driven over pipes, and the per-process
CPU time and peak memory the kernel keeps for each of them.

A ``WorkerProc`` is one tools/bench/cluster_worker.py process on a node; a
``SystemProcs`` is everything one system runs (servers, master, producer, consumer),
so the CPU time of an operation can be summed over every process that took part.
Each wait on a worker is bounded; a worker that dies or stalls fails the run with
the tail of its log.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, "-m", "tools.bench.cluster_worker"]
_TICK = os.sysconf("SC_CLK_TCK")


def worker_env() -> dict[str, str]:
    env = dict(os.environ, MC_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1")
    # TE gives up on a transfer after MC_TRANSFER_TIMEOUT seconds; a 4 GiB prompt
    # (32k tokens, large layout) at ~0.5 GB/s over veth TCP needs more than the default.
    env.setdefault("MC_TRANSFER_TIMEOUT", "120")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class WorkerError(RuntimeError):
    """A worker answered an error, died, or did not answer in time."""


class WorkerProc:
    # A start imports torch and starts TE: ~10 s here, over 60 s when the 2 cores run
    # a dozen other processes (a CI run beside real engines timed out at 60).
    def __init__(self, node, cfg: dict, log_path: Path, start_timeout: float = 180.0) -> None:
        self.name = f"{cfg['system']}-{cfg['role']}"
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = node.popen([*WORKER, json.dumps(cfg)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=self._log, cwd=REPO,
                               env=worker_env())
        self._read(start_timeout)  # {"ready": pid}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, cmd: dict, timeout: float = 300.0) -> dict:
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerError(f"{self.name} is gone: {self.tail()}") from None
        reply = self._read(timeout)
        if "error" in reply:
            raise WorkerError(f"{self.name} {cmd['op']}: {reply['error']}")
        return reply

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise WorkerError(f"{self.name}: no answer within {timeout:.0f}s "
                              f"(exit code {self.proc.poll()}): {self.tail()}")
        return json.loads(line)

    def tail(self, nbytes: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc.stdout.close()
        self._log.close()


# ------------------------------------------------------------ kernel accounting
def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), from /proc; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def peak_rss_mib(pid: int) -> float:
    """VmHWM (peak resident set, shared pages included) of ``pid`` in MiB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


@dataclass
class SystemProcs:
    """One system's processes. ``others``: the processes besides the two workers
    (kvstore-server, mooncake_master), for the CPU sums and the memory tables.
    ``get_options``: added to every get command (raw TE's transfer pattern; the
    raw-TE patterns are systems of their own that share one pair of workers)."""

    name: str
    producer: WorkerProc | None = None
    consumer: WorkerProc | None = None
    others: dict[str, subprocess.Popen] = field(default_factory=dict)
    get_options: dict = field(default_factory=dict)

    def pids(self) -> dict[str, int]:
        out = {k: p.pid for k, p in self.others.items()}
        for w in (self.producer, self.consumer):
            if w is not None:
                out[w.name.split("-", 1)[1]] = w.pid
        return out

    def cpu(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids().values())

    def timed(self, worker: WorkerProc, cmd: dict) -> tuple[dict, float]:
        """``worker.call(cmd)`` and the CPU seconds every process of the system spent."""
        before = self.cpu()
        reply = worker.call(cmd)
        return reply, self.cpu() - before

    def close(self) -> None:
        for w in (self.consumer, self.producer):
            if w is not None:
                w.close()

