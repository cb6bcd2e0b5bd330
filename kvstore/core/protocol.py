"""The control-plane wire format: msgpack maps, one per ZeroMQ frame.

Request: ``{v: 1, op: str, id: int, ...fields}``. Reply: ``{v: 1, id, ok: true, ...}``
or ``{v: 1, id, ok: false, code, message}`` with ``code`` from ``kvstore.core.errors``.

Every request is decoded into a frozen dataclass of its op (``Hello``, ``Reserve``, ...)
and every field is checked for type, length and bounds before the server looks at it:
a frame that fails any check raises ``InvalidRequestError`` and nothing else happens.
No pickle, no msgpack ext types (a Timestamp or ExtType fails the type checks), map
keys must be strings, and sizes are bounded both by the frame limit and per field.
Bytes never travel here; only keys, sizes, addresses and small metadata do.
docs/protocol.md lists every op, field and limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

import msgpack

from kvstore.core.errors import InvalidRequestError, KVStoreError, error_from_code

VERSION = 1
KEY_BYTES = 16
MAX_KEYS = 1 << 16  # blocks per message: a 1M-token prompt of 16-token blocks
MAX_ENTRY_BYTES = 1 << 34  # one entry (block) of one TP rank
MAX_ROOM_BYTES = MAX_KEYS * MAX_ENTRY_BYTES  # a room holds at most one message's entries
MAX_TOKEN_BYTES = 4 * 8192  # one block's int32 token ids
MAX_LEASE_S = 3600.0
# Keys, and bytes, per ``verify`` request that clients send (``KVStoreClient.verify``,
# ``kvstore verify``): the server holds its lock for one batch's reads at a time.
VERIFY_BATCH = 512
VERIFY_BATCH_BYTES = 64 << 20
MAX_ID = (1 << 63) - 1
MAX_LS_LIMIT = 10_000
MAX_META_BYTES = 1024  # the index keeps at most this much caller meta per entry
# An acquire's bytes sent after its reply (``Acquire.inline``, docs/protocol.md), at
# most: over the stream door, any prompt (a sanity bound); over the ZeroMQ port, in
# one frame or its parts, at most ``ROUTER_INLINE_BYTES``.
MAX_INLINE_BYTES = 1 << 40
ROUTER_INLINE_BYTES = 64 << 20
# The smallest part such bytes may be asked in (``Acquire.inline_part``).
MIN_INLINE_PART_BYTES = 64 << 10
NAMESPACE_BYTES = 16  # hashing.namespace_of; a reserve may send it or its first 8 bytes
# Every tier name, fastest first; demotion follows this order. The one definition.
TIER_ORDER = ("gpu", "dram", "nvme")


# ------------------------------------------------------------------ field checks
def _int(name: str, v: Any, lo: int = 0, hi: int = MAX_ID) -> int:
    # bool is an int subclass in Python; a wire bool is never a valid int.
    if type(v) is not int or not lo <= v <= hi:
        raise InvalidRequestError(f"{name}: need an int in {lo}..{hi}, got {_show(v)}")
    return v


def _float(name: str, v: Any, lo: float, hi: float) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or not lo < v <= hi:
        raise InvalidRequestError(f"{name}: need a number in ({lo}, {hi}], got {_show(v)}")
    return float(v)


def _bool(name: str, v: Any) -> bool:
    if type(v) is not bool:
        raise InvalidRequestError(f"{name}: need a bool, got {_show(v)}")
    return v


def _list(name: str, v: Any, limit: int = MAX_KEYS) -> list:
    if type(v) is not list or len(v) > limit:
        raise InvalidRequestError(f"{name}: need a list of at most {limit} items, got {_show(v)}")
    return v


# The list checks below first try the usual case in C-level passes (a prompt has
# thousands of blocks: a Python loop per item was most of decoding a big request),
# and only walk the items one by one to name the one that is wrong.
def _ints(name: str, v: Any, lo: int, hi: int) -> tuple[int, ...]:
    items = _list(name, v)
    if not items or (set(map(type, items)) == {int} and lo <= min(items)
                     and max(items) <= hi):
        return tuple(items)
    return tuple(_int(name, i, lo, hi) for i in items)


def _keys(name: str, v: Any) -> tuple[bytes, ...]:
    items = _list(name, v)
    if not items:
        raise InvalidRequestError(f"{name}: must not be empty")
    if set(map(type, items)) == {bytes} and set(map(len, items)) == {KEY_BYTES}:
        return tuple(items)
    for k in items:
        if type(k) is not bytes or len(k) != KEY_BYTES:
            raise InvalidRequestError(
                f"{name}: every key must be {KEY_BYTES} bytes, got {_show(k)}")
    return tuple(items)


def _sizes(name: str, v: Any) -> tuple[int, ...]:
    return _ints(name, v, 1, MAX_ENTRY_BYTES)


def _tokens(name: str, v: Any) -> tuple[bytes, ...]:
    out = _list(name, v)
    if set(map(type, out)) <= {bytes}:
        lengths = set(map(len, out))
        if not any(n % 4 or n > MAX_TOKEN_BYTES for n in lengths):
            return tuple(out)
    for t in out:
        if type(t) is not bytes or len(t) % 4 or len(t) > MAX_TOKEN_BYTES:
            raise InvalidRequestError(
                f"{name}: each item must be int32 token bytes (<= {MAX_TOKEN_BYTES}), "
                f"got {_show(t)}")
    return tuple(out)


def _offsets(name: str, v: Any) -> tuple[int, ...]:
    return _ints(name, v, 0, MAX_ROOM_BYTES)


def _positions(name: str, v: Any) -> tuple[int, ...]:
    return _ints(name, v, 0, MAX_KEYS - 1)


def _checksums(name: str, v: Any) -> tuple[int, ...]:
    return _ints(name, v, 0, (1 << 64) - 1)


def _metas(name: str, v: Any) -> tuple[bytes | None, ...] | None:
    """Per-entry opaque caller bytes (the store keeps them beside the entry)."""
    if v is None:
        return None
    out = _list(name, v)
    for m in out:
        if m is not None and (type(m) is not bytes or len(m) > MAX_META_BYTES):
            raise InvalidRequestError(f"{name}: each item is nil or at most {MAX_META_BYTES} bytes")
    return tuple(out)


def _tier(name: str, v: Any) -> str | None:
    if v is not None and v not in TIER_ORDER:
        raise InvalidRequestError(f"{name}: need one of {TIER_ORDER} or nil, got {_show(v)}")
    return v


def _namespace(name: str, v: Any) -> bytes:
    """A writer's namespace fingerprint: 16 bytes (``hashing.namespace_of``) or its first 8."""
    if type(v) is not bytes or len(v) not in (NAMESPACE_BYTES // 2, NAMESPACE_BYTES):
        raise InvalidRequestError(
            f"{name}: need {NAMESPACE_BYTES // 2} or {NAMESPACE_BYTES} bytes, got {_show(v)}")
    return v


def _seconds(name: str, v: Any) -> float:
    """A duration the client measured: 0 allowed (a move too quick for the clock)."""
    if type(v) not in (int, float) or not math.isfinite(v) or not 0 <= v <= MAX_LEASE_S:
        raise InvalidRequestError(f"{name}: need seconds in [0, {MAX_LEASE_S}], got {_show(v)}")
    return float(v)


def _opt(check: Callable[..., Any], *args: Any) -> Callable[[str, Any], Any]:
    return lambda name, v: None if v is None else check(name, v, *args)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


_lease = _opt(_float, 0.0, MAX_LEASE_S)
_rid = lambda name, v: _int(name, v)  # noqa: E731 - reservation / acquisition ids
# The client's measured data move (TE or same-node memcpy), reported with commit /
# release for the server's transfer metrics; both optional, neither changes the op.
_XFER = {"xfer_s": _opt(_seconds), "xfer_bytes": _opt(_int, 0, MAX_KEYS * MAX_ENTRY_BYTES)}
# ``deadline`` (reserve, commit, put; acquire too): the server's wall clock (``time.time()``) after
# which the writer no longer waits for the reply (a writer on another node knows that
# clock from hello's ``now``); the store refuses (busy) a request it reaches later, and
# undoes what a commit or put named, so a server frozen with the request in its socket
# buffer (which reads it only when it goes on) neither stores what the writer already
# reported failed nor holds a reservation nobody will write (whose keys other writers
# would dedup onto, and lose). (Checked once the store's lock is taken: a stall of
# more than the client's one second of slack after that can still do it.) Servers
# before this field refuse it as unknown (and say no ``now``: only same-node clients
# would send it): upgrade servers before clients.
_DEADLINE = {"deadline": _opt(_float, 0.0, 1e11)}
# ``wait_s`` (hello, lookup, acquire): how long the caller waits for the reply, counted from
# its sending; the server answers ``busy`` at once a request it sees it cannot start
# within that (queued behind slow work), instead of a reply nobody waits for.
# Relative, so it needs no clock: the server counts it from the request's arrival.
# Servers before this field refuse it as unknown; their hello has no ``wait_s``.
_WAIT = {"wait_s": _opt(_float, 0.0, MAX_LEASE_S)}


def verify_batches(entries: list[dict], most: int = VERIFY_BATCH,
                   most_bytes: int = VERIFY_BATCH_BYTES) -> list[tuple[bytes, ...]]:
    """The keys of ``entries`` (``ls`` replies' entries) in ``verify`` requests of at
    most ``most`` keys and ``most_bytes`` bytes each (at least one key each)."""
    if most < 1:
        raise InvalidRequestError(f"a verify batch must hold at least 1 key, got {most}")
    batches: list[tuple[bytes, ...]] = []
    keys: list[bytes] = []
    size = 0
    for e in entries:
        if keys and (len(keys) >= most or size + e["nbytes"] > most_bytes):
            batches.append(tuple(keys))
            keys, size = [], 0
        keys.append(e["key"])
        size += e["nbytes"]
    if keys:
        batches.append(tuple(keys))
    return batches


# ------------------------------------------------------------------ messages
@dataclass(frozen=True)
class Request:
    """Base of every request. ``CHECKS`` maps each field to its validator."""

    OP: ClassVar[str] = ""
    CHECKS: ClassVar[dict[str, Callable[[str, Any], Any]]] = {}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    def validate(self) -> None:
        """Cross-field rules beyond each field's own check."""


@dataclass(frozen=True)
class Hello(Request):
    """``wait_s``: see ``_WAIT`` (a client's first request may come behind slow work)."""

    wait_s: float | None = None
    OP = "hello"
    CHECKS = {**_WAIT}
    OPTIONAL = frozenset({"wait_s"})


@dataclass(frozen=True)
class Reserve(Request):
    keys: tuple[bytes, ...]
    sizes: tuple[int, ...]
    tokens: tuple[bytes, ...]
    meta: tuple[bytes | None, ...] | None = None
    lease_s: float | None = None
    namespace: bytes | None = None
    deadline: float | None = None
    OP = "reserve"
    CHECKS = {"keys": _keys, "sizes": _sizes, "tokens": _tokens, "meta": _metas,
              "lease_s": _lease, "namespace": _opt(_namespace), **_DEADLINE}
    OPTIONAL = frozenset({"meta", "lease_s", "namespace", *_DEADLINE})

    def validate(self) -> None:
        n = len(self.keys)
        if len(self.sizes) != n or len(self.tokens) != n or (self.meta is not None
                                                               and len(self.meta) != n):
            raise InvalidRequestError(
                "reserve: keys, sizes, tokens (and meta) must have equal lengths")


@dataclass(frozen=True)
class Commit(Request):
    """``next_room``: bytes the writer wants to hold for its next insert; the reply's
    ``room`` is the room granted (nil: none), which a ``Put`` then stores into.
    ``deadline``: see ``_DEADLINE``."""

    rid: int
    checksums: tuple[int, ...]
    xfer_s: float | None = None
    xfer_bytes: int | None = None
    pin: bool = False
    next_room: int | None = None
    deadline: float | None = None
    OP = "commit"
    CHECKS = {"rid": _rid, "checksums": _checksums, "pin": _bool, **_XFER,
              "next_room": _opt(_int, 0, MAX_ROOM_BYTES), **_DEADLINE}
    OPTIONAL = frozenset({"pin", *_XFER, "next_room", *_DEADLINE})


@dataclass(frozen=True)
class Put(Request):
    """Store entries the writer already copied into its room ``room`` (a reserve and
    a commit in one round trip). ``offsets`` (from the room's start) and
    ``checksums`` are those of ``keys[skip:]``; the first ``skip`` keys carry no
    bytes (the writer found them stored). ``next_room`` and ``deadline`` as for
    ``Commit``."""

    room: int
    keys: tuple[bytes, ...]
    sizes: tuple[int, ...]
    tokens: tuple[bytes, ...]
    offsets: tuple[int, ...]
    checksums: tuple[int, ...]
    meta: tuple[bytes | None, ...] | None = None
    namespace: bytes | None = None
    skip: int = 0
    pin: bool = False
    xfer_s: float | None = None
    xfer_bytes: int | None = None
    next_room: int | None = None
    deadline: float | None = None
    OP = "put"
    CHECKS = {"room": _rid, "keys": _keys, "sizes": _sizes, "tokens": _tokens,
              "offsets": _offsets, "checksums": _checksums, "meta": _metas,
              "namespace": _opt(_namespace), "skip": lambda name, v: _int(name, v, 0, MAX_KEYS),
              "pin": _bool, **_XFER, "next_room": _opt(_int, 0, MAX_ROOM_BYTES),
              **_DEADLINE}
    OPTIONAL = frozenset({"meta", "namespace", "skip", "pin", *_XFER, "next_room",
                          *_DEADLINE})

    def validate(self) -> None:
        n = len(self.keys)
        if len(self.sizes) != n or len(self.tokens) != n or (self.meta is not None
                                                               and len(self.meta) != n):
            raise InvalidRequestError("put: keys, sizes, tokens (and meta) must have equal "
                                      "lengths")
        if self.skip > n or len(self.offsets) != n - self.skip \
                or len(self.checksums) != n - self.skip:
            raise InvalidRequestError("put: need skip <= len(keys), and one offset and one "
                                      "checksum for each key after the skipped ones")


@dataclass(frozen=True)
class Abort(Request):
    rid: int
    OP = "abort"
    CHECKS = {"rid": _rid}


@dataclass(frozen=True)
class Lookup(Request):
    """``wait_s``: see ``_WAIT``."""

    keys: tuple[bytes, ...]
    tokens: tuple[bytes, ...]
    wait_s: float | None = None
    OP = "lookup"
    CHECKS = {"keys": _keys, "tokens": _tokens, **_WAIT}
    OPTIONAL = frozenset({"wait_s"})

    def validate(self) -> None:
        if len(self.keys) != len(self.tokens):
            raise InvalidRequestError(f"{self.OP}: keys and tokens must have equal lengths")


@dataclass(frozen=True)
class Acquire(Lookup):
    """``claim``: the caller will release with drop (drop_select); entries whose
    pending consumers are all claimed by other open acquisitions end the prefix.
    ``optional_tail``: the last key is an optional extra (the hidden-state entry), not
    a block of the prompt; the store's hit/miss counts leave it out.
    ``spend_rest``: the keys are the rest of a drop_select whose first round took the
    prompt's head; if none can be staged they are spent unread (see Store.acquire).
    ``inline``: the most bytes the caller takes in the reply itself (a frame after the
    reply's map, ``"inline"`` in the map its length) instead of reading them over
    TE; the server sends them so when they are all in DRAM, fit its own
    ``server.inline_max_bytes`` and the request came over the ZeroMQ port.
    ``inline_part`` (with ``inline``): those bytes may come in parts of whole
    entries, each about this long, the first in the reply and each other in a
    message of its own (``encode_part``), so the caller copies one while the next
    is on the wire; ``"parts"`` in the reply lists their lengths.
    ``deadline``: as a write's (``_DEADLINE``): the reader stops waiting then, so an
    acquire the store reaches later is refused (busy) and leases nothing, rather than
    holding the prompt for a reader that is gone until its lease runs out.
    ``wait_s``: as a lookup's (``_WAIT``).
    ``release_sent`` (with ``inline``): when the bytes follow the reply on the stream
    door, the server ends the lease itself once it has handed the last of them to its
    socket, as ``release`` with ``drop=claim`` would (the reply says so:
    ``"release_sent": True``), and the caller sends no release unless a read fails."""

    lease_s: float | None = None
    claim: bool = False
    optional_tail: bool = False
    spend_rest: bool = False
    inline: int | None = None
    inline_part: int | None = None
    deadline: float | None = None
    release_sent: bool | None = None
    OP = "acquire"
    CHECKS = {"keys": _keys, "tokens": _tokens, "lease_s": _lease, "claim": _bool,
              "optional_tail": _bool, "spend_rest": _bool,
              "inline": _opt(_int, 0, MAX_INLINE_BYTES),
              "inline_part": _opt(_int, MIN_INLINE_PART_BYTES, ROUTER_INLINE_BYTES),
              **_DEADLINE, **_WAIT, "release_sent": _opt(_bool)}
    OPTIONAL = frozenset({"lease_s", "claim", "optional_tail", "spend_rest", "inline",
                          "inline_part", "deadline", "wait_s", "release_sent"})

    def validate(self) -> None:
        super().validate()
        if self.inline_part is not None and self.inline is None:
            raise InvalidRequestError("acquire: inline_part without inline")
        if self.release_sent and self.inline is None:
            raise InvalidRequestError("acquire: release_sent without inline")


@dataclass(frozen=True)
class Release(Request):
    aid: int
    drop: bool
    xfer_s: float | None = None
    xfer_bytes: int | None = None
    # Positions (in the acquisition's entries) whose bytes failed the reader's
    # checksum: the server re-checks them, counts and drops the ones bad at rest.
    corrupt: tuple[int, ...] | None = None
    OP = "release"
    CHECKS = {"aid": _rid, "drop": _bool, **_XFER, "corrupt": _opt(_positions)}
    OPTIONAL = frozenset({*_XFER, "corrupt"})


@dataclass(frozen=True)
class Pin(Request):
    keys: tuple[bytes, ...]
    OP = "pin"
    CHECKS = {"keys": _keys}


@dataclass(frozen=True)
class Unpin(Pin):
    OP = "unpin"


@dataclass(frozen=True)
class Evict(Request):
    tier: str | None = None
    nbytes: int | None = None
    fraction: float | None = None
    keys: tuple[bytes, ...] | None = None
    everything: bool = False
    dry_run: bool = False
    OP = "evict"
    CHECKS = {"tier": _tier, "nbytes": _opt(_int, 1, 1 << 50), "fraction": _opt(_float, 0.0, 1.0),
              "keys": _opt(_keys), "everything": _bool, "dry_run": _bool}
    OPTIONAL = frozenset(CHECKS)

    def validate(self) -> None:
        chosen = [self.nbytes is not None, self.fraction is not None, self.keys is not None,
                  self.everything]
        if sum(chosen) != 1:
            raise InvalidRequestError(
                f"{self.OP}: give exactly one of nbytes, fraction, keys, everything")


@dataclass(frozen=True)
class Demote(Evict):
    """Like ``evict``'s selection, but the entries move one tier down (``kvstore
    demote``) instead of going."""

    OP = "demote"


@dataclass(frozen=True)
class Clear(Request):
    OP = "clear"


@dataclass(frozen=True)
class Stats(Request):
    OP = "stats"


@dataclass(frozen=True)
class Ls(Request):
    """``cursor``: the key the previous page ended at (its reply's ``next``); nil: the
    first page. Pages follow key order, so each costs O(limit), not O(entries)."""

    tier: str | None = None
    cursor: bytes | None = None
    limit: int = 1000
    OP = "ls"
    CHECKS = {"tier": _tier, "cursor": _opt(lambda n, v: _keys(n, [v])[0]),
              "limit": lambda n, v: _int(n, v, 1, MAX_LS_LIMIT)}
    OPTIONAL = frozenset(CHECKS)


@dataclass(frozen=True)
class Verify(Request):
    """``keys``: check only these (the CLI sends batches to show progress); nil: all."""

    keys: tuple[bytes, ...] | None = None
    OP = "verify"
    CHECKS = {"keys": _opt(_keys)}
    OPTIONAL = frozenset({"keys"})


@dataclass(frozen=True)
class Health(Request):
    """``deep`` also runs the store's ``check_integrity`` (O(entries))."""

    deep: bool = False
    OP = "health"
    CHECKS = {"deep": _bool}
    OPTIONAL = frozenset({"deep"})


REQUESTS: dict[str, type[Request]] = {
    cls.OP: cls for cls in (Hello, Reserve, Commit, Put, Abort, Lookup, Acquire, Release, Pin,
                            Unpin, Evict, Demote, Clear, Stats, Ls, Verify, Health)}


# ------------------------------------------------------------------ codec
def _unpack(frame: bytes, max_bytes: int) -> Any:
    if len(frame) > max_bytes:
        raise InvalidRequestError(f"message of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        # raw=False: str stays str, bin stays bytes; strict_map_key: only str/bytes keys.
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True,
                               ext_hook=_no_ext)
    except (ValueError, msgpack.UnpackException, RecursionError) as exc:
        raise InvalidRequestError(f"not a msgpack message: {type(exc).__name__}: {exc}") from None


def _no_ext(code: int, data: bytes) -> Any:
    raise InvalidRequestError(f"msgpack ext type {code} is not accepted")


def _peek(frame: bytes, max_bytes: int) -> tuple[int, str]:
    """The request id and op of a frame, read from its map header and first fields
    only (the rest is skipped, never built: the server's watchdog peeks at frames
    while it holds the socket); (0, "") where they cannot be read."""
    if len(frame) > max_bytes:
        return 0, ""
    rid, op = 0, ""
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, ext_hook=_no_ext,
                                    max_buffer_size=max(len(frame), 1))
        unpacker.feed(frame)
        for _ in range(min(unpacker.read_map_header(), 8)):
            name = unpacker.unpack()
            if name == "id" or name == "op":
                value = unpacker.unpack()
                if name == "id" and type(value) is int and 0 <= value <= MAX_ID:
                    rid = value
                elif name == "op" and type(value) is str:
                    op = value
                if rid and op:
                    break
            else:
                unpacker.skip()
    except Exception:  # noqa: BLE001 - not a readable map: nothing to peek at
        pass
    return rid, op


