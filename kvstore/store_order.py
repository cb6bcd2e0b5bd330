"""Entries of one tier kept in policy order, so choosing victims costs O(victims).

Sorting every entry of a tier on each room-making pass costs O(n log n) per pass
(about a second at 1M entries). Instead the store keeps, per tier (and one for the
NVMe copies of staged entries), a heap of the policy's sort key of each entry,
pushed whenever an entry lands in the group or its sort key changes. Items are
never removed in place: an item is *stale* when its key is gone from the group or
its record now has another sort key, and stale items are dropped as the heap
yields them. The heap is rebuilt from the live records when stale items outnumber
live ones, so memory stays O(entries) and pushes stay amortized O(log n).

Invariant: every live member of the group has an item equal to its current sort
key. So walking the heap in order (skipping stale and repeated items) yields the
members in exactly the order ``policy.order`` would sort them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterator

from kvstore.index import Record

_SLACK = 1024  # stale items tolerated beyond the live count before a rebuild


class GroupOrder:
    """One group's heap. ``members()`` is the group's keys now (a dict or set),
    ``member(key)`` the key's record when it belongs to the group, else None, and
    ``sort_key(record)`` the policy's order: a tuple ending with the key."""

    def __init__(self, sort_key: Callable[[Record], tuple],
                 member: Callable[[bytes], Record | None],
                 members: Callable[[], Collection[bytes]]) -> None:
        self._sort_key, self._member, self._members = sort_key, member, members
        self._heap: list[tuple] = []

    def push(self, rec: Record) -> None:
        heapq.heappush(self._heap, self._sort_key(rec))
        if len(self._heap) > 2 * len(self._members()) + _SLACK:
            self.rebuild()

    def rebuild(self) -> None:
        recs = (self._member(k) for k in self._members())
        self._heap = [self._sort_key(r) for r in recs if r is not None]
        heapq.heapify(self._heap)

    def walk(self) -> Iterator[Record]:
        """Members in policy order, lazily. Close the generator when done: every
        live item it popped goes back then (the caller may not act on them)."""
        popped: list[tuple] = []
        seen: set[bytes] = set()
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                key = item[-1]
                rec = self._member(key)
                if rec is None or key in seen or self._sort_key(rec) != item:
                    continue  # stale, or a repeat of an item already yielded
                seen.add(key)
                popped.append(item)
                yield rec
        finally:
            for item in popped:
                heapq.heappush(self._heap, item)
