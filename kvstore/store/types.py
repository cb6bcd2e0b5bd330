"""What the store hands out (typed results) and the checks on what it is handed.

Kept apart from kvstore/store/facade.py so the server and protocol can import the result
types without pulling in the tiers.
"""

from __future__ import annotations

import array
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.core.errors import InvalidRequestError
from kvstore.core.hashing import KEY_BYTES, NAMESPACE_TAG_BYTES
from kvstore.core.protocol import TIER_ORDER
from kvstore.store.index import MAX_META_BYTES

MEMORY_TIERS = ("gpu", "dram")  # where new writes land (TE-addressable)


class EntryPlacement(NamedTuple):
    """Where a writer puts one new entry's bytes."""

    key: bytes
    tier: str
    offset: int
    nbytes: int
    address: int | None  # virtual address for TE; None where the tier has none


class Reservation(NamedTuple):
    id: int
    placements: list[EntryPlacement | None]  # None: already stored or being written (dedup)
    expires_at: float  # wall time after which an uncommitted reservation is reaped


class RoomGrant(NamedTuple):
    """Room a writer holds for its next insert: it writes that insert's entries at
    ``page``-aligned offsets of ``[offset, offset + nbytes)`` and stores them with one
    ``put`` (which also names the room for the insert after it)."""

    id: int
    tier: str
    offset: int
    nbytes: int
    address: int | None  # virtual address of ``offset`` for TE; None where the tier has none
    page: int
    lease_s: float  # the room is reclaimed this long after it was granted


class CommitResult(NamedTuple):
    new: int  # entries made visible by this commit
    deduped: int  # existing entries whose pending-consumer count was bumped
    lost: int = 0  # deduped onto another writer that gave up; not stored
    room: RoomGrant | None = None  # for the writer's next insert (``next_room``)


class PutResult(NamedTuple):
    new: int  # entries made visible by this put
    deduped: int  # as CommitResult's
    lost: int
    # Positions (in the put's keys) whose bytes it did not store: the key was stored
    # already, being written by another writer, or repeated in the put.
    existing: tuple[int, ...]
    room: RoomGrant | None = None  # as CommitResult's


class LookupResult(NamedTuple):
    matched_blocks: int
    matched_tokens: int
    tiers: list[str]  # tier of each matched block, in order


class EntryInfo(NamedTuple):
    key: bytes
    tier: str
    offset: int
    nbytes: int
    address: int | None
    checksum: int
    ntokens: int
    meta: bytes


NO_ROOM_TO_STAGE = "no_room_to_stage"


class Acquisition(NamedTuple):
    id: int  # 0 when nothing matched (nothing to release)
    entries: list[EntryInfo]
    matched_tokens: int
    expires_at: float
    # Why the prefix ends before the stored one does: "" (it does not), or
    # NO_ROOM_TO_STAGE (the next entry is on NVMe and no memory tier had room to
    # stage it: pinned or leased entries fill it, or the prompt is bigger than it).
    # The entries from there on are still stored: acquire them in another round.
    short: str = ""
    # With ``spend_rest``: how many entries were spent unread (see Store.acquire).
    spent: int = 0


class DemoteResult(NamedTuple):
    keys: list[bytes]  # selected (for a dry run: would be), moved down or, where no
    # lower tier could take them, evicted
    nbytes: int
    skipped: list[bytes]  # pinned or leased entries passed over
    demoted: int  # entries now one tier lower
    evicted: int  # entries no lower tier could take (gone, as pressure demotion does)


class EvictResult(NamedTuple):
    keys: list[bytes]  # gone (or, for a dry run, would go)
    nbytes: int
    skipped: list[bytes]  # pinned or leased entries passed over


class VerifyResult(NamedTuple):
    checked: int
    bad: list[bytes]  # failed their checksum; dropped unless leased at the time


# Ids are the OS's random bytes, read 4 KiB at a time (an ``os.urandom`` call per id
# was a system call per room, reservation and acquire); a forked child reads its own.
# Not a seeded generator: a client that saw enough of its ids could predict others'.
_ID_BYTES = 8
_id_pool = array.array("Q")
_id_lock = threading.Lock()


