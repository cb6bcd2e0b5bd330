"""The contract every storage tier keeps.

Only ``kvstore.store.Store`` calls these methods, from one thread at a time (the
store holds its lock). A tier knows bytes and extents, never keys: which key owns
which extent is the store's business (the index).

Invariants:
* ``used`` is the sum of the sizes of live extents (rounded up to ``page_size``);
  ``used <= capacity``.
* An extent is live from ``allocate*`` until ``free``; freeing twice or freeing an
  extent never handed out raises ``IntegrityError``.
* ``allocate_many`` is all-or-nothing, and places the extents back to back in one
  run when a free run is large enough, so one transfer can move them all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from tiers.errors import InvalidRequestError


class Extent(NamedTuple):
    """A byte range ``[offset, offset + nbytes)`` of one tier."""

    tier: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class MemoryRegion(NamedTuple):
    """An address range to register with the Transfer Engine."""

    address: int
    nbytes: int
    location: str  # "cpu:0" or "cuda:N": where TE must look for the bytes


class TierStats(NamedTuple):
    name: str
    capacity: int
    used: int
    extents: int
    largest_free: int


class Tier(ABC):
    name: str  # "gpu" | "dram" | "nvme"
    volatile: bool  # True: contents are gone after a restart
    page_size: int

    @property
    @abstractmethod
    def capacity(self) -> int: ...

    @property
    @abstractmethod
    def used(self) -> int: ...

    @abstractmethod
    def allocate_many(self, sizes: list[int]) -> list[Extent]:
        """Extents for ``sizes``, contiguous when possible. Raises ``TierFullError``
        (and allocates nothing) when they do not fit."""

    def allocate(self, nbytes: int) -> Extent:
        return self.allocate_many([nbytes])[0]

    @abstractmethod
    def free(self, extent: Extent) -> None:
        """Return an extent. Its bytes may be reused at once."""

    def free_many(self, extents: list[Extent]) -> None:
        """Return several extents; all or nothing where the tier can check that first."""
        for extent in extents:
            self.free(extent)

    def retain(self, extent: Extent, pieces: list[tuple[int, int]]) -> list[Extent]:
        """Split the live ``extent`` into the live extents ``pieces`` (``(offset,
        nbytes)`` inside it, page-aligned, not overlapping) and free the rest of it.
        All or nothing: a bad piece raises ``InvalidRequestError`` and changes nothing."""
        raise InvalidRequestError(f"{self.name}: extents cannot be split")

    @abstractmethod
    def claim(self, extent: Extent) -> None:
        """Mark an extent live again after a restart (persistent tiers only)."""

    @abstractmethod
    def write(self, extent: Extent, data: memoryview) -> None:
        """Copy ``data`` (exactly ``extent.nbytes`` bytes) into the extent."""

    @abstractmethod
    def read_into(self, extent: Extent, out: memoryview) -> None:
        """Copy the extent's bytes into ``out`` (exactly ``extent.nbytes`` bytes)."""

    def write_many(self, extents: list[Extent], datas: list[memoryview]) -> None:
        """``write`` each extent; a tier may batch adjacent ones into one call."""
        same_length(extents, datas)
        for ext, data in zip(extents, datas):
            self.write(ext, data)

    def read_many(self, extents: list[Extent], outs: list[memoryview]) -> None:
        """``read_into`` each extent; a tier may batch adjacent ones into one call."""
        same_length(extents, outs)
        for ext, out in zip(extents, outs):
            self.read_into(ext, out)

    def view(self, extent: Extent) -> memoryview | None:
        """Zero-copy view of an extent for memory tiers; None for block tiers."""
        return None

    def views(self, extents: list[Extent]) -> Sequence[memoryview | None]:
        """``view`` of each extent (a tier may do the checks in one pass)."""
        return [self.view(e) for e in extents]

    def span(self, extents: list[Extent]) -> memoryview | None:
        """One zero-copy view over live ``extents`` that lie back to back, in order,
        for memory tiers; else None (block tiers: always)."""
        if not extents:
            return self.span_of((), ())
        tiers, offsets, sizes = zip(*extents)
        return self.span_of(offsets, sizes) if tiers.count(self.name) == len(tiers) \
            else None

    def span_of(self, offsets: Sequence[int], sizes: Sequence[int]) -> memoryview | None:
        """``span`` of this tier's extents at ``offsets`` of ``sizes`` (none: None)."""
        return None

    def runs_of(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[memoryview] | None:
        """Zero-copy views of this tier's extents at ``offsets`` of ``sizes``, in order,
        back-to-back ones joined (memory tiers; else None)."""
        return None

    def address(self, extent: Extent) -> int | None:
        """Virtual address of the extent for TE, or None when not memory-mapped."""
        return None

    def regions(self) -> list[MemoryRegion]:
        """Address ranges to register with TE once (the whole arena)."""
        return []

    def flush(self) -> None:
        """Make written bytes durable (persistent tiers)."""

    def stats(self) -> TierStats:
        return TierStats(self.name, self.capacity, self.used, 0, 0)

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` if the allocator's books do not balance."""

    def close(self) -> None:
        """Release the arena or file. The tier is unusable afterwards."""


def same_length(extents: list, bufs: list) -> None:
    if len(extents) != len(bufs):
        raise InvalidRequestError(f"{len(extents)} extents but {len(bufs)} buffers")


def free_by_tier(tiers: Mapping[str, Tier], extents: Iterable[Extent]) -> None:
    """Give ``extents`` back to their tiers, one ``free_many`` per tier (a prompt's
    neighbouring extents merge once)."""
    by_tier: dict[str, list[Extent]] = {}
    for ext in extents:
        by_tier.setdefault(ext.tier, []).append(ext)
    for name, group in by_tier.items():
        tiers[name].free_many(group)
