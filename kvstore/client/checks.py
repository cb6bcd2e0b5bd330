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
threads); smaller ones are hashed by the reader as they land, as before.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

import numpy as np

from kvstore.core.hashing import checksum

log = logging.getLogger(__name__)

# Entries this large are hashed by the background thread (module doc).
BACKGROUND_MIN_ENTRY_BYTES = 256 << 10
HASHER_NICE = 19

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


def use_background(sizes: list[int]) -> bool:
    """Whether a read of entries of ``sizes`` hands any to ``LandedChecks``."""
    return any(n >= BACKGROUND_MIN_ENTRY_BYTES for n in sizes)


class LandedChecks:
    """The checks of one read into ``out``: ``landed(items)`` as entries arrive
    (``(start in out, entry)`` pairs), then ``finish()`` once the read has ended, or
    ``cancel()`` if it failed. An entry of ``BACKGROUND_MIN_ENTRY_BYTES`` or more is
    hashed once, by whoever claims it first; a smaller one at once, by the reader
    (``ChecksumError`` from ``corrupt``, as a read hashing entries as they land).
    Neither ``finish`` nor ``cancel`` waits for the thread: an entry it holds, the
    reader hashes again itself (a nice-19 thread may wait long for a core)."""

    def __init__(self, out: np.ndarray,
                 corrupt: Callable[[list], BaseException]) -> None:
        self._out: np.ndarray | None = out
        self._corrupt = corrupt
        self._items: list[tuple[int, list]] = []
        self._next = 0  # the first item nobody has claimed
        self._held: set[int] = set()  # claimed by the thread, not done
        self._bad: tuple[int, list] | None = None  # the first item found corrupt
        self._cond = threading.Condition()

    def landed(self, items: list[tuple[int, list]]) -> None:
        large = []
        for item in items:
            if item[1][_NBYTES] < BACKGROUND_MIN_ENTRY_BYTES:
                if not self._matches(self._out, item):
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
        over). ``thread``: the hashing thread, whose item in hand ``finish`` may
        hash again; else the reader."""
        while True:
            with self._cond:
                out = self._out
                if out is None or self._bad is not None or self._next >= len(self._items):
                    return
                at = self._next
                item = self._items[at]
                self._next += 1
                if thread:
                    self._held.add(at)
            ok = self._matches(out, item)
            with self._cond:
                self._held.discard(at)
                if not ok and self._bad is None and self._out is not None:
                    self._bad = item

    def finish(self) -> tuple[int, list] | None:
        """Hash what the thread has not reached, and what it holds; the first item
        found corrupt (None: every entry matched). The read's memory is let go."""
        self.work(thread=False)
        with self._cond:
            out, held = self._out, [self._items[i] for i in sorted(self._held)]
        bad = next((item for item in held if not self._matches(out, item)), None)
        with self._cond:
            bad = self._bad or bad
            self._out, self._items = None, []
        return bad

    def cancel(self) -> None:
        """The read failed: nothing more is claimed, the read's memory let go (the
        thread's entry in hand is abandoned: its verdict is never read)."""
        with self._cond:
            self._out, self._items = None, []

    @staticmethod
    def _matches(out: np.ndarray | None, item: tuple[int, list]) -> bool:
        start, entry = item
        try:
            return out is not None and \
                checksum(out[start:start + entry[_NBYTES]]) == entry[_CHECKSUM]
        except Exception:  # noqa: BLE001 - counted as a mismatch, never lost
            return False