def peek_id(frame: bytes, max_bytes: int) -> int:
    """The request id of a frame, if it can be read; 0 otherwise (for error replies)."""
    return _peek(frame, max_bytes)[0]


def peek_op(frame: bytes, max_bytes: int) -> str:
    """The op a frame names, if it can be read; "" otherwise."""
    return _peek(frame, max_bytes)[1]


def decode_request(frame: bytes, max_bytes: int) -> tuple[int, Request]:
    """Frame -> (request id, validated request). Raises ``InvalidRequestError``."""
    msg = _unpack(frame, max_bytes)
    if type(msg) is not dict:
        raise InvalidRequestError(f"a message must be a map, got {type(msg).__name__}")
    if msg.get("v") != VERSION or type(msg.get("v")) is not int:
        raise InvalidRequestError(f"protocol version {_show(msg.get('v'))} not supported "
                                  f"(this server speaks {VERSION})")
    rid = _int("id", msg.get("id"))
    op = msg.get("op")
    cls = REQUESTS.get(op) if type(op) is str else None
    if cls is None:
        raise InvalidRequestError(f"unknown op {_show(op)}; one of {sorted(REQUESTS)}")
    values = {}
    for name, value in msg.items():
        if name in ("v", "op", "id"):
            continue
        if name not in cls.CHECKS:
            raise InvalidRequestError(f"{cls.OP}: unknown field {_show(name)}")
        values[name] = cls.CHECKS[name](f"{cls.OP}.{name}", value)
    missing = set(cls.CHECKS) - set(values) - cls.OPTIONAL
    if missing:
        raise InvalidRequestError(f"{cls.OP}: missing field(s) {sorted(missing)}")
    req = cls(**values)
    req.validate()
    return rid, req


