"""The store: the single owner of one node's entries (index + tiers + policy).

Who calls it: the server's handlers and its reaper thread, the admin CLI through
the server, and tests. Every public method takes the store's one lock, so calls
are serialized; none waits on anything but local memory and disk.

Life of an entry (docs/architecture.md, "Store"):
  reserved (memory only) -> committed (index + tier) -> leased / pinned
  -> demoted (gpu -> dram -> nvme) -> dropped (pending reached 0, evicted, corrupt)

Invariants (``check_integrity`` checks them):
* every live extent of every tier is owned by exactly one committed record or one
  open reservation; per tier their page-rounded sizes sum to ``tier.used``;
* a leased or pinned entry never moves and never goes;
* an index record is written only at commit, and an extent is freed only after the
  index transaction that stops pointing at it has committed, so after a crash no
  two records can claim one extent;
* bytes read back from NVMe are checksum-verified before anyone sees them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvstore.config import KVStoreConfig
from kvstore.errors import (
    ChecksumError,
    ConfigError,
    InvalidRequestError,
    LeaseExpiredError,
    NotFoundError,
)
from kvstore.hashing import checksum
from kvstore.index import Index, Record, open_volatile
from kvstore.policy import Candidate, make_policy
from kvstore.store_audit import AuditMixin
from kvstore.store_moves import Lease, MovesMixin, Open
from kvstore.store_order import GroupOrder
from kvstore.store_setup import DataDirLock, build_tiers, recover
from kvstore.store_types import (
    TIER_ORDER,
    Acquisition,
    CommitResult,
    EntryInfo,
    EvictResult,
    LookupResult,
    Placement,
    Reservation,
    VerifyResult,
    check_keys,
    check_meta,
    check_namespace,
    check_sizes,
    check_tier,
    check_tokens,
    new_id,
)
from tiers.base import Extent, MemoryRegion, Tier

log = logging.getLogger(__name__)

_EXPIRED_MEMORY = 4096  # ids of reaped reservations/leases remembered for a clear error


class Store(MovesMixin, AuditMixin):
    def __init__(self, config: KVStoreConfig, tiers: dict[str, Tier] | None = None,
                 policy: str = "lru") -> None:
        """Open (or recover) the store in ``config.store.data_dir``.

        ``tiers`` replaces the tiers config asks for (tests); the store owns and
        closes them either way.
        """
        self.config = config
        self.data_dir = Path(config.store.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._dir_lock = DataDirLock(self.data_dir)
        try:
            self._open(tiers, policy)
        except BaseException:
            self._dir_lock.release()
            raise

    def _open(self, tiers: dict[str, Tier] | None, policy: str) -> None:
        built = tiers if tiers is not None else build_tiers(self.config, self.data_dir)
        self._tiers = {name: built[name] for name in TIER_ORDER if name in built}
        try:
            if not any(name in self._tiers for name in ("gpu", "dram")):
                raise ConfigError("kvstore needs a memory tier (gpu_bytes or dram_bytes > 0): "
                                  "writers and readers reach entries through it")
            self._policy = make_policy(policy)
            # Two LMDB environments: ``index`` holds the records that name NVMe bytes
            # (synced per nvme_fsync), ``index-volatile`` those of memory tiers only
            # (never synced, recreated on start). A DRAM/GPU-only commit so costs no
            # fsync; docs/architecture.md "Departures from DESIGN.md".
            self._index = Index(self.data_dir / "index", self.config.store.index_map_bytes,
                                sync=self.config.tiers.nvme_fsync != "never")
            try:
                self._vindex = open_volatile(self.data_dir / "index-volatile",
                                             self.config.store.index_map_bytes)
            except BaseException:
                self._index.close()
                raise
        except BaseException:
            for tier in self._tiers.values():
                tier.close()
            raise
        self._records: dict[bytes, Record] = {}
        self._by_tier: dict[str, dict[bytes, None]] = {name: {} for name in self._tiers}
        self._copies: dict[bytes, None] = {}  # keys served from memory with an NVMe copy
        self._leased: dict[bytes, int] = {}  # key -> number of holders (acquisitions, dedup)
        self._claims: dict[bytes, int] = {}  # key -> pending consumers claimed by open leases
        self._acqs: dict[int, Lease] = {}
        self._res: dict[int, Open] = {}
        self._inflight: dict[bytes, int] = {}  # key being written -> reservation id
        self._expired: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._next_reap = float("inf")
        self._stats = collections.Counter()
        self._hits = collections.Counter()
        self._tier_bytes: collections.Counter = collections.Counter()  # (tier, in/out)
        self._closed = False
        try:
            recovered = recover(self._index, self._tiers).records
        except BaseException:
            self._index.close()
            self._vindex.close()
            for tier in self._tiers.values():
                tier.close()
            raise
        for rec in sorted(recovered, key=lambda r: r.last_access):
            self._records[rec.key] = rec
            self._by_tier[rec.tier][rec.key] = None
        # victim order per tier, and of the NVMe copies of staged entries
        self._orders = {name: GroupOrder(self._policy.sort_key, self._member_of(name),
                                         lambda name=name: self._by_tier[name])
                        for name in self._tiers}
        self._copy_order = GroupOrder(self._policy.sort_key, self._copy_of,
                                      lambda: self._copies)
        for order in self._orders.values():
            order.rebuild()

    # ------------------------------------------------------------ properties
    @property
    def dram_shared_path(self) -> str | None:
        """The shared-memory file same-node clients map to write into DRAM extents."""
        dram = self._tiers.get("dram")
        return getattr(dram, "shared_path", None)

    @property
    def tier_names(self) -> list[str]:
        return list(self._tiers)

    def regions(self) -> dict[str, list[MemoryRegion]]:
        """Address ranges of each memory tier, to register with TE once."""
        return {name: tier.regions() for name, tier in self._tiers.items()}

    # ------------------------------------------------------------ writes
    def reserve(self, keys: Sequence[bytes], sizes: Sequence[int], tokens: Sequence[bytes],
                meta: Sequence[bytes | None] | None = None,
                lease_s: float | None = None, namespace: bytes = b"") -> Reservation:
        """Space for the keys not yet stored, in the fastest memory tier with room.

        ``namespace``: the writer's ``hashing.namespace_of`` fingerprint (16 bytes, or
        its first 8); the new records keep its first 8 bytes so ``ls`` can filter."""
        keys = check_keys(keys)
        ns_tag = check_namespace(namespace)
        sizes = check_sizes(sizes, len(keys))
        tokens = check_tokens(tokens, len(keys))
        metas = check_meta(meta, len(keys))
        lease = _lease(lease_s, self.config.store.reservation_lease_s)
        with self._lock:
            self._maybe_reap()
            new, held, seen = [], [], set()
            for i, key in enumerate(keys):
                if key in self._records:
                    held.append(key)  # dedup: leased until commit so it cannot go meanwhile
                elif key not in seen and key not in self._inflight:
                    new.append(i)
                    seen.add(key)
            self._hold(held)
            try:
                extents = self._allocate_memory([sizes[i] for i in new]) if new else []
            except BaseException:
                self._drop_now(self._unhold(held))
                raise
            op = Open(new_id(), keys, tokens, metas, [None] * len(keys), held,
                      time.time() + lease, {}, ns_tag)
            for i, ext in zip(new, extents):
                op.extents[i] = ext
                self._inflight[keys[i]] = op.id
            self._res[op.id] = op
            self._next_reap = min(self._next_reap, op.expires_at)
            places = [None if e is None else Placement(k, e.tier, e.offset, e.nbytes,
                                                       self._tiers[e.tier].address(e))
                      for k, e in zip(keys, op.extents)]
            return Reservation(op.id, places, op.expires_at)

    def write(self, reservation_id: int, index: int, data) -> None:
        """Copy one new entry's bytes into its reserved extent (local writers)."""
        with self._lock:
            op = self._open_reservation(reservation_id)
            if not 0 <= index < len(op.extents) or op.extents[index] is None:
                raise InvalidRequestError(f"reservation has no placement {index} to write")
            ext = op.extents[index]
            self._tiers[ext.tier].write(ext, memoryview(data))

    def commit(self, reservation_id: int, checksums: Sequence[int]) -> CommitResult:
        """Verify the written bytes and make the reservation's entries visible."""
        with self._lock:
            op = self._open_reservation(reservation_id)
            new = [i for i, e in enumerate(op.extents) if e is not None]
            sums = _match_checksums(checksums, len(op.keys), new)
            got = self._checksums([op.extents[i] for i in new])
            bad = [op.keys[i] for i, s, g in zip(new, sums, got) if g != s]
            if bad:
                self._close_reservation(op)
                self._stats["commit_checksum_failures"] += len(bad)
                raise ChecksumError(f"{len(bad)} of {len(new)} written entries do not match "
                                    f"their checksum (first {bad[0].hex()}); nothing stored")
            return self._commit_verified(op, new, sums)

    def _commit_verified(self, op: Open, new: list[int], sums: list[int]) -> CommitResult:
        now = time.time()
        put: dict[bytes, Record] = {}
        for i, s in zip(new, sums):
            key, ext = op.keys[i], op.extents[i]
            put[key] = Record(key, ext.tier, ext.offset, ext.nbytes, len(op.tokens[i]) // 4,
                              op.tokens[i], s, now, now, 0, 1 + op.extra.get(key, 0),
                              op.meta[i], namespace=op.namespace)
        deduped = lost = 0
        for i in (i for i, e in enumerate(op.extents) if e is None):
            key = op.keys[i]
            rec = put.get(key) or self._records.get(key)
            if rec is not None and rec.tokens == op.tokens[i]:
                put[key] = rec._replace(pending=rec.pending + 1)
                deduped += 1
            elif rec is None and key in self._inflight and self._inflight[key] != op.id:
                other = self._res[self._inflight[key]]
                other.extra[key] = other.extra.get(key, 0) + 1
                deduped += 1
            else:  # its writer gave up, or a different block under the same key
                lost += 1
        self._apply(put=list(put.values()))  # first: if the index refuses, nothing changed
        for i in new:
            del self._inflight[op.keys[i]]
        del self._res[op.id]
        self._drop_now(self._unhold(op.held))
        self._stats["bytes_in"] += sum(op.extents[i].nbytes for i in new)
        for i in new:
            self._tier_bytes[op.extents[i].tier, "bytes_in"] += op.extents[i].nbytes
        self._stats["commits"] += 1
        return CommitResult(len(new), deduped, lost)

    def abort(self, reservation_id: int) -> None:
        """Forget a reservation; its space is free at once, nothing becomes visible."""
        with self._lock:
            self._close_reservation(self._open_reservation(reservation_id))
            self._stats["aborts"] += 1

    # ------------------------------------------------------------ reads
    def lookup(self, keys: Sequence[bytes], tokens: Sequence[bytes]) -> LookupResult:
        """Longest stored prefix; binds nothing (it may be gone by the next call)."""
        keys = check_keys(keys)
        tokens = check_tokens(tokens, len(keys))
        with self._lock:
            recs = self._walk(keys, tokens)
            return LookupResult(len(recs), sum(r.ntokens for r in recs), [r.tier for r in recs])

    def acquire(self, keys: Sequence[bytes], tokens: Sequence[bytes],
                lease_s: float | None = None, claim: bool = False,
                optional_tail: bool = False) -> Acquisition:
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
        """
        keys = check_keys(keys)
        tokens = check_tokens(tokens, len(keys))
        lease = _lease(lease_s, self.config.store.read_lease_s)
        with self._lock:
            self._maybe_reap()
            recs = self._walk(keys, tokens)
            if claim:
                recs = self._claimable_prefix(recs)
            found_in = [r.tier for r in recs]
            self._hold([r.key for r in recs])
            recs = self._stage_prefix(recs)
            blocks = len(keys) - bool(optional_tail)
            served = min(len(recs), blocks)
            for tier in found_in[:served]:
                self._hits[tier] += 1
            self._stats["misses"] += blocks - served
            now = time.time()
            if not recs:
                return Acquisition(0, [], 0, now)
            # Re-read: room-making while staging may have dropped NVMe copies of
            # these (held) entries; nothing else about them can have changed.
            recs = [self._records[r.key]._replace(last_access=now) for r in recs]
            for rec in recs:  # victim orders catch up lazily (store_order.py)
                self._records[rec.key] = rec
            aid = new_id()
            self._acqs[aid] = Lease([r.key for r in recs], now + lease, claim)
            if claim:
                for rec in recs:
                    self._claims[rec.key] = self._claims.get(rec.key, 0) + 1
            self._next_reap = min(self._next_reap, now + lease)
            self._stats["bytes_out"] += sum(r.nbytes for r in recs)
            for tier, rec in zip(found_in, recs):  # counted where it was found
                self._tier_bytes[tier, "bytes_out"] += rec.nbytes
            return Acquisition(aid, [self._info(r) for r in recs],
                               sum(r.ntokens for r in recs), now + lease)

    def read(self, acquisition_id: int, index: int) -> bytes:
        """The bytes of one acquired entry (local readers)."""
        with self._lock:
            lease = self._open_lease(acquisition_id)
            if not 0 <= index < len(lease.keys):
                raise InvalidRequestError(f"acquisition has no entry {index}")
            rec = self._records[lease.keys[index]]
            data = bytes(self._read_bytes(rec))
            if rec.tier == "nvme" and checksum(data) != rec.checksum:
                self._stats["checksum_failures"] += 1
                raise ChecksumError(f"entry {rec.key.hex()} failed its checksum on read")
            return data

    def release(self, acquisition_id: int, drop: bool = False) -> int:
        """End a lease. ``drop`` (drop_select) decrements each entry's pending count;
        entries at zero are freed once nothing else holds them. Returns how many
        entries were freed now."""
        with self._lock:
            if acquisition_id == 0:
                return 0  # the empty acquisition of a full miss
            lease = self._open_lease(acquisition_id)
            del self._acqs[acquisition_id]
            return self._end_lease(lease, drop)

    def _claimable_prefix(self, recs: list[Record]) -> list[Record]:
        for i, rec in enumerate(recs):
            if rec.pending - self._claims.get(rec.key, 0) <= 0:
                return recs[:i]
        return recs

    def _end_lease(self, lease: Lease, drop: bool) -> int:
        if lease.claim:
            for key in lease.keys:
                left = self._claims[key] - 1
                if left:
                    self._claims[key] = left
                else:
                    del self._claims[key]
        put = []
        if drop:
            for key in lease.keys:
                rec = self._records[key]
                self._records[key] = rec._replace(pending=max(0, rec.pending - 1))
            put = [self._records[k] for k in dict.fromkeys(lease.keys)]
        gone = self._unhold(lease.keys)
        self._apply(put=[r for r in put if r.key not in gone], drop=gone)
        self._stats["dropped"] += len(gone)
        return len(gone)

    # ------------------------------------------------------------ admin
    def pin(self, keys: Sequence[bytes]) -> int:
        """Pin stored entries (they never move or go until unpinned)."""
        return self._change_pins(check_keys(keys), +1)

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._change_pins(check_keys(keys), -1)

    def _change_pins(self, keys: list[bytes], delta: int) -> int:
        with self._lock:
            missing = [k.hex() for k in keys if k not in self._records]
            if missing:
                raise NotFoundError(f"not stored: {', '.join(missing[:4])}")
            pins = {k: self._records[k].pins for k in keys}
            for key in keys:
                pins[key] += delta
            if any(p < 0 for p in pins.values()):
                raise InvalidRequestError("unpin of an entry that is not pinned")
            put = [self._records[k]._replace(pins=p) for k, p in pins.items()]
            gone = [r.key for r in put if self._idle_at_zero(r)]
            self._apply(put=[r for r in put if r.key not in gone], drop=gone)
            return len(pins)

    def evict(self, tier: str | None = None, nbytes: int | None = None,
              fraction: float | None = None, keys: Sequence[bytes] | None = None,
              everything: bool = False, dry_run: bool = False) -> EvictResult:
        """Remove entries for good, LRU first, never pinned or leased ones (those are
        reported in ``skipped``). Exactly one of nbytes / fraction / keys / everything."""
        check_tier(tier)
        chosen = [nbytes is not None, fraction is not None, keys is not None, everything]
        if sum(chosen) != 1:
            raise InvalidRequestError("evict needs exactly one of nbytes, fraction, keys, everything")
        if nbytes is not None and (not isinstance(nbytes, int) or nbytes < 0):
            raise InvalidRequestError(f"nbytes must be an int >= 0, got {nbytes!r}")
        if fraction is not None and not 0 < fraction <= 1:
            raise InvalidRequestError(f"fraction must be in (0, 1], got {fraction!r}")
        wanted = check_keys(keys) if keys is not None else None
        with self._lock:
            names = [tier] if tier else list(self._tiers)
            cands = [c for name in names if name in self._tiers for c in self._candidates(name)]
            if wanted is not None:
                want = set(wanted)
                cands = [c for c in cands if c.key in want]
                sel = self._policy.select(cands, None)
            elif fraction is not None:
                sel = self._policy.select_fraction(cands, fraction)
            else:
                sel = self._policy.select(cands, None if everything else nbytes)
            size = sum(self._records[k].nbytes for k in sel.keys)
            if not dry_run:
                self._apply(drop=sel.keys)
                self._stats["evictions"] += len(sel.keys)
            return EvictResult(sel.keys, size, sel.skipped)

    def demote(self, keys: Sequence[bytes]) -> int:
        """Move entries one tier down now (e.g. DRAM -> NVMe so they survive a
        restart). Pinned, leased, missing and last-tier entries stay; like pressure
        demotion, an entry no lower tier can take is evicted. Returns how many moved
        or went."""
        keys = check_keys(keys)
        with self._lock:
            last = [n for n in TIER_ORDER if n in self._tiers][-1]
            by_tier: dict[str, list[bytes]] = {}
            for key in dict.fromkeys(keys):
                rec = self._records.get(key)
                if rec and rec.tier != last and not rec.pins and not self._leased.get(key):
                    by_tier.setdefault(rec.tier, []).append(key)
            moved = 0
            for name, group in by_tier.items():
                # an earlier group's move may have pushed some of these down already
                group = [k for k in group if k in self._records
                         and self._records[k].tier == name]
                if group:
                    self._move_down(name, group)
                moved += len(group)
            return moved

    def clear(self) -> EvictResult:
        """Remove every entry that no reader holds, pinned ones included."""
        with self._lock:
            gone = [k for k in self._records if not self._leased.get(k)]
            size = sum(self._records[k].nbytes for k in gone)
            skipped = [k for k in self._records if self._leased.get(k)]
            self._apply(drop=gone)
            self._stats["evictions"] += len(gone)
            return EvictResult(gone, size, skipped)

    def verify(self, keys: Sequence[bytes] | None = None) -> VerifyResult:
        """Re-check every entry's checksum (or only those of ``keys``; keys not stored are
        skipped); drop bad ones (leased ones when released). ``kvstore verify`` passes
        batches of keys so the lock is never held for a whole NVMe tier's read."""
        wanted = None if keys is None else check_keys(keys)
        with self._lock:
            recs = (list(self._records.items()) if wanted is None else
                    [(k, self._records[k]) for k in wanted if k in self._records])
            checked = len(recs)
            bad = [k for k, r in recs if checksum(self._read_bytes(r)) != r.checksum]
            self._stats["checksum_failures"] += len(bad)
            self._apply(drop=[k for k in bad if not self._leased.get(k)])
            return VerifyResult(checked, bad)

    def entries(self, tier: str | None = None) -> Iterator[Record]:
        """A snapshot of the committed records (of one tier), for ``kvstore ls``."""
        check_tier(tier)
        with self._lock:
            snap = [r for r in self._records.values() if tier is None or r.tier == tier]
        return iter(snap)

    def reap(self) -> int:
        """Reclaim expired reservations and read leases, then restore watermarks.
        Called periodically by the server; returns how many were reclaimed."""
        with self._lock:
            now = time.time()
            done = 0
            for op in [o for o in self._res.values() if o.expires_at <= now]:
                self._close_reservation(op)
                self._remember_expired(op.id)
                self._stats["reservations_expired"] += 1
                done += 1
            for aid, lease in [(a, l) for a, l in self._acqs.items() if l.expires_at <= now]:
                del self._acqs[aid]
                self._end_lease(lease, drop=False)
                self._remember_expired(aid)
                self._stats["leases_expired"] += 1
                done += 1
            self._next_reap = min([o.expires_at for o in self._res.values()]
                                  + [l.expires_at for l in self._acqs.values()],
                                  default=float("inf"))
            self._restore_watermarks()
            return done

    def stats(self) -> dict:
        with self._lock:
            tiers = {}
            for name, tier in self._tiers.items():
                tiers[name] = {"capacity": tier.capacity, "used": tier.used,
                               "entries": len(self._by_tier[name]), "hits": self._hits[name],
                               "bytes_in": self._tier_bytes[name, "bytes_in"],
                               "bytes_out": self._tier_bytes[name, "bytes_out"]}
            out = {"tiers": tiers, "entries": len(self._records),
                   "hits": sum(self._hits.values()), "reservations": len(self._res),
                   "leases": len(self._acqs), "leased_entries": len(self._leased),
                   "pinned_entries": sum(1 for r in self._records.values() if r.pins),
                   "nvme_copies": len(self._copies)}
            for name in ("misses", "bytes_in", "bytes_out", "evictions", "demotions",
                         "stagings", "checksum_failures", "commit_checksum_failures",
                         "collisions", "commits", "aborts", "dropped",
                         "reservations_expired", "leases_expired"):
                out[name] = self._stats[name]
            return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.close()
            self._vindex.close()
            for tier in self._tiers.values():
                tier.close()
            self._dir_lock.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ helpers
    def _walk(self, keys: list[bytes], tokens: list[bytes]) -> list[Record]:
        out = []
        for key, tok in zip(keys, tokens):
            rec = self._records.get(key)
            if rec is None:
                break
            if rec.tokens != tok:  # a hash collision: a miss, never someone else's KV
                self._stats["collisions"] += 1
                break
            out.append(rec)
        return out

    def _info(self, rec: Record) -> EntryInfo:
        tier = self._tiers[rec.tier]
        address = tier.address(Extent(rec.tier, rec.offset, rec.nbytes))
        return EntryInfo(rec.key, rec.tier, rec.offset, rec.nbytes, address, rec.checksum,
                         rec.ntokens, rec.meta)

    def _candidates(self, name: str) -> list[Candidate]:
        ps = self._tiers[name].page_size
        recs = self._records
        return [Candidate(k, -(-recs[k].nbytes // ps) * ps, recs[k].last_access,
                          recs[k].created, recs[k].pins, self._leased.get(k, 0))
                for k in self._by_tier[name]]

    def _member_of(self, name: str):
        def member(key: bytes) -> Record | None:
            rec = self._records.get(key)
            return rec if rec is not None and rec.tier == name else None
        return member

    def _copy_of(self, key: bytes) -> Record | None:
        rec = self._records.get(key)
        return rec if rec is not None and rec.nvme_copy is not None else None

    def _open_reservation(self, rid: int) -> Open:
        op = self._res.get(rid)
        if op is None:
            raise self._gone("reservation", rid)
        return op

    def _open_lease(self, aid: int) -> Lease:
        lease = self._acqs.get(aid)
        if lease is None:
            raise self._gone("acquisition", aid)
        return lease

    def _gone(self, what: str, ident: int) -> Exception:
        if ident in self._expired:
            return LeaseExpiredError(f"{what} {ident} expired and was reclaimed")
        return NotFoundError(f"no open {what} {ident}")

    def _remember_expired(self, ident: int) -> None:
        self._expired[ident] = None
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)

    def _close_reservation(self, op: Open) -> None:
        for key, ext in zip(op.keys, op.extents):
            if ext is not None:
                self._tiers[ext.tier].free(ext)
                del self._inflight[key]
        del self._res[op.id]
        self._drop_now(self._unhold(op.held))

    def _maybe_reap(self) -> None:
        if time.time() >= self._next_reap:
            self.reap()


def _lease(lease_s: float | None, default: float) -> float:
    if lease_s is None:
        return default
    if not isinstance(lease_s, (int, float)) or not 0 < lease_s <= 3600:
        raise InvalidRequestError(f"lease_s must be in (0, 3600], got {lease_s!r}")
    return float(lease_s)


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
    for s in picked:
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < 2**64:
            raise InvalidRequestError(f"checksum must be a uint64, got {s!r}")
    return picked
