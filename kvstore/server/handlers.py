"""The server's handler table: one function per wire op.

A handler gets the store and an already validated request (kvstore.core.protocol), calls
the one store method it maps to and turns the typed result into a msgpack-safe map.
No business logic lives here: dedup, leases, staging, eviction, the writer's deadline
are the store's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from typing import Any

from kvstore.core import protocol as p
from kvstore.store import Store
from kvstore.store.reads import Staging
from kvstore.store.types import Acquisition, EntryPlacement, RoomGrant
from kvstore.store.writes import Later

MAX_EVICT_KEYS_REPLY = 1000  # an evict reply lists at most this many keys (count is exact)


def plain(value: Any) -> Any:
    """Typed results (NamedTuple, dataclass, containers) -> msgpack-safe values."""
    if hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if is_dataclass(value) and not isinstance(value, type):
        return {k: plain(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, (bytes, str, bool, int, float)) or value is None:
        return value
    return str(value)


def _placement(pl: EntryPlacement | None) -> list | None:
    return None if pl is None else [pl.tier, pl.offset, pl.nbytes, pl.address]


def reserve(store: Store, req: p.Reserve) -> dict:
    res = store.reserve(list(req.keys), list(req.sizes), list(req.tokens),
                        meta=None if req.meta is None else list(req.meta), lease_s=req.lease_s,
                        namespace=req.namespace or b"", deadline=req.deadline)
    return {"rid": res.id, "expires_at": res.expires_at,
            "placements": [_placement(pl) for pl in res.placements]}


def commit(store: Store, req: p.Commit, later: Later | None = None) -> dict:
    res = store.commit(req.rid, list(req.checksums), pin=req.pin, deadline=req.deadline,
                       next_room=req.next_room or 0, later=later)
    return {"new": res.new, "deduped": res.deduped, "lost": res.lost, "room": _room(res.room)}


def put(store: Store, req: p.Put, later: Later | None = None) -> dict:
    res = store.put(req.room, list(req.keys), list(req.sizes), list(req.tokens),
                    list(req.offsets), list(req.checksums),
                    meta=None if req.meta is None else list(req.meta), skip=req.skip,
                    pin=req.pin, namespace=req.namespace or b"", deadline=req.deadline,
                    next_room=req.next_room or 0, later=later)
    return {"new": res.new, "deduped": res.deduped, "lost": res.lost,
            "existing": list(res.existing), "room": _room(res.room)}


def _room(room: RoomGrant | None) -> list | None:
    return None if room is None else [room.id, room.tier, room.offset, room.nbytes,
                                      room.address, room.page, room.lease_s]


def abort(store: Store, req: p.Abort) -> dict:
    store.abort(req.rid)
    return {}


def lookup(store: Store, req: p.Lookup) -> dict:
    res = store.lookup(list(req.keys), list(req.tokens))
    return {"matched_blocks": res.matched_blocks, "matched_tokens": res.matched_tokens,
            "tiers": list(res.tiers)}


def acquire(store: Store, req: p.Acquire) -> dict:
    return acquired(store.acquire(*_acquire_args(req)))


def begin_acquire(store: Store, req: p.Acquire) -> Acquisition | Staging:
    """The acquire, or its NVMe staging for the server's staging thread to run."""
    return store.begin_acquire(*_acquire_args(req))


def _acquire_args(req: p.Acquire) -> tuple:
    return (list(req.keys), list(req.tokens), req.lease_s, req.claim, req.optional_tail,
            req.spend_rest and req.claim, req.deadline)


def acquired(acq: Acquisition) -> dict:
    # Each entry on the wire: [tier, offset, nbytes, address, checksum, ntokens, meta],
    # EntryInfo's fields after the key (e[1:]: no call per entry).
    return {"aid": acq.id, "matched_tokens": acq.matched_tokens, "expires_at": acq.expires_at,
            "entries": [e[1:] for e in acq.entries], "short": acq.short,
            "spent": acq.spent}


def release(store: Store, req: p.Release) -> dict:
    return {"released": store.release(req.aid, drop=req.drop, corrupt=req.corrupt or ())}


def pin(store: Store, req: p.Pin) -> dict:
    return {"count": store.pin(list(req.keys))}


def unpin(store: Store, req: p.Unpin) -> dict:
    return {"count": store.unpin(list(req.keys))}


def evict(store: Store, req: p.Evict) -> dict:
    res = store.evict(tier=req.tier, nbytes=req.nbytes, fraction=req.fraction,
                      keys=None if req.keys is None else list(req.keys),
                      everything=req.everything, dry_run=req.dry_run)
    keys = list(res.keys)
    return {"count": len(keys), "nbytes": res.nbytes, "keys": keys[:MAX_EVICT_KEYS_REPLY],
            "skipped": len(res.skipped)}


def demote(store: Store, req: p.Demote) -> dict:
    res = store.demote_entries(tier=req.tier, nbytes=req.nbytes, fraction=req.fraction,
                               keys=None if req.keys is None else list(req.keys),
                               everything=req.everything, dry_run=req.dry_run)
    keys = list(res.keys)
    return {"count": len(keys), "nbytes": res.nbytes, "keys": keys[:MAX_EVICT_KEYS_REPLY],
            "skipped": len(res.skipped), "demoted": res.demoted, "evicted": res.evicted}


def clear(store: Store, req: p.Clear) -> dict:
    res = store.clear()
    return {"count": len(res.keys), "nbytes": res.nbytes, "skipped": len(res.skipped)}


def verify(store: Store, req: p.Verify) -> dict:
    return plain(store.verify(keys=None if req.keys is None else list(req.keys)))


def ls(store: Store, req: p.Ls) -> dict:
    # O(limit) per page: pages follow key order from the cursor (the last key sent).
    records, after = store.entries_page(tier=req.tier, after=req.cursor, limit=req.limit)
    return {"entries": [plain(r) for r in records], "next": after}


Handler = Callable[[Store, Any], dict]  # each takes its own p.Request subclass

# hello, stats and health need the server's own state; the server handles those.
HANDLERS: dict[str, Handler] = {
    "reserve": reserve, "commit": commit, "put": put, "abort": abort, "lookup": lookup,
    "acquire": acquire, "release": release, "pin": pin, "unpin": unpin, "evict": evict,
    "demote": demote,
    "clear": clear, "verify": verify, "ls": ls,
}
# ... and these may also hand their book-keeping to a ``later`` (``Writes``: answer first).
ANSWER_FIRST: dict[str, Callable[[Store, Any, Later | None], dict]] = {
    "commit": commit, "put": put}
