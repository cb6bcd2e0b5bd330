"""The catalog: every committed record, the LMDB index of those that name NVMe
bytes, the key order ``ls`` pages through, and the per-tier membership and victim
orders kept in step with them. The one place records change; the class says what it
owns and keeps."""

from __future__ import annotations

import functools
import itertools
import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from kvstore.core.errors import StorageError, TierFullError
from kvstore.store.index import (
    Index,
    Record,
    copy_of,
    nbytes_of,
    offset_of,
    on_disk,
    pins_of,
    tier_of,
)
from kvstore.store.keypages import KeyPages
from kvstore.store.order import GroupOrder
from tiers.base import Extent, Tier

log = logging.getLogger(__name__)

_STORAGE_LOG_EVERY_S = 10.0  # a full disk fails every write: one log line per this long


class Catalog:
    """Owner of: ``records`` (key -> Record), ``keys`` (their keys in key order, for
    ``ls``), ``by_tier`` (tier -> its keys, in insertion order), ``copies`` (keys
    served from memory that keep an NVMe copy), the durable ``index``, ``orders`` (one
    ``GroupOrder`` per tier, of its entries that are not pinned) and ``copy_order``
    (the NVMe copies). Others read these;
    only ``apply`` (and ``touch``, for access times) writes them.

    Invariants kept here:
    * ``apply`` is the only place records change: the index transaction first (when
      the change touches a record that names NVMe bytes), then memory, then the
      freeing of every extent no record points at any more. Freeing after the
      transaction means a crash can never leave two records on one extent. If the
      index refuses (``StorageError``: full, read-only, failing disk), nothing changed.
    * ``keys`` holds exactly the keys of ``records``; ``by_tier`` and ``copies`` list
      exactly the records of that tier / with a copy; every member has an item in its
      order whose key is at most its sort key (kvstore/store/order.py).
    * the records naming NVMe bytes are exactly those in the durable index; the
      records of memory tiers are in memory only (their bytes die with the process).
    """

    def __init__(self, data_dir: Path, map_bytes: int, sync: bool,
                 tiers: Mapping[str, Tier], sort_key: Callable[[Record], tuple],
                 counts: Counter) -> None:
        """Open the index (synced unless ``sync`` is False). ``tiers`` are only freed
        into here, never allocated; ``counts`` is the store's event counter
        (``storage_errors``, ``dropped``)."""
        # Only the records that name NVMe bytes have an index on disk (synced per
        # nvme_fsync): those of memory tiers die with the process, so a DRAM/GPU-only
        # commit or release touches no LMDB at all; docs/architecture.md "Departures
        # from DESIGN.md". Earlier versions kept them in ``index-volatile``: removed here.
        self.index = Index(data_dir / "index", map_bytes, sync=sync)
        shutil.rmtree(data_dir / _OLD_VOLATILE_INDEX, ignore_errors=True)
        self._tiers = tiers
        self._sort_key = sort_key
        self._counts = counts
        self._storage_logged_at = -_STORAGE_LOG_EVERY_S
        self.records: dict[bytes, Record] = {}
        self.keys = KeyPages()
        self.by_tier: dict[str, dict[bytes, None]] = {name: {} for name in tiers}
        self.copies: dict[bytes, None] = {}
        # Of those, how many each tier holds: a tier whose every entry has its copy
        # gives the background writeback nothing to do, known without a walk.
        self.copied: dict[str, int] = {name: 0 for name in tiers}
        # ... and the NVMe bytes (whole pages) they take: what the background's
        # eviction ahead may count as room (kvstore/store/placement.py, evict_ahead).
        self.copy_bytes = 0
        self._copy_page = tiers["nvme"].page_size if "nvme" in tiers else 1
        self.pinned = 0  # records with pins > 0 (stats reads it: no scan of the records)
        # Records committed without the server hashing their bytes
        # (store.verify_commits = "background"): key -> the checksum the writer gave.
        # Store.scrub_step checks them off the request path; a dropped record leaves.
        self.unchecked: dict[bytes, int] = {}
        # Entries known bad at rest while someone held them (the scrub found them, or
        # a reader reported them): key -> the record's ``created``. Acquires stop
        # before them (a miss), every read verifies them; dropped once unheld
        # (``Writes.drop_condemned``, at each scrub step and reap).
        self.condemned: dict[bytes, float] = {}
        # Of those, the ones a reader reported (counted in ``checksum_failures`` then,
        # not again in ``commit_checksum_failures`` when they go).
        self.reported: set[bytes] = set()
        self.orders = {name: GroupOrder(sort_key, self._member_of(name),
                                        self._members_of(name))
                       for name in tiers}
        self.copy_order = GroupOrder(sort_key, self._copy_of, lambda: self.copies)

    def load(self, recovered: list[Record]) -> None:
        """Fill memory with the records recovery kept (they are in the index)."""
        for rec in sorted(recovered, key=lambda r: r.last_access):
            self.records[rec.key] = rec
            self.by_tier[rec.tier][rec.key] = None
            self.pinned += rec.pins > 0
            if rec.nvme_copy is not None:
                self.copies[rec.key] = None
                self.copied[rec.tier] += 1
                self.copy_bytes += self.copy_pages(rec.nbytes)
        self.keys.add_many(rec.key for rec in recovered)
        for order in self.orders.values():
            order.rebuild()
        self.copy_order.rebuild()

    def close(self) -> None:
        self.index.close()

    def set_sort_key(self, sort_key: Callable[[Record], tuple]) -> None:
        """Order victims by another policy from now on (the orders are rebuilt)."""
        self._sort_key = sort_key
        for order in [*self.orders.values(), self.copy_order]:
            order.set_sort_key(sort_key)

    # ------------------------------------------------------------ changes
    def apply(self, put: Sequence[Record] = (), drop: Sequence[bytes] = ()) -> None:
        """Write ``put`` and delete ``drop`` (keys not stored are ignored): index
        first, then memory, then the extents nobody owns any more are freed."""
        records = self.records
        gone = list(filter(records.__contains__, dict.fromkeys(drop)))
        if not put:  # a release's drop: its records looked up once for both halves
            if not gone:
                return
            recs = list(map(records.__getitem__, gone))
            if "nvme" in map(tier_of, recs) or \
                    list(map(copy_of, recs)).count(None) != len(recs):
                self.write_index((), gone)  # (else no durable record: nothing to write)
            self._drop_records(gone, recs)
            return
        self.write_index(put, gone)
        self._put_records(put)
        self._drop_records(gone, list(map(records.__getitem__, gone)))

    def write_index(self, put: Sequence[Record], drop: Sequence[bytes] = ()) -> None:
        """The first half of ``apply`` (``drop``: stored keys), the only one that can
        fail; ``apply_memory(put)`` must follow before anyone else uses the catalog
        (a commit answered first: kvstore/store/writes.py)."""
        try:
            self._write_index(put, list(drop))
        except StorageError as exc:  # full / read-only / failing disk: nothing changed
            self._storage_failed(exc)
            raise

    def apply_memory(self, put: Sequence[Record]) -> None:
        """The second half of ``apply(put)``, after ``write_index(put)``."""
        self._put_records(put)

    def apply_or_free(self, put: list[Record], drop: list[bytes]) -> None:
        """``apply`` for records moved into freshly allocated extents: if the index
        refuses the change, those extents go back and the records stay where they were."""
        try:
            self.apply(put=put, drop=drop)
        except BaseException:
            for rec in put:
                old = self.records[rec.key]
                if (rec.tier, rec.offset) != (old.tier, old.offset) and not (
                        rec.tier == "nvme" and rec.offset == old.nvme_copy):
                    self._tiers[rec.tier].free(Extent(rec.tier, rec.offset, rec.nbytes))
            raise

    def drop_idle(self, keys: list[bytes]) -> int:
        """Free entries that nothing needs any more (how many went). Runs after the
        change that made them due (a commit, a release) has been applied: if the
        index cannot be written now, they stay stored (idle, evictable) rather than
        failing it."""
        if not keys:
            return 0
        try:
            self.apply(drop=keys)
        except StorageError:
            return 0  # counted and logged by apply
        except TierFullError:  # the index map is full: they stay, idle and evictable
            log.warning("index map full: %d idle entries stay until it has room", len(keys))
            return 0
        self._counts["dropped"] += len(keys)
        return len(keys)

    def condemn(self, rec: Record, reported: bool = False) -> None:
        """``rec`` is known bad at rest but held: acquires stop before it and it goes
        once unheld (``condemned``); ``reported``: a reader's report found it (already
        counted in ``checksum_failures``)."""
        self.condemned[rec.key] = rec.created
        if reported:
            self.reported.add(rec.key)

    def touch(self, keys: Iterable[bytes], now: float) -> None:
        """Set the access time of the entries of ``keys`` still stored to ``now`` (none
        goes back in time) in memory only: it is persisted with the entry's next
        change. Their victim orders catch up lazily (order.py)."""
        records = self.records
        at = _LAST_ACCESS
        for key in keys:
            cur = records.get(key)
            if cur is not None and cur.last_access < now:
                # tuple.__new__, not _replace: ~5x cheaper, a read touches every entry.
                records[key] = tuple.__new__(Record, (*cur[:at], now, *cur[at + 1:]))

    # ------------------------------------------------------------ inside apply
    def _put_records(self, put: Sequence[Record]) -> None:
        """Memory catches up with ``put`` (already in the index); extents the old
        records owned and the new ones do not are freed."""
        records, by_tier = self.records, self.by_tier
        new: list[bytes] = []
        fresh: dict[str, list[Record]] = {}  # new entries (commits), by tier: pushed at once
        for rec in put:
            old = records.get(rec.key)
            records[rec.key] = rec
            self.pinned += (rec.pins > 0) - (old is not None and old.pins > 0)
            if old is None:
                new.append(rec.key)
                if rec.nvme_copy is None:  # a new entry (commit): the short way
                    by_tier[rec.tier][rec.key] = None
                    group = fresh.get(rec.tier)
                    if group is None:
                        fresh[rec.tier] = [rec]
                    else:
                        group.append(rec)
                    continue
            if rec.tier == "nvme":  # every read from NVMe verifies it
                self.unchecked.pop(rec.key, None)
            if old is not None and old.tier != rec.tier:
                del by_tier[old.tier][rec.key]
            by_tier[rec.tier][rec.key] = None
            if old is not None and old.nvme_copy is not None:
                self.copied[old.tier] -= 1
                self.copy_bytes -= self.copy_pages(old.nbytes)
            if rec.nvme_copy is None:
                self.copies.pop(rec.key, None)
            else:
                self.copies[rec.key] = None
                self.copied[rec.tier] += 1
                self.copy_bytes += self.copy_pages(rec.nbytes)
            self._reordered(rec, old)
            if old is not None:
                for ext in set(owned(old)) - set(owned(rec)):
                    self._tiers[ext.tier].free(ext)
        for tier, group in fresh.items():
            self.orders[tier].push_many(group)
        self.keys.add_many(new)

    def _drop_records(self, drop: list[bytes], recs: list[Record]) -> None:
        """Forget the stored keys ``drop``, whose records are ``recs``; free their
        extents."""
        if self._drop_one_tier(drop, recs):
            return
        self.keys.discard_many(drop)
        records, by_tier, copies = self.records, self.by_tier, self.copies
        unchecked, condemned, reported = self.unchecked, self.condemned, self.reported
        # owned(rec) and free_by_tier, inlined: a release drops every entry it read.
        freed: dict[str, list[Extent]] = {}
        make = tuple.__new__
        for key, rec in zip(drop, recs):
            del records[key]
            self.pinned -= rec.pins > 0
            unchecked.pop(key, None)
            if condemned.pop(key, None) is not None:
                reported.discard(key)
            del by_tier[rec.tier][key]
            if copies.pop(key, 0) is None:  # (a stored copy's value is None)
                self.copied[rec.tier] -= 1
                self.copy_bytes -= self.copy_pages(rec.nbytes)
            ext = make(Extent, (rec.tier, rec.offset, rec.nbytes))
            group = freed.get(ext[0])
            if group is None:
                freed[ext[0]] = [ext]
            else:
                group.append(ext)
            if rec.nvme_copy is not None:
                freed.setdefault("nvme", []).append(make(Extent, ("nvme", rec.nvme_copy,
                                                                  rec.nbytes)))
        for name, group in freed.items():
            self._tiers[name].free_many(group)

    def _drop_one_tier(self, drop: list[bytes], recs: list[Record]) -> bool:
        """``_drop_records`` of the usual release: stored keys of one tier, none with
        an NVMe copy, none condemned, none pinned; done in C-level passes (the loop
        cost ~1.5 us an entry, a third of a 128-entry release). False, with nothing
        changed, for anything else."""
        records = self.records
        if not recs:
            return False
        tiers = list(map(tier_of, recs))
        tier = tiers[0]
        unchecked, condemned, copies = self.unchecked, self.condemned, self.copies
        if tiers.count(tier) != len(tiers) or \
                list(map(copy_of, recs)).count(None) != len(recs) or \
                list(map(pins_of, recs)).count(0) != len(recs) or \
                (condemned and not condemned.keys().isdisjoint(drop)) or \
                (copies and not copies.keys().isdisjoint(drop)):
            return False
        self.keys.discard_many(drop)
        if unchecked:  # (not yet scrubbed: a drop_select soon after its insert)
            list(map(unchecked.pop, drop, itertools.repeat(None, len(drop))))
        list(map(records.__delitem__, drop))
        list(map(self.by_tier[tier].__delitem__, drop))
        self._tiers[tier].free_many(list(map(
            _extent, zip(itertools.repeat(tier), map(offset_of, recs), map(nbytes_of, recs)))))
        return True

    def _write_index(self, put: Sequence[Record], drop: list[bytes]) -> None:
        """The change's records that name NVMe bytes into the durable index (as
        ``on_disk`` has them), in one transaction, and out of it those that stop
        naming them (staged and their copy dropped, or dropped). Rows whose only
        change is the access time are written with the rest, or left as they are if
        the index refuses them. A change of memory-tier records only writes nothing."""
        records = self.records
        dput, ddel, touched = [], [], []
        for rec in put:
            if rec.tier == "nvme" or rec.nvme_copy is not None:  # durable(rec), inlined
                # Only NVMe bytes are durable (on_disk): staging an NVMe hit, or
                # demoting it onto its copy again, changes no more than the stored
                # row's access time, which may wait: reads need no index space.
                row = on_disk(rec)
                old = records.get(rec.key)
                if old is None or not durable(old) or not _same_row(old, rec):
                    dput.append(row)
                else:
                    touched.append(row)
            else:
                old = records.get(rec.key)
                if old is not None and durable(old):
                    ddel.append(rec.key)
        for key in drop:
            if durable(records[key]):
                ddel.append(key)
        if touched:
            try:
                self.index.apply(put=dput + touched, delete=ddel)
                return
            except TierFullError:
                pass  # (a full map) those access times wait for a later change
            except StorageError as exc:  # a full or failing disk: the same, counted
                if not (dput or ddel):  # (else the write below fails and is counted)
                    self._storage_failed(exc)
                    return
        if dput or ddel:
            self.index.apply(put=dput, delete=ddel)

    def _reordered(self, rec: Record, old: Record | None = None) -> None:
        """Keep the victim orders in step with ``rec``, which just replaced ``old``:
        a new item where it joined a group or moved in it."""
        key = self._sort_key
        moved = old is None or key(old) != key(rec)
        if moved or old is None or old.tier != rec.tier or (old.pins and not rec.pins):
            self.orders[rec.tier].push(rec)  # (unpinned: back in the order)
        if rec.nvme_copy is not None and (moved or old is None or old.nvme_copy is None):
            self.copy_order.push(rec)

    def _storage_failed(self, exc: StorageError) -> None:
        """Count an index write the file system refused; log it, once per
        ``_STORAGE_LOG_EVERY_S`` (a full disk fails every write until it is freed)."""
        self._counts["storage_errors"] += 1
        now = time.monotonic()
        if now - self._storage_logged_at >= _STORAGE_LOG_EVERY_S:
            self._storage_logged_at = now
            log.error("%s (%d index writes failed so far; writes that need space fail, "
                      "reads go on)", exc, self._counts["storage_errors"])

    def copy_pages(self, nbytes: int) -> int:
        """What a copy of ``nbytes`` takes of the NVMe tier (whole pages)."""
        page = self._copy_page
        return -(-nbytes // page) * page

    def _member_of(self, name: str) -> Callable[[bytes], Record | None]:
        # Pinned entries are never victims: out of the order, no walk passes over
        # them (pinned template blocks would sit at its front for ever).
        def member(key: bytes) -> Record | None:
            rec = self.records.get(key)
            return rec if rec is not None and rec.tier == name and not rec.pins else None
        return member

    def _members_of(self, name: str) -> Callable[[], dict[bytes, None]]:
        return lambda: self.by_tier[name]

    def _copy_of(self, key: bytes) -> Record | None:
        rec = self.records.get(key)
        return rec if rec is not None and rec.nvme_copy is not None else None


_LAST_ACCESS = Record._fields.index("last_access")
_TIER, _OFFSET = Record._fields.index("tier"), Record._fields.index("offset")
_COPY = Record._fields.index("nvme_copy")
_extent = functools.partial(tuple.__new__, Extent)  # Extent((tier, offset, nbytes))
# Where earlier versions kept the records of memory tiers in LMDB; removed on open.
_OLD_VOLATILE_INDEX = "index-volatile"


def durable(rec: Record) -> bool:
    """Does the record name NVMe bytes (then it lives in the synced index)?"""
    return rec.tier == "nvme" or rec.nvme_copy is not None


def _same_row(a: Record, b: Record) -> bool:
    """Do two durable records have one ``on_disk`` row but for its access time
    (which reaches the index with the entry's next change)? Compared in place:
    no row is built."""
    if (a[_OFFSET] if a[_TIER] == "nvme" else a[_COPY]) != \
            (b[_OFFSET] if b[_TIER] == "nvme" else b[_COPY]):
        return False
    at = _LAST_ACCESS
    return (a[_OFFSET + 1:at] == b[_OFFSET + 1:at] and a[at + 1:_COPY] == b[at + 1:_COPY]
            and a[_COPY + 1:] == b[_COPY + 1:])


def owned(rec: Record) -> list[Extent]:
    """Extents a record owns: where it is served from, and its NVMe copy if any."""
    out = [Extent(rec.tier, rec.offset, rec.nbytes)]
    if rec.nvme_copy is not None:
        out.append(Extent("nvme", rec.nvme_copy, rec.nbytes))
    return out
