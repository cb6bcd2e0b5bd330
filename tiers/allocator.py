"""The one extent allocator every tier uses.

Space is ``[0, capacity)`` cut into pages; every range handed out is a whole number
of pages, so extents of every tier are page-aligned (what O_DIRECT and TE want).

Books kept (invariants, checked by ``check_integrity``):
* free space is a set of *maximal* runs: no two free runs touch (freeing coalesces
  with both neighbours), so the free set has one canonical shape;
* ``_free_len[start] = length``, ``_free_end[start + length] = start``;
  ``_starts`` is the sorted run starts and ``_by_size`` the sorted ``(length, start)``;
* ``_live[offset] = length`` of each range handed out; live ranges and free runs never
  overlap and together cover ``[0, capacity)`` exactly, so ``used + free == capacity``.

Best fit (smallest free run that is large enough, lowest offset among equals) keeps
large runs whole for large requests, which bounds fragmentation under churn.
Lookups are O(log n) by bisect (list inserts move pointers, a memmove: cheap).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from typing import NamedTuple

from tiers.errors import ConfigError, IntegrityError, InvalidRequestError, TierFullError


class Run(NamedTuple):
    """A free byte range ``[start, start + nbytes)``."""

    start: int
    nbytes: int


class ExtentAllocator:
    def __init__(self, capacity: int, page_size: int) -> None:
        if page_size <= 0 or page_size & (page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {page_size}")
        # A capacity that is not a page multiple loses its tail: pages are the unit.
        usable = (capacity // page_size) * page_size
        if usable <= 0:
            raise ConfigError(f"capacity {capacity} is smaller than one page ({page_size})")
        self.capacity = usable
        self.page_size = page_size
        self._used = 0
        self._live: dict[int, int] = {}
        self._free_len: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._starts: list[int] = []
        self._by_size: list[tuple[int, int]] = []
        self._add_run(0, usable)

    # ------------------------------------------------------------ queries
    @property
    def used(self) -> int:
        return self._used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def free_runs(self) -> int:
        """Number of free runs: 1 means the free space is one piece."""
        return len(self._starts)

    @property
    def live_count(self) -> int:
        return len(self._live)

    def runs(self) -> list[Run]:
        """Free runs by offset (for tests and diagnostics; O(n))."""
        return [Run(s, self._free_len[s]) for s in self._starts]

    def round_up(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size) * self.page_size

    def is_live(self, offset: int, nbytes: int) -> bool:
        """True if ``[offset, offset + nbytes)`` was handed out as one range."""
        return nbytes > 0 and self._live.get(offset) == self.round_up(nbytes)

    def all_live(self, offsets: Sequence[int], sizes: Sequence[int]) -> bool:
        """``is_live`` of each ``(offset, nbytes)`` pair, the lookups in one C-level
        pass (a server checks a reply's 32 - 128 entries so on every small read)."""
        return self._live_lengths(offsets, sizes) is not None

    def _live_lengths(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[int] | None:
        """The page lengths of ``(offset, nbytes)`` pairs that are each live (None if
        one is not): ``all_live``, and the start of ``_free_run``."""
        page = self.page_size
        lengths = [-(-n // page) * page for n in sizes]
        if len(offsets) != len(sizes) or min(sizes, default=1) <= 0 or \
                list(map(self._live.get, offsets)) != lengths:
            return None
        return lengths

    # ------------------------------------------------------------ changes
    def allocate_many(self, sizes: list[int]) -> list[int]:
        """Offsets for ``sizes``; all or nothing. Back to back in one run when one
        free run holds the whole batch, else each piece best-fit on its own."""
        rounded = [self._rounded_request(n) for n in sizes]
        total = sum(rounded)
        if not rounded:
            return []
        if total > self.capacity - self._used:
            raise TierFullError(f"need {total} bytes, {self.capacity - self._used} free")
        start = self._take_best_fit(total)
        if start is not None:
            return self._carve_batch(start, rounded)
        return self._allocate_split(rounded, total)

    def free(self, offset: int, nbytes: int) -> None:
        self.free_many([(offset, nbytes)])

    def free_many(self, ranges: list[tuple[int, int]]) -> None:
        """Free every ``(offset, nbytes)``; all or nothing (``IntegrityError`` and
        nothing freed if one is not live, or is given twice). Ranges that touch go
        back to the free set as one run: a prompt's entries, reserved back to back,
        cost one merge instead of one per entry (2 048 frees of 64 KiB: the largest
        part of a drop_select's release)."""
        if self._free_run(ranges):
            return
        page, live = self.page_size, self._live
        lengths = [(offset, -(-nbytes // page) * page) for offset, nbytes in ranges]
        seen: set[int] = set()
        for (offset, length), (_, nbytes) in zip(lengths, ranges):
            if live.get(offset) != length or length <= 0 or offset in seen:
                raise IntegrityError(f"free of [{offset}, +{nbytes}): not a live range "
                                     "(double free or never allocated); nothing freed")
            seen.add(offset)
        if any(a[0] > b[0] for a, b in zip(lengths, lengths[1:])):
            lengths.sort()
        run_start = run_end = -1
        for offset, length in lengths:
            del live[offset]
            self._used -= length
            if offset == run_end:
                run_end += length
                continue
            if run_end > run_start:
                self._release(run_start, run_end - run_start)
            run_start, run_end = offset, offset + length
        if run_end > run_start:
            self._release(run_start, run_end - run_start)

    def _free_run(self, ranges: list[tuple[int, int]]) -> bool:
        """``free_many`` of the usual release: live ranges back to back in order (a
        prompt's entries), freed as one run in C-level passes. False, with nothing
        changed, for anything else (``free_many``'s own loop checks and says why)."""
        if not ranges:
            return False
        offsets, sizes = zip(*ranges)
        lengths = self._live_lengths(offsets, sizes)
        if lengths is None:
            return False
        ends = list(itertools.accumulate(lengths, initial=offsets[0]))
        if ends[:-1] != list(offsets):
            return False
        list(map(self._live.__delitem__, offsets))
        self._used -= ends[-1] - offsets[0]
        self._release(offsets[0], ends[-1] - offsets[0])
        return True

    def retain(self, offset: int, pieces: list[tuple[int, int]]) -> None:
        """Keep ``pieces`` (``(offset, nbytes)``, each page-aligned) of the live range
        at ``offset`` live as ranges of their own and free the rest of it: a writer's
        standing room becomes the extents of the entries written into it. All or
        nothing: ``InvalidRequestError`` (and nothing changed) if a piece is not
        page-aligned, leaves the range, or overlaps another; ``IntegrityError`` if
        ``offset`` is not live."""
        length = self._live.get(offset)
        if length is None:
            raise IntegrityError(f"retain in [{offset}, ...): not a live range")
        page = self.page_size
        # A room's pieces come as plain ints in writing order: rounded inline and
        # checked for order once (a put of 2 048 entries calls this once per entry).
        if all(type(n) is int and n > 0 for _, n in pieces):
            kept = [(start, -(-n // page) * page) for start, n in pieces]
            if any(a[0] > b[0] for a, b in zip(kept, kept[1:])):
                kept.sort()
        else:
            kept = sorted((start, self._rounded_request(n)) for start, n in pieces)
        cursor, end = offset, offset + length
        for start, size in kept:
            if start % page or start < cursor or start + size > end:
                raise InvalidRequestError(
                    f"piece [{start}, +{size}) is not page-aligned, overlaps another, or "
                    f"leaves [{offset}, +{length})")
            cursor = start + size
        live = self._live
        del live[offset]
        cursor = offset
        for start, size in kept:
            if start > cursor:
                self._release(cursor, start - cursor)
            live[start] = size  # _mark_live, with ``used`` settled below
            cursor = start + size
        self._used += sum(size for _, size in kept) - length
        if cursor < end:
            self._release(cursor, end - cursor)

    def claim(self, offset: int, nbytes: int) -> None:
        """Mark a range live again (restart of a persistent tier). It must lie wholly
        inside one free run, i.e. overlap nothing live."""
        length = self._rounded_request(nbytes)
        if offset < 0 or offset % self.page_size or offset + length > self.capacity:
            raise InvalidRequestError(
                f"claim [{offset}, +{nbytes}): not page-aligned or outside [0, {self.capacity})")
        i = bisect.bisect_right(self._starts, offset) - 1
        run_start = self._starts[i] if i >= 0 else -1
        run_len = self._free_len.get(run_start, 0)
        if run_start < 0 or offset + length > run_start + run_len:
            raise IntegrityError(f"claim [{offset}, +{nbytes}) overlaps a live range")
        self._remove_run(run_start, run_len)
        if offset > run_start:
            self._add_run(run_start, offset - run_start)
        if offset + length < run_start + run_len:
            self._add_run(offset + length, run_start + run_len - offset - length)
        self._mark_live(offset, length)

    # ------------------------------------------------------------ internals
    def _rounded_request(self, nbytes: int) -> int:
        try:
            n = operator.index(nbytes)  # ints and numpy integers, not floats
        except TypeError:
            n = 0
        if isinstance(nbytes, bool) or n <= 0:
            raise InvalidRequestError(f"extent size must be a positive int, got {nbytes!r}")
        return self.round_up(n)

    def _allocate_split(self, rounded: list[int], total: int) -> list[int]:
        offsets: list[int] = []
        for length in rounded:
            start = self._take_best_fit(length)
            if start is None:
                # Undo: the free set is canonical (maximal runs), so freeing what we
                # took restores exactly the shape we started from.
                for off, ln in zip(offsets, rounded):
                    self.free(off, ln)
                raise TierFullError(
                    f"need {total} bytes in {len(rounded)} extents; free space too fragmented "
                    f"(largest run {self.largest_free})")
            offsets.extend(self._carve_batch(start, [length]))
        return offsets

    def _take_best_fit(self, length: int) -> int | None:
        """Remove the best-fit run for ``length``, give back its tail; return its start."""
        i = bisect.bisect_left(self._by_size, (length, -1))
        if i == len(self._by_size):
            return None
        run_len, start = self._by_size[i]
        self._remove_run(start, run_len)
        if run_len > length:
            self._add_run(start + length, run_len - length)
        return start

    def _carve_batch(self, start: int, rounded: list[int]) -> list[int]:
        offsets = []
        for length in rounded:
            self._mark_live(start, length)
            offsets.append(start)
            start += length
        return offsets

    def _mark_live(self, offset: int, length: int) -> None:
        self._live[offset] = length
        self._used += length

    def _release(self, start: int, length: int) -> None:
        """Return ``[start, start+length)`` to the free set, merging with neighbours."""
        left = self._free_end.get(start)
        if left is not None:
            left_len = self._free_len[left]
            self._remove_run(left, left_len)
            start, length = left, length + left_len
        right_len = self._free_len.get(start + length)
        if right_len is not None:
            self._remove_run(start + length, right_len)
            length += right_len
        self._add_run(start, length)

    def _add_run(self, start: int, length: int) -> None:
        self._free_len[start] = length
        self._free_end[start + length] = start
        bisect.insort(self._starts, start)
        bisect.insort(self._by_size, (length, start))

    def _remove_run(self, start: int, length: int) -> None:
        del self._free_len[start]
        del self._free_end[start + length]
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._by_size[bisect.bisect_left(self._by_size, (length, start))]

    # ------------------------------------------------------------ audit
    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless the books balance (O(n log n))."""
        pieces = sorted([(s, n, "free") for s, n in self._free_len.items()]
                        + [(s, n, "live") for s, n in self._live.items()])
        cursor, prev_kind = 0, None
        for start, length, kind in pieces:
            if start != cursor or length <= 0 or start % self.page_size or length % self.page_size:
                raise IntegrityError(f"{kind} range [{start}, +{length}) at cursor {cursor}")
            if kind == prev_kind == "free":
                raise IntegrityError(f"free runs not coalesced at {start}")
            cursor, prev_kind = start + length, kind
        if cursor != self.capacity:
            raise IntegrityError(f"ranges cover [0, {cursor}), capacity {self.capacity}")
        self._check_indexes()

    def _check_indexes(self) -> None:
        if self._used != sum(self._live.values()) or self._used > self.capacity:
            raise IntegrityError(f"used {self._used} != sum of live ranges")
        if self._starts != sorted(self._free_len) or len(self._starts) != len(set(self._starts)):
            raise IntegrityError("run-start index out of step with the free runs")
        if self._by_size != sorted((n, s) for s, n in self._free_len.items()):
            raise IntegrityError("size index out of step with the free runs")
        if self._free_end != {s + n: s for s, n in self._free_len.items()}:
            raise IntegrityError("run-end index out of step with the free runs")
