"""Holds: what keeps entries in place while someone works on them, and the open
reservations and read leases that make them; the class says what it owns and keeps."""

from __future__ import annotations

import collections
import itertools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from kvstore.core.errors import LeaseExpiredError, NotFoundError
from kvstore.store.index import Record
from tiers.base import Extent

_T = TypeVar("_T")
_ENDED_KEYS = 1 << 16  # keys of leases ended once sent remembered, at most (~4 MiB)
_EXPIRED_MEMORY = 4096  # ids of reaped reservations/leases remembered for a clear error


@dataclass
class Open:
    """An open (uncommitted) reservation; lives only in memory."""

    id: int
    keys: list[bytes]
    tokens: list[bytes]
    meta: list[bytes]
    extents: list[Extent | None]  # None: deduped onto an existing or in-flight entry
    held: list[bytes]  # committed keys deduped onto, leased until commit/abort
    expires_at: float
    extra: dict[bytes, int]  # consumers that deduped onto our in-flight keys
    namespace: bytes = b""  # the writer's namespace tag, kept in each new record
    # pins that pinning commits deduped onto our in-flight keys; applied at our commit
    extra_pins: dict[bytes, int] = field(default_factory=dict)
    # prompt ends that deduping reservations put on our in-flight keys
    extra_ends: dict[bytes, int] = field(default_factory=dict)


class Room(NamedTuple):
    """Room a writer holds for its next insert (``Writes.put``): one extent of a
    memory tier, reserved for no key yet; lives only in memory."""

    id: int
    extent: Extent
    expires_at: float
    lease_s: float


class Lease(NamedTuple):
    keys: list[bytes]
    expires_at: float
    claim: bool = False  # holds one pending consumer of each key (drop_select)
    take: bool = True  # release(drop=True) may take: False for a drop_select that
    # matched only a prefix other prompts share (it reads, it takes nothing)
    end: bytes | None = None  # the prompt end this lease claimed (one ``ends``)
    # When a drop_select's claiming lease was opened: the access time its entries
    # get when it ends, on those it leaves stored (``Reads.end_lease``); None for
    # the others (a get's entries are touched at its acquire; staging's placeholder
    # and a spend's lease are read by no one).
    read_at: float | None = None


