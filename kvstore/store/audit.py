"""``Store.check_integrity``: do the books of the store's parts balance?

Checked, each raising ``IntegrityError`` with what is wrong:
* each tier's own allocator books (``tier.check_integrity``);
* every extent is owned once: no two records / reservations / rooms share an
  offset, and per tier the page-rounded sizes of records plus open reservations
  and rooms equal ``tier.used`` (so no extent is leaked or owned twice);
* the per-tier membership lists and the pinned count match the records exactly;
* hold counts equal the holds of open acquisitions plus reservation dedups, and
  every held key is stored; pins and pending counts are never negative;
* the in-flight key map matches the open reservations;
* the LMDB index holds exactly the committed records that name NVMe bytes
  (last_access aside: access times are kept in memory and persisted with the next
  change), and the key pages ``ls`` walks exactly the keys of every record.
"""

from __future__ import annotations

import collections

from kvstore.core.errors import IntegrityError
from kvstore.store.index import Record, on_disk
from kvstore.store.catalog import durable
from kvstore.store.parts import Operations


class Audit(Operations):
    def check_integrity(self) -> None:
        with self.lock:
            self._audit_tiers()
            self._audit_holds()
            self._audit_index()

    def _audit_tiers(self) -> None:
        used = self._owned_bytes()
        for name, tier in self.place.tiers.items():
            tier.check_integrity()
            if used[name] != tier.used:
                raise IntegrityError(f"{name}: owners account for {used[name]} bytes, "
                                     f"tier says {tier.used} used")
            members = set(self.catalog.by_tier[name])
            expected = {k for k, r in self.catalog.records.items() if r.tier == name}
            if members != expected:
                raise IntegrityError(f"{name}: membership list differs from records by "
                                     f"{len(members ^ expected)} keys")

        pinned = sum(1 for r in self.catalog.records.values() if r.pins)
        if pinned != self.catalog.pinned:
            raise IntegrityError(f"pinned count {self.catalog.pinned}, records say {pinned}")
        copies = {k for k, r in self.catalog.records.items() if r.nvme_copy is not None}
        copied = collections.Counter(self.catalog.records[k].tier for k in copies)
        if any(copied[name] != n for name, n in self.catalog.copied.items()):
            raise IntegrityError(f"copies per tier {self.catalog.copied}, records say "
                                 f"{dict(copied)}")
        if copies != set(self.catalog.copies):
            raise IntegrityError("NVMe copy list differs from the records")
        copy_bytes = sum(self.catalog.copy_pages(self.catalog.records[k].nbytes) for k in copies)
        if copy_bytes != self.catalog.copy_bytes:
            raise IntegrityError(f"NVMe copies take {copy_bytes} bytes, the catalog counts "
                                 f"{self.catalog.copy_bytes}")

    def _owned_bytes(self) -> collections.Counter[str]:
        """Page-rounded bytes per tier of every record, NVMe copy and open reservation;
        raises if two of them claim one offset."""
        owned: dict[str, dict[int, str]] = {name: {} for name in self.place.tiers}
        used: collections.Counter[str] = collections.Counter()

        def own(tier: str, offset: int, nbytes: int, owner: str) -> None:
            if tier not in self.place.tiers:
                raise IntegrityError(f"{owner} lives in absent tier {tier!r}")
            if offset in owned[tier]:
                raise IntegrityError(f"{tier}@{offset} owned by {owned[tier][offset]} and {owner}")
            owned[tier][offset] = owner
            page = self.place.tiers[tier].page_size
            used[tier] += -(-nbytes // page) * page

        for key, rec in self.catalog.records.items():
            _audit_record(key, rec)
            own(rec.tier, rec.offset, rec.nbytes, f"record {key.hex()}")
            if rec.nvme_copy is not None:
                if rec.tier == "nvme":
                    raise IntegrityError(f"{key.hex()} on NVMe has an NVMe copy")
                own("nvme", rec.nvme_copy, rec.nbytes, f"copy of {key.hex()}")
        for op in self.holds.reservations.values():
            for ext in op.extents:
                if ext is not None:
                    own(ext.tier, ext.offset, ext.nbytes, f"reservation {op.id}")
        for room in self.holds.rooms.values():
            own(room.extent.tier, room.extent.offset, room.extent.nbytes, f"room {room.id}")
        for ext in self.place.copies_in_flight:
            own(ext.tier, ext.offset, ext.nbytes, "a writeback copy being written")
        for plan in self.place.staging_in_flight.values():
            for _, ext in plan.staging:
                if ext is not None:
                    own(ext.tier, ext.offset, ext.nbytes, "an NVMe entry being staged")
        return used

    def _audit_holds(self) -> None:
        holds: collections.Counter[bytes] = collections.Counter()
        for lease in self.holds.leases.values():
            holds.update(lease.keys)
        for keys in self.holds.sends.values():
            holds.update(keys)
        inflight = {}
        for op in self.holds.reservations.values():
            holds.update(op.held)
            for key, ext in zip(op.keys, op.extents):
                if ext is not None:
                    inflight[key] = op.id
        if dict(holds) != self.holds.leased:
            raise IntegrityError(f"hold counts out of step: {len(self.holds.leased)} held keys, "
                                 f"{len(holds)} expected")
        missing = [k for k in holds if k not in self.catalog.records]
        if missing:
            raise IntegrityError(f"{len(missing)} held keys are not stored "
                                 f"(first {missing[0].hex()})")
        if inflight != self.holds.inflight:
            raise IntegrityError("in-flight key map out of step with open reservations")
        stored = [k for k in inflight if k in self.catalog.records]
        if stored:
            raise IntegrityError(f"key {stored[0].hex()} is both committed and being written")

    def _audit_index(self) -> None:
        """The durable index holds exactly the records that name NVMe bytes (access
        times aside: they reach it with the next change), and the key pages exactly
        the keys of every record."""
        memory = {k: on_disk(r)._replace(last_access=0.0)
                  for k, r in self.catalog.records.items() if durable(r)}
        stored = {r.key: on_disk(r)._replace(last_access=0.0)
                  for r in self.catalog.index.records()}
        if stored != memory:
            diff = set(stored) ^ set(memory)
            changed = [k for k in set(stored) & set(memory) if stored[k] != memory[k]]
            raise IntegrityError(f"durable index and memory disagree: {len(diff)} keys in "
                                 f"one only, {len(changed)} records differ")
        if set(self.catalog.keys) != self.catalog.records.keys():  # a key is in one bucket
            raise IntegrityError(f"key pages out of step: {len(self.catalog.keys)} keys for "
                                 f"{len(self.catalog.records)} records")


def _audit_record(key: bytes, rec: Record) -> None:
    if rec.key != key:
        raise IntegrityError(f"record under {key.hex()} names {rec.key.hex()}")
    if rec.pins < 0 or rec.pending < 0:
        raise IntegrityError(f"{key.hex()}: pins {rec.pins}, pending {rec.pending}")
