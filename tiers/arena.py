"""What every tier shares: space booked by one ``ExtentAllocator``, and the checks
made before any byte is copied in or out of an extent.

A concrete tier adds only its storage (memory arena, file, device tensor) and the
copies; the bookkeeping lives here once.
"""

from __future__ import annotations

from typing import Any

from tiers.errors import IntegrityError, InvalidRequestError
from tiers.allocator import ExtentAllocator
from tiers.base import Extent, Tier, TierStats


def byte_view(data: Any) -> memoryview:
    """A flat, byte-format view of any C-contiguous buffer (bytes, bytearray,
    memoryview, numpy array). Raises ``InvalidRequestError`` for anything else."""
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise InvalidRequestError(f"not a buffer: {type(data).__name__}") from exc
    if not view.c_contiguous:
        raise InvalidRequestError("buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class ArenaTier(Tier):
    """A tier whose extents come from an ``ExtentAllocator`` over ``capacity`` bytes."""

    def __init__(self, capacity: int, page_size: int) -> None:
        self.page_size = page_size
        self._alloc = ExtentAllocator(capacity, page_size)

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def used(self) -> int:
        return self._alloc.used

    @property
    def allocator(self) -> ExtentAllocator:
        return self._alloc

    def allocate_many(self, sizes: list[int]) -> list[Extent]:
        offsets = self._alloc.allocate_many(list(sizes))
        return [Extent(self.name, off, int(n)) for off, n in zip(offsets, sizes)]

    def free(self, extent: Extent) -> None:
        self._own(extent)
        self._alloc.free(extent.offset, extent.nbytes)

    def free_many(self, extents: list[Extent]) -> None:
        if not extents:
            return
        tiers, offsets, sizes = zip(*extents)  # (C-level passes: a release frees each entry)
        if tiers.count(self.name) != len(tiers):
            for extent in extents:
                self._own(extent)  # raises for the first foreign one
        self._alloc.free_many(list(zip(offsets, sizes)))

    def retain(self, extent: Extent, pieces: list[tuple[int, int]]) -> list[Extent]:
        self._own(extent)
        if not self._alloc.is_live(extent.offset, extent.nbytes):
            raise IntegrityError(f"{self.name}: extent {extent} is not live")
        self._alloc.retain(extent.offset, pieces)
        new, name = tuple.__new__, self.name  # one Extent per entry of a put: no call each
        return [new(Extent, (name, off, int(n))) for off, n in pieces]

    def claim(self, extent: Extent) -> None:
        self._own(extent)
        self._alloc.claim(extent.offset, extent.nbytes)

    def stats(self) -> TierStats:
        a = self._alloc
        return TierStats(self.name, a.capacity, a.used, a.live_count, a.largest_free)

    def check_integrity(self) -> None:
        self._alloc.check_integrity()
        if self._alloc.used > self._alloc.capacity:
            raise IntegrityError(f"{self.name}: used {self._alloc.used} > capacity")

    # ------------------------------------------------------------ for subclasses
    def _own(self, extent: Extent) -> None:
        if extent.tier != self.name:
            raise InvalidRequestError(f"extent of tier {extent.tier!r} given to {self.name!r}")

    def _checked(self, extent: Extent, data: object, writable: bool = False) -> memoryview:
        """``data`` as bytes, after checking it fits the extent and the extent is live."""
        self._own(extent)
        view = byte_view(data)
        if writable and view.readonly:
            raise InvalidRequestError(f"{self.name}: read_into needs a writable buffer")
        if view.nbytes != extent.nbytes:
            raise InvalidRequestError(
                f"{self.name}: buffer of {view.nbytes} bytes for an extent of {extent.nbytes}")
        self._require_live(extent)
        return view

    def _require_live(self, extent: Extent) -> None:
        if not self._alloc.is_live(extent.offset, extent.nbytes):
            raise IntegrityError(f"{self.name}: extent {extent} is not live")