class Holds:
    """Owner of: ``reservations`` (id -> Open), ``inflight`` (key being written -> its
    reservation), ``rooms`` (id -> Room), ``leases`` (id -> Lease), ``leased`` (key ->
    number of holds),
    ``claims`` (key -> pending consumers claimed by open leases), ``end_claims`` (key
    -> its prompt ends claimed by open leases), the ids recently reaped (for a clear
    "expired" error) and when the next lease runs out (``next_reap``).

    Invariants kept here (``check_integrity`` checks them):
    * ``leased[key]`` is the number of holds on ``key``: one per open lease that lists
      it, one per open reservation that dedups onto it, one per reply being sent from
      the arena that carries it (``sends``). A held entry never moves and never goes;
    * a key is in ``inflight`` exactly while one open reservation holds an extent for
      it, so two writers never store the same key twice;
    * every count is positive: a key whose count reaches zero leaves its map.
    """

    def __init__(self, records: Mapping[bytes, Record]) -> None:
        """``records``: the catalog's records (read only), to tell which released
        keys are due to go."""
        self._records = records
        self.reservations: dict[int, Open] = {}
        self.rooms: dict[int, Room] = {}
        self.inflight: dict[bytes, int] = {}
        self.leases: dict[int, Lease] = {}
        self.leased: dict[bytes, int] = {}
        self.claims: dict[bytes, int] = {}
        self.end_claims: dict[bytes, int] = {}
        # Replies a server sends from the arena itself, by acquisition id: the keys
        # each holds until its bytes are out (``hold_send`` / ``end_send``).
        self.sends: dict[int, list[bytes]] = {}
        self.next_reap = float("inf")
        self._expired: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Leases the server ended itself once their reply's bytes were out, so a
        # reader's later release or report on one is understood: a get's keys (its
        # entries stay, to be checked), a drop_select's count (they went), and until
        # when the lease would have run (``remember_ended_sent``).
        self._ended_sent: collections.OrderedDict[
            int, tuple[tuple[bytes, ...] | int, float]] = collections.OrderedDict()
        self._ended_keys = 0  # keys held in ``_ended_sent``

    def hold(self, keys: Sequence[bytes]) -> None:
        count(self.leased, keys)

    def unhold(self, keys: Sequence[bytes]) -> list[bytes]:
        """Drop one hold per key; returns the keys now due to be freed (pending 0,
        unpinned, unheld)."""
        uncount(self.leased, keys)
        if all(map(self.leased.__contains__, keys)):  # all still held: none idle
            return []
        return [k for k in dict.fromkeys(keys)
                if k in self._records and self.idle_at_zero(self._records[k])]

    def idle_at_zero(self, rec: Record) -> bool:
        """Nothing needs ``rec`` any more: no consumer pending, no pin, no hold."""
        return rec.pending == 0 and rec.pins == 0 and not self.leased.get(rec.key)

    # ------------------------------------------------------------ reservations
    def add_reservation(self, op: Open) -> None:
        """Open ``op``: its written keys go in flight (its deduped keys are
        already held by the caller)."""
        for key, ext in zip(op.keys, op.extents):
            if ext is not None:
                self.inflight[key] = op.id
        self.reservations[op.id] = op
        self.due(op.expires_at)

    def end_reservation(self, op: Open) -> list[bytes]:
        """Close ``op`` (committed or given up): its keys leave flight, its dedup
        holds are given back. Returns the held keys now due to be freed."""
        for key, ext in zip(op.keys, op.extents):
            if ext is not None:
                del self.inflight[key]
        del self.reservations[op.id]
        return self.unhold(op.held)

    # ------------------------------------------------------------ rooms
    def add_room(self, room: Room) -> None:
        self.rooms[room.id] = room
        self.due(room.expires_at)

    def open_room(self, rid: int) -> Room:
        return self._found(self.rooms, "room", rid)

    def take_room(self, rid: int) -> Room:
        """Close open room ``rid`` and return it (its extent is the caller's now)."""
        room = self._found(self.rooms, "room", rid)
        del self.rooms[rid]
        return room

    def room_bytes(self) -> int:
        """Bytes that open rooms hold."""
        return sum(r.extent.nbytes for r in self.rooms.values())

    def dedup_onto(self, op: Open, key: bytes, end: bool, pin: bool) -> None:
        """Another reservation dedups onto ``op``'s in-flight ``key``: one more
        pending consumer at ``op``'s commit (and a prompt end, a pin)."""
        op.extra[key] = op.extra.get(key, 0) + 1
        if end:
            op.extra_ends[key] = op.extra_ends.get(key, 0) + 1
        if pin:
            op.extra_pins[key] = op.extra_pins.get(key, 0) + 1

    def reaped(self, now: float) -> None:
        """After a reap: the next one is due when the first open lease or
        reservation runs out (soon again if one could not be ended now)."""
        self.next_reap = min([o.expires_at for o in self.reservations.values()]
                             + [r.expires_at for r in self.rooms.values()]
                             + [le.expires_at for le in self.leases.values()],
                             default=float("inf"))
        if self.next_reap <= now:  # a lease the index refused to end: retry soon
            self.next_reap = now + 1.0

    def writer_of(self, key: bytes) -> Open | None:
        """The open reservation writing ``key``, if any."""
        rid = self.inflight.get(key)
        return None if rid is None else self.reservations[rid]

    # ------------------------------------------------------------ leases
    def add_lease(self, aid: int, lease: Lease) -> None:
        """Open ``lease`` on keys the caller already holds: its claims (one pending
        consumer per key, and its prompt end) are counted here."""
        self.leases[aid] = lease
        if lease.claim:
            count(self.claims, lease.keys)
        if lease.end is not None:
            self.end_claims[lease.end] = self.end_claims.get(lease.end, 0) + 1
        self.due(lease.expires_at)

    def end_lease(self, lease: Lease) -> None:
        """Give back what ``lease`` holds and claims (it may be open or not)."""
        uncount(self.leased, lease.keys)
        if lease.claim:
            uncount(self.claims, lease.keys)
        if lease.end is not None:
            uncount(self.end_claims, [lease.end])

    def hold_send(self, aid: int) -> None:
        """Hold the keys of open lease ``aid`` once more, for as long as its reply's
        bytes are being sent from the arena (whatever becomes of the lease)."""
        keys = list(self.leases[aid].keys)
        self.hold(keys)
        self.sends[aid] = keys

    def end_send(self, aid: int) -> list[bytes]:
        """The reply of ``hold_send(aid)`` is out: its holds go; the keys now due to be
        freed (as ``unhold``)."""
        return self.unhold(self.sends.pop(aid))

    def close_lease(self, aid: int) -> None:
        """Forget open lease ``aid`` once ``end_lease`` has given its holds back."""
        del self.leases[aid]

    def unclaimed(self, rec: Record) -> int:
        """Pending consumers of ``rec`` no open lease has claimed."""
        return rec.pending - self.claims.get(rec.key, 0)

    def unclaimed_ends(self, rec: Record) -> int:
        """Prompt ends at ``rec`` no open lease has claimed."""
        return rec.ends - self.end_claims.get(rec.key, 0)

    def due(self, expires_at: float) -> None:
        """A reservation or lease runs out at ``expires_at``: reap no later."""
        self.next_reap = min(self.next_reap, expires_at)

    def open_reservation(self, rid: int) -> Open:
        return self._found(self.reservations, "reservation", rid)

    def open_lease(self, aid: int) -> Lease:
        return self._found(self.leases, "acquisition", aid)

    def _found(self, table: Mapping[int, _T], what: str, ident: int) -> _T:
        """``table[ident]``, or the clear error: expired (reaped lately) or unknown."""
        found = table.get(ident)
        if found is None:
            raise self._gone(what, ident)
        return found

    def remember_expired(self, ident: int) -> None:
        self._expired[ident] = None
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)

    def remember_ended_sent(self, aid: int, keys: tuple[bytes, ...] | int,
                            expires_at: float, now: float) -> None:
        """Lease ``aid``, ended on sending its bytes: ``keys`` (a count, where its
        entries went with a drop), kept until ``expires_at`` (its reader's release
        comes within the lease), the last ``_EXPIRED_MEMORY`` and at most
        ``_ENDED_KEYS`` keys of them: a busy server's good reads, every one of which
        is remembered, hold a bounded few MiB."""
        ended = self._ended_sent
        ended[aid] = (keys, expires_at)
        self._ended_keys += len(keys) if isinstance(keys, tuple) else 0
        while ended:
            first, until = next(iter(ended.values()))
            if until > now and len(ended) <= _EXPIRED_MEMORY \
                    and self._ended_keys <= _ENDED_KEYS:
                break
            ended.popitem(last=False)
            self._ended_keys -= len(first) if isinstance(first, tuple) else 0

    def ended_sent(self, aid: int) -> tuple[bytes, ...] | int | None:
        """Lease ``aid``'s keys (a count, for a drop_select's), if the server ended
        it on sending its bytes (``Reads.end_sent``) and its lease would still run;
        else None."""
        found = self._ended_sent.get(aid)
        return None if found is None else found[0]

    def _gone(self, what: str, ident: int) -> Exception:
        if ident in self._expired:
            return LeaseExpiredError(f"{what} {ident} expired and was reclaimed")
        return NotFoundError(f"no open {what} {ident}")


