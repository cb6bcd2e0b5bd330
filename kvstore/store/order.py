"""Entries of one tier kept in policy order, so choosing victims costs O(victims).

Sorting every entry of a tier on each room-making pass costs O(n log n) per pass
(about a second at 1M entries). Instead the store keeps, per tier (and one for the
NVMe copies of staged entries), a heap of the policy's sort key of each entry,
pushed when an entry joins the group. A hit does not push: an entry's sort key
only grows (access time), so its old item still sits no later than it should;
when the walk pops an item whose record has moved on, it pushes the current key
and goes on (lazy re-insertion), so reads pay nothing for the order. Items of
entries gone from the group are dropped as the walk meets them, and the heap is
rebuilt when stale items outnumber live ones (memory stays O(entries)). (A tier's
group leaves out its pinned entries, which are never victims: the catalog pushes
an entry again when it is unpinned.)

Invariant: every live member has an item whose key is at most its current sort
key. So the smallest item whose key is current belongs to the member that sorts
first, and the walk yields members in exactly the order ``policy.order`` would
sort them. (A wall clock stepping back can break "only grows"; such an entry is
then yielded late, as soon as its stale item comes up.)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Generator, Iterable

from kvstore.store.index import Record

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
        self._limit = _SLACK  # heap size at which the stale items are counted again

    def set_sort_key(self, sort_key: Callable[[Record], tuple]) -> None:
        """Order by another key from now on (a rebuild)."""
        self._sort_key = sort_key
        self.rebuild()

    def push(self, rec: Record) -> None:
        heapq.heappush(self._heap, self._sort_key(rec))
        if len(self._heap) > self._limit:
            self._bound()

    def push_many(self, recs: Iterable[Record]) -> None:
        """``push`` each of ``recs`` (a commit's new entries), the bound checked once."""
        heap, sort_key, heappush = self._heap, self._sort_key, heapq.heappush
        for rec in recs:
            heappush(heap, sort_key(rec))
        if len(heap) > self._limit:
            self._bound()

    def _bound(self) -> None:
        """Rebuild when stale items outnumber live ones (by more than the slack);
        else move the next check out to where they would."""
        limit = 2 * len(self._members()) + _SLACK
        if len(self._heap) > limit:
            self.rebuild()
        else:
            self._limit = limit

    def rebuild(self) -> None:
        recs = (self._member(k) for k in self._members())
        self._heap = [self._sort_key(r) for r in recs if r is not None]
        heapq.heapify(self._heap)
        self._limit = 2 * len(self._heap) + _SLACK

    def snapshot(self) -> list[tuple]:
        """A copy of the heap, taken under the store's lock, for ``walk_snapshot``
        without it (a C-level list copy: ~1 ms at 300k items)."""
        return list(self._heap)

    def walk_snapshot(self, heap: list[tuple]) -> Generator[Record, None, None]:
        """Members in policy order from a ``snapshot`` (consumed), leaving this
        order as it is: a walk made without the store's lock, reading each member's
        record as it is at that moment (dict reads, atomic under the GIL). A member
        that changes meanwhile can come out late or not at all, so whoever acts on
        what it yields checks it again under the lock."""
        for _, rec in self._members_in_order(heap):
            yield rec

    def _members_in_order(self, heap: list[tuple]) -> Generator[tuple, None, None]:
        """(item, record) of each member, popping ``heap``: stale items dropped, a
        touched member's item pushed again at its current key (lazy re-insertion)."""
        seen: set[bytes] = set()
        while heap:
            item = heapq.heappop(heap)
            key = item[-1]
            rec = self._member(key)
            if rec is None or key in seen:
                continue  # gone from the group, or a repeat already yielded
            now = self._sort_key(rec)
            if now != item:  # touched since it was pushed: its place is further on
                heapq.heappush(heap, now)
                continue
            seen.add(key)
            yield item, rec

    def walk(self) -> Generator[Record, None, None]:
        """Members in policy order, lazily. Close the generator when done: every
        live item it popped goes back then (the caller may not act on them)."""
        popped: list[tuple] = []
        try:
            for item, rec in self._members_in_order(self._heap):
                popped.append(item)
                yield rec
        finally:
            for item in popped:
                heapq.heappush(self._heap, item)