def _forked() -> None:
    global _id_lock
    del _id_pool[:]
    _id_lock = threading.Lock()  # (another thread may have held it at the fork)


os.register_at_fork(after_in_child=_forked)


def new_id() -> int:
    """Random positive 63-bit id: ids from before a restart never match new ones."""
    with _id_lock:
        if not _id_pool:
            _id_pool.frombytes(os.urandom(512 * _ID_BYTES))
        return _id_pool.pop() >> 1 or 1


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    if not isinstance(keys, (list, tuple)):
        keys = list(keys)  # an iterator: the passes below must see every key
    # The usual case in two C-level passes (a prompt has thousands of keys).
    if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {KEY_BYTES}:
        return list(keys)
    out = []
    for key in keys:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise InvalidRequestError(f"keys must be {KEY_BYTES}-byte bytes, got {key!r:.60}")
        out.append(bytes(key))
    return out


def check_tokens(tokens: Sequence[bytes], n: int) -> list[bytes]:
    if not isinstance(tokens, (list, tuple)):
        tokens = list(tokens)
    if len(tokens) != n:
        raise InvalidRequestError(f"{n} keys but {len(tokens)} token blocks")
    if set(map(type, tokens)) <= {bytes}:  # the usual case, checked in C-level passes
        sizes = set(map(len, tokens))
        if 0 not in sizes and not any(size % 4 for size in sizes):
            return list(tokens)
    out = []
    for tok in tokens:
        if not isinstance(tok, (bytes, bytearray)) or not tok or len(tok) % 4:
            raise InvalidRequestError("each token block must be non-empty int32le bytes")
        out.append(bytes(tok))
    return out


def check_sizes(sizes: Sequence[int], n: int) -> list[int]:
    if len(sizes) != n:
        raise InvalidRequestError(f"{n} keys but {len(sizes)} sizes")
    if set(map(type, sizes)) == {int} and min(sizes) > 0:  # the usual case, in C
        return list(sizes)
    for size in sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidRequestError(f"entry sizes must be positive ints, got {size!r}")
    return list(sizes)


def check_meta(meta: Sequence[bytes | None] | None, n: int) -> list[bytes]:
    if meta is None:
        return [b""] * n
    if len(meta) != n:
        raise InvalidRequestError(f"{n} keys but {len(meta)} meta values")
    out = []
    for m in meta:
        m = b"" if m is None else m
        if not isinstance(m, (bytes, bytearray)) or len(m) > MAX_META_BYTES:
            raise InvalidRequestError(f"meta must be bytes of at most {MAX_META_BYTES}")
        out.append(bytes(m))
    return out


def check_namespace(namespace: bytes | None) -> bytes:
    """A writer's namespace fingerprint -> the tag records keep (its first 8 bytes)."""
    if namespace is None:
        return b""
    if not isinstance(namespace, (bytes, bytearray)) or len(namespace) not in (
            0, NAMESPACE_TAG_BYTES, 2 * NAMESPACE_TAG_BYTES):
        raise InvalidRequestError(f"namespace must be 0, {NAMESPACE_TAG_BYTES} or "
                                  f"{2 * NAMESPACE_TAG_BYTES} bytes, got {namespace!r:.60}")
    return bytes(namespace[:NAMESPACE_TAG_BYTES])


def check_tier(name: str | None) -> None:
    if name is not None and name not in TIER_ORDER:
        raise InvalidRequestError(f"unknown tier {name!r}; one of {TIER_ORDER}")


def check_lease(lease_s: float | None, default: float) -> float:
    """A caller's lease length in seconds, or ``default`` when it gives none."""
    if lease_s is None:
        return default
    if not isinstance(lease_s, (int, float)) or not 0 < lease_s <= 3600:
        raise InvalidRequestError(f"lease_s must be in (0, 3600], got {lease_s!r}")
    return float(lease_s)
