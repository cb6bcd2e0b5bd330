"""The store's books: the one primitive that changes records (``_apply``), the
holds that keep entries in place, and reading an entry's bytes.

A mixin of ``kvstore.store.facade.Store``: every method here runs under the store's lock
and uses its state (``_records``, ``_by_tier``, ``_copies``, ``_leased``, ...).

Invariants kept here:
* ``_apply`` is the only place records change: the index transactions first (the
  volatile environment's, then the durable one's: ``_write_index``), then memory,
  then the freeing of every extent no record points at any more. Freeing after
  the transaction means a crash can never leave two records on one extent.
* ``_leased[key]`` is the number of holds on ``key`` (open acquisitions and
  reservation dedups); a held entry never moves and never goes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstore.core.errors import StorageError
from kvstore.core.hashing import checksum, hidden_key
from kvstore.store.index import Record
from tiers.base import Extent

log = logging.getLogger(__name__)

_STORAGE_LOG_EVERY_S = 10.0  # a full disk fails every write: one log line per this long

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


class Lease(NamedTuple):
    keys: list[bytes]
    expires_at: float
    claim: bool = False  # holds one pending consumer of each key (drop_select)
    take: bool = True  # release(drop=True) may take: False for a drop_select that
    # matched only a prefix other prompts share (it reads, it takes nothing)
    end: bytes | None = None  # the prompt end this lease claimed (one ``ends``)


class RecordsMixin:
    def _apply(self, put: Sequence[Record] = (), drop: Sequence[bytes] = ()) -> None:
        drop = [k for k in dict.fromkeys(drop) if k in self._records]
        if not put and not drop:
            return
        try:
            self._write_index(put, drop)
        except StorageError as exc:  # full / read-only / failing disk: nothing changed
            self._storage_failed(exc)
            raise
        self._put_records(put)
        self._drop_records(drop)

    def _put_records(self, put: Sequence[Record]) -> None:
        """Memory catches up with ``put`` (already in the index); extents the old
        records owned and the new ones do not are freed."""
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

    def _drop_records(self, drop: list[bytes]) -> None:
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
        """Keep the victim orders (kvstore/store/order.py) in step with ``rec``, which
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
        uncount(self._leased, keys)
        return [k for k in dict.fromkeys(keys)
                if k in self._records and self._idle_at_zero(self._records[k])]

    def _idle_at_zero(self, rec: Record) -> bool:
        return rec.pending == 0 and rec.pins == 0 and not self._leased.get(rec.key)

    def _drop_now(self, keys: list[bytes]) -> None:
        """Free entries that nothing needs any more. Runs after the change that made
        them due (a commit, a release) has been applied: if the index cannot be
        written now, they stay stored (idle, evictable) rather than failing it."""
        if not keys:
            return
        try:
            self._apply(drop=keys)
        except StorageError:
            return  # counted and logged by _apply
        self._stats["dropped"] += len(keys)

    def _storage_failed(self, exc: StorageError) -> None:
        """Count an index write the file system refused; log it, once per
        ``_STORAGE_LOG_EVERY_S`` (a full disk fails every write until it is freed)."""
        self._stats["storage_errors"] += 1
        now = time.monotonic()
        if now - getattr(self, "_storage_logged_at", -_STORAGE_LOG_EVERY_S) >= _STORAGE_LOG_EVERY_S:
            self._storage_logged_at = now
            log.error("%s (%d index writes failed so far; writes that need space fail, "
                      "reads go on)", exc, self._stats["storage_errors"])

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

def uncount(counts: dict[bytes, int], keys: Sequence[bytes]) -> None:
    """One less of each key in ``counts``; a key at zero leaves it (so ``counts``
    only ever holds positive counts). Each key must be there."""
    for key in keys:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]


def prompt_end(keys: Sequence[bytes]) -> bytes:
    """The key of a reservation's last block: its last key, or the one before when
    the last is that block's hidden-state entry (``hashing.hidden_key``)."""
    if len(keys) >= 2 and keys[-1] == hidden_key(keys[-2]):
        return keys[-2]
    return keys[-1]


def durable(rec: Record) -> bool:
    """Does the record name NVMe bytes (then it lives in the synced index)?"""
    return rec.tier == "nvme" or rec.nvme_copy is not None


def _owned(rec: Record) -> list[Extent]:
    """Extents a record owns: where it is served from, and its NVMe copy if any."""
    out = [Extent(rec.tier, rec.offset, rec.nbytes)]
    if rec.nvme_copy is not None:
        out.append(Extent("nvme", rec.nvme_copy, rec.nbytes))
    return out
