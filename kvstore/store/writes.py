"""The write path of the store: reserve -> write -> commit (or abort).

Operations over the store's parts (parts.py): every method takes the store's lock
and changes records only through the catalog, holds only through ``Holds``.

Invariants kept here:
* a key is in ``holds.inflight`` exactly while one open reservation holds an
  extent for it, so two writers never store the same key twice;
* a reservation's dedups onto committed keys are held (leased) until it commits
  or aborts, so the entries it counted on cannot go meanwhile;
* nothing becomes visible unless every new entry matches its checksum;
* a reserve, commit or put that the store reaches after its writer's ``deadline``
  changes nothing (its reservation or room is given back): the writer was told
  it failed, and a reservation nobody writes would hold its keys from other
  writers, who dedup onto it, until its lease ends;
* answered first (``store.answer_first``): a commit or put whose caller passes
  ``later`` is answered once everything that can fail is done (checks, the room,
  the index write of its records) and hands the rest, the in-memory book-keeping
  that makes the entries visible (records, victim orders, holds, counters), to
  ``later``. The caller (the server) keeps the store's lock from the request to the
  end of that work and runs it right after sending the reply: no other thread and
  no other request sees the store in between, and a writer told "stored" is never
  wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvstore.core.errors import (
    LATE_WRITE,
    ChecksumError,
    InvalidRequestError,
    NotFoundError,
    StorageError,
)
from kvstore.core.hashing import checksum, hidden_key
from kvstore.store.index import COMMITTED, Record
from kvstore.store.holds import Open, Room
from kvstore.store.parts import Operations
from kvstore.store.types import (
    CommitResult,
    EntryPlacement,
    PutResult,
    Reservation,
    RoomGrant,
    check_keys,
    check_lease,
    check_meta,
    check_namespace,
    check_sizes,
    check_tokens,
    new_id,
)

# Where a commit or put hands the in-memory rest of its work once its answer is
# known (the server: runs it after sending the reply, the store's lock held
# throughout; module docstring).
Later = Callable[[Callable[[], None]], None]


class Writes(Operations):
    def reserve(self, keys: Sequence[bytes], sizes: Sequence[int], tokens: Sequence[bytes],
                meta: Sequence[bytes | None] | None = None,
                lease_s: float | None = None, namespace: bytes = b"",
                deadline: float | None = None) -> Reservation:
        """Space for the keys not yet stored, in the fastest memory tier with room.

        ``namespace``: the writer's ``hashing.namespace_of`` fingerprint (16 bytes, or
        its first 8); the new records keep its first 8 bytes so ``ls`` can filter.
        ``deadline`` (``time.time()``): reached later, ``BusyError`` and nothing
        reserved (``_refuse_late``)."""
        keys = check_keys(keys)
        ns_tag = check_namespace(namespace)
        sizes = check_sizes(sizes, len(keys))
        tokens = check_tokens(tokens, len(keys))
        metas = check_meta(meta, len(keys))
        lease = check_lease(lease_s, self.config.store.reservation_lease_s)
        with self.lock:
            self._refuse_late(deadline, "reserve")
            self.reap_due()
            new, held = self._split_new(keys)
            self.holds.hold(held)
            try:
                extents = self.place.allocate_memory([sizes[i] for i in new]) if new else []
            except BaseException:
                self.catalog.drop_idle(self.holds.unhold(held))
                raise
            op = Open(new_id(), keys, tokens, metas, [None] * len(keys), held,
                      time.time() + lease, {}, ns_tag)
            for i, ext in zip(new, extents):
                op.extents[i] = ext
            self.holds.add_reservation(op)
            # Again: making room (demotions to NVMe) may have taken past it.
            self._refuse_late(deadline, "reserve", lambda: self.close_reservation(op))
            return Reservation(op.id, self._placements(op), op.expires_at)

    def _split_new(self, keys: list[bytes]) -> tuple[list[int], list[bytes]]:
        """Indexes of the keys this reservation writes (first of each, not stored, not
        in flight), and the stored keys it dedups onto (to hold until commit)."""
        new, held, seen = [], [], set()
        for i, key in enumerate(keys):
            if key in self.catalog.records:
                held.append(key)
            elif key not in seen and key not in self.holds.inflight:
                new.append(i)
                seen.add(key)
        return new, held

    def _placements(self, op: Open) -> list[EntryPlacement | None]:
        return [None if e is None else EntryPlacement(k, e.tier, e.offset, e.nbytes,
                                                 self.place.tiers[e.tier].address(e))
                for k, e in zip(op.keys, op.extents)]

    def write(self, reservation_id: int, index: int, data) -> None:
        """Copy one new entry's bytes into its reserved extent (local writers)."""
        with self.lock:
            op = self.holds.open_reservation(reservation_id)
            ext = op.extents[index] if 0 <= index < len(op.extents) else None
            if ext is None:
                raise InvalidRequestError(f"reservation has no placement {index} to write")
            self.io.write(ext, memoryview(data))

    def commit(self, reservation_id: int, checksums: Sequence[int],
               pin: bool = False, deadline: float | None = None,
               next_room: int = 0, later: Later | None = None) -> CommitResult:
        """Verify the written bytes and make the reservation's entries visible.

        ``pin``: pin every entry this commit stores or dedups onto, in the same
        locked step, so no eviction can come between the entry appearing and its
        pin (a separate ``pin`` call races room-making by other writers).
        ``deadline``: reached later, the reservation is aborted (``_refuse_late``).
        ``next_room``: bytes of room to grant the writer for its next insert, in the
        same locked step (``grant_room``; ``room`` in the result). ``later``: answer
        first where allowed (``store.answer_first``; the module's docstring)."""
        with self.lock:
            op = self.holds.open_reservation(reservation_id)
            self._refuse_late(deadline, "commit", lambda: self.close_reservation(op))
            new = [i for i, e in enumerate(op.extents) if e is not None]
            sums = _match_checksums(checksums, len(op.keys), new)
            done = self._commit_open(op, new, sums, pin, deadline, "commit",
                                     self._later(later))
            return done._replace(room=self.grant_room(next_room))

    def _commit_open(self, op: Open, new: list[int], sums: list[int], pin: bool,
                     deadline: float | None = None, what: str = "commit",
                     later: Later | None = None) -> CommitResult:
        """Commit open reservation ``op``, whose entries ``new`` were written with
        checksums ``sums``: checked now, or by the scrub soon (``verify_commits``).
        Past ``deadline`` once hashed inline, ``op`` is closed and nothing stored (the
        caller checked it before: without hashing nothing slow came since).
        ``later``: where the in-memory book-keeping goes (``_commit_verified``)."""
        if self.config.store.verify_commits == "background":
            return self._commit_verified(op, new, sums, pin, later, unchecked=True)
        got = self.io.checksums([e for e in op.extents if e is not None])
        bad = [op.keys[i] for i, s, g in zip(new, sums, got) if g != s]
        if bad:
            self.close_reservation(op)
            self.counts["commit_checksum_failures"] += len(bad)
            raise ChecksumError(f"{len(bad)} of {len(new)} written entries do not match "
                                f"their checksum (first {bad[0].hex()}); nothing stored")
        # Again: hashing a large commit may have taken past it.
        self._refuse_late(deadline, what, lambda: self.close_reservation(op))
        return self._commit_verified(op, new, sums, pin, later)

    # ------------------------------------------------------------ rooms
    # A room is standing room a writer on this node holds for its next insert: it
    # copies that insert's entries into the room (in the shared DRAM arena) at
    # offsets of its own choosing, then ``put`` stores them in one step (what reserve
    # + commit do in two round trips). Rooms are cut from free space only
    # (``Placement.room_extent``) and reclaimed when their lease runs out, as a
    # reservation's extents are (``store.reservation_lease_s``: the lease is what
    # keeps a writer stalled mid-copy from writing into space given to another). Only same-node writers get them: a writer copies into a
    # room before the server has said the room is still there, which is safe only
    # through the arena file of the very server process that granted it (a
    # restarted server has a new file); a TE write to a restarted server with the
    # same segment name could land on someone else's entry.
    def grant_room(self, nbytes: int) -> RoomGrant | None:
        """A room of ``nbytes`` (page-rounded) in the DRAM tier, or None: 0 asked,
        rooms off, or not that much free below the high watermark and the room
        share. (Commit and put grant one in their own locked step when the writer
        asks: ``next_room``.)"""
        if nbytes <= 0 or self.config.policy.room_fraction <= 0:
            return None
        with self.lock:
            ext = self.place.room_extent(nbytes, self.holds.room_bytes())
            if ext is None:
                return None
            lease = self.config.store.reservation_lease_s
            room = Room(new_id(), ext, time.time() + lease, lease)
            self.holds.add_room(room)
            tier = self.place.tiers[ext.tier]
            return RoomGrant(room.id, ext.tier, ext.offset, ext.nbytes, tier.address(ext),
                             tier.page_size, lease)

    def put(self, room_id: int, keys: Sequence[bytes], sizes: Sequence[int],
            tokens: Sequence[bytes], offsets: Sequence[int], checksums: Sequence[int],
            meta: Sequence[bytes | None] | None = None, skip: int = 0, pin: bool = False,
            namespace: bytes = b"", deadline: float | None = None,
            next_room: int = 0, later: Later | None = None) -> PutResult:
        """Store entries a writer has already copied into room ``room_id``: the
        reserve and the commit of ``keys`` in one step. ``deadline``: reached later,
        the room goes back (``_refuse_late``). ``next_room``: as ``commit``'s (the
        new room is granted once this one is spent). ``later``: as ``commit``'s.

        ``offsets`` and ``checksums`` are given for ``keys[skip:]`` (the first
        ``skip`` keys carry no bytes: the writer found them stored; if one is not,
        ``NotFoundError``, nothing is stored and the room is spent). Each entry lies at its offset from
        the room's start, page-aligned, inside the room, overlapping no other
        (else ``InvalidRequestError`` and nothing changes). Keys stored already or
        being written dedup as a reservation's do, their bytes unused (``existing``
        in the result). The room is then spent: what no new entry took is free
        again. A room reclaimed (its lease ran out) or never granted:
        ``LeaseExpiredError`` / ``NotFoundError``."""
        keys = check_keys(keys)
        ns_tag = check_namespace(namespace)
        sizes = check_sizes(sizes, len(keys))
        tokens = check_tokens(tokens, len(keys))
        metas = check_meta(meta, len(keys))
        n = len(keys)
        if type(skip) is not int or not 0 <= skip <= n:
            raise InvalidRequestError(f"skip must be in 0..{n}, got {skip!r}")
        if len(offsets) != n - skip:
            raise InvalidRequestError(f"{len(offsets)} offsets for {n - skip} written keys")
        for off in offsets:
            if type(off) is not int or off < 0:
                raise InvalidRequestError(f"offsets must be ints >= 0, got {off!r}")
        sums = _match_checksums(checksums, n - skip, list(range(n - skip)))
        with self.lock:
            self.reap_due()
            open_room = self.holds.open_room(room_id)
            self._refuse_late(deadline, "put", lambda: self.close_room(room_id))
            new, held = self._split_new(keys)
            if new and new[0] < skip:
                self.close_room(room_id)  # spent: the writer reserves anew
                raise NotFoundError(f"the server lacks block {new[0]} of the {skip} the "
                                    f"insert skipped (evicted since it was found): not stored")
            start = open_room.extent.offset
            extents = self.place.retain(open_room.extent,
                                        [(start + offsets[i - skip], sizes[i]) for i in new])
            self.holds.take_room(room_id)
            self.holds.hold(held)
            op = Open(new_id(), keys, tokens, metas, [None] * n, held,
                      time.time() + self.config.store.reservation_lease_s, {}, ns_tag)
            for i, ext in zip(new, extents):
                op.extents[i] = ext
            self.holds.add_reservation(op)
            try:
                result = self._commit_open(op, new, [sums[i - skip] for i in new], pin,
                                           deadline, "put", self._later(later))
            except BaseException:
                if op.id in self.holds.reservations:  # not stored: the room is spent anyway
                    self.close_reservation(op)
                raise
            return PutResult(result.new, result.deduped, result.lost,
                             tuple(i for i in range(skip, n) if op.extents[i] is None),
                             self.grant_room(next_room))

    def _later(self, later: Later | None) -> Later | None:
        """``later`` if commits may be answered first (``store.answer_first``)."""
        return later if self.config.store.answer_first else None

    def close_room(self, room_id: int) -> None:
        """Give room ``room_id`` back (reaped, or its writer is done with it)."""
        self.place.free([self.holds.take_room(room_id).extent])

    # ------------------------------------------------------------ the scrub
    def unchecked_batch(self, batch_bytes: int, min_age_s: float = 0.0) -> list[Record]:
        """The next records committed unhashed (oldest first, up to ``batch_bytes``,
        committed at least ``min_age_s`` ago) that are still in a memory tier; the
        rest of those looked at leave the list (gone, or moved to NVMe: every read
        from NVMe is verified)."""
        picked: list[Record] = []
        size = 0
        unchecked, records = self.catalog.unchecked, self.catalog.records
        young = time.time() - min_age_s
        stale = []
        for key, value in unchecked.items():
            if size >= batch_bytes:
                break
            rec = records.get(key)
            if rec is None or rec.tier == "nvme" or rec.checksum != value:
                stale.append(key)
                continue
            if rec.created > young:
                break  # commit order: the rest are younger still
            picked.append(rec)
            size += rec.nbytes
        for key in stale:
            del unchecked[key]
        return picked

    def finish_check(self, checked: list[Record], sums: list[int]) -> list[bytes]:
        """Settle a scrub round whose hashes ran without the lock. A record that is
        still the same one (same place, same commit) and matched is checked. A
        mismatch is hashed again now, under the lock (its extent may have been freed
        and rewritten while it was hashed); if still bad the record is condemned
        (``catalog.condemned``: every read of it verifies) and dropped as soon as no
        one holds it (``drop_condemned``). Returns the keys found bad."""
        bad: list[bytes] = []
        unchecked, records = self.catalog.unchecked, self.catalog.records
        for rec, got in zip(checked, sums):
            now = records.get(rec.key)
            if now is None or unchecked.get(rec.key) != rec.checksum:
                continue  # gone, or a new record under the key: its own entry decides
            if (now.tier, now.offset, now.created) != (rec.tier, rec.offset, rec.created):
                continue  # moved or stored again meanwhile: its entry decides
            del unchecked[rec.key]
            if got != rec.checksum and checksum(self.io.read_bytes(now)) != now.checksum:
                bad.append(rec.key)
                self.catalog.condemn(now)
        return bad

    def drop_condemned(self) -> list[bytes]:
        """Drop the condemned records no one holds any more (those the scrub found
        counted in ``commit_checksum_failures``); the held ones wait for their holders. If the
        index refuses the drop, they stay condemned and are tried again."""
        records, condemned = self.catalog.records, self.catalog.condemned
        due = []
        for key, created in list(condemned.items()):
            rec = records.get(key)
            if rec is None or rec.created != created:
                del condemned[key]  # gone, or stored again since
                self.catalog.reported.discard(key)
            elif not self.holds.leased.get(key):
                due.append(key)
        if not due:
            return []
        scrubbed = sum(key not in self.catalog.reported for key in due)
        try:
            self.catalog.apply(drop=due)  # leaves ``condemned`` with the records
        except StorageError:
            return []  # counted and logged by the catalog
        self.counts["commit_checksum_failures"] += scrubbed
        return due

    def _commit_verified(self, op: Open, new: list[int], sums: list[int], pin: bool = False,
                         later: Later | None = None, unchecked: bool = False) -> CommitResult:
        """Store ``op``'s checked (or, ``unchecked``, to-be-scrubbed) entries: the index
        first (if it refuses, nothing changed and the error is the caller's), then
        memory, the holds and the counters (``books``), now or, given ``later``,
        handed to it: the caller answers first and runs it before anyone else may use
        the store (module docstring)."""
        put = _new_records(op, new, sums, time.time())
        deduped, lost, onto = self._count_dedups(op, put, pin)
        if pin:
            put = {k: r._replace(pins=r.pins + 1) for k, r in put.items()}
        records = list(put.values())
        self.catalog.write_index(records)

        def books() -> None:
            self.catalog.apply_memory(records)
            for other, key, end, pin_it in onto:  # (only now the other writers' books)
                self.holds.dedup_onto(other, key, end=end, pin=pin_it)
            written = [e for e in op.extents if e is not None]
            self.counts["bytes_in"] += sum(e.nbytes for e in written)
            for ext in written:
                self.tier_bytes[ext.tier, "bytes_in"] += ext.nbytes
            self.counts["commits"] += 1
            if unchecked:  # Store.scrub_step hashes them soon
                for i, s in zip(new, sums):
                    self.catalog.unchecked[op.keys[i]] = s
            # Last: the only index write left (freeing what no one holds any more),
            # which never fails the commit (``drop_idle``).
            self.catalog.drop_idle(self.holds.end_reservation(op))

        if later is None:
            books()
        else:
            later(books)
        return CommitResult(len(new), deduped, lost)

    def _count_dedups(self, op: Open, put: dict[bytes, Record], pin: bool = False
                      ) -> tuple[int, int, list[tuple[Open, bytes, bool, bool]]]:
        """Give each deduped key of ``op`` its extra pending consumer in ``put``;
        returns (deduped, lost, the dedups onto other writers' in-flight keys, as
        ``Holds.dedup_onto`` arguments, for the caller to apply once ``put`` is)."""
        deduped = lost = 0
        onto: list[tuple[Open, bytes, bool, bool]] = []
        pinned: set[bytes] = set()
        end = prompt_end(op.keys)
        for i in (i for i, e in enumerate(op.extents) if e is None):
            key = op.keys[i]
            rec = put.get(key) or self.catalog.records.get(key)
            if rec is not None and rec.tokens == op.tokens[i]:
                put[key] = rec._replace(pending=rec.pending + 1,
                                        ends=rec.ends + (key == end))
                deduped += 1
            elif rec is None and (other := self.holds.writer_of(key)) is not None \
                    and other is not op:
                pin_it = pin and key not in pinned  # one pin per key, as for committed keys
                pinned.add(key)
                onto.append((other, key, key == end, pin_it))
                deduped += 1
            else:  # its writer gave up, or a different block under the same key
                lost += 1
        return deduped, lost, onto

    def _refuse_late(self, deadline: float | None, op: str,
                     undo: Callable[[], None] | None = None) -> None:
        """``Operations.late`` for a writer's request: the writer reported the insert
        failed, so nothing is stored or held for it. Counted in ``late_writes``."""
        self.late(deadline, op, LATE_WRITE, "reserved" if op == "reserve" else "stored",
                  "late_writes", undo)

    def abort(self, reservation_id: int) -> None:
        """Forget a reservation, or give a room back; its space is free at once,
        nothing becomes visible."""
        with self.lock:
            if reservation_id in self.holds.rooms:
                self.close_room(reservation_id)
                return
            self.close_reservation(self.holds.open_reservation(reservation_id))
            self.counts["aborts"] += 1

    def close_reservation(self, op: Open) -> None:
        """Give a reservation up (abort, expiry, bad checksum): its extents are free
        at once, nothing of it becomes visible."""
        self.place.free([ext for ext in op.extents if ext is not None])
        self.catalog.drop_idle(self.holds.end_reservation(op))


