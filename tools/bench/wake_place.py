"""Where the kernel wakes a reader of a large TCP reply: beside its sender, or apart.

    python -m tools.bench.wake_place [--mib 2,8] [--reps 80] [--idle-ms 30]

Two processes on loopback, as a stream door reply crosses the transfer benchmark's
two namespaces on this machine (one kernel): the reader sends one byte; the sender,
asleep in ``poll`` until then, answers with a 5 000-byte header and ``--mib`` MiB in
one non-blocking ``sendmsg`` (the rest on ``POLLOUT``), as kvstore-server's door
does; the reader takes the first bytes with one ``recv`` (up to 64 KiB: the
header's arrival) and the rest with ``MSG_WAITALL``. Each size runs twice: ``free``
(the scheduler places both processes) and ``apart`` (the sender on the first CPU
this process may use, the reader on the second). Prints the median ms from the
request to the header, and to the last byte, of each, after ``--idle-ms`` asleep
before every round, as the benchmark's processes idle between gets.

A wake-up by a socket's data is a "sync" wake-up: the kernel may run the woken
reader on the waker's CPU, expecting the waker to sleep soon. A sender in the middle
of a large ``sendmsg`` does not, and the reader waits for it instead of copying
beside it. Across two machines this cannot happen; here it decides a small get.
Needs two CPUs.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]  # the sender runs as ``-m`` from here
HEADER = 5000
MODES = ("free", "apart")


def _serve(port: int, nbytes: int, cpu: int | None) -> None:
    """The sender: one reply per request byte, until the reader closes."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    data = memoryview(os.urandom(nbytes))
    head = memoryview(b"h" * HEADER)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while True:
        poller.poll()
        if not sock.recv(1):
            return
        out = [head, data]
        while out:
            try:
                sent = sock.sendmsg(out, (), socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            while sent:
                if sent >= len(out[0]):
                    sent -= len(out.pop(0))
                else:
                    out[0], sent = out[0][sent:], 0
            if out:
                select.select([], [sock], [])


def _cpus() -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("wake_place needs two CPUs to place the processes apart")
    return cpus


def measure(nbytes: int, mode: str, reps: int, idle_s: float) -> tuple[float, float]:
    """Median seconds from the request to the header and to the last byte."""
    cpus = _cpus()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    mine = os.sched_getaffinity(0)
    argv = [sys.executable, "-m", "tools.bench.wake_place", "--serve",
            str(listener.getsockname()[1]), str(nbytes)]
    if mode == "apart":
        argv.append(str(cpus[0]))
    proc = subprocess.Popen(argv, cwd=REPO)
    conn = None
    try:
        listener.settimeout(30)
        conn, _ = listener.accept()
        conn.settimeout(30)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if mode == "apart":
            os.sched_setaffinity(0, {cpus[1]})
        buf = bytearray(HEADER + nbytes)
        view = memoryview(buf)
        heads, wholes = [], []
        for _ in range(reps):
            time.sleep(idle_s)
            start = time.perf_counter()
            conn.send(b"x")
            got = conn.recv_into(buf, 65536)
            head = time.perf_counter()
            while got < len(buf):
                n = conn.recv_into(view[got:], len(buf) - got, socket.MSG_WAITALL)
                if not n:
                    raise RuntimeError("the sender closed the connection")
                got += n
            heads.append(head - start)
            wholes.append(time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, mine)
        if conn is not None:
            conn.close()  # the sender's poll sees the close: it ends
        listener.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return statistics.median(heads), statistics.median(wholes)


def run(sizes_mib: list[float], reps: int, idle_s: float) -> dict[float, dict[str, tuple]]:
    """{size in MiB: {mode: (header s, whole s)}}: each size's modes one after the
    other, each in a sender process of its own."""
    return {mib: {mode: measure(int(mib * MiB), mode, reps, idle_s) for mode in MODES}
            for mib in sizes_mib}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        _serve(int(argv[1]), int(argv[2]), int(argv[3]) if len(argv) > 3 else None)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", default="2,8", help="reply sizes in MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=80)
    ap.add_argument("--idle-ms", type=float, default=30.0)
    args = ap.parse_args(argv)
    sizes = [float(x) for x in args.mib.split(",")]
    result = run(sizes, args.reps, args.idle_ms / 1e3)
    print(f"{'MiB':>6}  {'placed':>6}  {'header ms':>9}  {'whole ms':>8}")
    for mib, modes in result.items():
        for mode, (head, whole) in modes.items():
            print(f"{mib:>6g}  {mode:>6}  {head * 1e3:>9.3f}  {whole * 1e3:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
