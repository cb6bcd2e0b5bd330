"""How entries change place: allocation with room-making, demotion down the tiers,
and staging of NVMe hits into memory; the class says what it owns and keeps."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

from kvstore.core.config import KVStoreConfig
from kvstore.core.errors import MissError, StorageError, TierFullError
from kvstore.core.hashing import checksum
from kvstore.store.bytes_io import ByteIO
from kvstore.store.catalog import Catalog
from kvstore.store.holds import Holds
from kvstore.store.index import Record, on_disk, tier_of
from kvstore.store.order import GroupOrder
from kvstore.store.policy import (
    Candidate,
    EvictionPolicy,
    Selection,
    bytes_to_free,
    demote_mark,
    over_watermark,
)
from kvstore.store.types import MEMORY_TIERS, NO_ROOM_TO_STAGE, TIER_ORDER
from tiers.base import Extent, Tier, free_by_tier

log = logging.getLogger(__name__)


class StagingPlan(NamedTuple):
    """What an acquire stages (``Placement.plan_staging``)."""

    recs: list[Record]  # the held prefix, as walked
    staging: list[tuple[int, Extent | None]]  # each NVMe entry's index and staging extent
    upto: int  # the prefix ends before this index: no room to stage it
    target: str  # the memory tier staged into


# Pinned or leased entries a chunk of demotion or eviction ahead passes over, per entry
# it may take.
DEMOTE_SKIP_FACTOR = 16
# Entries a writeback round copies at most (besides policy.writeback_batch_bytes): its
# allocation and its record of the copies hold the store's lock for each of them
# (~60 ms at 16k small entries, what 64 MiB of 4 KiB ones would be).
WRITEBACK_ROUND_ENTRIES = 1024


class WritebackWindow(NamedTuple):
    """What a writeback round walks (``Placement.writeback_window``)."""

    tier: str  # the tier right above NVMe
    order: GroupOrder  # its victim order
    heap: list[tuple]  # a copy of that order's heap, taken under the lock
    ahead: int  # bytes of it the next demotions would take


class Placement:
    """Owner of: the tiers (``tiers``, fastest first; it closes them) and the victim
    policy (``policy``). Runs under the store's lock; every record change goes
    through ``Catalog.apply``, every hold through ``Holds``.

    Invariants kept here:
    * Room is made by policy victims only; leased and pinned entries are never
      victims, so when they fill a tier the caller gets ``TierFullError``.
    * Demotion writes (and flushes, per ``nvme_fsync``) the lower tier before the
      index points there; a crash in between leaves the old record, which restart
      drops with its volatile tier.
    """

    def __init__(self, config: KVStoreConfig, tiers: dict[str, Tier], policy: EvictionPolicy,
                 catalog: Catalog, holds: Holds, io: ByteIO, counts: Counter) -> None:
        self.config = config
        self.tiers = tiers
        self.policy = policy
        self.catalog = catalog
        self.holds = holds
        self.io = io
        self.counts = counts
        # NVMe extents of copies a writeback round is writing (no record owns them yet)
        self.copies_in_flight: list[Extent] = []
        # Staging extents of acquires whose NVMe reads are under way (plan_staging),
        # by id(plan): no record owns them until settle_staging.
        self.staging_in_flight: dict[int, StagingPlan] = {}

    def candidates(self, name: str) -> list[Candidate]:
        """Every entry of tier ``name`` as the policy sees it (for evict / demote)."""
        ps = self.tiers[name].page_size
        recs = self.catalog.records
        return [Candidate(k, -(-recs[k].nbytes // ps) * ps, recs[k].last_access,
                          recs[k].created, recs[k].pins, self.holds.leased.get(k, 0))
                for k in self.catalog.by_tier[name]]

    def free(self, extents: list[Extent]) -> None:
        """Give extents no record owns back to their tiers (a reservation given up)."""
        free_by_tier(self.tiers, extents)

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()

    # ------------------------------------------------------------ room
    def allocate_memory(self, sizes: list[int]) -> list[Extent]:
        """Extents in the fastest memory tier that has (or can make) room."""
        errors = []
        for name in MEMORY_TIERS:
            if name in self.tiers:
                try:
                    return self.allocate_in(name, sizes)
                except TierFullError as exc:
                    errors.append(f"{name}: {exc}")
        raise TierFullError(f"no room for {len(sizes)} entries ({sum(sizes)} bytes); "
                            f"pinned and leased entries are never evicted ({'; '.join(errors)})")

    def allocate_in(self, name: str, sizes: list[int]) -> list[Extent]:
        """Extents in tier ``name``; above the high watermark, LRU entries move down
        first until the tier would sit at the low watermark."""
        tier = self.tiers[name]
        page = tier.page_size
        need = sum(-(-n // page) * page for n in sizes)
        if need > tier.capacity:
            raise TierFullError(f"{need} bytes exceed the tier's capacity {tier.capacity}")
        pol = self.config.policy
        if over_watermark(tier.used, need, tier.capacity, pol.high_watermark):
            try:
                self.shed(name, bytes_to_free(tier.used, need, tier.capacity,
                                              pol.low_watermark))
            except (TierFullError, StorageError):
                pass  # the index refused the moves (full): what is free may still do
        while True:
            try:
                return tier.allocate_many(list(sizes))
            except TierFullError:
                # Not enough free, or too fragmented: move more out, give up when
                # nothing movable is left.
                if not self.shed(name, need):
                    raise

    def room_extent(self, nbytes: int, held: int) -> Extent | None:
        """An extent of ``nbytes`` of the DRAM tier for a writer's room, if it fits
        below the high watermark and, with the ``held`` bytes of the rooms already
        open, within ``policy.room_fraction`` of the tier; else None. Never makes
        room: a room is taken from free space only, so granting one never costs a
        stored entry. (Held, it counts as used, as the insert it will hold: the
        background's demotion and eviction ahead make room past it.) (DRAM only:
        rooms are for writers on this node, which copy into the shared arena,
        ``Writes.grant_room``.)"""
        pol, tier = self.config.policy, self.tiers.get("dram")
        if tier is None:
            return None
        need = -(-nbytes // tier.page_size) * tier.page_size
        if (need + held > tier.capacity * pol.room_fraction
                or over_watermark(tier.used, need, tier.capacity, pol.high_watermark)):
            return None
        try:
            return tier.allocate(need)
        except TierFullError:  # too fragmented
            return None

    def retain(self, room: Extent, pieces: list[tuple[int, int]]) -> list[Extent]:
        """The extents ``pieces`` (``(offset, nbytes)`` inside ``room``) cut out of a
        room; the rest of the room is free again. A bad piece: ``InvalidRequestError``
        and nothing changed."""
        return self.tiers[room.tier].retain(room, pieces)

    def allocate_each(self, name: str, recs: list[Record]) -> list[Extent | None]:
        """One extent per record (a batch when possible); None where none fits."""
        try:
            return list(self.allocate_in(name, [r.nbytes for r in recs]))
        except TierFullError:
            pass
        out: list[Extent | None] = []
        try:
            for rec in recs:
                try:
                    out.append(self.allocate_in(name, [rec.nbytes])[0])
                except TierFullError:
                    out.append(None)
        except BaseException:  # room-making failed (the index refused a demotion)
            for ext in out:
                if ext is not None:
                    self.tiers[name].free(ext)
            raise
        return out

    def shed(self, name: str, nbytes: int) -> int:
        """Move policy victims out of tier ``name`` (down, or gone from the last
        tier); returns the bytes chosen. On NVMe, copies of entries that are served
        from memory go first: dropping one loses no entry."""
        if nbytes <= 0:
            return 0
        freed = 0
        if name == "nvme" and self.catalog.copies:
            sel = self._victims(self.catalog.copy_order, "nvme", nbytes, copies=True)
            self.catalog.apply(put=[self.catalog.records[k]._replace(nvme_copy=None) for k in sel.keys])
            freed = sel.nbytes
        if freed < nbytes:
            sel = self._victims(self.catalog.orders[name], name, nbytes - freed)
            if sel.keys:
                self.move_down(name, sel.keys)
            freed += sel.nbytes
        return freed

    def _victims(self, order: GroupOrder, name: str, nbytes: int,
                 copies: bool = False) -> Selection:
        """Policy victims worth ``nbytes`` of tier ``name``, walking its kept order
        (O(victims + skipped), not a sort of the tier). A copy is never leased:
        dropping it leaves the entry where it is served from; but not the copy a
        staging under way is reading (another reader staged the entry first)."""
        walk = order.walk()
        try:
            return self._take(walk, name, nbytes, copies)
        finally:
            walk.close()

    def _take(self, recs: Iterable[Record], name: str, nbytes: int,
              copies: bool = False) -> Selection:
        """The policy's victims worth ``nbytes`` among ``recs`` (in policy order) of
        tier ``name``: their sizes in its pages, pinned and held ones passed over."""
        page = self.tiers[name].page_size
        reading = {plan.recs[i].key for plan in self.staging_in_flight.values()
                   for i, _ in plan.staging} if copies else set()
        leased = self.holds.leased
        return self.policy.take(
            (Candidate(r.key, -(-r.nbytes // page) * page, r.last_access, r.created,
                       r.pins, int(r.key in reading) if copies else leased.get(r.key, 0))
             for r in recs), nbytes)

    def move_down(self, name: str, keys: list[bytes]) -> None:
        recs = self._back_to_copies([self.catalog.records[k] for k in keys])
        below = [n for n in TIER_ORDER[TIER_ORDER.index(name) + 1:] if n in self.tiers]
        moved, left = self._write_below(recs, below)
        self.catalog.apply_or_free(put=moved, drop=[r.key for r in left])
        self.counts["demotions"] += len(moved)
        self.counts["evictions"] += len(left)

    def _back_to_copies(self, recs: list[Record]) -> list[Record]:
        """Demote the entries that have an NVMe copy straight back to it (no write
        needed); returns the others. Done first, before room-making below could
        drop those very copies."""
        back = [on_disk(r) for r in recs if r.nvme_copy is not None]
        self.catalog.apply(put=back)
        self.counts["demotions"] += len(back)
        return [r for r in recs if r.nvme_copy is None]

    def _write_below(self, recs: list[Record],
                     below: list[str]) -> tuple[list[Record], list[Record]]:
        """Copy ``recs`` into the first tier of ``below`` with room for each; returns
        (their moved records, not yet applied; those no tier could take). On error
        the new extents are freed and the records stay where they were."""
        moved: list[Record] = []
        try:
            for dst in below:
                if not recs:
                    break
                exts = self.allocate_each(dst, recs)
                pairs = [(r, e) for r, e in zip(recs, exts) if e is not None]
                moved += [r._replace(tier=dst, offset=e.offset) for r, e in pairs]
                # one call per run of adjacent extents on NVMe (tiers/nvme_runs.py)
                self.tiers[dst].write_many([e for _, e in pairs],
                                            [memoryview(self.io.read_bytes(r)) for r, _ in pairs])
                if dst == "nvme" and self.config.tiers.nvme_fsync != "never":
                    self.tiers[dst].flush()  # durable before the index points at it
                recs = [r for r, e in zip(recs, exts) if e is None]
        except BaseException:
            for rec in moved:
                self.tiers[rec.tier].free(self.io.extent(rec))
            raise
        return moved, recs

    def restore_watermarks(self) -> None:
        pol = self.config.policy
        for name, tier in self.tiers.items():
            if over_watermark(tier.used, 0, tier.capacity, pol.high_watermark):
                self.shed(name, bytes_to_free(tier.used, 0, tier.capacity, pol.low_watermark))

    # ------------------------------------------------------------ writeback
    # A round's choice is made in three steps, so that the walk of the window (its
    # least recently used entries: O(entries in it), ~55 ms at 25k entries) does
    # not hold the store's lock: ``writeback_window`` under the lock (a copy of the
    # tier's order), ``writeback_candidates`` without it (the walk of that copy),
    # ``allocate_writeback`` under it again (each candidate checked afresh).
    # ``plan_writeback`` makes all three at once, under the caller's lock.
    def plan_writeback(self, limit: int) -> list[tuple[Record, Extent]]:
        """The next background writeback round: the least-recently-used entries of
        the tier right above NVMe that the next demotions (down to the low
        watermark, three rounds ahead) would take and that have no NVMe copy yet,
        each with a free NVMe extent for its copy, at most ``limit`` bytes. Free
        NVMe space only: a round never evicts anything (``evict_ahead`` keeps
        room free). The caller reads and
        writes their bytes without the store's lock. The entries are *not* held:
        a round must never keep room-making from demoting or evicting them (a
        reserve that needs the room would fail), so an entry may move or go while
        its copy is written; ``finish_writeback`` then throws that copy away. (The
        arena stays mapped, so such a read is only stale, never a fault.)"""
        window = self.writeback_window()
        if window is None:
            return []
        return self.allocate_writeback(self.writeback_candidates(window, limit), limit)

    def _above_nvme(self, background: bool = True) -> str | None:
        """The tier right above NVMe, whose entries the background copies and
        demotes; None without NVMe, without a tier above it, or (``background``)
        with ``policy.background_writeback`` off."""
        names = [n for n in self.tiers if n != "nvme"]
        if "nvme" not in self.tiers or not names or \
                (background and not self.config.policy.background_writeback):
            return None
        return names[-1]

    def writeback_window(self) -> WritebackWindow | None:
        """Under the lock: what a round walks (None: nothing to copy). The window
        is the ``ahead`` bytes the next three demotions would take: a shed frees down
        to low (plus what the reserve that triggers it needs), and the next ones come
        after (high - low) more bytes each."""
        name = self._above_nvme()
        if name is None:
            return None
        ahead = self._window_bytes(name)
        if ahead <= 0 or self.catalog.copied[name] == len(self.catalog.by_tier[name]):
            return None  # every entry of the tier has its copy: known without a walk
        order = self.catalog.orders[name]
        return WritebackWindow(name, order, order.snapshot(), ahead)

    def _window_bytes(self, name: str) -> int:
        """The bytes of tier ``name`` (right above NVMe) the next three demotions
        would take: its use above ``low - 2 (high - low)`` of it (0 if none)."""
        pol, tier = self.config.policy, self.tiers[name]
        start = max(0.0, pol.low_watermark - 2 * (pol.high_watermark - pol.low_watermark))
        return max(0, tier.used - int(tier.capacity * start))

    def writeback_candidates(self, window: WritebackWindow, limit: int) -> list[bytes]:
        """Without the lock (or with it): the window's entries that have no copy, in
        policy order, about ``limit`` bytes of them (``allocate_writeback`` stops at
        ``limit``; a few more cover the ones that changed meanwhile). Reads only
        records and leases, one dict read each (atomic under the GIL)."""
        records = self.catalog.records
        sel = self._take(window.order.walk_snapshot(window.heap), window.tier, window.ahead)
        keys: list[bytes] = []
        planned = 0
        for key in sel.keys:
            rec = records.get(key)
            if rec is None or rec.nvme_copy is not None:
                continue
            if planned > 2 * limit or len(keys) >= 2 * WRITEBACK_ROUND_ENTRIES:
                break
            keys.append(key)
            planned += rec.nbytes
        return keys

    def allocate_writeback(self, keys: list[bytes], limit: int) -> list[tuple[Record, Extent]]:
        """Under the lock: a free NVMe extent for each of ``keys`` that is still in
        the tier above NVMe, without a copy, and neither pinned nor leased, up to
        ``limit`` bytes and ``WRITEBACK_ROUND_ENTRIES`` entries (at least one)."""
        name = self._above_nvme(background=False)
        if name is None:
            return []
        nvme = self.tiers["nvme"]
        plan: list[tuple[Record, Extent]] = []
        planned = 0
        for key in keys:
            rec = self.catalog.records.get(key)
            if rec is None or rec.tier != name or rec.nvme_copy is not None or rec.pins \
                    or self.holds.leased.get(key):
                continue
            if (planned + rec.nbytes > limit or len(plan) >= WRITEBACK_ROUND_ENTRIES) and plan:
                break
            try:
                ext = nvme.allocate(rec.nbytes)
            except TierFullError:
                break
            plan.append((rec, ext))
            planned += rec.nbytes
        self.copies_in_flight += [ext for _, ext in plan]
        return plan

    def demote_ahead(self, most: int, going: bool = False) -> int:
        """Under the lock, from the writeback thread: once the tier right above NVMe
        holds more than halfway from the low watermark to the high one (or, when
        ``going``, the demotion begun, more than the low watermark), demote up to
        ``most`` of its policy victims that have their NVMe copy (an index flip, no
        write), towards the low watermark, so that a request's reserve seldom
        crosses the high watermark and sheds on the serving thread. Stops at the
        first victim without a copy (the next writeback round copies it: nothing is
        written under the lock here). Returns the bytes freed (0: nothing to do)."""
        name = self._above_nvme()
        if name is None:
            return 0
        want = self._ahead(name, going)
        if not want:
            return 0
        # The policy's order, leased entries passed over (as victims are chosen),
        # at most ``most`` taken a chunk (``_chunk``).
        recs: list[Record] = []
        freed = 0
        leased, page = self.holds.leased, self.tiers[name].page_size
        walk = self.catalog.orders[name].walk()
        try:
            for rec in self._chunk(walk, most):
                if rec.pins or leased.get(rec.key):
                    continue
                if rec.nvme_copy is None:
                    break
                recs.append(rec)
                freed += -(-rec.nbytes // page) * page  # (what the tier's use counts)
                if freed >= want:
                    break
        finally:
            walk.close()
        if not recs:
            return 0
        self._back_to_copies(recs)
        return freed

    def evict_ahead(self, most: int, going: bool = False) -> int:
        """Under the lock, from the writeback thread: once the last tier (NVMe, or
        the lowest memory tier of a server without one) holds more than halfway
        from the low watermark to the high one (or, when ``going``, the eviction
        begun, more than the low watermark), evict up to ``most`` of its own policy
        victims, pinned and leased ones passed over, towards the low watermark. The
        tier then keeps free room: the writeback's copies and the demotions into it
        find it there, and a request seldom sheds the last tier (a tenth of it, in
        one index transaction) on the serving thread. Returns the bytes freed."""
        names = [n for n in TIER_ORDER if n in self.tiers]
        pol = self.config.policy
        if not names or not pol.background_writeback:
            return 0
        name = names[-1]
        want = self._ahead(name, going)
        if not want:
            return 0
        walk = self.catalog.orders[name].walk()
        try:
            sel = self._take(self._chunk(walk, most), name, want)
        finally:
            walk.close()
        if sel.keys:
            self.move_down(name, sel.keys)  # gone: no tier below
        return sel.nbytes

    def _ahead(self, name: str, going: bool) -> int:
        """The bytes the background's demotion or eviction ahead frees from tier
        ``name`` now: down to the low watermark once it holds more than
        ``demote_mark`` (when ``going``, the work begun: more than the low
        watermark); 0 below that."""
        pol, tier = self.config.policy, self.tiers[name]
        mark = pol.low_watermark if going else \
            demote_mark(pol.high_watermark, pol.low_watermark)
        used = self._stored(name)
        if used <= tier.capacity * mark:
            return 0
        return bytes_to_free(used, 0, tier.capacity, pol.low_watermark)

    def _stored(self, name: str) -> int:
        """What tier ``name`` holds for the background's demotion and eviction ahead:
        its use, but on NVMe not the copies past the bytes of the writeback's window
        (counted by bytes, not by whose copies they are). Copies of entries read
        again after they were copied are no next demotions any more (a prefix
        cache's hot entries), and can pile up to the whole tier above NVMe; counted,
        they would push out entries that live on NVMe alone, where a shed on the
        request path drops copies first. (Writers' open rooms count as used: each
        is its writer's next insert. Left out, they kept a tier's real use over the
        high watermark, where ``room_extent`` grants no next room, and writers fell
        back to two round trips an insert.)"""
        used = self.tiers[name].used
        if name == "nvme" and self.catalog.copy_bytes:
            above = self._above_nvme(background=False)
            window = self._window_bytes(above) if above is not None else 0
            return used - max(0, self.catalog.copy_bytes - window)
        return used

    def _chunk(self, recs: Iterable[Record], most: int) -> Iterable[Record]:
        """``recs`` up to the ``most``-th one that is neither pinned nor leased, and
        at most ``DEMOTE_SKIP_FACTOR * most`` of those passed over."""
        leased = self.holds.leased
        movable = skipped = 0
        for rec in recs:
            if rec.pins or leased.get(rec.key):
                skipped += 1
                if skipped > DEMOTE_SKIP_FACTOR * most:
                    return
            else:
                movable += 1
                if movable > most:
                    return
            yield rec

    def finish_writeback(self, plan: list[tuple[Record, Extent]], written: bool) -> int:
        """Record the copies ``plan``'s writes made (``written``: they reached NVMe,
        flushed per ``nvme_fsync``) on the entries that are still where they were
        when the round read them (same tier, offset and checksum: the bytes read
        are theirs); every other extent goes back. Returns how many copies were
        recorded."""
        done = {ext.offset for _, ext in plan}
        self.copies_in_flight = [e for e in self.copies_in_flight if e.offset not in done]
        put, unused = [], []
        for rec, ext in plan:
            cur = self.catalog.records.get(rec.key)
            if (written and cur is not None and cur.nvme_copy is None and cur.tier == rec.tier
                    and cur.offset == rec.offset and cur.checksum == rec.checksum):
                put.append(cur._replace(nvme_copy=ext.offset))
            else:
                unused.append(ext)
        try:
            self.catalog.apply(put=put)
        except BaseException:
            unused = [ext for _, ext in plan]
            put = []
            raise
        finally:
            for ext in unused:
                self.tiers["nvme"].free(ext)
        self.counts["writebacks"] += len(put)
        return len(put)

    # ------------------------------------------------------------ staging
    # Three steps, so that the NVMe reads and their checksums run without the
    # store's lock (``Reads.begin_acquire``): ``plan_staging`` (lock: the staging
    # extents), ``read_staging`` (no lock: NVMe reads into those extents, which no
    # record owns yet, and checksums), ``settle_staging`` (lock: the index changes).
    # The entries are held all along, so none of them can move or go meanwhile.
    def plan_staging(self, recs: list[Record]) -> StagingPlan | None:
        """Staging extents for the NVMe entries of a held prefix; None: there are none."""
        if "nvme" not in map(tier_of, recs):  # the usual case, in one C-level pass
            return None
        nv = [i for i, r in enumerate(recs) if r.tier == "nvme"]
        stage = self.config.policy.stage_nvme_hits
        target = "dram" if "dram" in self.tiers else "gpu"
        exts: list[Extent | None] = [None] * len(nv)
        if stage:
            try:
                exts = self.allocate_each(target, [recs[i] for i in nv])
            except StorageError:  # making room needs index writes the disk refuses:
                pass              # none staged, the prefix ends there (short)
        # the prefix ends before the first entry that should stage but found no room
        upto = next((i for i, e in zip(nv, exts) if stage and e is None), len(recs))
        plan = StagingPlan(list(recs), list(zip(nv, exts)), upto, target)
        self.staging_in_flight[id(plan)] = plan
        return plan

    def read_staging(self, plan: StagingPlan) -> tuple[dict[int, memoryview], dict[int, bool]]:
        """The plan's NVMe reads, each into its staging extent (or a scratch buffer),
        and whether each matched its checksum. Needs no store lock (the NVMe tier
        serialises its own I/O); ``MissError`` on an I/O error (nothing changed)."""
        which = [i for i, _ in plan.staging if i < plan.upto]
        try:
            bufs = self._read_nvme(plan.recs, which, dict(plan.staging))
        except OSError as exc:
            raise MissError(f"NVMe read failed staging {len(plan.staging)} entries: "
                            f"{exc}") from exc
        return bufs, {i: checksum(bufs[i]) == plan.recs[i].checksum for i in which}

    def abandon_staging(self, plan: StagingPlan) -> None:
        """Give the plan's staging extents back (they have no owner yet)."""
        self.staging_in_flight.pop(id(plan), None)
        for _, ext in plan.staging:
            if ext is not None:
                self.tiers[ext.tier].free(ext)

    def settle_staging(self, plan: StagingPlan, bufs: dict[int, memoryview],
                       good: dict[int, bool]) -> tuple[list[Record], str]:
        """After ``read_staging``: the staged entries now live in memory (their NVMe
        bytes stay as their copy), corrupt ones are dropped and counted (kept while
        someone else holds them: their reads verify). Returns the prefix that can be
        served and why it is shorter than the plan's when the reason is room
        (``NO_ROOM_TO_STAGE``; "" otherwise). The caller gives back the holds of the
        cut tail."""
        recs, upto, target = plan.recs, plan.upto, plan.target
        self.staging_in_flight.pop(id(plan), None)
        cut, moved, bad = len(recs), [], []
        for i, ext in plan.staging:
            cur = self.catalog.records.get(recs[i].key)
            if i >= cut or i >= upto or cur is None:
                cut = min(cut, i)
            elif cur.tier != "nvme" or cur.offset != recs[i].offset:
                pass  # a concurrent reader staged it first: serve its copy
            elif not good[i]:
                bad.append(recs[i].key)  # only the bytes of ext (if any) changed
                cut = i
            elif ext is not None:
                if self.tiers[target].view(ext) is None:  # read into a scratch buffer
                    self.tiers[target].write(ext, bufs[i])
                # the current record: its counts may have changed while it was read
                moved.append(cur._replace(tier=target, offset=ext.offset,
                                          nvme_copy=cur.offset))
                continue
            if ext is not None:
                self.tiers[target].free(ext)
        # A bad entry someone else still holds stays until then (its reads verify).
        bad = [k for k in bad if self.holds.leased.get(k, 0) <= 1]
        self.catalog.apply_or_free(put=moved, drop=bad)
        self.counts["stagings"] += len(moved)
        self.counts["checksum_failures"] += len(bad)
        short = NO_ROOM_TO_STAGE if upto < len(recs) and cut == upto else ""
        return recs[:cut], short

    def _read_nvme(self, recs: list[Record], which: list[int],
                   exts: dict[int, Extent | None]) -> dict[int, memoryview]:
        """Read NVMe entries ``recs[i]`` for ``i in which`` in one batch (adjacent
        extents in one call), each straight into its staging extent's view where
        the tier has one, else into a scratch buffer."""
        bufs: dict[int, memoryview] = {}
        for i in which:
            ext = exts[i]
            view = self.tiers[ext.tier].view(ext) if ext is not None else None
            bufs[i] = view if view is not None else memoryview(bytearray(recs[i].nbytes))
        self.tiers["nvme"].read_many([self.io.extent(recs[i]) for i in which],
                                      [bufs[i] for i in which])
        return bufs

