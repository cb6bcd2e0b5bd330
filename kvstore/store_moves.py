"""How entries change place: allocation with room-making, demotion down the tiers,
staging of NVMe hits, and the one primitive that writes the index and frees space.

A mixin of ``kvstore.store.Store``: every method here runs under the store's lock
and uses its state (``_records``, ``_by_tier``, ``_leased``, ``_tiers``, ...).

Invariants kept here:
* ``_apply`` is the only place records change: the index transactions first (the
  volatile environment's, then the durable one's: ``_write_index``), then memory,
  then the freeing of every extent no record points at any more. Freeing after
  the transaction means a crash can never leave two records on one extent.
* Room is made by policy victims only; leased and pinned entries are never
  victims, so when they fill a tier the caller gets ``TierFullError``.
* Demotion writes (and flushes, per ``nvme_fsync``) the lower tier before the
  index points there; a crash in between leaves the old record, which restart
  drops with its volatile tier.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.errors import TierFullError
from kvstore.hashing import checksum
from kvstore.index import Record
from kvstore.policy import Candidate, Selection, bytes_to_free, over_watermark
from kvstore.store_order import GroupOrder
from kvstore.store_types import MEMORY_TIERS, TIER_ORDER
from tiers.base import Extent

log = logging.getLogger(__name__)


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


class Lease(NamedTuple):
    keys: list[bytes]
    expires_at: float
    claim: bool = False  # holds one pending consumer of each key (drop_select)


class MovesMixin:
    # ------------------------------------------------------------ records
    def _apply(self, put: Sequence[Record] = (), drop: Sequence[bytes] = ()) -> None:
        drop = [k for k in dict.fromkeys(drop) if k in self._records]
        if not put and not drop:
            return
        self._write_index(put, drop)
        records, by_tier, orders = self._records, self._by_tier, self._orders
        for rec in put:
            old = records.get(rec.key)
            records[rec.key] = rec
            if old is None and rec.nvme_copy is None:  # a new entry (commit): the short way
                by_tier[rec.tier][rec.key] = None
                orders[rec.tier].push(rec)
                continue
            if old is not None and old.tier != rec.tier:
                del self._by_tier[old.tier][rec.key]
            self._by_tier[rec.tier][rec.key] = None
            if rec.nvme_copy is None:
                self._copies.pop(rec.key, None)
            else:
                self._copies[rec.key] = None
            self._reordered(rec, old)
            if old is not None:
                for ext in set(_owned(old)) - set(_owned(rec)):
                    self._tiers[ext.tier].free(ext)
        for key in drop:
            rec = self._records.pop(key)
            del self._by_tier[rec.tier][key]
            self._copies.pop(key, None)
            for ext in _owned(rec):
                self._tiers[ext.tier].free(ext)

    def _write_index(self, put: Sequence[Record], drop: list[bytes]) -> None:
        """Each change into its environment: records naming NVMe bytes into the
        durable index, the rest into the volatile one (no fsync). Volatile first:
        if the durable transaction then fails, the volatile one is undone, so the
        change is still all or nothing. A record that crosses over is deleted from
        the other environment; a crash between the two transactions is harmless
        because the volatile one is discarded on start anyway."""
        vput, vdel, dput, ddel = [], [], [], []
        for rec in put:
            old = self._records.get(rec.key)
            if durable(rec):
                dput.append(rec)
                if old is not None and not durable(old):
                    vdel.append(rec.key)
            else:
                vput.append(rec)
                if old is not None and durable(old):
                    ddel.append(rec.key)
        for key in drop:
            (ddel if durable(self._records[key]) else vdel).append(key)
        if vput or vdel:
            self._vindex.apply(put=vput, delete=vdel)
        if dput or ddel:
            try:
                self._index.apply(put=dput, delete=ddel)
            except BaseException:
                if vput or vdel:
                    self._undo_volatile([r.key for r in vput] + vdel)
                raise

    def _undo_volatile(self, keys: list[bytes]) -> None:
        """Put the volatile index back as memory still has it for ``keys``."""
        back = [r for r in (self._records.get(k) for k in keys)
                if r is not None and not durable(r)]
        try:
            self._vindex.apply(put=back, delete=[k for k in keys if k not in
                                                 {r.key for r in back}])
        except Exception:  # the first error (the durable one) is the one to report
            log.exception("volatile index out of step after a failed index write")

    def _apply_or_free(self, put: list[Record], drop: list[bytes]) -> None:
        """``_apply`` for records moved into freshly allocated extents: if the index
        refuses the change, those extents go back and the records stay where they were."""
        try:
            self._apply(put=put, drop=drop)
        except BaseException:
            for rec in put:
                old = self._records[rec.key]
                if (rec.tier, rec.offset) != (old.tier, old.offset) and not (
                        rec.tier == "nvme" and rec.offset == old.nvme_copy):
                    self._tiers[rec.tier].free(Extent(rec.tier, rec.offset, rec.nbytes))
            raise

    def _reordered(self, rec: Record, old: Record | None = None) -> None:
        """Keep the victim orders (kvstore/store_order.py) in step with ``rec``, which
        just replaced ``old``: a new item where it joined a group or moved in it."""
        key = self._policy.sort_key
        moved = old is None or key(old) != key(rec)
        if moved or old.tier != rec.tier:
            self._orders[rec.tier].push(rec)
        if rec.nvme_copy is not None and (moved or old.nvme_copy is None):
            self._copy_order.push(rec)

    def _hold(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._leased[key] = self._leased.get(key, 0) + 1

    def _unhold(self, keys: Sequence[bytes]) -> list[bytes]:
        """Drop one hold per key; returns the keys now due to be freed (pending 0,
        unpinned, unheld)."""
        for key in keys:
            left = self._leased[key] - 1
            if left:
                self._leased[key] = left
            else:
                del self._leased[key]
        return [k for k in dict.fromkeys(keys)
                if k in self._records and self._idle_at_zero(self._records[k])]

    def _idle_at_zero(self, rec: Record) -> bool:
        return rec.pending == 0 and rec.pins == 0 and not self._leased.get(rec.key)

    def _drop_now(self, keys: list[bytes]) -> None:
        if keys:
            self._apply(drop=keys)
            self._stats["dropped"] += len(keys)

    # ------------------------------------------------------------ bytes
    def _extent(self, rec: Record) -> Extent:
        return Extent(rec.tier, rec.offset, rec.nbytes)

    def _bytes_at(self, ext: Extent):
        """The extent's bytes: a zero-copy view where the tier has one, else a copy."""
        tier = self._tiers[ext.tier]
        view = tier.view(ext)
        if view is not None:
            return view
        buf = bytearray(ext.nbytes)
        tier.read_into(ext, memoryview(buf))
        return buf

    def _read_bytes(self, rec: Record):
        return self._bytes_at(self._extent(rec))

    def _checksum_at(self, ext: Extent) -> int:
        return checksum(self._bytes_at(ext))

    def _checksums(self, exts: list[Extent]) -> list[int]:
        """xxh3_64 of each extent's bytes; views fetched per tier in one batch."""
        if len({e.tier for e in exts}) > 1:
            return [self._checksum_at(e) for e in exts]
        if not exts:
            return []
        views = self._tiers[exts[0].tier].views(exts)
        return [checksum(v) if v is not None else self._checksum_at(e)
                for e, v in zip(exts, views)]

    # ------------------------------------------------------------ room
    def _allocate_memory(self, sizes: list[int]) -> list[Extent]:
        """Extents in the fastest memory tier that has (or can make) room."""
        errors = []
        for name in MEMORY_TIERS:
            if name in self._tiers:
                try:
                    return self._allocate_in(name, sizes)
                except TierFullError as exc:
                    errors.append(f"{name}: {exc}")
        raise TierFullError(f"no room for {len(sizes)} entries ({sum(sizes)} bytes); "
                            f"pinned and leased entries are never evicted ({'; '.join(errors)})")

    def _allocate_in(self, name: str, sizes: list[int]) -> list[Extent]:
        """Extents in tier ``name``; above the high watermark, LRU entries move down
        first until the tier would sit at the low watermark."""
        tier = self._tiers[name]
        page = tier.page_size
        need = sum(-(-n // page) * page for n in sizes)
        if need > tier.capacity:
            raise TierFullError(f"{need} bytes exceed the tier's capacity {tier.capacity}")
        pol = self.config.policy
        if over_watermark(tier.used, need, tier.capacity, pol.high_watermark):
            self._shed(name, bytes_to_free(tier.used, need, tier.capacity, pol.low_watermark))
        while True:
            try:
                return tier.allocate_many(list(sizes))
            except TierFullError:
                # Not enough free, or too fragmented: move more out, give up when
                # nothing movable is left.
                if not self._shed(name, need):
                    raise

    def _allocate_each(self, name: str, recs: list[Record]) -> list[Extent | None]:
        """One extent per record (a batch when possible); None where none fits."""
        try:
            return list(self._allocate_in(name, [r.nbytes for r in recs]))
        except TierFullError:
            pass
        out: list[Extent | None] = []
        for rec in recs:
            try:
                out.append(self._allocate_in(name, [rec.nbytes])[0])
            except TierFullError:
                out.append(None)
        return out

    def _shed(self, name: str, nbytes: int) -> int:
        """Move policy victims out of tier ``name`` (down, or gone from the last
        tier); returns the bytes chosen. On NVMe, copies of entries that are served
        from memory go first: dropping one loses no entry."""
        if nbytes <= 0:
            return 0
        freed = 0
        if name == "nvme" and self._copies:
            sel = self._victims(self._copy_order, "nvme", nbytes, copies=True)
            self._apply(put=[self._records[k]._replace(nvme_copy=None) for k in sel.keys])
            freed = sel.nbytes
        if freed < nbytes:
            sel = self._victims(self._orders[name], name, nbytes - freed)
            if sel.keys:
                self._move_down(name, sel.keys)
            freed += sel.nbytes
        return freed

    def _victims(self, order: GroupOrder, name: str, nbytes: int,
                 copies: bool = False) -> Selection:
        """Policy victims worth ``nbytes`` of tier ``name``, walking its kept order
        (O(victims + skipped), not a sort of the tier). A copy is never leased:
        dropping it leaves the entry where it is served from."""
        page = self._tiers[name].page_size
        walk = order.walk()
        try:
            return self._policy.take(
                (Candidate(r.key, -(-r.nbytes // page) * page, r.last_access, r.created,
                           r.pins, 0 if copies else self._leased.get(r.key, 0))
                 for r in walk), nbytes)
        finally:
            walk.close()

    def _move_down(self, name: str, keys: list[bytes]) -> None:
        recs = [self._records[k] for k in keys]
        below = [n for n in TIER_ORDER[TIER_ORDER.index(name) + 1:] if n in self._tiers]
        # An entry with an NVMe copy goes straight back to it: no write needed. Done
        # first, before room-making below could drop those very copies.
        back = [r._replace(tier="nvme", offset=r.nvme_copy, nvme_copy=None)
                for r in recs if r.nvme_copy is not None]
        self._apply(put=back)
        self._stats["demotions"] += len(back)
        recs = [r for r in recs if r.nvme_copy is None]
        moved: list[Record] = []
        try:
            for dst in below:
                if not recs:
                    break
                exts = self._allocate_each(dst, recs)
                pairs = [(r, e) for r, e in zip(recs, exts) if e is not None]
                moved += [r._replace(tier=dst, offset=e.offset) for r, e in pairs]
                # one call per run of adjacent extents on NVMe (tiers/nvme_runs.py)
                self._tiers[dst].write_many([e for _, e in pairs],
                                            [self._read_bytes(r) for r, _ in pairs])
                if dst == "nvme" and self.config.tiers.nvme_fsync != "never":
                    self._tiers[dst].flush()  # durable before the index points at it
                recs = [r for r, e in zip(recs, exts) if e is None]
        except BaseException:
            for rec in moved:  # the records stay where they were; their new homes go
                self._tiers[rec.tier].free(self._extent(rec))
            raise
        self._apply_or_free(put=moved, drop=[r.key for r in recs])
        self._stats["demotions"] += len(moved)
        self._stats["evictions"] += len(recs)

    def _restore_watermarks(self) -> None:
        pol = self.config.policy
        for name, tier in self._tiers.items():
            if over_watermark(tier.used, 0, tier.capacity, pol.high_watermark):
                self._shed(name, bytes_to_free(tier.used, 0, tier.capacity, pol.low_watermark))

    # ------------------------------------------------------------ staging
    def _stage_prefix(self, recs: list[Record]) -> list[Record]:
        """Stage the NVMe entries of a leased prefix into a memory tier, verifying
        each checksum. Returns the prefix that can be served; leases on the cut
        tail are returned, corrupt entries dropped."""
        nv = [i for i, r in enumerate(recs) if r.tier == "nvme"]
        if not nv:
            return recs
        stage = self.config.policy.stage_nvme_hits
        target = "dram" if "dram" in self._tiers else "gpu"
        exts = self._allocate_each(target, [recs[i] for i in nv]) if stage else [None] * len(nv)
        upto = next((i for i, e in zip(nv, exts) if stage and e is None), len(recs))
        bufs = self._read_nvme(recs, [i for i in nv if i < upto], dict(zip(nv, exts)))
        cut, moved, bad = len(recs), [], []
        for i, ext in zip(nv, exts):
            if i >= cut or i >= upto:
                cut = min(cut, i)
            elif checksum(bufs[i]) != recs[i].checksum:
                bad.append(recs[i].key)  # only the bytes of ext (if any) changed
                cut = i
            elif ext is not None:
                if self._tiers[target].view(ext) is None:  # read into a scratch buffer
                    self._tiers[target].write(ext, bufs[i])
                # the NVMe bytes stay as the entry's copy (restart, cheap re-demotion)
                moved.append(recs[i]._replace(tier=target, offset=ext.offset,
                                              nvme_copy=recs[i].offset))
                continue
            if ext is not None:
                self._tiers[target].free(ext)
        gone = self._unhold([r.key for r in recs[cut:]])
        # A bad entry someone else still holds stays until then (its reads verify).
        bad = [k for k in bad if not self._leased.get(k)]
        self._apply_or_free(put=moved, drop=bad + gone)
        self._stats["stagings"] += len(moved)
        self._stats["checksum_failures"] += len(bad)
        staged = {r.key: r for r in moved}
        return [staged.get(r.key, r) for r in recs[:cut]]

    def _read_nvme(self, recs: list[Record], which: list[int],
                   exts: dict[int, Extent | None]) -> dict[int, memoryview]:
        """Read NVMe entries ``recs[i]`` for ``i in which`` in one batch (adjacent
        extents in one call), each straight into its staging extent's view where
        the tier has one, else into a scratch buffer."""
        bufs: dict[int, memoryview] = {}
        for i in which:
            ext = exts[i]
            view = self._tiers[ext.tier].view(ext) if ext is not None else None
            bufs[i] = view if view is not None else memoryview(bytearray(recs[i].nbytes))
        self._tiers["nvme"].read_many([self._extent(recs[i]) for i in which],
                                      [bufs[i] for i in which])
        return bufs


def durable(rec: Record) -> bool:
    """Does the record name NVMe bytes (then it lives in the synced index)?"""
    return rec.tier == "nvme" or rec.nvme_copy is not None


def _owned(rec: Record) -> list[Extent]:
    """Extents a record owns: where it is served from, and its NVMe copy if any."""
    out = [Extent(rec.tier, rec.offset, rec.nbytes)]
    if rec.nvme_copy is not None:
        out.append(Extent("nvme", rec.nvme_copy, rec.nbytes))
    return out
