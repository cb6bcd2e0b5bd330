"""The memory a transport may move bytes from and to: its TE registrations and
the staging buffers it maps itself. A mixin of ``kvstore.transport.te.Transport``.

Invariants kept here (under the transport's lock):
* registered regions never overlap (TE does not support it), and
  ``_starts`` / ``_ends`` are their sorted bounds, rebuilt on every change;
* every local range handed to TE lies inside one registered region: TE on TCP
  would read any pointer (a bad one segfaults the process).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from kvstore.core.errors import InvalidRequestError, KVStoreError, TransferError

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE


class Region(NamedTuple):
    address: int
    nbytes: int
    location: str


class StagingBuffer(NamedTuple):
    """A page-aligned anonymous mapping registered with the engine."""

    address: int
    array: np.ndarray  # uint8 view of the whole buffer



class RegionsMixin:
    # Transport.__init__ sets these; declared here so this mixin's use of them is checked.
    _lock: threading.RLock
    _te: Any  # mooncake's TransferEngine (untyped); None once a metadata-mode one closed
    _regions: dict[int, Region]
    _starts: np.ndarray
    _ends: np.ndarray
    _buffers: dict[int, mmap.mmap]
    _closed: bool

    def _check_open(self) -> None:
        raise NotImplementedError  # Transport's

    def register(self, address: int | tuple[int, int, str] | tuple[int, int],
                 nbytes: int | None = None, location: str = "cpu:0") -> Region:
        """Register ``[address, address + nbytes)``; ``register(region)`` also takes an
        ``(address, nbytes, location)`` tuple such as ``tiers.base.MemoryRegion``."""
        if isinstance(address, tuple) and nbytes is None:
            return self.register_many([address])[0]
        if isinstance(address, tuple) or nbytes is None:
            raise InvalidRequestError(
                "register takes (address, nbytes[, location]) or one region tuple")
        return self.register_many([(address, nbytes, location)])[0]
    def register_many(self, regions: Iterable[tuple[int, int, str] | tuple[int, int]]
                      ) -> list[Region]:
        """Register regions once, in one TE call. All or nothing: an overlap with an
        existing region or with each other raises ``InvalidRequestError``."""
        try:
            new = [Region(int(r[0]), int(r[1]), str(r[2]) if len(r) > 2 else "cpu:0")
                   for r in regions]
        except (TypeError, ValueError, IndexError) as exc:
            raise InvalidRequestError(
                f"regions must be (address, nbytes[, location]): {exc}") from exc
        with self._lock:
            self._check_open()
            self._check_free(new)
            if not new:
                return []
            self._te_register(new)
            for r in new:
                self._regions[r.address] = r
            self._reindex()
        log.debug("registered %s region(s)", len(new))
        return new

    def _te_register(self, new: list[Region]) -> None:
        """All of ``new`` registered with TE, or none of it and ``TransferError``."""
        if len({r.location for r in new}) == 1:
            rc = self._te.batch_register_memory([r.address for r in new],
                                                [r.nbytes for r in new], new[0].location)
        else:
            rc = min(self._te.register_memory(r.address, r.nbytes, r.location)
                     for r in new)
        if rc != 0:
            for r in new:  # undo whatever part TE took; unknown ones just return < 0
                self._te.unregister_memory(r.address)
            raise TransferError(f"TE refused to register {len(new)} region(s) "
                                f"({sum(r.nbytes for r in new)} bytes): rc {rc}")

    def unregister(self, address: int) -> None:
        with self._lock:
            if address not in self._regions:
                raise InvalidRequestError(f"no region registered at {address:#x}")
            rc = self._te.unregister_memory(address) if not self._closed else 0
            del self._regions[address]
            self._reindex()
            buf = self._buffers.pop(address, None)
        if rc != 0:
            log.warning("TE unregister_memory(%#x) returned %s", address, rc)
        if buf is not None:
            _close_mapping(buf)

    def regions(self) -> list[Region]:
        with self._lock:
            return sorted(self._regions.values())

    def allocate_buffer(self, nbytes: int, location: str = "cpu:0") -> StagingBuffer:
        """A page-aligned anonymous mapping, registered once; ``unregister(address)``
        or ``close()`` frees it (once no numpy view of it is left)."""
        if nbytes <= 0:
            raise InvalidRequestError(f"buffer size must be > 0, got {nbytes}")
        size = -(-nbytes // _PAGE) * _PAGE
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        array = np.frombuffer(buf, dtype=np.uint8)
        address = array.ctypes.data
        try:
            self.register(address, size, location)
        except KVStoreError:
            del array
            buf.close()
            raise
        with self._lock:
            self._buffers[address] = buf
        return StagingBuffer(address, array[:nbytes])

    def _check_free(self, new: list[Region]) -> None:
        spans = sorted([(r.address, r.address + r.nbytes) for r in new]
                       + [(r.address, r.address + r.nbytes) for r in self._regions.values()])
        for r in new:
            if r.address <= 0 or r.nbytes <= 0:
                raise InvalidRequestError(f"bad region {r}: address and size must be > 0")
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise InvalidRequestError(
                    f"region at {start:#x} overlaps one already registered (or in this "
                    "call); TE does not support overlapping registrations")

    def _reindex(self) -> None:
        starts = sorted(self._regions)
        self._starts = np.array(starts, dtype=np.int64)
        self._ends = np.array([a + self._regions[a].nbytes for a in starts], dtype=np.int64)

    def _check_local(self, loc: np.ndarray, ln: np.ndarray) -> None:
        """Every local range inside one registered region (vectorised)."""
        idx = np.searchsorted(self._starts, loc, side="right") - 1
        ok = idx >= 0
        ok[ok] &= loc[ok] + ln[ok] <= self._ends[idx[ok]]
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise InvalidRequestError(
                f"local range {int(loc[bad]):#x}+{int(ln[bad])} is not inside a region "
                f"registered with this transport ({len(self._starts)} registered)")



def _close_mapping(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # a numpy view still uses it: unmapped when that view dies
        log.debug("staging buffer still viewed; left to the garbage collector")
