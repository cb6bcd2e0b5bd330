"""The store: one node's entries, behind a thin facade over parts that each own
their state (parts.py says who owns what).

Who calls it: the server's handlers and its reaper thread, the admin CLI through
the server, and tests. Every public method takes the store's one lock, so calls
are serialized; none waits on anything but local memory and disk.

Life of an entry (docs/architecture.md, "Store"):
  reserved (memory only) -> committed (records; the LMDB index too when it names
  NVMe bytes) -> leased / pinned
  -> demoted (gpu -> dram -> nvme) -> dropped (pending reached 0, evicted, corrupt)

Parts: ``Catalog`` (records, the NVMe index, key order, victim orders: the one
place records change), ``Holds`` (reservations, leases, hold counts), ``Placement`` (tiers,
policy: allocation, demotion, staging), ``ByteIO`` (bytes and checksums); the
operations over them in groups: ``Writes``, ``Reads``, ``Admin``, ``Audit``.
This class builds and wires them, reaps, counts, and is the typed interface
the server's handlers call.

Invariants across the parts (``check_integrity`` checks them):
* every live extent of every tier is owned by exactly one committed record or one
  open reservation; per tier their page-rounded sizes sum to ``tier.used``;
* a leased or pinned entry never moves and never goes;
* an index record is written only at commit, and an extent is freed only after the
  index transaction that stops pointing at it has committed, so after a crash no
  two records can claim one extent;
* bytes read back from NVMe are checksum-verified before anyone sees them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from kvstore.core.config import KVStoreConfig
from kvstore.core.errors import ConfigError, StorageError, TierFullError
from kvstore.core.hashing import checksum
from kvstore.store.admin import Admin
from kvstore.store.audit import Audit
from kvstore.store.bytes_io import ByteIO
from kvstore.store.catalog import Catalog
from kvstore.store.holds import Holds
from kvstore.store.index import Record
from kvstore.store.parts import Counters, Parts
from kvstore.store.placement import Placement
from kvstore.store.policy import make_policy
from kvstore.store.reads import Reads, Staging
from kvstore.store.setup import DataDirLock, build_tiers, recover
from kvstore.store.types import (  # the result types are re-exported: callers import them here
    TIER_ORDER,
    Acquisition,
    CommitResult,
    DemoteResult,
    EntryInfo,
    EvictResult,
    LookupResult,
    EntryPlacement,
    PutResult,
    Reservation,
    RoomGrant,
    VerifyResult,
)
from kvstore.store.writes import Later, Writes
from tiers.base import Extent, MemoryRegion, Tier

__all__ = ["Acquisition", "CommitResult", "DemoteResult", "EntryInfo", "EntryPlacement",
           "EvictResult", "LookupResult", "PutResult", "Reservation", "RoomGrant", "Store",
           "VerifyResult"]

log = logging.getLogger(__name__)

# The server's scrub hashes an entry committed unhashed once it is this old (seconds).
SCRUB_AFTER_S = 1.0
# After a writeback round that wrote nothing, wait at least this many times the CPU
# time it took: its walk of the window takes a core (and the GIL), and such rounds
# must take at most 1 / (1 + this) of it (while a round takes under
# WRITEBACK_PAUSE_MAX_S / this, ~0.22 s of CPU: a window of ~75k entries; past that
# the cap below keeps the writeback from lagging further, at more of a core).
WRITEBACK_IDLE_FACTOR = 9
WRITEBACK_PAUSE_MAX_S = 2.0  # ... but never longer than this
# A stream door reply sends its entries' runs in the arena as views (``dram_bytes``)
# when they average at least this many bytes; smaller ones (sub-page entries, a
# page's gap after each) are copied into one: a view costs the serving thread about
# what a copy of a few tens of KiB does, and a system call per 64 of them.
SEND_RUN_BYTES = 32 << 10
# Entries the background demotes per hold of the store's lock (an index flip each).
DEMOTE_CHUNK = 256
DEMOTE_YIELD_S = 0.001  # the pause between two chunks

_COUNTED = ("misses", "bytes_in", "bytes_out", "evictions", "demotions", "stagings",
            "checksum_failures", "commit_checksum_failures", "collisions", "commits",
            "aborts", "dropped", "reservations_expired", "rooms_expired", "leases_expired",
            "storage_errors", "late_writes", "late_reads",
            "staging_shortfalls", "staging_spent", "transfer_checksum_failures",
            "unchecked_checksum_failures", "writebacks")


class Store:
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
        self._closed = False
        # Held through a whole writeback round, I/O included: close waits for it.
        self._writeback_round = threading.Lock()
        self._writeback_stop = threading.Event()
        self._writeback_thread: threading.Thread | None = None
        self._scrub_thread: threading.Thread | None = None
        self._dir_lock = DataDirLock(self.data_dir)
        try:
            self._open(tiers, policy)
        except BaseException:
            self._dir_lock.release()
            raise

    def _open(self, tiers: dict[str, Tier] | None, policy: str) -> None:
        built = tiers if tiers is not None else build_tiers(self.config, self.data_dir)
        ordered = {name: built[name] for name in TIER_ORDER if name in built}
        try:
            if not any(name in ordered for name in ("gpu", "dram")):
                raise ConfigError("kvstore needs a memory tier (gpu_bytes or dram_bytes > 0): "
                                  "writers and readers reach entries through it")
            rules = make_policy(policy)
            self._counters = Counters()
            self.catalog = Catalog(self.data_dir, self.config.store.index_map_bytes,
                                   self.config.tiers.nvme_fsync != "never", ordered,
                                   rules.sort_key, self._counters.events)
        except BaseException:
            for tier in built.values():
                tier.close()
            raise
        self.holds = Holds(self.catalog.records)
        io = ByteIO(ordered)
        self.place = Placement(self.config, ordered, rules, self.catalog, self.holds, io,
                               self._counters.events)
        try:
            recovered = recover(self.catalog.index, ordered).records
        except BaseException:
            self.catalog.close()
            self.place.close()
            raise
        self.catalog.load(recovered)
        parts = Parts(self.config, self._lock, self.catalog, self.holds, self.place, io,
                      self._counters, self._maybe_reap)
        self._writes, self._reads = Writes(parts), Reads(parts)
        self._admin, self._audit = Admin(parts), Audit(parts)

    # ------------------------------------------------------------ writes
    def reserve(self, keys: Sequence[bytes], sizes: Sequence[int], tokens: Sequence[bytes],
                meta: Sequence[bytes | None] | None = None,
                lease_s: float | None = None, namespace: bytes = b"",
                deadline: float | None = None) -> Reservation:
        """Space for the keys not yet stored (writes.py, ``Writes.reserve``)."""
        return self._writes.reserve(keys, sizes, tokens, meta, lease_s, namespace, deadline)

    def write(self, reservation_id: int, index: int, data: Any) -> None:
        """Copy one new entry's bytes into its reserved extent (local writers)."""
        self._writes.write(reservation_id, index, data)

    def commit(self, reservation_id: int, checksums: Sequence[int],
               pin: bool = False, deadline: float | None = None,
               next_room: int = 0, later: Later | None = None) -> CommitResult:
        """Verify the written bytes and make the entries visible (``Writes.commit``;
        ``later``: the in-memory part may be handed there, to run after the answer
        with ``lock`` held throughout)."""
        return self._writes.commit(reservation_id, checksums, pin, deadline, next_room, later)

    def put(self, room_id: int, keys: Sequence[bytes], sizes: Sequence[int],
            tokens: Sequence[bytes], offsets: Sequence[int], checksums: Sequence[int],
            meta: Sequence[bytes | None] | None = None, skip: int = 0, pin: bool = False,
            namespace: bytes = b"", deadline: float | None = None,
            next_room: int = 0, later: Later | None = None) -> PutResult:
        """Store entries already copied into a room: reserve + commit in one step
        (``Writes.put``; ``later`` as ``commit``'s)."""
        return self._writes.put(room_id, keys, sizes, tokens, offsets, checksums, meta, skip,
                                pin, namespace, deadline, next_room, later)

    @property
    def lock(self) -> threading.RLock:
        """The store's one lock. A caller that passes ``later`` to ``commit`` or
        ``put`` holds it from the call until it has run what it was handed (the
        server: around each request, its reply and that work)."""
        return self._lock

    def grant_room(self, nbytes: int) -> RoomGrant | None:
        """Room for a writer's next insert, from free space only (``Writes.grant_room``)."""
        return self._writes.grant_room(nbytes)

    def abort(self, reservation_id: int) -> None:
        """Forget a reservation, or give a room back; its space is free at once."""
        self._writes.abort(reservation_id)

    # ------------------------------------------------------------ reads
    def lookup(self, keys: Sequence[bytes], tokens: Sequence[bytes]) -> LookupResult:
        """Longest stored prefix; binds nothing."""
        return self._reads.lookup(keys, tokens)

    def acquire(self, keys: Sequence[bytes], tokens: Sequence[bytes],
                lease_s: float | None = None, claim: bool = False,
                optional_tail: bool = False, spend_rest: bool = False,
                deadline: float | None = None) -> Acquisition:
        """Longest stored prefix, leased until ``release`` (reads.py, ``Reads.acquire``)."""
        return self._reads.acquire(keys, tokens, lease_s, claim, optional_tail, spend_rest,
                                   deadline)

    def begin_acquire(self, keys: Sequence[bytes], tokens: Sequence[bytes],
                      lease_s: float | None = None, claim: bool = False,
                      optional_tail: bool = False, spend_rest: bool = False,
                      deadline: float | None = None) -> Acquisition | Staging:
        """``acquire`` whose NVMe staging the caller runs elsewhere: the Acquisition,
        or a ``Staging`` to ``read()`` without the lock and then ``finish()``
        (reads.py, ``Reads.begin_acquire``)."""
        return self._reads.begin_acquire(keys, tokens, lease_s, claim, optional_tail,
                                         spend_rest, deadline)

    def dram_bytes(self, entries: Sequence[EntryInfo], runs: bool = False,
                   copy_max: int | None = None
                   ) -> memoryview | bytes | list[memoryview] | None:
        """The bytes of acquired entries back to back (a server sends a small
        drop_select's bytes in the acquire's reply): a view of the DRAM arena when
        they lie back to back in it (a prompt's entries, reserved together), else
        one copy, or with ``runs`` views of them in order, those back to back joined
        (``Tier.runs_of``: a stream door sends several without a copy) unless they
        are smaller than ``SEND_RUN_BYTES`` on average (then one copy). A copy is
        made of at most ``copy_max`` bytes (None: any): past that, ``runs`` gives
        the views however small, else None. None unless all are in DRAM. Their lease
        keeps them where they are while this runs; a caller that keeps a view longer
        holds them (``hold_send``)."""
        with self._lock:
            dram = self.place.tiers.get("dram")
            if dram is None:
                return None
            if not entries:
                return b"".join(cast(list[memoryview], dram.views([])))  # (closed: raises)
            # (EntryInfo's fields transposed in one C-level pass: no Python per entry
            # on the usual path, where they lie back to back.)
            _, tiers, offsets, sizes = list(zip(*entries))[:4]
            if tiers.count("dram") != len(tiers):
                return None
            span = dram.span_of(offsets, sizes)  # (the usual case, in C-level passes)
            if span is not None:
                return [span] if runs else span
            nbytes = sum(sizes)
            copies = copy_max is None or nbytes <= copy_max
            if runs:  # (a Python pass per entry only for entries apart in the arena)
                views = dram.runs_of(offsets, sizes)
                if views is None or not copies or nbytes >= SEND_RUN_BYTES * len(views):
                    return views
            elif not copies:
                return None
            extents = [Extent("dram", off, n) for off, n in zip(offsets, sizes)]
            return b"".join(cast(list[memoryview], dram.views(extents)))

    def hold_send(self, acquisition_id: int) -> None:
        """Hold the entries of open lease ``acquisition_id`` until ``end_send``: a
        server sends their bytes from a view of the arena (``dram_bytes``), and they
        must neither move nor go, nor their space be written, before the bytes are
        out, however soon the lease ends (released, expired)."""
        with self._lock:
            self.holds.hold_send(acquisition_id)

    def end_send(self, acquisition_id: int) -> int:
        """The bytes of ``hold_send(acquisition_id)`` are out: the hold goes, and with
        it entries nothing else needs any more (how many), and those known bad at rest
        that only the send still held (a reader reported them while it was out)."""
        with self._lock:
            freed = self.catalog.drop_idle(self.holds.end_send(acquisition_id))
            return freed + self._drop_condemned()

    def _drop_condemned(self) -> int:
        """Drop the entries known bad at rest that nothing holds any more (logged);
        how many. Under the lock."""
        if not self.catalog.condemned:
            return 0
        gone = self._writes.drop_condemned()
        if gone:
            log.warning("%d entries known bad at rest, held until now: dropped (first %s)",
                        len(gone), gone[0].hex())
        return len(gone)

    def read(self, acquisition_id: int, index: int) -> bytes:
        """The bytes of one acquired entry (local readers)."""
        return self._reads.read(acquisition_id, index)

    def release(self, acquisition_id: int, drop: bool = False,
                corrupt: Sequence[int] = ()) -> int:
        """End a lease; with ``drop`` spend one pending consumer (``Reads.release``)."""
        return self._reads.release(acquisition_id, drop, corrupt)

    def end_sent(self, acquisition_id: int, drop: bool) -> int:
        """End a lease whose reply's bytes are all sent (``Reads.end_sent``)."""
        return self._reads.end_sent(acquisition_id, drop)

    # ------------------------------------------------------------ admin
    def pin(self, keys: Sequence[bytes]) -> int:
        """Pin stored entries (they never move or go until unpinned)."""
        return self._admin.pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._admin.unpin(keys)

    def evict(self, tier: str | None = None, nbytes: int | None = None,
              fraction: float | None = None, keys: Sequence[bytes] | None = None,
              everything: bool = False, dry_run: bool = False) -> EvictResult:
        """Remove entries for good, LRU first (admin.py, ``Admin.evict``)."""
        return self._admin.evict(tier, nbytes, fraction, keys, everything, dry_run)

    def demote_entries(self, tier: str | None = None, nbytes: int | None = None,
                       fraction: float | None = None, keys: Sequence[bytes] | None = None,
                       everything: bool = False, dry_run: bool = False) -> DemoteResult:
        """Move entries one tier down now, chosen as ``evict`` chooses."""
        return self._admin.demote_entries(tier, nbytes, fraction, keys, everything, dry_run)

    def demote(self, keys: Sequence[bytes]) -> int:
        """Move these entries one tier down now; returns how many moved or went."""
        return self._admin.demote(keys)

    def clear(self) -> EvictResult:
        """Remove every entry that no reader holds, pinned ones included."""
        return self._admin.clear()

    def verify(self, keys: Sequence[bytes] | None = None) -> VerifyResult:
        """Re-check checksums (of ``keys``, or all); drop bad entries."""
        return self._admin.verify(keys)

    def entries_page(self, tier: str | None = None, after: bytes | None = None,
                     limit: int = 1000) -> tuple[list[Record], bytes | None]:
        """One page of ``kvstore ls``, in key order (``Admin.entries_page``)."""
        return self._admin.entries_page(tier, after, limit)

    def entries(self, tier: str | None = None) -> Iterator[Record]:
        """A snapshot of the committed records (of one tier), for ``kvstore ls``."""
        return self._admin.entries(tier)

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless the parts' books balance (audit.py)."""
        self._audit.check_integrity()

    # ------------------------------------------------------------ the node
    @property
    def dram_shared_path(self) -> str | None:
        """The shared-memory file same-node clients map to write into DRAM extents."""
        dram = self.place.tiers.get("dram")
        return getattr(dram, "shared_path", None)

    @property
    def tier_names(self) -> list[str]:
        return list(self.place.tiers)

    def regions(self) -> dict[str, list[MemoryRegion]]:
        """Address ranges of each memory tier, to register with TE once."""
        return {name: tier.regions() for name, tier in self.place.tiers.items()}

    def reap(self) -> int:
        """Reclaim expired reservations, rooms and read leases, then restore watermarks.
        Called periodically by the server; returns how many were reclaimed."""
        with self._lock:
            now = time.time()
            holds, counts = self.holds, self._counters.events
            done = 0
            for op in [o for o in holds.reservations.values() if o.expires_at <= now]:
                self._writes.close_reservation(op)
                holds.remember_expired(op.id)
                counts["reservations_expired"] += 1
                done += 1
            for rid in [r.id for r in holds.rooms.values() if r.expires_at <= now]:
                self._writes.close_room(rid)
                holds.remember_expired(rid)
                counts["rooms_expired"] += 1
                done += 1
            for aid, lease in [(a, le) for a, le in holds.leases.items() if le.expires_at <= now]:
                # (drop=False writes only idle entries' drops, and a refused one
                # leaves them stored: the lease always ends here)
                self._reads.end_lease(lease, drop=False)
                holds.close_lease(aid)
                holds.remember_expired(aid)
                counts["leases_expired"] += 1
                done += 1
            holds.reaped(now)
            self.catalog.index.drop_strays()  # rows a full index could not delete
            self._drop_condemned()  # known bad, and maybe no longer held
            try:
                self.place.restore_watermarks()
            except (StorageError, TierFullError):  # demotion resumes when space does
                pass
            return done

    # ------------------------------------------------------------ writeback
    def start_writeback(self, idle_s: float = 0.05) -> None:
        """Run ``writeback_step`` in a background thread until ``close`` (the
        server does; a store used in-process by tests calls the step itself).
        After a round that wrote nothing it waits ``idle_s``, or
        ``WRITEBACK_IDLE_FACTOR`` times the CPU time that round took where that is
        longer (at most ``WRITEBACK_PAUSE_MAX_S``; time spent waiting for the store's
        lock or the GIL is not counted, so slow work elsewhere does not stop it): a round's choice walks the tier's least recently used entries
        (O(entries in the window): tens of ms at 100k entries; without the store's
        lock, but on the GIL), and rounds that find them all copied must not take
        most of a core. (A tier whose every entry has its copy costs a round no walk
        at all.)"""
        if not self.config.policy.background_writeback or self._writeback_thread is not None:
            return

        def run() -> None:
            while not self._writeback_stop.is_set():
                start = time.thread_time()  # (waiting for the lock or the GIL: not counted)
                try:
                    wrote = self.writeback_step()
                except Exception:  # never let the thread die; the step logs its cause
                    log.exception("background writeback round failed")
                    wrote = 0
                try:
                    wrote += self.demote_step()
                except Exception:
                    log.exception("background demotion failed")
                try:
                    wrote += self.evict_step()
                except Exception:
                    log.exception("background eviction failed")
                if not wrote:
                    took = time.thread_time() - start
                    self._writeback_stop.wait(min(WRITEBACK_PAUSE_MAX_S,
                                                  max(idle_s, WRITEBACK_IDLE_FACTOR * took)))

        self._writeback_thread = threading.Thread(target=run, name="kvstore-writeback",
                                                  daemon=True)
        self._writeback_thread.start()

    def demote_step(self) -> int:
        """Demote ahead of the high watermark (``Placement.demote_ahead``): the
        entries of the tier right above NVMe that have their copies flip to them
        until it is at the low watermark or its next victim has no copy. Returns the
        bytes freed. (The writeback thread runs it after each round, then
        ``evict_step``; a store used in-process by tests calls them itself.)"""
        return self._in_chunks(self.place.demote_ahead)

    def evict_step(self) -> int:
        """Evict ahead of the high watermark (``Placement.evict_ahead``): the last
        tier's own victims go until it is at the low watermark. Returns the bytes
        freed."""
        return self._in_chunks(self.place.evict_ahead)

    def _in_chunks(self, step: Callable[[int, bool], int]) -> int:
        """``step`` in chunks of ``DEMOTE_CHUNK`` entries, the lock let go between
        them, until it frees nothing; the bytes freed."""
        freed = 0
        while True:
            with self._lock:
                if self._closed:
                    return freed
                try:
                    chunk = step(DEMOTE_CHUNK, freed > 0)
                except (StorageError, TierFullError):  # the index refused: next round
                    return freed
            if not chunk:
                return freed
            freed += chunk
            # Let a request waiting for the lock have it: a lock let go and taken
            # again at once by this thread (it holds the GIL) starved requests
            # through all of a demotion's chunks (60 ms at 5,000 entries).
            time.sleep(DEMOTE_YIELD_S)

    def writeback_step(self) -> int:
        """One background writeback round: choose the entries the next demotions
        would take (the walk of the window without the lock, the choice checked and
        its NVMe extents allocated under it), write their NVMe copies without the
        lock, then record the copies (under the lock). Demotion under pressure then only
        flips the index to the copy. Returns the bytes written."""
        limit = self.config.policy.writeback_batch_bytes
        with self._writeback_round:
            with self._lock:
                if self._closed:
                    return 0
                window = self.place.writeback_window()
            if window is None:
                return 0
            # The walk of the window without the lock (O(entries in it)); each
            # candidate is checked again under it.
            keys = self.place.writeback_candidates(window, limit)
            if not keys:
                return 0
            with self._lock:
                if self._closed:
                    return 0
                plan = self.place.allocate_writeback(keys, limit)
            if not plan:
                return 0
            written = False
            try:
                nvme = self.place.tiers["nvme"]
                # Not held: an entry that moves meanwhile loses its copy at finish.
                nvme.write_many([ext for _, ext in plan],
                                [memoryview(self.place.io.read_bytes(r)) for r, _ in plan])
                if self.config.tiers.nvme_fsync != "never":
                    nvme.flush()  # durable before the index points at it
                written = True
            except OSError as exc:
                self._counters.events["storage_errors"] += 1
                log.warning("background writeback of %d entries failed: %s", len(plan), exc)
            finally:
                with self._lock:
                    try:
                        self.place.finish_writeback(plan, written)
                    except StorageError:
                        written = False  # counted and logged by the catalog
            return sum(rec.nbytes for rec, _ in plan) if written else 0

    # ------------------------------------------------------------ scrub
    def start_scrub(self, idle_s: float = 0.05, batch_bytes: int = 64 << 20,
                    min_age_s: float = SCRUB_AFTER_S) -> None:
        """Run ``scrub_step`` in a background thread at low CPU priority until
        ``close`` (the server does, with ``store.verify_commits = "background"``; a
        store used in-process calls the step itself). Entries are hashed once they
        are ``min_age_s`` old: most of a disaggregated store's entries are taken by
        their consumer, which verifies them, well before that, and are never hashed
        by the server at all."""
        if self.config.store.verify_commits != "background" or self._scrub_thread is not None:
            return

        def run() -> None:
            try:  # this thread only: requests keep the CPU when both want it
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (OSError, AttributeError):
                pass
            while not self._writeback_stop.is_set():
                try:
                    done = self.scrub_step(batch_bytes, min_age_s)
                except Exception:  # never let the thread die
                    log.exception("background commit check failed")
                    done = 0
                if not done:
                    self._writeback_stop.wait(idle_s)

        self._scrub_thread = threading.Thread(target=run, name="kvstore-scrub", daemon=True)
        self._scrub_thread.start()

    def scrub_step(self, batch_bytes: int = 64 << 20, min_age_s: float = 0.0) -> int:
        """Hash the next entries that were committed unhashed (up to ``batch_bytes``)
        and drop those that do not match what their writer claimed (``Writes.
        finish_check`` and ``drop_condemned`` say how, and how a record that changes
        meanwhile is settled). The hashing, and any copy out of a tier without views
        (GPU), run without the lock, so requests go on meanwhile. Returns how many
        were hashed."""
        with self._lock:
            if self._closed:
                return 0
            dropped = self._writes.drop_condemned()
            batch = self._writes.unchecked_batch(batch_bytes, min_age_s)
        # Without the lock: an extent's memory stays valid (the arena outlives its
        # records; close joins this thread first), only its bytes can change.
        sums = [checksum(self.place.io.read_bytes(rec)) for rec in batch]
        if batch:
            with self._lock:
                if self._closed:
                    return 0
                self._writes.finish_check(batch, sums)
                dropped += self._writes.drop_condemned()
        if dropped:
            log.warning("%d committed entries did not match their writer's checksum "
                        "(first %s): dropped", len(dropped), dropped[0].hex())
        return len(batch)

    def _maybe_reap(self) -> None:
        if time.time() >= self.holds.next_reap:
            self.reap()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self._counters
            records = self.catalog.records
            tiers = {}
            for name, tier in self.place.tiers.items():
                tiers[name] = {"capacity": tier.capacity, "used": tier.used,
                               "entries": len(self.catalog.by_tier[name]), "hits": c.hits[name],
                               "bytes_in": c.tier_bytes[name, "bytes_in"],
                               "bytes_out": c.tier_bytes[name, "bytes_out"]}
            out: dict[str, Any] = {
                "tiers": tiers, "entries": len(records), "hits": sum(c.hits.values()),
                "reservations": len(self.holds.reservations), "leases": len(self.holds.leases),
                "rooms": len(self.holds.rooms),
                "room_bytes": sum(r.extent.nbytes for r in self.holds.rooms.values()),
                "leased_entries": len(self.holds.leased),
                "pinned_entries": self.catalog.pinned,
                "nvme_copies": len(self.catalog.copies),
                "unchecked_entries": len(self.catalog.unchecked) + len(self.catalog.condemned)}
            for name in _COUNTED:
                out[name] = c.events[name]
            return out

    def close(self) -> None:
        self._writeback_stop.set()
        for thread in (self._writeback_thread, self._scrub_thread):
            if thread is not None:
                thread.join()
        with self._writeback_round, self._lock:
            if self._closed:
                return
            self._closed = True
            self.catalog.close()
            self.place.close()
            self._dir_lock.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