def _new_records(op: Open, new: list[int], sums: list[int], now: float) -> dict[bytes, Record]:
    """The records of ``op``'s written entries; each starts with one pending consumer
    plus those that deduped onto it while it was in flight."""
    put: dict[bytes, Record] = {}
    end = prompt_end(op.keys)
    keys, extents, tokens, metas, namespace = op.keys, op.extents, op.tokens, op.meta, \
        op.namespace
    extra_pins, extra, extra_ends = op.extra_pins, op.extra, op.extra_ends
    # tuple.__new__: a NamedTuple's own __new__ is a Python call per entry (and
    # keyword arguments a third more); the fields in Record's order.
    make = tuple.__new__
    for i, s in zip(new, sums):
        key, ext, tok = keys[i], extents[i], tokens[i]
        assert ext is not None  # ``new`` lists the written placements only
        put[key] = make(Record, (key, ext[0], ext[1], ext[2], len(tok) // 4, tok, s, now,
                                 now, extra_pins.get(key, 0), 1 + extra.get(key, 0), metas[i],
                                 COMMITTED, None, namespace,
                                 (key == end) + extra_ends.get(key, 0)))
    return put


def _match_checksums(checksums: Sequence[int], nkeys: int, new: list[int]) -> list[int]:
    """Checksums of the new placements: given per key (deduped ones ignored) or per
    new placement only."""
    if len(checksums) == nkeys:
        picked = [checksums[i] for i in new]
    elif len(checksums) == len(new):
        picked = list(checksums)
    else:
        raise InvalidRequestError(f"{len(checksums)} checksums for {nkeys} keys "
                                  f"({len(new)} new placements)")
    if all(type(s) is int and 0 <= s < 2**64 for s in picked):
        return picked  # the usual case, one pass (a subclass of int takes the long way)
    for s in picked:
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < 2**64:
            raise InvalidRequestError(f"checksum must be a uint64, got {s!r}")
    return picked


def prompt_end(keys: Sequence[bytes]) -> bytes:
    """The key of a reservation's last block: its last key, or the one before when
    the last is that block's hidden-state entry (``hashing.hidden_key``)."""
    if len(keys) >= 2 and keys[-1] == hidden_key(keys[-2]):
        return keys[-2]
    return keys[-1]
