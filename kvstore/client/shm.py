"""Same-node copies between a client's memory and the server's shared DRAM arena,
with the checksums computed on the way (kvstore.client.datapath's same-node path).

Checksums are per entry (xxh3_64, ``kvstore.core.hashing.checksum``) and always taken
from the caller's side of the copy, right after copying, while the bytes are still
in cache: the client's checksum at insert, the verification at drop_select.

Where the client's C extension was built with xxhash.h (``SCATTER`` / ``GATHER``,
kvstore/client/_ntcopy.c), one call copies and hashes all of a thread's entries,
chunk by chunk, without the GIL. Side by side with the loops below (``python -m
tools.bench.parts --compare-loops``; docs/benchmarks.md, "Copying and hashing in one
pass"), an 8 MiB insert of 64 KiB entries spent 1.22 - 1.44 ms in its copy against
1.47 - 1.61, an 8 MiB drop_select 0.96 - 1.03 ms against 1.40 - 1.64, a 128 MiB
insert of 2 MiB entries 8.0 - 9.7 ms against 11.5 - 12.0; at 2 MiB the gain is
within the noise. Since nothing holds the GIL, entries of any size then go to two
threads from ``PARALLEL_MIN_BYTES``. What follows describes the Python loops, used
where the extension or its hashing is missing.

Reading, entries that are neighbours in the arena (a prompt's 64 KiB blocks,
reserved back to back) land back to back in the output, so they are copied as one
run of up to ``RUN_BYTES`` and then verified entry by entry: one slice copy per run
instead of per entry (a micro-benchmark of 2 048 x 64 KiB: 16.4 ms against 19.5 ms
entry by entry). An entry larger than ``PIECE_BYTES`` is copied and hashed piece by
piece (one streaming xxh3 per entry, the same digest), so each piece is hashed while
it is still in cache: 128 x 2 MiB into the shared arena on two threads, 15.3 - 16.2
GB/s whole against 18.0 - 18.5 GB/s in 256 KiB pieces, side by side (an ad-hoc loop
over ``copy_in``; an earlier one-thread measurement had found pieces slower).

From ``PARALLEL_MIN_BYTES`` on, entries of ``PARALLEL_MIN_ENTRY_BYTES`` or more are
split into ``COPY_THREADS`` groups of about equal bytes, copied and hashed by that
many threads at once (numpy's copy and xxh3 of a large buffer both release the GIL):
256 MiB of 2 MiB entries into a shared mapping went from 5.0 - 5.8 GB/s on one thread
to 8.9 - 9.5 GB/s on two, on this 2-core machine (``python -m tools.bench.parts
--path shm`` shows it in a whole insert). Smaller entries stay on one thread: the
xxhash binding holds the GIL for inputs below ~256 KiB (two threads hashing 64 - 192
KiB buffers took 1.2 - 1.4x one thread's time, 256 KiB - 1 MiB ones 0.7 - 0.8x), so
a second thread mostly waits for the first: ``copy_in`` of 512 x 64 KiB took 5.6 ms
on one thread against 6.5 - 6.9 ms on two, of 2 048 x 64 KiB 21.6 against 23.0
(docs/benchmarks.md, "Answering first").
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstore.core.errors import ConfigError
from kvstore.core.hashing import checksum, checksummer

# Small enough that a run is still in a core's L2 (1 MiB here) when its entries are hashed.
RUN_BYTES = 1 << 20
# An entry larger than this is copied and hashed in pieces of this size.
PIECE_BYTES = 256 << 10

# Wire layout of placements / entries (kvstore.server.handlers): tier, offset, nbytes, ...
_OFFSET, _NBYTES = 1, 2

# Copies at least this large use COPY_THREADS threads (below it, handing work to a
# thread costs about what it saves).
PARALLEL_MIN_BYTES = 4 << 20
# ... of entries this large on average (below, hashing an entry holds the GIL).
PARALLEL_MIN_ENTRY_BYTES = 256 << 10
COPY_THREADS = max(1, min(2, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="kvstore-copy")
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist here, but the pool
    thinks they do (work handed to it would never run). Start afresh."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _groups(sizes: Sequence[int], threads: int, native: bool = False
            ) -> list[tuple[int, int]]:
    """``[lo, hi)`` index ranges, in order, of about equal bytes each: one per thread
    (fewer when there are fewer items), or one range below PARALLEL_MIN_BYTES in all
    or, unless ``native`` (the extension hashes without the GIL), below
    PARALLEL_MIN_ENTRY_BYTES per item."""
    total = sum(sizes)
    n = min(threads, len(sizes))
    small = not native and total < PARALLEL_MIN_ENTRY_BYTES * len(sizes)
    if n <= 1 or total < PARALLEL_MIN_BYTES or small:
        return [(0, len(sizes))]
    bounds: list[tuple[int, int]] = []
    acc = lo = 0
    for i, size in enumerate(sizes):
        acc += size
        if len(bounds) < n - 1 and acc >= total * (len(bounds) + 1) / n and i + 1 < len(sizes):
            bounds.append((lo, i + 1))
            lo = i + 1
    bounds.append((lo, len(sizes)))
    return bounds


def _in_parallel(work: Callable[..., object], groups: Sequence[tuple[int, ...]]) -> list:
    """``work(*group)`` for every group (``(lo, hi)``, and what else the work takes):
    the first on this thread, the rest on the pool;
    their results in group order. The first error raised is raised here, after every
    group has finished (none is left writing into the caller's memory)."""
    if len(groups) == 1:
        return [work(*groups[0])]
    futures = [_executor().submit(work, *group) for group in groups[1:]]
    first_error: BaseException | None = None
    try:
        results = [work(*groups[0])]
    except BaseException as exc:  # noqa: BLE001 - re-raised below, once the pool is done
        first_error, results = exc, [None]
    for future in futures:
        try:
            results.append(future.result())
        except BaseException as exc:  # noqa: BLE001
            first_error = first_error or exc
            results.append(None)
    if first_error is not None:
        raise first_error
    return results


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


def _native() -> Any:
    """``kvstore.client._ntcopy`` where it was built (pyproject's ext-modules: an
    optional C extension), else None."""
    try:
        return importlib.import_module("kvstore.client._ntcopy")
    except ImportError:
        return None


_NATIVE = _native()
# Copies into the arena with non-temporal stores, the GIL released (None: not built).
# The arena is written here and read by the server and other processes, never again by
# this copy: a plain copy first pulls each destination line into the cache.
STREAM: Callable[[Any, Any], None] | None = getattr(_NATIVE, "copy", None)
# Many entries copied and hashed in one call, chunk by chunk, the GIL released
# (None: the extension was built without xxhash.h, or not at all). ``copy_in`` and a
# verified ``copy_out`` use them where they exist; Python's loops otherwise.
SCATTER: Callable[..., list[int]] | None = getattr(_NATIVE, "scatter", None)
GATHER: Callable[..., list[int]] | None = getattr(_NATIVE, "gather", None)
# A prompt's entries, back to back in one buffer, laid out page by page from a place
# in the arena and copied and hashed in one call (``copy_run``; None: not built).
SCATTER_RUN: Callable[..., tuple[list[int], list[int]]] | None = \
    getattr(_NATIVE, "scatter_run", None)
# Many entries of one buffer hashed in one call, the GIL released (kvstore.client.checks).
HASHES: Callable[..., list[int]] | None = getattr(_NATIVE, "hashes", None)
# A stream door reply received and its entries hashed as they land, in one call, the
# GIL released (kvstore.client.local, ``_Incoming.read_hashed``).
RECV_HASHED: Callable[..., tuple[int, list[int], str]] | None = \
    getattr(_NATIVE, "recv_hashed", None)
# A prompt's keys and block token bytes in one call (``hashing.prompt_blocks``'s
# ``native``: the client passes it in; None where not built).
PROMPT_KEYS: Callable[..., tuple[list[bytes], list[bytes], int] | None] | None = \
    getattr(_NATIVE, "prompt_keys", None)


@contextlib.contextmanager
def python_loops() -> Iterator[None]:
    """This process's copies without ``SCATTER`` / ``GATHER`` while inside: Python's
    loops, each entry copied (streamed with ``STREAM`` where asked and built) and then
    hashed by the xxhash binding, as before the one-pass calls. For tests and
    side-by-side measurements (``tools.bench.parts --compare-loops``); not for use
    while other threads copy."""
    global SCATTER, GATHER
    saved = SCATTER, GATHER
    SCATTER = GATHER = None
    try:
        yield
    finally:
        SCATTER, GATHER = saved


def _assign(dst: np.ndarray, src: np.ndarray) -> None:
    dst[...] = src


def copy_in(shm: np.ndarray, bufs: list[np.ndarray], placements: list[list],
            threads: int | None = None, stream: bool = True) -> list[int]:
    """Copy each buffer to its placement's offset in ``shm``; their checksums, of the
    caller's bytes. One copy per entry: proving two caller buffers adjacent costs ~1 us
    per buffer (numpy's address lookup), as much as merging saved. ``threads``: at most
    this many copy at once (default ``COPY_THREADS``), from ``PARALLEL_MIN_BYTES``.
    ``stream``: with non-temporal stores where ``STREAM`` exists (numpy's copy
    otherwise)."""
    scatter = SCATTER  # (built in the same extension as STREAM)
    put = STREAM if stream and STREAM is not None else _assign

    def work(lo: int, hi: int) -> list[int]:
        if scatter is not None:
            part = placements[lo:hi]
            return scatter(shm, [pl[_OFFSET] for pl in part], [pl[_NBYTES] for pl in part],
                           bufs[lo:hi], stream)
        sums: list[int] = []
        for buf, pl in zip(bufs[lo:hi], placements[lo:hi]):
            offset, nbytes = pl[_OFFSET], pl[_NBYTES]
            if nbytes <= PIECE_BYTES:
                put(shm[offset:offset + nbytes], buf)
                sums.append(checksum(buf))
                continue
            summer = checksummer()
            for at in range(0, nbytes, PIECE_BYTES):
                piece = buf[at:at + PIECE_BYTES]
                put(shm[offset + at:offset + at + piece.size], piece)
                summer.update(piece.data)
            sums.append(summer.intdigest())
        return sums

    groups = _groups([pl[_NBYTES] for pl in placements], threads or COPY_THREADS,
                     scatter is not None)
    return [s for part in _in_parallel(work, groups) for s in part]


def copy_run(shm: np.ndarray, start: int, data: np.ndarray, page: int, sizes: list[int],
             threads: int | None = None, stream: bool = True
             ) -> tuple[list[int], list[int]] | None:
    """The entries of ``sizes``, back to back in ``data`` (1-D uint8, exactly their
    bytes, else ``ValueError``), copied into ``shm`` from ``start`` on, each its size
    rounded up to a multiple of ``page`` after the one before (a writer's room,
    ``_room_layout`` in the client); returns their offsets from ``start`` and their
    checksums. Every entry must fit ``shm`` (``ValueError``, nothing copied).
    ``copy_in``'s work without a view and a placement per entry: one ``SCATTER_RUN``
    per thread's share (``threads`` as for ``copy_in``). None, nothing copied, where
    the extension does not have it (or ``python_loops`` is on): the caller then uses
    ``copy_in``."""
    run = SCATTER_RUN
    if run is None or SCATTER is None:
        return None
    if data.ndim != 1 or data.dtype != np.uint8 or data.nbytes != sum(sizes):
        raise ValueError(f"copy_run: entries of {sum(sizes)} bytes from a {data.dtype} "
                         f"array of shape {data.shape}: needs their bytes as one uint8 run")
    groups = _groups(sizes, threads or COPY_THREADS, True)
    if len(groups) == 1:
        return run(shm, start, data, page, sizes, stream)
    # Each share: its entries, its first byte in ``data``, its first entry's place.
    shares, src, dst = [], 0, 0
    for lo, hi in groups:
        shares.append((lo, hi, src, dst))
        for n in sizes[lo:hi]:
            src += n
            dst += -(-n // page) * page

    def work(lo: int, hi: int, a: int, d: int) -> tuple[list[int], list[int]]:
        part = sizes[lo:hi]
        offs, sums = run(shm, start + d, data[a:a + sum(part)], page, part, stream)
        return [d + o for o in offs], sums

    done = _in_parallel(work, shares)
    return [o for offs, _ in done for o in offs], [s for _, sums in done for s in sums]


def copy_out(shm: np.ndarray, out: np.ndarray, items: list[tuple[int, list]],
             verify: bool, threads: int | None = None) -> int | None:
    """Copy each entry from ``shm`` to its ``(start, entry)`` position in ``out``.
    ``verify``: returns the index in ``items`` of the first entry whose bytes do not
    match the checksum it was stored with (entry field 4), copying no further in its
    thread's share (``GATHER`` copies the whole share first); None when all match (or
    not verifying). ``threads``: as for
    ``copy_in``."""
    gather = GATHER if verify else None

    def work(first: int, end: int) -> int | None:
        part = items[first:end]
        if gather is not None:
            sums = gather(out, [start for start, _ in part], shm,
                          [e[_OFFSET] for _, e in part], [e[_NBYTES] for _, e in part])
            return next((first + i for i, (got, (_, e)) in enumerate(zip(sums, part))
                         if got != e[4]), None)
        for lo, hi in _run_bounds(len(part), lambda i: _adjacent_out(part, i)):
            dst, entry = part[lo][0], part[lo][1]
            nbytes = part[hi - 1][0] + part[hi - 1][1][_NBYTES] - dst
            if verify and hi - lo == 1 and nbytes > PIECE_BYTES:  # one large entry
                if _copy_checked(shm[entry[_OFFSET]:entry[_OFFSET] + nbytes],
                                 out[dst:dst + nbytes]) != entry[4]:
                    return first + lo
                continue
            out[dst:dst + nbytes] = shm[entry[_OFFSET]:entry[_OFFSET] + nbytes]
            if verify:
                for i in range(lo, hi):
                    start, e = part[i]
                    if checksum(out[start:start + e[_NBYTES]]) != e[4]:
                        return first + i
        return None

    groups = _groups([e[_NBYTES] for _, e in items], threads or COPY_THREADS,
                     gather is not None)
    bad = [i for i in _in_parallel(work, groups) if i is not None]
    return min(bad) if bad else None


def _copy_checked(src: np.ndarray, dst: np.ndarray) -> int:
    """Copy ``src`` to ``dst`` piece by piece; the checksum of what landed."""
    summer = checksummer()
    for at in range(0, src.size, PIECE_BYTES):
        dst[at:at + PIECE_BYTES] = src[at:at + PIECE_BYTES]
        summer.update(dst[at:at + PIECE_BYTES].data)
    return summer.intdigest()


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
