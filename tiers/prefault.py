"""Faulting in a mapping's pages ahead of use, in the background.

A page of the DRAM arena that a process has not touched yet costs a page fault the
first time that process copies into it or out of it, TE's send from it included:
~1 us per 4 KiB page here, which doubles the cost of a same-node insert of 32 MiB
into a fresh part of the arena (14.4 ms against 6.3 ms warm; ``python -m
tools.bench.prefault`` measures it). ``/dev/shm`` pages reserved by
``posix_fallocate`` are not mapped in any process until touched, so without this
each process (the server, every same-node client) pays it once per page, on its
hot path, for as long as it takes to touch the whole arena.

``Prefault`` asks the kernel to map every page of a range (``madvise`` with
``MADV_POPULATE_WRITE``, Linux 5.14+) in ``CHUNK_BYTES`` steps from a daemon thread
at the lowest CPU priority. The call goes through ctypes, which lets go of the GIL,
so the process's other threads run meanwhile. Steps are small (4 MiB, ~2 ms here)
because each holds the process's mmap lock for reading: a thread of the process
that maps or unmaps memory meanwhile (an allocator growing its heap) waits for the
step to end, and a step of a thread at nice 19 can be preempted half-way. Nothing
is written: the bytes stay as they are. On a kernel without it nothing is done
(logged once); the pages then fault on first use, as before.

Populating is not cheaper per page than faulting (1 GiB in 0.39 - 0.57 s here, ~1.5
us a page): it moves the cost off the hot path, to a thread that runs when a core is
idle. Transparent huge pages for the arena were measured and not kept: on this
machine populating 1 GiB of anonymous memory with ``MADV_HUGEPAGE`` took 11.7 s (the
kernel compacting memory for 2 MiB pages) against 0.48 s without, and a 32 MiB copy
into it was 3.77 ms against 3.99 ms. A ``/dev/shm`` file gets huge pages only from its
mount (``huge=within_size``), the operator's choice (docs/operations.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
CHUNK_BYTES = 4 << 20  # one madvise: ~2 ms here (module docstring); stop is read between

_madvise_fn: Any = None  # ctypes' function object, once made
_unsupported = False


def _madvise():
    """libc's madvise with its argument types set (a 64-bit address is never cut
    down to a C int): built whole, then published, so two threads never see it
    half-made."""
    global _madvise_fn
    if _madvise_fn is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise_fn = fn
    return _madvise_fn


def populate(address: int, nbytes: int) -> bool:
    """Map every page of ``[address, address + nbytes)`` now, as a write would (the
    bytes are not changed); False where the kernel cannot (and nothing was done)."""
    global _unsupported
    if _unsupported or nbytes <= 0:
        return False
    if _madvise()(address, nbytes, MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == 22:  # EINVAL: a kernel before 5.14
        _unsupported = True
        log.info("this kernel cannot prefault memory (MADV_POPULATE_WRITE): the DRAM "
                 "arena's pages fault on first use")
    else:
        log.warning("prefaulting %d bytes at %#x failed: %s", nbytes, address,
                    os.strerror(err))
    return False


class Prefault:
    """Populate ``array``'s pages (a numpy view of a whole mapping) in the background.

    The thread holds the array only while one step is populated (a weak reference
    between steps), so a mapping its owner lets go of is unmapped as usual and the
    thread stops; ``stop()`` stops it and waits for the step in progress (call it
    before closing the mapping). ``done`` is set when it ends, finished or not;
    ``nbytes_done`` says how far it got. An unexpected error ends the job, logged."""

    def __init__(self, array: np.ndarray, name: str = "arena") -> None:
        self.nbytes = int(array.nbytes)
        self.nbytes_done = 0
        self.done = threading.Event()
        self._stop = threading.Event()
        self._array = weakref.ref(array)
        self._thread = threading.Thread(target=self._run, name=f"kvstore-prefault-{name}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        try:
            while self.nbytes_done < self.nbytes and not self._stop.is_set():
                array = self._array()
                if array is None:
                    return
                step = min(CHUNK_BYTES, self.nbytes - self.nbytes_done)
                ok = populate(int(array.ctypes.data) + self.nbytes_done, step)
                del array
                if not ok:
                    return
                self.nbytes_done += step
        except Exception:  # noqa: BLE001 - a job that cannot go on leaves faults as before
            log.exception("prefaulting stopped after %d of %d bytes", self.nbytes_done,
                          self.nbytes)
        finally:
            self.done.set()

    def covers(self, array: np.ndarray) -> bool:
        """Whether this job populates ``array`` (the very array it was given)."""
        return self._array() is array

    def stop(self, wait: bool = True) -> None:
        """End the job; ``wait``: until the step in progress is done (one step, a
        few ms of CPU, however long the thread waits for a core at nice 19)."""
        self._stop.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()
