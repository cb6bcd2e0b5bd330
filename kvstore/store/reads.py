"""The read path of the store: lookup, acquire -> read -> release.

Operations over the store's parts (parts.py): every method takes the store's lock
and changes records only through the catalog, holds only through ``Holds``.

Invariants kept here:
* a prefix ends at the first missing key or the first key whose stored tokens
  differ (a hash collision): a reader never gets another block's KV;
* every key of an open acquisition is held (``holds.leased``) until its release or
  expiry, so it cannot move or go while a reader may be reading it;
* ``holds.claims[key]`` is the number of open claiming leases on ``key`` and never
  exceeds its pending consumers: drop_select hands each insert out once.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Callable, Final, cast

from kvstore.core.errors import LATE_READ, ChecksumError, InvalidRequestError
from kvstore.core.hashing import checksum
from kvstore.store.index import Record, key_of, pending_of, pins_of, tier_of
from kvstore.store.holds import Lease
from kvstore.store.parts import Operations
from kvstore.store.placement import StagingPlan
from kvstore.store.types import (
    Acquisition,
    EntryInfo,
    LookupResult,
    check_keys,
    check_lease,
    check_tokens,
    new_id,
)
from tiers.base import Extent

log = logging.getLogger(__name__)

# Record fields by position, for the loops that run once per entry of an acquire
# (a field by name costs a descriptor call; by index, none).
_KEY: Final = 0
_TIER: Final = 1
_OFFSET: Final = 2
_NBYTES: Final = 3
_NTOKENS: Final = 4
_TOKENS: Final = 5
_CHECKSUM: Final = 6
_PENDING: Final = 10
_META: Final = 11
assert [Record._fields[i] for i in (_KEY, _TIER, _OFFSET, _NBYTES, _NTOKENS, _TOKENS,
                                    _CHECKSUM, _PENDING, _META)] == [
    "key", "tier", "offset", "nbytes", "ntokens", "tokens", "checksum", "pending", "meta"]


class Staging:
    """An acquire waiting on NVMe (``Reads.begin_acquire``): ``read()`` without the
    store's lock, then ``finish(*read())`` under it. ``abandon()`` instead of both
    (e.g. it waited too long to start): holds, claims and extents go back and
    nothing changed."""

    def __init__(self, reads: Reads, aid: int, plan: StagingPlan, found_in: list[str],
                 lease_s: float, nblocks: int, spend_rest: bool,
                 deadline: float | None = None) -> None:
        self._reads, self.aid, self.plan = reads, aid, plan
        self.found_in, self.lease_s, self.nblocks = found_in, lease_s, nblocks
        self.spend_rest, self.deadline = spend_rest, deadline
        self.nbytes = sum(plan.recs[i].nbytes for i, _ in plan.staging)

    def read(self) -> tuple[dict, dict]:
        """The NVMe reads and their checksums; on an I/O error the staging is undone
        and ``MissError`` raised; past the reader's deadline it is undone and
        ``BusyError`` raised before any read (``Reads.refuse_late``)."""
        self._reads.refuse_late(self.deadline, self.abandon)
        try:
            return self._reads.place.read_staging(self.plan)
        except BaseException:
            self.abandon()
            raise

    def finish(self, bufs: dict, good: dict) -> Acquisition:
        """The acquisition; past the reader's deadline the staging is undone and
        ``BusyError`` raised instead (``Reads.refuse_late``)."""
        self._reads.refuse_late(self.deadline, self.abandon)
        return self._reads.finish_staging(self, bufs, good)

    def abandon(self) -> None:
        """Undo it, unless it is finished or undone already (then nothing happens)."""
        if id(self.plan) in self._reads.place.staging_in_flight:
            self._reads.finish_staging(self, None, None)


class Reads(Operations):
    _short_logged_at = -10.0  # when a staging shortfall was last logged
    def lookup(self, keys: Sequence[bytes], tokens: Sequence[bytes]) -> LookupResult:
        """Longest stored prefix; binds nothing (it may be gone by the next call)."""
        keys = check_keys(keys)
        tokens = check_tokens(tokens, len(keys))
        with self.lock:
            recs = self._walk(keys, tokens)
            return LookupResult(len(recs), sum(r.ntokens for r in recs), [r.tier for r in recs])

    def acquire(self, keys: Sequence[bytes], tokens: Sequence[bytes],
                lease_s: float | None = None, claim: bool = False,
                optional_tail: bool = False, spend_rest: bool = False,
                deadline: float | None = None) -> Acquisition:
        """Longest stored prefix, leased (cannot move or go) until ``release``.

        NVMe entries are staged into a memory tier and checksum-verified first; a
        bad one is dropped and counted, and the prefix ends before it.

        ``claim`` (drop_select): also reserve one of each entry's pending consumers
        for this lease, and end the prefix at an entry whose pending consumers are
        all claimed by open leases. So N concurrent drop_selects of an entry
        inserted once get it exactly once. ``release(drop=True)`` spends the claim;
        ``release(drop=False)`` or an expired lease gives it back.

        ``optional_tail``: the last key is an optional extra (a prompt's hidden-state
        entry), not a block: served or absent, it counts as neither hit nor miss.

        ``spend_rest`` (with ``claim``): these keys are the rest of a drop_select
        whose earlier round already took the prompt's first blocks. If none of them
        can be staged, they are spent now (one pending consumer each, as a
        drop_select would): with their head gone no whole-prompt read could ever
        reach them, so they would sit stranded until evicted. The caller hears how
        many (``spent``) next to ``short``.

        ``deadline`` (``time.time()``): where the store reaches the acquire later, or
        finishes its staging later, the reader has stopped waiting: ``BusyError``,
        nothing leased (``refuse_late``).
        """
        step = self.begin_acquire(keys, tokens, lease_s, claim, optional_tail, spend_rest,
                                  deadline)
        if isinstance(step, Acquisition):
            return step
        return step.finish(*step.read())

    def begin_acquire(self, keys: Sequence[bytes], tokens: Sequence[bytes],
                      lease_s: float | None = None, claim: bool = False,
                      optional_tail: bool = False, spend_rest: bool = False,
                      deadline: float | None = None) -> Acquisition | Staging:
        """``acquire`` in steps, so that the server's request thread never waits on
        NVMe: the Acquisition at once when nothing needs staging, else a ``Staging``
        whose ``read()`` (no lock: NVMe reads and checksums, in a worker) and
        ``finish()`` (lock: book-keeping) make it. Until then the prefix is held and
        claimed by a lease that does not expire and that no client knows."""
        keys = check_keys(keys)
        tokens = check_tokens(tokens, len(keys))
        lease_s = check_lease(lease_s, self.config.store.read_lease_s)
        with self.lock:
            self.refuse_late(deadline)
            self.reap_due()
            recs = self._walk(keys, tokens)
            take, end = True, None
            if claim:
                recs, take, end = self._takeable(recs, len(keys) - bool(optional_tail))
                claim = take
            found_in = list(map(tier_of, recs))
            nblocks = len(keys) - bool(optional_tail)
            self.holds.hold(list(map(key_of, recs)))
            try:
                plan = self.place.plan_staging(recs)
            except BaseException:
                self.catalog.drop_idle(self.holds.unhold([r.key for r in recs]))
                raise
            if plan is None:
                self._count_hits(found_in, len(recs), nblocks)
                if not recs:
                    return Acquisition(0, [], 0, time.time())
                return self._lease_prefix(recs, found_in, lease_s, claim, take, end,
                                          reread=False)
            aid = new_id()
            # The holds just taken become this lease's; it claims what the reply will.
            self.holds.add_lease(aid, Lease([r.key for r in recs], float("inf"), claim, take,
                                            end))
            return Staging(self, aid, plan, found_in, lease_s, nblocks, spend_rest, deadline)

    def refuse_late(self, deadline: float | None,
                    undo: Callable[[], None] | None = None) -> None:
        """``Operations.late`` for an acquire: a lease taken for a reader that has
        gone would keep its prompt from every other reader until it ran out. Counted
        in ``late_reads``."""
        self.late(deadline, "acquire", LATE_READ, "acquired", "late_reads", undo)

    def finish_staging(self, staging: Staging, bufs: dict | None, good: dict | None
                       ) -> Acquisition:
        """``Staging.finish``: settle what was read (``bufs``/``good`` None: the
        read failed or was given up; the staging is undone) and open the lease the
        client gets on what can be served."""
        with self.lock:
            if id(staging.plan) not in self.place.staging_in_flight:
                raise InvalidRequestError("this staging was finished or abandoned already")
            lease = self.holds.leases.get(staging.aid)
            # The placeholder lease: ended here, then the served prefix gets its own.
            if lease is not None:
                self.holds.end_lease(lease)
                self.holds.close_lease(staging.aid)
            plan = staging.plan
            keys = [r.key for r in plan.recs]
            if bufs is None or good is None or lease is None:
                self.place.abandon_staging(plan)
                self.catalog.drop_idle([k for k in keys if k in self.catalog.records
                                        and self.holds.idle_at_zero(self.catalog.records[k])])
                return Acquisition(0, [], 0, time.time())
            self.holds.hold(keys)  # back for the settling, as one acquire holds them
            try:
                recs, short = self.place.settle_staging(plan, bufs, good)
            except BaseException:
                self.catalog.drop_idle(self.holds.unhold(keys))
                raise
            gone = self.holds.unhold(keys[len(recs):])
            self.catalog.drop_idle(gone)
            # Entries cut for want of staging room are found, not missed: the
            # caller may take them in another round.
            found_in = staging.found_in
            self._count_hits(found_in, len(found_in) if short else len(recs), staging.nblocks)
            if short:
                self._staging_short(len(found_in) - len(recs), len(found_in))
            if not recs:
                wanted = keys if lease.claim else []
                spent = self._spend(wanted, lease.end) if staging.spend_rest and short else 0
                return Acquisition(0, [], 0, time.time(), short, spent)
            return self._lease_prefix(recs, found_in, staging.lease_s, lease.claim, lease.take,
                                      lease.end)._replace(short=short)

    def _takeable(self, recs: list[Record],
                  nblocks: int) -> tuple[list[Record], bool, bytes | None]:
        """What a drop_select (claiming acquire) of the walked prefix ``recs`` gets,
        and whether it takes it. It takes only an insert's own blocks: the longest
        prefix whose entries all have an unclaimed pending consumer and whose last
        block is where some insert's prompt ended (an unclaimed ``ends``). A prefix
        no insert ended in (a prompt sharing only the first blocks of stored ones)
        is read, not taken; one whose ends are all claimed by concurrent
        drop_selects is a miss (each insert is handed out once). Returns (the
        prefix, whether it is taken, the prompt end it takes)."""
        claimable = self._claimable_prefix(recs)
        blocks = claimable[:nblocks]
        for i in range(len(blocks) - 1, -1, -1):
            if self.holds.unclaimed_ends(blocks[i]) > 0:
                # the hidden entry (after the last block) comes along only then
                upto = i + 1 + (i + 1 == nblocks and len(claimable) > nblocks)
                return claimable[:upto], True, blocks[i].key
        if any(r.ends for r in recs[:nblocks]):
            return [], True, None  # an insert ends here, its consumer is reading it
        return recs, False, None

    def _spend(self, keys: list[bytes], end: bytes | None) -> int:
        """Spend one pending consumer of each of ``keys`` (and the prompt end
        ``end``) as a drop_select's release would, without reading them. Returns
        how many entries that freed."""
        keys = [k for k in keys if k in self.catalog.records]
        if not keys:
            return 0
        end = end if end in keys else None
        # An unread lease, opened and ended at once, as a drop_select's would be.
        lease = Lease(keys, float("inf"), claim=False, take=True, end=end)
        self.holds.hold(keys)
        aid = new_id()
        self.holds.add_lease(aid, lease)
        self.holds.close_lease(aid)
        freed = self.end_lease(lease, drop=True)
        log.warning("a drop_select took the first blocks of a prompt and no memory room "
                    "was left to stage the rest: spent %d stranded entries (%d freed)",
                    len(keys), freed)
        self.counts["staging_spent"] += len(keys)
        return len(keys)

    def _staging_short(self, cut: int, found: int) -> None:
        self.counts["staging_shortfalls"] += 1
        now = time.monotonic()
        if now - self._short_logged_at >= 10.0:  # once per 10 s
            self._short_logged_at = now
            log.warning("no memory room to stage %d of %d NVMe-backed entries of a read "
                        "(pinned/leased entries fill it, or the prompt is bigger than it): "
                        "served the first %d (%d shortfalls so far)", cut, found,
                        found - cut, self.counts["staging_shortfalls"])

    def _count_hits(self, found_in: list[str], served: int, blocks: int) -> None:
        served = min(served, blocks)
        for tier, n in Counter(found_in[:served]).items():
            self.hits[tier] += n
        self.counts["misses"] += blocks - served

    def _lease_prefix(self, recs: list[Record], found_in: list[str], lease_s: float,
                      claim: bool, take: bool = True, end: bytes | None = None,
                      reread: bool = True) -> Acquisition:
        """Open the lease on ``recs`` (already held) and set their access times to now:
        at once for a plain read (a get), whose entries stay; for a drop_select's
        claim when the lease ends, on the entries it leaves stored (``end_lease``):
        most go at its release, so its reply waits for no record rewritten per entry,
        and held meanwhile, they are no eviction's victims (a victim walk meets them
        at their old place, and skips them, for the lease's few milliseconds)."""
        now = time.time()
        if reread:
            # Room-making while staging may have dropped NVMe copies of these
            # (held) entries; nothing else about them can have changed.
            records = self.catalog.records
            recs = [records[r.key] for r in recs]
        aid = new_id()
        keys = list(map(key_of, recs))
        if end is not None and end not in keys:
            end = None  # staging cut the lease before the prompt's end: a later round
        if not claim:
            self.catalog.touch(keys, now)
        self.holds.add_lease(aid, Lease(keys, now + lease_s, claim, take, end,
                                        now if claim else None))
        nbytes = sum([r[_NBYTES] for r in recs])
        self.counts["bytes_out"] += nbytes
        if len(set(found_in)) == 1 and len(found_in) == len(recs):  # the usual case
            self.tier_bytes[found_in[0], "bytes_out"] += nbytes
        else:
            for tier, rec in zip(found_in, recs):  # counted where it was found
                self.tier_bytes[tier, "bytes_out"] += rec.nbytes
        return Acquisition(aid, self._infos(recs), sum([r[_NTOKENS] for r in recs]),
                           now + lease_s)

    def read(self, acquisition_id: int, index: int) -> bytes:
        """The bytes of one acquired entry (local readers)."""
        with self.lock:
            lease = self.holds.open_lease(acquisition_id)
            if not 0 <= index < len(lease.keys):
                raise InvalidRequestError(f"acquisition has no entry {index}")
            rec = self.catalog.records[lease.keys[index]]
            data = bytes(self.io.read_bytes(rec))
            unchecked = (rec.tier == "nvme" or rec.key in self.catalog.unchecked
                         or rec.key in self.catalog.condemned)
            if unchecked and checksum(data) != rec.checksum:
                self.counts["checksum_failures"] += 1
                raise ChecksumError(f"entry {rec.key.hex()} failed its checksum on read")
            return data

    def release(self, acquisition_id: int, drop: bool = False,
                corrupt: Sequence[int] = ()) -> int:
        """End a lease. ``drop`` (drop_select) decrements each entry's pending count;
        entries at zero are freed once nothing else holds them. Returns how many
        entries were freed now.

        ``corrupt``: positions of the lease's entries whose bytes failed the
        reader's checksum. Then every entry of the lease is re-checked here: one
        whose stored bytes are bad is counted in ``checksum_failures`` and dropped
        (it could never be served again); a reported one that is fine at rest was
        damaged in transit (``transfer_checksum_failures``) and stays. A bad one
        that another lease (or a reply being sent) still holds is condemned instead:
        acquires stop before it, and it goes once nothing holds it
        (``Writes.drop_condemned``). The reader's word alone drops nothing."""
        with self.lock:
            if acquisition_id == 0:
                return 0  # the empty acquisition of a full miss
            ended = self.holds.ended_sent(acquisition_id)
            if isinstance(ended, int):  # a drop_select's, gone: only a report to hear
                return self._reported_gone(acquisition_id, ended, corrupt)
            if ended is not None:  # a get's: its entries stay, to be checked
                return self._drop_bad(self._bad_at_rest(ended, corrupt))
            lease = self.holds.open_lease(acquisition_id)
            bad = self._bad_at_rest(lease.keys, corrupt)
            freed = self.end_lease(lease, drop)  # raises with nothing changed
            self.holds.close_lease(acquisition_id)
            return freed + self._drop_bad(bad)

    def _drop_bad(self, bad: list[bytes]) -> int:
        """Drop the entries found bad at rest (those another lease or a reply still
        holds: condemned, gone once free); how many went now. Under the lock."""
        if not bad:
            return 0
        records, leased = self.catalog.records, self.holds.leased
        free = []
        for key in (k for k in bad if k in records):
            if leased.get(key):  # others hold it: never served again, gone when free
                self.catalog.condemn(records[key], reported=True)
            else:
                free.append(key)
        self.catalog.apply(drop=free)
        return len(free)

    def end_sent(self, acquisition_id: int, drop: bool) -> int:
        """The server handed every byte of the acquisition's reply to its socket and
        ends the lease itself (``Acquire.release_sent``), as ``release(drop)`` would;
        how many entries went. Remembered (``Holds.ended_sent``), so the reader's
        release after a failed read ends nothing twice and its report of corrupt
        entries is still counted."""
        with self.lock:
            lease = self.holds.open_lease(acquisition_id)
            freed = self.release(acquisition_id, drop)
            taken = drop and lease.take  # (its entries went: a count will do)
            self.holds.remember_ended_sent(
                acquisition_id, len(lease.keys) if taken else tuple(lease.keys),
                lease.expires_at, time.time())
            return freed

    def _reported_gone(self, aid: int, entries: int, corrupt: Sequence[int]) -> int:
        """A report on a drop_select's lease ended once sent: its entries went with
        the drop, so the ones reported bad are counted unchecked; nothing else."""
        positions = _positions(corrupt, entries)
        if positions:
            self.counts["unchecked_checksum_failures"] += len(positions)
            log.error("the reader of acquisition %d reports %d entries corrupt that went "
                      "when the server sent them: not checked at rest", aid, len(positions))
        return 0

    def _bad_at_rest(self, keys: Sequence[bytes], corrupt: Sequence[int]) -> list[bytes]:
        """The keys of a lease (``keys``, in order) bad at rest, when its reader
        reported the entries at ``corrupt`` bad on arrival; each counted: bad at rest
        (``checksum_failures``), fine at rest (``transfer_checksum_failures``), or no
        longer stored (``unchecked_checksum_failures``: gone since, e.g. evicted
        after a lease the server ended on sending it, ``end_sent``)."""
        positions = _positions(corrupt, len(keys))
        if not positions:
            return []
        # A reader stops at its first bad entry; a stray writer rarely hits just
        # one. So every entry of the lease is checked (memory speed), not only those.
        bad = []
        for key in dict.fromkeys(keys):
            rec = self.catalog.records.get(key)
            if rec is not None and checksum(self.io.read_bytes(rec)) != rec.checksum:
                bad.append(rec.key)
        self.counts["checksum_failures"] += len(bad)
        reported = {keys[i] for i in positions}
        gone = {k for k in reported if k not in self.catalog.records}
        self.counts["unchecked_checksum_failures"] += len(gone)
        self.counts["transfer_checksum_failures"] += len(reported - gone - set(bad))
        if gone:
            log.error("%d entries reported corrupt by a reader are no longer stored: not "
                      "checked at rest (first %s)", len(gone), next(iter(gone)).hex())
        if bad:
            log.error("%d entries reported corrupt by a reader are bad at rest: dropped "
                      "(first %s)", len(bad), bad[0].hex())
        return bad

    def _claimable_prefix(self, recs: list[Record]) -> list[Record]:
        claims = self.holds.claims  # (``Holds.unclaimed``, inlined: once per entry)
        if not claims and min(map(pending_of, recs), default=1) > 0:
            return recs  # the usual case (no drop_select in flight), in one C-level pass
        for i, rec in enumerate(recs):
            if rec[_PENDING] - claims.get(rec[_KEY], 0) <= 0:
                return recs[:i]
        return recs

    def end_lease(self, lease: Lease, drop: bool) -> int:
        """Give back the lease's holds (and claims); with ``drop``, one pending
        consumer per key. The index write comes first: if it fails, the lease,
        its holds, claims and records are exactly as they were. Without ``drop``
        nothing but idle entries' drops is written, and a refused one leaves them
        stored (``Catalog.drop_idle``). Returns how many entries went."""
        records, leased = self.catalog.records, self.holds.leased
        if drop and lease.take and self._all_go(lease):
            self.catalog.apply(drop=list(lease.keys))
            self.holds.end_lease(lease)
            self.counts["dropped"] += len(lease.keys)
            return len(lease.keys)
        times = Counter(lease.keys)
        recs = {k: records[k] for k in times if k in records}
        drop = drop and lease.take
        at = lease.read_at
        # What the drop leaves pending, without building records for those it ends.
        left = {k: max(0, r.pending - times[k]) if drop else r.pending
                for k, r in recs.items()}
        gone = [k for k, r in recs.items() if left[k] == 0 and r.pins == 0
                and leased.get(k, 0) <= times[k]]
        if not drop:
            # Only idle entries to drop: if the index refuses that (a full map or
            # disk), they stay, idle and evictable, and the lease ends all the same.
            dropped = self.catalog.drop_idle(gone)
            if at is not None:
                self.catalog.touch(recs, at)
            self.holds.end_lease(lease)
            return dropped
        put = []
        going = set(gone)  # not the list: ``in`` on it made a release O(entries^2)
        for k, r in recs.items():
            if k not in going:
                r = r._replace(pending=left[k], last_access=max(r.last_access, at or 0.0))
                put.append(r._replace(ends=max(0, r.ends - 1)) if k == lease.end else r)
        self.catalog.apply(put=put, drop=gone)
        self.holds.end_lease(lease)
        self.counts["dropped"] += len(gone)
        return len(gone)

    def _all_go(self, lease: Lease) -> bool:
        """Whether a drop that ends ``lease`` frees every entry it holds: the usual
        drop_select, whose keys are each stored once, each with this one pending
        consumer (or none left), unpinned, held by this lease alone. Checked in
        C-level passes; ``end_lease``'s general loop then has nothing to rewrite."""
        keys = lease.keys
        found = list(map(self.catalog.records.get, keys))
        if not found or None in found or len(set(keys)) != len(keys):
            return False
        recs = cast(list[Record], found)
        return max(map(pending_of, recs)) <= 1 and max(map(pins_of, recs)) == 0 and \
            max(map(self.holds.leased.get, keys, itertools.repeat(0))) <= 1

    def _walk(self, keys: list[bytes], tokens: list[bytes]) -> list[Record]:
        condemned = self.catalog.condemned  # known bad: a miss from there on
        # The usual case in C-level passes: every key stored, none condemned, every
        # block's tokens its own.
        found = list(map(self.catalog.records.get, keys))
        if not condemned and None not in found:
            stored = cast(list[Record], found)
            if [rec[_TOKENS] for rec in stored] == list(tokens):
                return stored
        out = []
        for key, tok in zip(keys, tokens):
            rec = self.catalog.records.get(key)
            if rec is None or (condemned and key in condemned):
                break
            if rec.tokens != tok:  # a hash collision: a miss, never someone else's KV
                self.counts["collisions"] += 1
                break
            out.append(rec)
        return out

    def _infos(self, recs: list[Record]) -> list[EntryInfo]:
        """What a reader needs of each record (``EntryInfo``): the tier's base address
        looked up once per run of one tier (an extent's address is its tier's base plus
        its offset, or None), each built with ``tuple.__new__`` (an acquire builds one
        per entry: this loop was half of a 2 048-entry acquire)."""
        tiers, new = self.place.tiers, tuple.__new__
        names = list(map(tier_of, recs))
        if names and names.count(names[0]) == len(names):  # the usual case
            name = names[0]
            base = tiers[name].address(Extent(name, 0, 0))
            if base is not None:
                return [new(EntryInfo, (rec[_KEY], name, rec[_OFFSET], rec[_NBYTES],
                                        base + rec[_OFFSET], rec[_CHECKSUM], rec[_NTOKENS],
                                        rec[_META])) for rec in recs]
        out: list[EntryInfo] = []
        name, base = "", None
        for rec in recs:
            if rec.tier != name:
                name = rec.tier
                base = tiers[name].address(Extent(name, 0, 0))
            out.append(new(EntryInfo, (rec.key, name, rec.offset, rec.nbytes,
                                       None if base is None else base + rec.offset,
                                       rec.checksum, rec.ntokens, rec.meta)))
        return out


def _positions(corrupt: Sequence[int], entries: int) -> set[int]:
    """The positions a reader reported corrupt, each one of a lease of ``entries``."""
    positions = set(corrupt)
    if any(not 0 <= i < entries for i in positions):
        raise InvalidRequestError(f"corrupt: positions must be below {entries}")
    return positions
