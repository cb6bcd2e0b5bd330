"""Verifying a TE read's large entries on a low-priority thread while the rest of the
read is on the wire.

A reader hashes every entry it receives (xxh3_64) against the checksum it was stored
with. Hashing each entry as soon as all of it has landed, on the thread that waits
for the read, overlaps the hash with the transfer where a core is free for it; where
none is (a TE transfer over TCP keeps the kernel's copies and TE's threads busy on
both ends), the hash takes CPU from the transfer it waits for, and the read comes
out later by more than the hash took: on this project's two-core benchmark machine
a TE get of 128 MiB - 256 MiB of 2 MiB entries took 15 - 33 % longer verified than
unverified (``python -m tools.bench.verify_cost --nodes netns``; docs/benchmarks.md,
"What verifying costs a TE read").

``LandedChecks`` hands each landed entry to one hashing thread per process that runs
at the lowest CPU priority (nice 19): it hashes while a core is idle and yields to
TE's threads and the kernel when none is. What it has not reached when the read
ends (the entry the thread holds included: the reader never waits for it), the
reader hashes itself, at its own priority (``finish``), so a busy machine delays the
check by at most the hashing left. Only entries of ``BACKGROUND_MIN_ENTRY_BYTES`` or
more go to the thread: the xxhash binding lets go of the GIL for those, while for
smaller ones it holds it, and a thread at nice 19 preempted with the GIL held would
stall the reader's thread (kvstore.client.shm has the same rule for its copy
threads); smaller ones are hashed by the reader as they land, as before. Where the
client's C extension has ``hashes`` (built with xxhash.h), every entry goes to the
thread whatever its size: it hashes up to ``BATCH_BYTES`` of landed entries in one
call that holds no GIL, so small entries (64 KiB) are no more GIL-bound than large
ones (``HASHES``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import cast

import numpy as np

from kvstore.client.shm import HASHES
from kvstore.core.hashing import checksum

log = logging.getLogger(__name__)

# Entries this large are hashed by the background thread (module doc); with
# ``HASHES``, entries of any size.
BACKGROUND_MIN_ENTRY_BYTES = 256 << 10
HASHER_NICE = 19
# With ``HASHES``, one claim takes landed entries up to this many bytes (at least one
# entry): one call for many small entries, and little for the reader to hash again
# when the read ends while the thread holds a claim.
BATCH_BYTES = 1 << 20

# Wire layout of entries (kvstore.server.handlers): tier, offset, nbytes, address, checksum.
_NBYTES, _CHECKSUM = 2, 4

_jobs: queue.SimpleQueue | None = None
_start_lock = threading.Lock()


def _hasher_queue() -> queue.SimpleQueue:
    """The hashing thread's queue; the thread is started on first use."""
    global _jobs
    with _start_lock:
        if _jobs is None:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_hasher, args=(jobs,), name="kvstore-verify",
                             daemon=True).start()
            _jobs = jobs
        return _jobs


def _hasher(jobs: queue.SimpleQueue) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HASHER_NICE)
    except (OSError, AttributeError):  # then it runs at the process's priority
        pass
    while True:
        job = jobs.get()
        try:
            job.work()
        except Exception:  # noqa: BLE001 - the thread must live on (work never raises)
            log.exception("background checksum thread: a check failed")


def _forget_hasher() -> None:
    """In a forked child the parent's thread does not exist: start afresh."""
    global _jobs, _start_lock
    _jobs, _start_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_hasher)


def _background_min() -> int:
    return 0 if HASHES is not None else BACKGROUND_MIN_ENTRY_BYTES


def use_background(sizes: list[int]) -> bool:
    """Whether a read of entries of ``sizes`` hands any to ``LandedChecks``."""
    least = _background_min()
    return any(n >= least for n in sizes)


