"""An entry's bytes where they live, and their checksums. Owns no state: it reads
and writes the extents it is given (never allocates or frees: Placement does)."""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.core.hashing import checksum
from kvstore.store.index import Record
from tiers.base import Extent, Tier


class ByteIO:
    def __init__(self, tiers: Mapping[str, Tier]) -> None:
        self._tiers = tiers

    @staticmethod
    def extent(rec: Record) -> Extent:
        return Extent(rec.tier, rec.offset, rec.nbytes)

    def write(self, ext: Extent, data: memoryview) -> None:
        """A local writer's bytes into its reserved extent."""
        self._tiers[ext.tier].write(ext, data)

    def bytes_at(self, ext: Extent) -> memoryview | bytearray:
        """The extent's bytes: a zero-copy view where the tier has one, else a copy."""
        tier = self._tiers[ext.tier]
        view = tier.view(ext)
        if view is not None:
            return view
        buf = bytearray(ext.nbytes)
        tier.read_into(ext, memoryview(buf))
        return buf

    def read_bytes(self, rec: Record) -> memoryview | bytearray:
        return self.bytes_at(self.extent(rec))

    def checksum_at(self, ext: Extent) -> int:
        return checksum(self.bytes_at(ext))

    def checksums(self, exts: list[Extent]) -> list[int]:
        """xxh3_64 of each extent's bytes; views fetched per tier in one batch."""
        if len({e.tier for e in exts}) > 1:
            return [self.checksum_at(e) for e in exts]
        if not exts:
            return []
        views = self._tiers[exts[0].tier].views(exts)
        return [checksum(v) if v is not None else self.checksum_at(e)
                for e, v in zip(exts, views)]
