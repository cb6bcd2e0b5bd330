"""Same-node copies between a client's memory and the server's shared DRAM arena,
with the checksums computed on the way (kvstore.client.datapath's same-node path).

Checksums are per entry (xxh3_64, ``kvstore.core.hashing.checksum``) and always taken
from the caller's side of the copy, right after copying, while the bytes are still
in cache: the client's checksum at insert, the verification at drop_select.

Reading, entries that are neighbours in the arena (a prompt's 64 KiB blocks,
reserved back to back) land back to back in the output, so they are copied as one
run of up to ``RUN_BYTES`` and then verified entry by entry: one slice copy per run
instead of per entry (a micro-benchmark of 2 048 x 64 KiB: 16.4 ms against 19.5 ms
entry by entry). An entry larger than ``RUN_BYTES`` is copied whole: copying 2 MiB
entries in 256 KiB pieces, each hashed after its copy, measured slower on the arena.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import numpy as np

from kvstore.core.errors import ConfigError
from kvstore.core.hashing import checksum

# Small enough that a run is still in a core's L2 (1 MiB here) when its entries are hashed.
RUN_BYTES = 1 << 20

# Wire layout of placements / entries (kvstore.server.handlers): tier, offset, nbytes, ...
_OFFSET, _NBYTES = 1, 2


def map_shared(path: str, nbytes: int) -> np.ndarray:
    """Map the first ``nbytes`` of a server's shared DRAM arena, writable, in a client
    process. The mapping lives as long as the returned array (or views of it)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise ConfigError(f"cannot open shared DRAM arena {path}: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if nbytes <= 0 or nbytes > size:
            raise ConfigError(f"shared DRAM arena {path} has {size} bytes, asked for {nbytes}")
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


def copy_in(shm: np.ndarray, bufs: list[np.ndarray], placements: list[list]) -> list[int]:
    """Copy each buffer to its placement's offset in ``shm``; their checksums. One
    copy per entry: proving two caller buffers adjacent costs ~1 us per buffer
    (numpy's address lookup), as much as merging saved."""
    sums: list[int] = []
    for buf, pl in zip(bufs, placements):
        shm[pl[_OFFSET]:pl[_OFFSET] + pl[_NBYTES]] = buf
        sums.append(checksum(buf))
    return sums


def copy_out(shm: np.ndarray, out: np.ndarray, items: list[tuple[int, list]],
             verify: bool) -> int | None:
    """Copy each entry from ``shm`` to its ``(start, entry)`` position in ``out``.
    ``verify``: returns the index in ``items`` of the first entry whose bytes do not
    match the checksum it was stored with (entry field 4), copying no further; None
    when all match (or not verifying)."""
    for lo, hi in _run_bounds(len(items), lambda i: _adjacent_out(items, i)):
        dst, entry = items[lo][0], items[lo][1]
        nbytes = items[hi - 1][0] + items[hi - 1][1][_NBYTES] - dst
        out[dst:dst + nbytes] = shm[entry[_OFFSET]:entry[_OFFSET] + nbytes]
        if verify:
            for i in range(lo, hi):
                start, e = items[i]
                if checksum(out[start:start + e[_NBYTES]]) != e[4]:
                    return i
    return None


def _run_bounds(n: int, adjacent: Callable[[int], int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs: item i joins the run before it when ``adjacent(i)`` gives
    its size (> 0) and the run stays within RUN_BYTES."""
    runs: list[tuple[int, int]] = []
    lo, size = 0, 0
    for i in range(n):
        nbytes = adjacent(i)
        if nbytes > 0 and size + nbytes <= RUN_BYTES:
            size += nbytes
            continue
        if i:
            runs.append((lo, i))
        lo, size = i, abs(nbytes)
    if n:
        runs.append((lo, n))
    return runs


def _adjacent_out(items: list[tuple[int, list]], i: int) -> int:
    """Entry i's size if it follows entry i - 1 in the arena and in the output."""
    start, e = items[i]
    if i == 0:
        return -e[_NBYTES]
    prev_start, prev = items[i - 1]
    ok = (prev[_OFFSET] + prev[_NBYTES] == e[_OFFSET]
          and prev_start + prev[_NBYTES] == start)
    return e[_NBYTES] if ok else -e[_NBYTES]