def first_bad(out: np.ndarray, items: list[tuple[int, list]]) -> int | None:
    """The index in ``items`` (``(start in out, entry)`` pairs) of the first entry whose
    bytes in ``out`` do not match the checksum it was stored with; None if all do. One
    call without the GIL where ``HASHES`` exists, else entry by entry."""
    if HASHES is not None and items:
        try:
            sums = HASHES(out, [start for start, _ in items],
                          [e[_NBYTES] for _, e in items])
        except Exception:  # noqa: BLE001 - (an entry outside ``out``): one by one below
            sums = None
        if sums is not None:
            return next((i for i, (got, (_, e)) in enumerate(zip(sums, items))
                         if got != e[_CHECKSUM]), None)
    for i, (start, e) in enumerate(items):
        n = e[_NBYTES]
        try:
            if start + n > out.size or checksum(out[start:start + n]) != e[_CHECKSUM]:
                return i
        except Exception:  # noqa: BLE001 - counted as a mismatch, never lost
            return i
    return None


class LandedChecks:
    """The checks of one read into ``out``: ``landed(items)`` as entries arrive
    (``(start in out, entry)`` pairs), then ``finish()`` once the read has ended, or
    ``cancel()`` if it failed. An entry the thread takes (module doc) is hashed once,
    by whoever claims it first; a smaller one at once, by the reader
    (``ChecksumError`` from ``corrupt``, as a read hashing entries as they land).
    Neither ``finish`` nor ``cancel`` waits for the thread: what it holds, the
    reader hashes again itself (a nice-19 thread may wait long for a core)."""

    def __init__(self, out: np.ndarray,
                 corrupt: Callable[[list], BaseException]) -> None:
        self._out: np.ndarray | None = out
        self._corrupt = corrupt
        self._items: list[tuple[int, list]] = []
        self._next = 0  # the first item nobody has claimed
        self._held: tuple[int, int] | None = None  # items the thread claimed, not done
        self._bad: tuple[int, list] | None = None  # the first item found corrupt
        self._cond = threading.Condition()
        self._least = _background_min()

    def landed(self, items: list[tuple[int, list]]) -> None:
        large = []
        for item in items:
            if item[1][_NBYTES] < self._least:
                if first_bad(cast(np.ndarray, self._out), [item]) is not None:
                    raise self._corrupt(item[1])
            else:
                large.append(item)
        if not large:
            return
        with self._cond:
            if self._out is None:
                raise RuntimeError("entries landed after their read was finished")
            self._items.extend(large)
        _hasher_queue().put(self)

    def work(self, thread: bool = True) -> None:
        """Hash unclaimed items until none is left (or one is bad, or the read is
        over), a claim of up to ``BATCH_BYTES`` at a time (one item without
        ``HASHES``). ``thread``: the hashing thread, whose claim in hand ``finish`` may
        hash again; else the reader."""
        batch = BATCH_BYTES if HASHES is not None else 0
        while True:
            with self._cond:
                out = self._out
                if out is None or self._bad is not None or self._next >= len(self._items):
                    return
                first = end = self._next
                nbytes = 0
                while end < len(self._items) and (end == first or nbytes < batch):
                    nbytes += self._items[end][1][_NBYTES]
                    end += 1
                self._next = end
                claim = self._items[first:end]
                if thread:
                    self._held = (first, end)
            bad = first_bad(out, claim)
            with self._cond:
                if thread:
                    self._held = None
                if bad is not None and self._bad is None and self._out is not None:
                    self._bad = claim[bad]

    def finish(self) -> tuple[int, list] | None:
        """Hash what the thread has not reached, and what it holds; the first item
        found corrupt (None: every entry matched). The read's memory is let go."""
        self.work(thread=False)
        with self._cond:
            out = self._out
            held = [] if self._held is None or self._bad is not None else \
                self._items[self._held[0]:self._held[1]]
        at = first_bad(cast(np.ndarray, out), held) if held else None
        with self._cond:
            bad = self._bad or (None if at is None else held[at])
            self._out, self._items = None, []
        return bad

    def cancel(self) -> None:
        """The read failed: nothing more is claimed, the read's memory let go (the
        thread's claim in hand is abandoned: its verdict is never read)."""
        with self._cond:
            self._out, self._items = None, []
