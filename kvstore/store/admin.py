"""What an operator does to stored entries: pin, evict, demote, clear, verify, list.

Operations over the store's parts (parts.py; the admin CLI reaches them through
the server): every method takes the store's lock and changes records only
through the catalog.

Invariant kept here: a leased entry is never removed by any of these (``clear``
and ``evict`` skip it, ``verify`` drops a bad one only once it is released), and
a pinned one only by ``clear``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from kvstore.core.errors import InvalidRequestError, NotFoundError, StorageError, TierFullError
from kvstore.core.hashing import checksum
from kvstore.store.index import Record
from kvstore.store.parts import Operations
from kvstore.store.policy import Candidate, Selection
from kvstore.store.types import (
    TIER_ORDER,
    DemoteResult,
    EvictResult,
    VerifyResult,
    check_keys,
    check_tier,
)


log = logging.getLogger(__name__)

# A page of ``ls`` looks at no more than this many keys per entry it may return.
LS_SCAN_FACTOR = 8
# Entries an evict (or clear) the index refuses at once, its disk or map full, removes
# per change instead: LMDB copies each page a delete changes, so one change of a
# large part of the index needs pages a full disk does not have. Each chunk's
# pages come from the index's reserve (kvstore/store/index.py, ``Reserve``), and
# those it frees serve the chunks after it.
EVICT_CHUNK = 256


class Admin(Operations):
    def pin(self, keys: Sequence[bytes]) -> int:
        """Pin stored entries (they never move or go until unpinned)."""
        return self._change_pins(check_keys(keys), +1)

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._change_pins(check_keys(keys), -1)

    def _change_pins(self, keys: list[bytes], delta: int) -> int:
        with self.lock:
            missing = [k.hex() for k in keys if k not in self.catalog.records]
            if missing:
                raise NotFoundError(f"not stored: {', '.join(missing[:4])}")
            pins = {k: self.catalog.records[k].pins for k in keys}
            for key in keys:
                pins[key] += delta
            if any(p < 0 for p in pins.values()):
                raise InvalidRequestError("unpin of an entry that is not pinned")
            put = [self.catalog.records[k]._replace(pins=p) for k, p in pins.items()]
            gone = [r.key for r in put if self.holds.idle_at_zero(r)]
            going = set(gone)
            self.catalog.apply(put=[r for r in put if r.key not in going], drop=gone)
            return len(pins)

    def evict(self, tier: str | None = None, nbytes: int | None = None,
              fraction: float | None = None, keys: Sequence[bytes] | None = None,
              everything: bool = False, dry_run: bool = False) -> EvictResult:
        """Remove entries for good, LRU first, never pinned or leased ones (those are
        reported in ``skipped``). Exactly one of nbytes / fraction / keys / everything."""
        _check_evict_args(tier, nbytes, fraction, keys, everything)
        wanted = check_keys(keys) if keys is not None else None
        with self.lock:
            names = [tier] if tier else list(self.place.tiers)
            cands = [c for name in names if name in self.place.tiers for c in self.place.candidates(name)]
            sel = self._select_evictions(cands, nbytes, fraction, wanted, everything)
            sizes = {k: self.catalog.records[k].nbytes for k in sel.keys}
            if dry_run:
                return EvictResult(sel.keys, sum(sizes.values()), sel.skipped)
            gone = self._drop(sel.keys)
            self.counts["evictions"] += len(gone)
            return EvictResult(gone, sum(sizes[k] for k in gone), sel.skipped)

    def demote_entries(self, tier: str | None = None, nbytes: int | None = None,
                       fraction: float | None = None, keys: Sequence[bytes] | None = None,
                       everything: bool = False, dry_run: bool = False) -> DemoteResult:
        """Move entries one tier down now (``kvstore demote``), LRU first, chosen as
        ``evict`` chooses (exactly one of nbytes / fraction / keys / everything)
        among the tiers that have one below; pinned and leased entries stay
        (``skipped``). As in pressure demotion, an entry no lower tier can take is
        evicted (``evicted``). The last tier has nothing below: naming it is an
        ``InvalidRequestError``."""
        _check_evict_args(tier, nbytes, fraction, keys, everything)
        wanted = check_keys(keys) if keys is not None else None
        with self.lock:
            last = [n for n in TIER_ORDER if n in self.place.tiers][-1]
            if tier == last:
                raise InvalidRequestError(f"{tier} is the last tier: nothing below it "
                                          f"(evict removes entries)")
            names = [tier] if tier else [n for n in self.place.tiers if n != last]
            cands = [c for name in names if name in self.place.tiers for c in self.place.candidates(name)]
            sel = self._select_evictions(cands, nbytes, fraction, wanted, everything)
            size = sum(self.catalog.records[k].nbytes for k in sel.keys)
            if dry_run:
                return DemoteResult(sel.keys, size, sel.skipped, 0, 0)
            before = self.counts["demotions"], self.counts["evictions"]
            for name in names:  # fastest first: a gpu entry lands in dram, stays there
                group = [k for k in sel.keys if k in self.catalog.records
                         and self.catalog.records[k].tier == name]
                if group:
                    self.place.move_down(name, group)
            return DemoteResult(sel.keys, size, sel.skipped,
                                self.counts["demotions"] - before[0],
                                self.counts["evictions"] - before[1])

    def _select_evictions(self, cands: list[Candidate], nbytes: int | None,
                          fraction: float | None, wanted: list[bytes] | None,
                          everything: bool) -> Selection:
        if wanted is not None:
            want = set(wanted)
            return self.place.policy.select([c for c in cands if c.key in want], None)
        if fraction is not None:
            return self.place.policy.select_fraction(cands, fraction)
        return self.place.policy.select(cands, None if everything else nbytes)

    def demote(self, keys: Sequence[bytes]) -> int:
        """Move entries one tier down now (e.g. DRAM -> NVMe so they survive a
        restart). Pinned, leased, missing and last-tier entries stay; like pressure
        demotion, an entry no lower tier can take is evicted. Returns how many moved
        or went."""
        keys = check_keys(keys)
        with self.lock:
            moved = 0
            for name, group in self._demotable_by_tier(keys).items():
                # an earlier group's move may have pushed some of these down already
                group = [k for k in group if k in self.catalog.records
                         and self.catalog.records[k].tier == name]
                if group:
                    self.place.move_down(name, group)
                moved += len(group)
            return moved

    def _demotable_by_tier(self, keys: list[bytes]) -> dict[str, list[bytes]]:
        last = [n for n in TIER_ORDER if n in self.place.tiers][-1]
        by_tier: dict[str, list[bytes]] = {}
        for key in dict.fromkeys(keys):
            rec = self.catalog.records.get(key)
            if rec and rec.tier != last and not rec.pins and not self.holds.leased.get(key):
                by_tier.setdefault(rec.tier, []).append(key)
        return by_tier

    def clear(self) -> EvictResult:
        """Remove every entry that no reader holds, pinned ones included."""
        with self.lock:
            sizes = {k: r.nbytes for k, r in self.catalog.records.items()
                     if not self.holds.leased.get(k)}
            skipped = [k for k in self.catalog.records if self.holds.leased.get(k)]
            gone = self._drop(list(sizes))
            self.counts["evictions"] += len(gone)
            return EvictResult(gone, sum(sizes[k] for k in gone), skipped)

    def _drop(self, keys: list[bytes]) -> list[bytes]:
        """Remove the stored entries ``keys`` in one change, or, if the index refuses
        that (its disk or map full), ``EVICT_CHUNK`` at a time for as long as the
        index takes them. The keys removed, in order; raises the index's
        ``StorageError`` / ``TierFullError`` only when not one chunk went."""
        try:
            self.catalog.apply(drop=keys)
            return keys
        except (StorageError, TierFullError) as exc:
            if len(keys) <= EVICT_CHUNK:
                raise
            log.warning("the index refused removing %d entries at once (%s): removing "
                        "them %d at a time", len(keys), exc, EVICT_CHUNK)
        gone: list[bytes] = []
        for at in range(0, len(keys), EVICT_CHUNK):
            chunk = keys[at:at + EVICT_CHUNK]
            try:
                self.catalog.apply(drop=chunk)
            except (StorageError, TierFullError) as exc:
                if not gone:
                    raise
                log.error("removed %d of %d entries, then the index refused: %s",
                          len(gone), len(keys), exc)
                break
            gone += chunk
        return gone

    def verify(self, keys: Sequence[bytes] | None = None) -> VerifyResult:
        """Re-check every entry's checksum (or only those of ``keys``; keys not stored are
        skipped); drop bad ones (leased ones when released). ``kvstore verify`` passes
        batches of keys so the lock is never held for a whole NVMe tier's read."""
        wanted = None if keys is None else check_keys(keys)
        with self.lock:
            recs = (list(self.catalog.records.items()) if wanted is None else
                    [(k, self.catalog.records[k]) for k in wanted if k in self.catalog.records])
            checked = len(recs)
            bad = [k for k, r in recs if checksum(self.io.read_bytes(r)) != r.checksum]
            self.counts["checksum_failures"] += len(bad)
            self.catalog.apply(drop=[k for k in bad if not self.holds.leased.get(k)])
            return VerifyResult(checked, bad)

    def entries_page(self, tier: str | None, after: bytes | None, limit: int
                     ) -> tuple[list[Record], bytes | None]:
        """Up to ``limit`` committed records (of one tier) in key order after ``after``,
        and the key to continue from (None: no more). Keys come from the catalog's
        ``KeyPages`` (kvstore/store/keypages.py), so a page costs O(limit): with a tier
        filter at most ``LS_SCAN_FACTOR * limit`` keys are looked at, and a page may
        come back short (even empty) with a key to go on from."""
        check_tier(tier)
        if not 0 < limit:
            raise InvalidRequestError(f"limit must be > 0, got {limit}")
        page: list[Record] = []
        scanned = 0
        with self.lock:
            records = self.catalog.records
            while True:
                keys = self.catalog.keys.after(after, limit)
                for k in keys:
                    rec = records[k]
                    if tier is None or rec.tier == tier:
                        page.append(rec)
                        if len(page) == limit:
                            return page, k
                if len(keys) < limit:
                    return page, None
                after = keys[-1]
                scanned += len(keys)
                if scanned >= LS_SCAN_FACTOR * limit:
                    return page, after  # a short page: the lock is never held for long

    def entries(self, tier: str | None = None) -> Iterator[Record]:
        """A snapshot of the committed records (of one tier), for ``kvstore ls``."""
        check_tier(tier)
        with self.lock:
            snap = [r for r in self.catalog.records.values() if tier is None or r.tier == tier]
        return iter(snap)


def _check_evict_args(tier: str | None, nbytes: int | None, fraction: float | None,
                      keys: Sequence[bytes] | None, everything: bool) -> None:
    check_tier(tier)
    chosen = [nbytes is not None, fraction is not None, keys is not None, everything]
    if sum(chosen) != 1:
        raise InvalidRequestError("evict needs exactly one of nbytes, fraction, keys, everything")
    if nbytes is not None and (not isinstance(nbytes, int) or nbytes < 0):
        raise InvalidRequestError(f"nbytes must be an int >= 0, got {nbytes!r}")
    if fraction is not None and not 0 < fraction <= 1:
        raise InvalidRequestError(f"fraction must be in (0, 1], got {fraction!r}")