# ``collections.Counter``'s helper: ``counts[k] = counts.get(k, 0) + 1`` for each key,
# in C in CPython (a pure-Python fallback elsewhere); not in typeshed's stubs.
_count_elements: Callable[[dict, Iterable], None] = getattr(collections, "_count_elements")


def count(counts: dict[bytes, int], keys: Sequence[bytes]) -> None:
    """One more of each key in ``counts`` (``uncount``'s inverse), in C:
    ``collections.Counter``'s own helper, which takes any mapping."""
    _count_elements(counts, keys)


def uncount(counts: dict[bytes, int], keys: Sequence[bytes]) -> None:
    """One less of each key in ``counts``; a key at zero leaves it (so ``counts``
    only ever holds positive counts). Each key must be there: one that is not
    (the books are broken already) raises ``KeyError``, before any change when
    the keys are distinct and more than 4, else after those before it."""
    if len(keys) > 4 and len(set(keys)) == len(keys):  # the usual: each key once
        held = list(map(counts.__getitem__, keys))
        ones = held.count(1)
        if ones == len(held):  # (C-level passes; the loop below for a mix)
            list(map(counts.__delitem__, keys))
            return
        if not ones:
            counts.update(zip(keys, map(operator.sub, held, itertools.repeat(1))))
            return
    for key in keys:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]
