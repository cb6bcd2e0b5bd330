"""Raw Transfer Engine throughput between two processes, against numpy memcpy.

``bench_raw_te(nbytes_total, block_bytes, repeats)`` spawns a TE peer process
(tests/integration/te_peer.py), sends ``nbytes_total`` as ``block_bytes`` blocks,
one TE entry per block (``merge=False``: what TE itself costs per transfer), and
returns plain numbers; the project benchmark (tools/bench/__init__.py) reuses it.

    python -m tools.bench.te [--total 64MiB] [--blocks 4KiB,64KiB,1MiB,16MiB] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np

from kvstore.core.config import format_size, parse_size
from kvstore.transport.te import Transport
from tests.integration.te_peer import PeerProcess

DEFAULT_BLOCKS = ("4KiB", "64KiB", "1MiB", "16MiB")


def bench_raw_te(nbytes_total: int, block_bytes: int, repeats: int = 3) -> dict:
    """Median GB/s of TE batch write / read (one entry per block), of the same
    blocks coalesced into one transfer, and of a numpy copy of the same bytes."""
    if not 0 < block_bytes <= nbytes_total or repeats < 1:
        raise ValueError("need 0 < block_bytes <= nbytes_total and repeats >= 1")
    nblocks = nbytes_total // block_bytes
    nbytes = nblocks * block_bytes
    with PeerProcess(nbytes) as peer, Transport() as te:
        buf = te.allocate_buffer(2 * nbytes)
        src, dst = buf.array[:nbytes], buf.array[nbytes:]
        src[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        offsets = np.arange(nblocks, dtype=np.int64) * block_bytes
        lengths = np.full(nblocks, block_bytes, dtype=np.int64)
        local, remote = buf.address + offsets, peer.info.address + offsets
        seg = peer.info.segment
        te.write(seg, local, remote, lengths, merge=False)  # warm-up: handshake, connections
        write_s = _times(repeats, lambda: te.write(seg, local, remote, lengths, merge=False))
        read_s = _times(repeats, lambda: te.read(seg, local + nbytes, remote, lengths,
                                                 merge=False))
        if not np.array_equal(src, dst):
            raise RuntimeError("TE read-back differs from what was written")
        merged_s = _times(repeats, lambda: te.write(seg, local, remote, lengths))
        copy_s = _times(repeats, lambda: np.copyto(dst, src))
    return {
        "nbytes": nbytes, "block_bytes": block_bytes, "blocks": nblocks, "repeats": repeats,
        "write_gbps": _gbps(nbytes, write_s), "read_gbps": _gbps(nbytes, read_s),
        "coalesced_write_gbps": _gbps(nbytes, merged_s), "memcpy_gbps": _gbps(nbytes, copy_s),
        "write_s": write_s, "read_s": read_s, "coalesced_write_s": merged_s, "memcpy_s": copy_s,
    }


def _times(repeats: int, fn) -> float:
    """Median wall time of ``repeats`` calls."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def format_table(rows: list[dict]) -> str:
    head = (f"{'block':>8} {'blocks':>7} {'TE write':>9} {'TE read':>9} "
            f"{'coalesced':>10} {'memcpy':>8}   (GB/s, median)")
    lines = [head]
    for r in rows:
        lines.append(f"{format_size(r['block_bytes']):>8} {r['blocks']:>7} "
                     f"{r['write_gbps']:>9.3f} {r['read_gbps']:>9.3f} "
                     f"{r['coalesced_write_gbps']:>10.3f} {r['memcpy_gbps']:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="raw TE throughput between two processes")
    parser.add_argument("--total", default="64MiB")
    parser.add_argument("--blocks", default=",".join(DEFAULT_BLOCKS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    total = parse_size(args.total)
    rows = [bench_raw_te(total, parse_size(b), args.repeats) for b in args.blocks.split(",")]
    print(f"TE over TCP, {format_size(total)} per run, one TE entry per block")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