def encode_request(rid: int, req: Request) -> bytes:
    """Request -> frame. Unset optional fields are left out. (msgpack packs a tuple
    as the array a list would be.)"""
    body: dict[str, Any] = {"v": VERSION, "op": req.OP, "id": rid}
    names = _FIELD_NAMES.get(type(req))
    if names is None:
        names = _FIELD_NAMES[type(req)] = tuple(f.name for f in fields(req))
    for name in names:
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    return msgpack.packb(body, use_bin_type=True)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # each request class's, in order


def encode_ok(rid: int, result: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": VERSION, "id": rid, "ok": True, **result}, use_bin_type=True)


def encode_error(rid: int, err: KVStoreError) -> bytes:
    return msgpack.packb({"v": VERSION, "id": rid, "ok": False, "code": err.code,
                          "message": str(err)}, use_bin_type=True)


# The key of a part head's index in what decode_reply returns: not an identifier, so
# never the name of a reply's field (an ok reply with a field "part" stays a reply).
PART_HEAD = "part head"


def encode_part(rid: int, index: int) -> bytes:
    """The head of part ``index`` (1 ..) of request ``rid``'s inline bytes: the first
    frame of a message of its own, the part's bytes the second (``Acquire.inline_part``)."""
    return msgpack.packb({"v": VERSION, "id": rid, "part": index}, use_bin_type=True)


def decode_reply(frame: bytes, max_bytes: int) -> tuple[int, dict[str, Any]]:
    """Frame -> (id, result map). An error reply is returned as (id, {"error": exc});
    the head of a part of an acquire's inline bytes (``encode_part``) as
    (id, {PART_HEAD: index}), under a key no reply's field can have."""
    msg = _unpack(frame, max_bytes)
    if type(msg) is not dict or msg.get("v") != VERSION or type(msg.get("id")) is not int:
        raise InvalidRequestError("malformed reply from server")
    rid = msg.pop("id")
    if "part" in msg and "ok" not in msg:
        index = msg["part"]
        if type(index) is not int or index < 1 or len(msg) != 2:
            raise InvalidRequestError("malformed part of a reply from server")
        return rid, {PART_HEAD: index}
    if msg.pop("ok", None) is True:
        del msg["v"]
        return rid, msg
    code, message = msg.get("code"), msg.get("message")
    if type(code) is not str or type(message) is not str:
        raise InvalidRequestError("malformed error reply from server")
    return rid, {"error": error_from_code(code, message)}
