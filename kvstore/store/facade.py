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
from pathlib import Path

from kvstore.core.config import KVStoreConfig
from kvstore.core.errors import ConfigError, LeaseExpiredError, NotFoundError, StorageError
from kvstore.store.index import Index, Record, open_volatile
from kvstore.store.policy import Candidate, make_policy
from kvstore.store.admin import AdminMixin
from kvstore.store.audit import AuditMixin
from kvstore.store.moves import MovesMixin
from kvstore.store.order import GroupOrder
from kvstore.store.reads import ReadsMixin
from kvstore.store.records import Lease, Open
from kvstore.store.setup import DataDirLock, build_tiers, recover
from kvstore.store.types import (  # the result types are re-exported: callers import them here
    TIER_ORDER,
    Acquisition,
    CommitResult,
    EntryInfo,
    EvictResult,
    LookupResult,
    Placement,
    Reservation,
    VerifyResult,
)
from kvstore.store.writes import WritesMixin
from tiers.base import MemoryRegion, Tier

__all__ = ["Acquisition", "CommitResult", "EntryInfo", "EvictResult", "LookupResult",
           "Placement", "Reservation", "Store", "VerifyResult"]

log = logging.getLogger(__name__)

_EXPIRED_MEMORY = 4096  # ids of reaped reservations/leases remembered for a clear error

# The public methods live in one mixin per concern: store_writes.py (reserve / write /
# commit / abort), store_reads.py (lookup / acquire / read / release), store_admin.py
# (pin / evict / demote / clear / verify / entries), store_moves.py (how entries
# change place), store_records.py (``_apply``, holds), store_audit.py
# (check_integrity). This class owns the state.
class Store(WritesMixin, ReadsMixin, AdminMixin, MovesMixin, AuditMixin):
    def __init__(self, config: KVStoreConfig, tiers: dict[str, Tier] | None = None,
                 policy: str = "lru") -> None:
        """Open (or recover) the store in ``config.store.data_dir``.

        ``tiers`` replaces the tiers config asks for (tests); the store owns and
        closes them either way.
        """
        self.config = config
        self.data_dir = Path(config.store.data_dir)
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"data dir {self.data_dir} exists and is not a "
                              f"directory") from None
        except OSError as exc:
            raise ConfigError(f"cannot create data dir {self.data_dir}: "
                              f"{exc.strerror or exc}") from None
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
            self._open_indexes()
        except BaseException:
            self._close_tiers()
            raise
        self._init_state()
        try:
            recovered = recover(self._index, self._tiers).records
        except BaseException:
            self._index.close()
            self._vindex.close()
            self._close_tiers()
            raise
        self._load(recovered)

    def _open_indexes(self) -> None:
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

    def _init_state(self) -> None:
        self._records: dict[bytes, Record] = {}
        self._by_tier: dict[str, dict[bytes, None]] = {name: {} for name in self._tiers}
        self._copies: dict[bytes, None] = {}  # keys served from memory with an NVMe copy
        self._leased: dict[bytes, int] = {}  # key -> number of holders (acquisitions, dedup)
        self._claims: dict[bytes, int] = {}  # key -> pending consumers claimed by open leases
        self._end_claims: dict[bytes, int] = {}  # key -> its ``ends`` claimed by open leases
        self._acqs: dict[int, Lease] = {}
        self._res: dict[int, Open] = {}
        self._inflight: dict[bytes, int] = {}  # key being written -> reservation id
        self._expired: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._next_reap = float("inf")
        self._stats = collections.Counter()
        self._hits = collections.Counter()
        self._tier_bytes: collections.Counter = collections.Counter()  # (tier, in/out)
        self._closed = False

    def _load(self, recovered: list[Record]) -> None:
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

    def _close_tiers(self) -> None:
        for tier in self._tiers.values():
            tier.close()

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
                try:
                    self._end_lease(lease, drop=False)
                except StorageError:  # counted and logged; the lease is reaped next tick
                    continue
                del self._acqs[aid]
                self._remember_expired(aid)
                self._stats["leases_expired"] += 1
                done += 1
            self._next_reap = min([o.expires_at for o in self._res.values()]
                                  + [l.expires_at for l in self._acqs.values()],
                                  default=float("inf"))
            if self._next_reap <= now:  # a lease the index refused to end: retry soon
                self._next_reap = now + 1.0
            try:
                self._restore_watermarks()
            except StorageError:  # counted and logged; demotion resumes when space does
                pass
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
                         "reservations_expired", "leases_expired", "storage_errors",
                         "staging_shortfalls", "staging_spent", "transfer_checksum_failures"):
                out[name] = self._stats[name]
            return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.close()
            self._vindex.close()
            self._close_tiers()
            self._dir_lock.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ helpers
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

    def _gone(self, what: str, ident: int) -> Exception:
        if ident in self._expired:
            return LeaseExpiredError(f"{what} {ident} expired and was reclaimed")
        return NotFoundError(f"no open {what} {ident}")

    def _remember_expired(self, ident: int) -> None:
        self._expired[ident] = None
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)

    def _maybe_reap(self) -> None:
        if time.time() >= self._next_reap:
            self.reap()
