"""KVStoreClient: insert and drop_select a prompt's KV through one kvstore-server.

Per call: the prompt is hashed once (chained block keys), one control message
reserves or acquires every block, the bytes move in one coalesced batch (TE
one-sided write/read, or memcpy through the server's shared DRAM arena when the
server is on this node), and one more message commits or releases. Bytes never
travel over the control socket.

Failures raise ``kvstore.core.errors`` classes within a bounded time: a miss
(``MissError``: timeout, peer gone, transfer error, checksum) means "recompute";
``InvalidRequestError`` means the caller passed something wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import msgpack
import numpy as np
from numpy.lib.stride_tricks import as_strided
import torch

from kvstore.core import protocol as p
from kvstore.core.config import (ClientConfig, client_config_from_env, parse_te_devices,
                                 seconds)
from kvstore.client.datapath import DataPath, Segment, TeEngine, flat_buffer
from kvstore.core.errors import (LATE_READ, LATE_WRITE, BusyError, ChecksumError, ConfigError,
                                 InvalidRequestError, KVStoreError, KVTimeoutError,
                                 LeaseExpiredError, NotFoundError, PeerUnavailableError)
from kvstore.core.hashing import checksummer, hidden_key, namespace_of, prompt_blocks
from kvstore.core.layout import KVLayout, dtype_name, pack_hf
from kvstore.client.local import Control, door_address
from kvstore.client.rpc import Channel, CurveKeys, Take
from kvstore.client.shm import PROMPT_KEYS

log = logging.getLogger(__name__)

# Abort/release after a failure are courtesies (leases reclaim anyway): wait briefly.
_CLEANUP_TIMEOUT_S = 2.0
_SCOPES_KEPT = 4096  # per-request namespaces remembered (a cache_salt per user is normal)
# A layer-wise insert writes into its room only until this long (at most a quarter
# of the lease) before the room's lease ends, when the server may give the bytes
# away: covers a layer's copy and the reply's way back.
_WRITE_MARGIN_S = 2.0
# A reserve, commit or put with a deadline waits this much past it for the reply: the
# server refuses one that reaches it later, so only one sent in time can come back.
_DEADLINE_SLACK_S = 1.0
# A remote server's clock is known from its hello (``clock_offset``) only where that
# round trip took at most twice this: the error is at most half the round trip, and it
# must stay well inside the slack above.
_CLOCK_ERROR_S = 0.25
# A lookup's or acquire's ``wait_s`` leaves this share of the time left for the way
# back of a ``busy`` (1/N), at most _WAIT_MARGIN_S. A tenth (at most 0.1 s) left the
# connector's 0.25 s lookup 25 ms, less than a loaded host's way back: with two CPU
# hogs on 2 cores, busy replies sent 60 - 120 ms before 0.2 - 0.3 s lookups' deadlines
# had not reached them (in a third to a half of the tries, with either margin).
_WAIT_MARGIN_SHARE = 4
_WAIT_MARGIN_S = 0.25
_WAIT_FLOOR_S = 0.001  # the least wait_s sent (the protocol takes (0, MAX_LEASE_S])


class InsertResult(NamedTuple):
    new_blocks: int  # blocks whose bytes were written now
    existing_blocks: int  # already stored: their pending-consumer count was bumped
    ntokens: int
    nbytes: int  # bytes moved


class SelectResult(NamedTuple):
    matched_tokens: int  # 0: a miss
    kv: torch.Tensor | None  # flat uint8 entry bytes of the matched tokens (from skip_blocks)
    hidden: torch.Tensor | None
    # Why fewer blocks came than are stored: "" (none), or "no_room_to_stage" (the
    # server's memory tiers are full of pinned/leased entries: the rest is on NVMe).
    short: str = ""


class LookupResult(NamedTuple):
    matched_tokens: int
    matched_blocks: int
    tiers: list[str]


class _Room(NamedTuple):
    """Room the server holds for this client's next insert (``Writes.put``)."""

    id: int
    tier: str
    offset: int
    nbytes: int
    address: int | None
    page: int
    usable_until: float  # time.monotonic(): half its lease after it was asked for
    expires: float  # time.monotonic(): its whole lease after it was asked for
    # The server's arena as mapped when the request that got the room was sent: the
    # copy into the room goes through this mapping, the granting server's own file,
    # whatever hello another thread says meanwhile (a restarted server's new arena
    # is never written at this room's offsets).
    segment: Segment


class _Prompt(NamedTuple):
    keys: list[bytes]
    tokens: list[bytes]  # int32le token bytes per block
    counts: list[int]  # tokens per block
    ntokens: int


class KVStoreClient:
    """A client of one server. Not shared between processes; thread-safe per call.

    ``same_node``: "auto" memcpys through the server's shared DRAM arena when the
    server is on this node (same host id and the arena file exists), True requires
    that, False always uses TE. ``layout`` is needed for insert/select, not for admin.
    ``observer(op, seconds, ok)`` hears each TE move's duration (``te_write`` /
    ``te_read``), e.g. ``kvstore.server.metrics.Metrics().observe``: the server cannot see them.
    ``te_protocol`` ("tcp" | "rdma", the servers' ``server.te_protocol``) and
    ``te_devices`` (RDMA NICs, e.g. "mlx5_0,mlx5_1"; empty: all) reach this client's
    TE engine; "rdma" on a machine without an RDMA NIC is a ``ConfigError`` here.
    ``te_engine``: a TE engine + staging buffer shared with other clients of this
    process (``te_host``, ``te_protocol``, ``te_devices`` and ``staging_bytes`` are
    then the engine's); its creator closes it, ``close()`` here does not.
    """

    def __init__(self, server: str | None = None, layout: KVLayout | None = None,
                 model_id: str = "default", tp_rank: int = 0, tp_size: int = 1,
                 salt: bytes | str = b"", timeout_s: float | None = None,
                 te_host: str | None = None, same_node: bool | str = "auto",
                 staging_bytes: int | None = None, curve_secret_key: str | None = None,
                 curve_server_public_key: str | None = None,
                 config: ClientConfig | None = None,
                 observer: Callable[[str, float, bool], None] | None = None,
                 te_engine: TeEngine | None = None, pp_rank: int = 0,
                 pp_size: int = 1, te_protocol: str | None = None,
                 te_devices: str | None = None) -> None:
        # client.* options: the caller's config, else KVSTORE_CLIENT_* (docs/operations.md).
        cfg = config or client_config_from_env()
        self.server = server or cfg.server
        self.layout = layout
        self.timeout_s = cfg.timeout_s if timeout_s is None else seconds(timeout_s, "timeout_s")
        self._namespace_of = functools.partial(
            namespace_of, model_id=model_id, tp_rank=tp_rank, tp_size=tp_size, salt=salt,
            pp_rank=pp_rank, pp_size=pp_size)
        self.namespace = None if layout is None else self._namespace_of(layout=layout)
        self._scoped: dict[bytes | str, bytes] = {}
        self._token_nbytes = 0 if layout is None else layout.token_nbytes
        secret = curve_secret_key if curve_secret_key is not None else cfg.curve_secret_key
        server_key = (curve_server_public_key if curve_server_public_key is not None
                      else cfg.curve_server_public_key)
        curve = CurveKeys.load(secret, server_key) if secret or server_key else None
        if te_engine is not None:
            _check_shared_engine(te_engine, te_protocol, te_devices)
        # The data path first: it refuses a TE protocol this machine cannot run
        # before any socket is open.
        self._data = DataPath(te_host or cfg.te_host, staging_bytes or cfg.staging_bytes,
                              same_node, observer, timeout_s=self.timeout_s, engine=te_engine,
                              protocol=te_protocol or cfg.te_protocol,
                              devices=cfg.te_devices if te_devices is None else te_devices,
                              piece_bytes=cfg.te_piece_bytes, wait=cfg.te_wait,
                              prefault=cfg.prefault_arena, stream=cfg.stream_copies)
        # The ROUTER, or the server's same-node socket once a hello names one
        # (kvstore/client/local.py).
        self._rpc = Control(Channel(self.server, self.timeout_s, curve=curve))
        self._hello: dict[str, Any] | None = None
        self._hello_lock = threading.Lock()
        self._hellos = 0  # hellos said (a late write's clock check, _call)
        self._clock: float | None = None  # the server's wall clock less ours (hello)
        self._hello_host: str | None = None  # the host_id that offset was measured for
        # The room the server holds for this client's next insert (one at a time;
        # taken under the lock, so two threads never write into one room).
        self._room: _Room | None = None
        self._room_lock = threading.Lock()
        self._last_need = 0  # bytes the last insert wrote (rooms are asked that big)
        # A drop_select / get of at most this many bytes asks for them in the acquire's
        # reply (``_inline``); TE over TCP only: RDMA reads beat the control socket. Not
        # under CURVE either: ZeroMQ would encrypt the bytes, 1.4 - 2.3x slower than TE
        # reads them (docs/benchmarks.md, "Small drop_selects in one round trip").
        self._inline_max = cfg.inline_max_bytes \
            if self._data.engine.protocol == "tcp" and curve is None else 0
        # ... in parts of about this many bytes, from servers that send them so
        # (hello's ``inline_parts``): each part is copied and verified while the next
        # is on the wire (docs/benchmarks.md, "Inline bytes in parts").
        self._inline_part_bytes = cfg.inline_part_bytes
        self._stream = cfg.stream_socket  # the stream door, where a hello names one
        self._release_sent_ok = cfg.release_sent  # (``_release_sent``)
        self._wait_refused = False  # a server without lookup wait_s answered (``_wait_s``)

    # ------------------------------------------------------------ connection
    def hello(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The server's identity; cached. Verifies the peer before any TE transfer.
        ``timeout_s``: the bound of saying it (the client's ``timeout_s`` by default;
        a call with its own deadline passes what is left of it)."""
        hello = self._hello
        if hello is not None and not self._rpc.lost:
            return hello
        # One hello at a time: threads sharing this client wait for it instead of
        # each saying its own (every hello voids the room the others hold). A socket
        # of the server's found closed (``Control.lost``): it may be another process
        # now, with another socket: ask.
        with self._hello_lock:
            hello = self._hello
            if hello is None or self._rpc.lost:
                self._rpc.use_local(None)  # hello over the ROUTER: it names the server
                sent = time.time()
                info = self._say_hello(timeout_s)
                clock = self._clock_of(info, sent, time.time())
                self._rpc.max_bytes = int(info.get("max_message_bytes", self._rpc.max_bytes))
                self._data.connect(info)
                # A client that writes into the server's arena is on its node: its
                # requests take the server's Unix socket from now on; one on another
                # node, the stream door, where it gets bytes in replies (_inline_max).
                self._rpc.use_local(self._door(info))
                # Set with the hello, once connected: a late write's reset of the
                # offset meanwhile is overwritten by this fresh one, not left half-done.
                self._clock, self._hello_host = clock, info.get("host_id")
                self._hello = hello = info
                # The server may be another process now: a room held is void (its
                # segment is no longer the data path's, _take_room).
                self._hellos += 1
            return hello

    def _say_hello(self, timeout_s: float | None) -> dict[str, Any]:
        """The hello's reply; with ``wait_s`` unless this client saw it refused (an
        older server refuses it as an unknown field: then asked again without)."""
        wait_s = None if self._wait_refused else \
            self._wait_s(_timeout(timeout_s, self.timeout_s))
        return self._call_waiting(p.Hello(wait_s=wait_s),
                                  lambda req: self._rpc.call(req, timeout_s))

    def _call_waiting(self, req: p.Hello | p.Lookup,
                      call: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """``call(req)``; where the server refuses ``req``'s ``wait_s`` as an unknown
        field (an older server: at this address since the hello that named it, or
        asked without a hello), asked again without it, and not sent again."""
        try:
            return call(req)
        except InvalidRequestError as exc:
            if req.wait_s is None or "unknown field 'wait_s'" not in str(exc):
                raise
            self._hello, self._wait_refused = None, True
            return call(dataclasses.replace(req, wait_s=None))

    def _door(self, info: dict[str, Any]) -> str | tuple[str, int] | None:
        """The socket a hello's server names for this client's requests: its Unix
        socket (``local``) to a client that writes into its arena; its stream door
        (``stream_port``, at the host this client reaches the server by) to one on
        another node that takes bytes in replies (TCP, no CURVE) and
        ``client.stream_socket``; else None (the ROUTER)."""
        if self._data.uses_shared_memory:
            return info.get("local")
        port = info.get("stream_port")
        if not self._stream or not self._inline_max or type(port) is not int \
                or not 0 < port < 65536:
            return None
        return door_address(self.server, port)

    def _segment(self, current: str | None = None,
                 timeout_s: float | None = None) -> Segment:
        """The server's data segment; ``current`` is the one a reply just named; if
        it differs from ours the server restarted and we say hello again. If the
        server found then is not ``current``'s either (it restarted once more, or
        another thread's hello reached a new one), ``PeerUnavailableError``: what
        that reply placed or leased is not in this server's arena."""
        hello = self._hello  # (read once: another thread may reset it)
        if current is not None and hello is not None and current != hello["segment"]:
            self._hello = None
        self.hello(timeout_s)
        segment = self._data.segment
        assert segment is not None  # hello() connected the data path
        if current is not None and segment.name != current:
            raise PeerUnavailableError(
                f"server {self.server} is another process than the one that answered "
                f"(segment {segment.name}, the reply's {current}): try again")
        return segment

    def _clock_of(self, info: dict[str, Any], sent: float, got: float) -> float | None:
        """The server's clock less ours, from a hello sent at ``sent`` and answered at
        ``got``; None where the server does not say its time (older than deadlines on
        every write: it gets none). A hello too slow to measure by keeps the last
        offset measured for the same machine (a re-hello comes after a stall, while
        the server works off its backlog: just when deadlines matter)."""
        if "now" not in info:
            return None
        offset = clock_offset(sent, info["now"], got)
        if offset is None and self._hello_host == info.get("host_id"):
            return self._clock
        return offset

    def _call(self, req: p.Request, timeout_s: float | None = None,
              take: Take | None = None) -> dict[str, Any]:
        hellos = self._hellos
        try:
            result = self._rpc.call(req, timeout_s, take)
            # (Inline bytes in parts that stopped coming: the same, raised later.)
            if isinstance(result.get("take_error"), (PeerUnavailableError, KVTimeoutError)):
                self._hello = None
            return result
        except (PeerUnavailableError, KVTimeoutError):
            self._hello = None  # the server may come back as a new process
            raise
        except BusyError as exc:
            deadline, clock = getattr(req, "deadline", None), self._clock
            late = LATE_WRITE in str(exc) or LATE_READ in str(exc)
            if deadline is not None and clock is not None and late \
                    and not self._data.uses_shared_memory and time.time() + clock < deadline \
                    and self._hellos == hellos:
                # Refused as late before its deadline by our reckoning: the server's
                # clock stepped ahead since hello measured it. Forget that offset (no
                # deadlines until a hello measures again, at the next call), so a wrong
                # one cannot make every write late.
                self._clock, self._hello_host, self._hello = None, None, None
            raise

    def _deadline(self) -> tuple[float | None, float | None]:
        """A reserve's, commit's or put's ``deadline`` (the server's wall clock: this
        node's where the server is on it, else ours moved by the offset its hello
        measured) and how long to wait for its reply: the server refuses it after the
        deadline, and the client waits ``_DEADLINE_SLACK_S`` longer, so a reply that
        was sent in time is not given up on (that stored, or reserved, what it was
        told failed). (None, None) where the server's clock is not known: no
        deadline, the client's own timeout."""
        hello = self._hello
        if hello is None or "now" not in hello:  # (a server older than deadlines on
            return None, None                    # every write: it would refuse them)
        offset = 0.0 if self._data.uses_shared_memory else self._clock  # (this node's)
        if offset is None:  # not measured: no hello quick enough yet
            return None, None
        return time.time() + offset + self.timeout_s, self.timeout_s + _DEADLINE_SLACK_S

    def _read_deadline(self, deadline: float) -> float | None:
        """An acquire's ``deadline`` on the server's wall clock (as ``_deadline``
        reckons it): when this call gives up (``deadline``, monotonic), less a margin
        for the reply's way back (a quarter of what is left; for a server on another
        node at least ``_CLOCK_ERROR_S``, its clock's error; at most
        ``_DEADLINE_SLACK_S``), so that a reply the server sent in time is not given
        up on with its lease held. None where the server's clock is not known, or it
        does not take acquire deadlines (its hello's ``acquire_deadline``)."""
        hello = self._hello
        if hello is None or not hello.get("acquire_deadline") or "now" not in hello:
            return None  # (a server older than acquire deadlines: it would refuse one)
        local = self._data.uses_shared_memory
        offset = 0.0 if local else self._clock
        if offset is None:
            return None
        left = max(0.0, deadline - time.monotonic())
        # A remote clock is known to within _CLOCK_ERROR_S: the margin covers that too.
        margin = left / 4 if local else max(left / 4, _CLOCK_ERROR_S)
        return time.time() + offset + left - min(_DEADLINE_SLACK_S, margin)

    def _wait_s(self, left: float) -> float | None:
        """A lookup's or acquire's ``wait_s``: how long this call still waits
        (``left``), less a margin for the reply's way back (a quarter, at most
        ``_WAIT_MARGIN_S``), so that a server stalled behind slow work answers
        ``busy`` while this call still listens. None where the server does not take
        it (its hello's ``wait_s``; without a hello, as a lookup-only client may be,
        sent unless this client saw it refused)."""
        hello = self._hello
        if (not hello.get("wait_s")) if hello is not None else self._wait_refused:
            return None
        left = max(0.0, left)
        # Within what the server takes: a call with no time left still says a little
        # (it then hears busy or times out: a miss), one of hours says the most.
        margin = min(left / _WAIT_MARGIN_SHARE, _WAIT_MARGIN_S)
        return min(p.MAX_LEASE_S, max(_WAIT_FLOOR_S, left - margin))

    def keys_for(self, tokens: Sequence[int] | np.ndarray,
                 scope: bytes | str = b"") -> list[bytes]:
        return self._prompt(tokens, scope).keys

    def namespace_for(self, scope: bytes | str = b"") -> bytes:
        """This client's key namespace, narrowed by a per-request ``scope`` (see
        kvstore.core.hashing.namespace_of); the unscoped one is ``self.namespace``."""
        if self.layout is None or self.namespace is None:
            raise InvalidRequestError("this client was created without a KV layout")
        if not scope:
            return self.namespace
        ns = self._scoped.get(scope)
        if ns is None:
            if len(self._scoped) >= _SCOPES_KEPT:
                self._scoped.clear()  # a bound, not a policy: rebuilding one is a hash
            ns = self._scoped[scope] = self._namespace_of(layout=self.layout, scope=scope)
        return ns

    def _prompt(self, tokens: Sequence[int] | np.ndarray, scope: bytes | str = b"") -> _Prompt:
        namespace = self.namespace_for(scope)
        assert self.layout is not None
        bk, toks, ntokens = prompt_blocks(namespace, tokens, self.layout.block_tokens,
                                          PROMPT_KEYS)
        if not ntokens:
            raise InvalidRequestError("empty prompt")
        return _Prompt(bk.keys, toks, bk.token_counts, ntokens)

    # ---------------------------------------------------------------- insert
    def insert(self, tokens: Sequence[int] | np.ndarray, kv: Any,
               hidden: torch.Tensor | None = None, pin: bool = False,
               scope: bytes | str = b"", skip_blocks: int = 0,
               count_skipped: bool = True) -> InsertResult:
        """Store the KV of ``tokens``: per-layer HF ``(k, v)`` pairs, or the flat entry
        bytes (uint8 torch tensor / numpy array of exactly ``layout.nbytes(n)``).
        ``pin``: the entries are pinned by the commit itself (unpin to release).
        ``scope``: what else the KV depends on (namespace_for); readers must pass it too.
        ``skip_blocks``: the caller knows the server holds the prompt's first blocks
        (a lookup found them), so ``kv`` is flat entry bytes from that block on; the
        insert still counts for every block, as a whole one would. If the server
        lacks one of them after all, nothing is stored (``NotFoundError``).
        ``count_skipped`` False: the skipped blocks were stored, and counted, by this
        caller's own earlier insert of the prompt's first part (a chunked prefill
        saved chunk by chunk): only the new blocks are reserved and counted, and the
        skipped ones are not checked."""
        prompt = self._prompt(tokens, scope)
        skip = min(max(0, int(skip_blocks)), len(prompt.keys))
        # token_nbytes once: layout.entry_sizes costs a torch call per block.
        token_nbytes = self._token_nbytes
        sizes = [token_nbytes * n for n in prompt.counts]
        if skip and isinstance(kv, (list, tuple)):
            raise InvalidRequestError("skip_blocks needs kv as flat entry bytes")
        # The entries' bytes, back to back: for sizes[skip:] (the skipped blocks carry none).
        data: np.ndarray | None = self._entry_bytes(
            kv, prompt.ntokens - sum(prompt.counts[:skip]) if skip else prompt.ntokens)
        buffers: list[np.ndarray | None] | None = None  # per entry, made where needed
        keys, toks = list(prompt.keys), list(prompt.tokens)
        metas: list[bytes | None] = [None] * len(sizes)
        if hidden is not None:
            hbuf, hmeta = _hidden_bytes(hidden)
            keys.append(hidden_key(prompt.keys[-1]))
            toks.append(prompt.tokens[-1])  # the store wants tokens; the last block's
            assert data is not None
            buffers = _per_entry(data, sizes, skip) + [hbuf]
            data = None  # (not one run any more)
            metas.append(hmeta)
            sizes = [*sizes, hbuf.size]
        first = 0 if count_skipped else skip
        meta = tuple(metas[first:]) if hidden is not None else None
        need = _need(sizes[skip:])
        want, self._last_need = max(need, self._last_need), need
        if self._segment().shm is None:
            want = 0  # rooms are for writers on the server's node (Writes.grant_room)
        room = self._take_room(sizes[skip:])
        if room is not None:
            try:
                return self._put(room, prompt, keys, toks, sizes, buffers, data, meta, skip,
                                 first, pin, want)
            except (LeaseExpiredError, NotFoundError) as exc:
                # The room was reclaimed, or a skipped block is gone: the reserve
                # below stores the insert, or says which block is missing.
                log.debug("insert into room %s failed (%s): reserving instead", room.id, exc)
        if buffers is None:
            assert data is not None
            buffers = _per_entry(data, sizes, skip)
        res, rid, placements = self._reserve(keys, sizes, toks, skip,
                                             tuple(metas) if hidden is not None else None,
                                             count_skipped)
        try:
            seg = self._segment(res["segment"])
            # (a placement for a skipped block, with no bytes here, was refused above)
            new = [(buf, pl) for buf, pl in zip(buffers, placements)
                   if pl is not None and buf is not None]
            start = time.perf_counter()
            # The checksums come back from the move (same node: hashed while copying).
            sums = self._data.write(seg, [b for b, _ in new], [pl for _, pl in new])
            moved = time.perf_counter() - start
            # The move's time and size go along: TE is one-sided, the server cannot see it.
            deadline, wait = self._deadline()
            asked = time.monotonic()
            done = self._call(p.Commit(rid=rid, checksums=tuple(sums), xfer_s=moved,
                                       xfer_bytes=sum(pl[2] for _, pl in new), pin=pin,
                                       next_room=want, deadline=deadline), wait)
            self._keep_room(done, asked, seg)
        except PeerUnavailableError:
            self._hello = None  # TE or control plane lost the server
            self._abort(rid)
            raise
        except BaseException:
            self._abort(rid)
            raise
        nblocks = len(prompt.keys)
        new_blocks = sum(pl is not None for pl in placements[:nblocks])
        if done.get("lost"):
            # Deduped onto another writer's insert of the same blocks, which gave up
            # before committing: those blocks are not stored (a reader will miss).
            log.warning("%d of %d blocks not stored: their other writer aborted",
                        done["lost"], nblocks)
        return InsertResult(new_blocks, nblocks - new_blocks, prompt.ntokens,
                            sum(pl[2] for pl in placements if pl is not None))

    # ---------------------------------------------------------------- rooms
    # After an insert the server holds room for this client's next one (``next_room``
    # on commit and put): the next insert copies its entries into that room and
    # stores them with one ``Put``, one round trip instead of reserve + commit. Only
    # on the server's node: the copy goes through the arena file of the server
    # process that granted the room, so a restarted server is never written into
    # (kvstore/store/writes.py, "rooms").
    def _put(self, room: _Room, prompt: _Prompt, keys: list[bytes], toks: list[bytes],
             sizes: list[int], buffers: list[np.ndarray | None] | None,
             data: np.ndarray | None,
             meta: tuple | None, skip: int, first: int, pin: bool, want: int
             ) -> InsertResult:
        """Insert ``keys[first:]`` (those before ``skip`` carry no bytes) through
        ``room``: copy every entry into it back to back, page by page, then one
        ``Put``. The bytes: ``data``, the entries from ``skip`` on back to back, or
        (``data`` None) ``buffers``, one per entry from ``skip`` on (None while
        ``data`` is given: made here if the one-call copy cannot be used). Raises
        ``LeaseExpiredError`` / ``NotFoundError`` when the server no longer holds the
        room or lacks a skipped block (``insert`` then reserves)."""
        try:
            seg = room.segment  # (not this moment's: _Room.segment)
            start = time.perf_counter()
            # One call (a thread's share each) for the whole run where it can.
            run = None if data is None or room.tier != "dram" else \
                self._data.write_run(seg, data, sizes[skip:], room.offset, room.nbytes,
                                     room.page)
            if run is not None:
                offsets, sums = run
            else:
                if buffers is None:
                    assert data is not None
                    buffers = _per_entry(data, sizes, skip)
                offsets, placements = _room_layout(room, sizes[skip:])
                sums = self._data.write(seg, [b for b in buffers[skip:] if b is not None],
                                        placements)
            moved = time.perf_counter() - start
        except BaseException:
            self._abort(room.id)
            raise
        return self._put_room(room, prompt, keys, toks, sizes, offsets, sums, meta, skip,
                              first, pin, want, moved)

    def _put_room(self, room: _Room, prompt: _Prompt, keys: list[bytes], toks: list[bytes],
                  sizes: list[int], offsets: list[int], sums: list[int], meta: tuple | None,
                  skip: int, first: int, pin: bool, want: int, moved: float) -> InsertResult:
        """The ``Put`` that stores entries already copied into ``room`` at ``offsets``
        (``_put``, ``PendingInsert.commit``). ``LeaseExpiredError`` / ``NotFoundError``:
        the room is gone or spent, or a skipped block is; the caller reserves."""
        moved_bytes = sum(sizes[skip:])
        deadline, wait = self._deadline()  # (a room is always on this node)
        asked = time.monotonic()
        try:
            done = self._call(p.Put(room=room.id, keys=tuple(keys[first:]),
                                    sizes=tuple(sizes[first:]), tokens=tuple(toks[first:]),
                                    offsets=tuple(offsets), checksums=tuple(sums), meta=meta,
                                    namespace=self.namespace, skip=skip - first, pin=pin,
                                    xfer_s=moved, xfer_bytes=moved_bytes, next_room=want,
                                    deadline=deadline), wait)
        except (LeaseExpiredError, NotFoundError):
            raise  # the room is gone or spent: insert reserves
        except BaseException:
            # Refused before the store (invalid, busy) or unanswered: the room may
            # still be held; give it back (if the put was applied, that is a no-op).
            self._abort(room.id)
            raise
        self._keep_room(done, asked, room.segment)
        nblocks = len(prompt.keys)  # keys[nblocks:] is the hidden-state entry, if any
        existing = sum(first + j < nblocks for j in done.get("existing", ()))
        new_blocks = max(0, nblocks - skip) - existing
        if done.get("lost"):
            log.warning("%d of %d blocks not stored: their other writer aborted",
                        done["lost"], nblocks)
        return InsertResult(new_blocks, nblocks - new_blocks, prompt.ntokens, moved_bytes)

    def _take_room(self, sizes: list[int]) -> _Room | None:
        """This client's room, if entries of ``sizes`` fit it now (else it is given
        back); None: the insert reserves."""
        with self._room_lock:
            room, self._room = self._room, None
        if room is None:
            return None
        if time.monotonic() >= room.usable_until or room.segment is not self._data.segment \
                or self._hello is None or room.segment.shm is None:
            # Reclaimed soon, or granted before the last hello (the server may have
            # restarted since): never written, and not worth a message.
            return None
        if _need(sizes, room.page) > room.nbytes:
            self._abort(room.id)
            return None
        return room

    def _keep_room(self, reply: dict[str, Any], asked: float, seg: Segment) -> None:
        """Hold the room a commit or put reply grants for the next insert. Its lease
        is counted from ``asked`` (time.monotonic() before the request was sent): the
        server granted it later than that, never earlier, so the client's idea of
        its end is never later than the server's. ``seg``: the segment the request's
        bytes went to; a reply from another server (its segment differs), or one
        that comes after a new hello (the data path maps another arena now), is not
        kept."""
        grant, segment = reply.get("room"), reply.get("segment")
        if not grant or self._hello is None or segment != seg.name \
                or seg is not self._data.segment or seg.shm is None:
            return
        rid, tier, offset, nbytes, address, page, lease_s = grant
        room = _Room(rid, tier, offset, nbytes, address, page, asked + lease_s / 2,
                     asked + lease_s, seg)
        with self._room_lock:
            old, self._room = self._room, room
        if old is not None:  # another thread's insert got one meanwhile
            self._abort(old.id)

    def _reserve(self, keys: list[bytes], sizes: list[int], toks: list[bytes], skip: int,
                 metas: tuple | None = None, count_skipped: bool = True
                 ) -> tuple[dict, int, list]:
        """Reserve room for an insert's entries; NotFoundError (nothing reserved) if
        the server lacks one of the ``skip`` blocks the caller said it holds. Not
        ``count_skipped``: the skipped blocks are left out of the reservation (their
        placements come back None)."""
        # A reserve the server reaches after this client gave up is refused, not left
        # holding the keys (other writers of the prompt would dedup onto it, and lose
        # them).
        self._segment()
        deadline, wait = self._deadline()
        first = 0 if count_skipped else skip
        res = self._call(p.Reserve(keys=tuple(keys[first:]), sizes=tuple(sizes[first:]),
                                   tokens=tuple(toks[first:]),
                                   meta=None if metas is None else metas[first:],
                                   namespace=self.namespace, deadline=deadline), wait)
        rid, placements = res["rid"], [None] * first + list(res["placements"])
        lacking = [i for i, pl in enumerate(placements[:skip]) if pl is not None]
        if lacking:
            self._abort(rid)
            raise NotFoundError(f"the server lacks block {lacking[0]} of the {skip} the "
                                f"insert skipped (evicted since it was found): not stored")
        return res, rid, placements

    def begin_insert(self, tokens: Sequence[int] | np.ndarray, scope: bytes | str = b"",
                     skip_blocks: int = 0, count_skipped: bool = True) -> PendingInsert | None:
        """An insert whose bytes come layer by layer (a connector saving each layer as
        the forward computes it): ``write_layer`` copies one layer of every entry into
        the server's shared DRAM arena, ``commit`` writes what is left, checks and
        stores. The room is the one this client holds for its next insert (the last
        insert's reply granted it; ``commit`` is then one ``put``), else it is reserved
        now (``commit`` commits it). Only where the server is on this node and every
        entry lands in its shared DRAM arena; else None (nothing held) and the caller
        inserts whole. Same rules as ``insert`` (``skip_blocks``, ``count_skipped``);
        a skipped block the server lacks is ``NotFoundError`` from here when it
        reserves, else from ``commit``, and nothing is stored."""
        prompt = self._prompt(tokens, scope)
        skip = min(max(0, int(skip_blocks)), len(prompt.keys))
        sizes = [self._token_nbytes * n for n in prompt.counts]
        if self._segment().shm is None:
            return None  # not on the server's node: nothing to write into early
        assert self.layout is not None  # _prompt checked it
        need = _need(sizes[skip:])
        want, self._last_need = max(need, self._last_need), need
        first = 0 if count_skipped else skip

        def whole(data: np.ndarray) -> InsertResult:  # reserve, copy, commit, as insert does
            return self.insert(tokens, data, scope=scope, skip_blocks=skip,
                               count_skipped=count_skipped)

        room = self._take_room(sizes[skip:])
        if room is not None:
            seg = room.segment  # (not this moment's: _Room.segment)
            if room.tier == "dram" and seg.shm is not None:
                offsets, placements = _room_layout(room, sizes[skip:])
                keys, toks = list(prompt.keys), list(prompt.tokens)

                def put(sums: list[int], moved_s: float) -> InsertResult:
                    return self._put_room(room, prompt, keys, toks, sizes, offsets, sums,
                                          None, skip, first, False, want, moved_s)

                # Written only before the room's lease ends (less a margin): after it,
                # the server may have given those bytes to another entry.
                lease = 2 * (room.expires - room.usable_until)
                self._data.warm(seg.shm)
                return PendingInsert(self, seg.shm, room.id, prompt, [None] * skip + placements,
                                     skip, self.layout, _write_until(room.expires, lease),
                                     whole, put)
            self._abort(room.id)
        res, rid, placements = self._reserve(list(prompt.keys), sizes, list(prompt.tokens),
                                             skip, count_skipped=count_skipped)
        try:
            seg = self._segment(res["segment"])
        except BaseException:
            self._abort(rid)
            raise
        new = [i for i in range(skip, len(sizes)) if placements[i] is not None]
        if seg.shm is None or any(placements[i][0] != "dram" for i in new):
            self._abort(rid)  # (room on NVMe: the whole insert after the step)
            return None
        # The server's wall clock is this node's: the reservation's end in monotonic time.
        left = res["expires_at"] - time.time()
        until = _write_until(time.monotonic() + left, left)

        def commit(sums: list[int], moved_s: float) -> InsertResult:
            nbytes = sum(placements[i][2] for i in new)
            done = self._commit_parts(rid, sums, moved_s, nbytes, want, seg)
            if done.get("lost"):
                log.warning("%d of %d blocks not stored: their other writer aborted",
                            done["lost"], len(prompt.keys))
            new_blocks = sum(pl is not None for pl in placements[:len(prompt.keys)])
            return InsertResult(new_blocks, len(prompt.keys) - new_blocks, prompt.ntokens,
                                nbytes)

        self._data.warm(seg.shm)
        return PendingInsert(self, seg.shm, rid, prompt, placements, skip, self.layout, until,
                             whole, commit)

    def _commit_parts(self, rid: int, sums: list[int], moved_s: float, nbytes: int,
                      want: int, seg: Segment) -> dict:
        deadline, wait = self._deadline()  # (begin_insert: a server on this node)
        asked = time.monotonic()
        try:
            done = self._call(p.Commit(rid=rid, checksums=tuple(sums), xfer_s=moved_s,
                                       xfer_bytes=nbytes, pin=False, next_room=want,
                                       deadline=deadline), wait)
        except BaseException:
            self._abort(rid)
            raise
        self._keep_room(done, asked, seg)
        return done

    def _entry_bytes(self, kv: Any, ntokens: int) -> np.ndarray:
        if isinstance(kv, (list, tuple)):
            assert self.layout is not None  # _prompt checked it
            kv = pack_hf(self.layout, kv, ntokens)
        if isinstance(kv, torch.Tensor):
            kv = kv.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        if not isinstance(kv, np.ndarray):
            raise InvalidRequestError(
                f"kv must be HF (k, v) pairs or entry bytes, got {type(kv).__name__}")
        flat = np.ascontiguousarray(kv).reshape(-1).view(np.uint8)
        if flat.size != self._token_nbytes * ntokens:
            raise InvalidRequestError(f"{ntokens} tokens need {self._token_nbytes * ntokens} "
                                      f"bytes of KV, got {flat.size}")
        return flat

    def _abort(self, rid: int) -> None:
        """Give back reservation or room ``rid``, one-way: the server applies it before
        this client's next request (when that goes over another channel, a call on
        this one settles it first, ``Control._leave``), and its lease reclaims
        it anyway. Not waiting for
        the reply keeps a failed insert from outlasting its timeout by the abort's
        own round trip (up to ``_CLEANUP_TIMEOUT_S`` against a server that stopped
        answering)."""
        try:
            self._rpc.send(p.Abort(rid=rid), timeout_s=_CLEANUP_TIMEOUT_S)
        except KVStoreError as exc:
            log.debug("abort of reservation %s failed: %s", rid, exc)

    # ---------------------------------------------------------------- select
    def drop_select(self, tokens: Sequence[int] | np.ndarray, timeout: float | None = None,
                    into: Any = None, scope: bytes | str = b"",
                    skip_blocks: int = 0) -> SelectResult:
        """Longest stored prefix of ``tokens``: move its KV here, then drop it there.

        ``into``: a buffer the caller reuses (contiguous numpy array or CPU tensor, at
        least the prompt's KV bytes plus its hidden state); the bytes land there with
        no copy and no fresh memory per call, and ``kv`` is a view of it.

        ``skip_blocks``: the caller already holds the prompt's first blocks (an
        engine's own prefix cache): they are taken (dropped, counted in
        ``matched_tokens``) but not moved, so ``kv`` (and ``into``) start at block
        ``skip_blocks``."""
        return self._select(tokens, drop=True, timeout=timeout, into=into, scope=scope,
                            skip_blocks=skip_blocks)

    def get(self, tokens: Sequence[int] | np.ndarray, timeout: float | None = None,
            into: Any = None, scope: bytes | str = b"", skip_blocks: int = 0) -> SelectResult:
        """Like ``drop_select`` but leaves the entries stored (prefix caching)."""
        return self._select(tokens, drop=False, timeout=timeout, into=into, scope=scope,
                            skip_blocks=skip_blocks)

    def _select(self, tokens: Any, drop: bool, timeout: float | None,
                into: Any = None, scope: bytes | str = b"",
                skip_blocks: int = 0) -> SelectResult:
        deadline = time.monotonic() + _timeout(timeout, self.timeout_s)
        prompt = self._prompt(tokens, scope)
        # Blocks only: the hidden-state entry after them is always moved.
        skip = min(max(0, int(skip_blocks)), len(prompt.keys))
        self._segment(timeout_s=_left(deadline))
        keys = [*prompt.keys, hidden_key(prompt.keys[-1])]
        toks = [*prompt.tokens, prompt.tokens[-1]]
        # Rounds: a server without the memory to stage all of a prompt's NVMe
        # entries serves a part and says so ("short"); the next round acquires the
        # rest (chained keys need no earlier block) once this one's are released.
        entries: list[list] = []
        parts: list[np.ndarray] = []
        short = ""
        flat_into = _rest_of(into, 0)  # checked before anything is acquired
        while len(entries) < len(keys):
            done = len(entries)
            landed = sum(x.size for x in parts)
            round_into = None if flat_into is None else flat_into[landed:]
            inline = self._inline(skip - done)
            part = self._inline_part() if inline is not None else None
            # The hidden key is optional: a prompt stored without one is no miss.
            # A later round of a drop_select that finds no room spends the rest:
            # with the head taken, no whole-prompt read could reach it again.
            try:
                acq = self._acquire(
                    p.Acquire(keys=tuple(keys[done:]), tokens=tuple(toks[done:]),
                              claim=drop, optional_tail=True, spend_rest=drop and done > 0,
                              inline=inline, inline_part=part,
                              release_sent=self._release_sent(inline),
                              deadline=self._read_deadline(deadline),
                              wait_s=self._wait_s(deadline - time.monotonic())), deadline,
                    None if inline is None else functools.partial(self._data.take_parts,
                                                                  into=round_into))
            except (BusyError, KVTimeoutError, PeerUnavailableError) as exc:
                if not entries:
                    raise
                # The earlier rounds' entries are verified and released (a drop_select's
                # with drop: gone from the server): they are the caller's, short.
                log.warning("drop_select: a later round failed (%s): returning the first "
                            "%d entries", exc, done)
                break
            short = acq.get("short", "")
            if not acq["entries"]:
                if acq.get("spent"):
                    log.warning("drop_select: the server spent the %d entries it had no "
                                "room to stage after serving the first %d", acq["spent"],
                                done)
                break
            out, released = self._read_round(
                acq, drop, deadline, round_into,
                skip=min(max(0, skip - done), len(acq["entries"])))
            entries += acq["entries"]
            parts.append(out)
            if not short or not released:
                break
        if not entries:
            return SelectResult(0, None, None, short)
        if flat_into is not None:  # the rounds landed back to back in it
            out = flat_into[:sum(x.size for x in parts)]
        else:
            out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        nblocks = min(len(entries), len(prompt.keys))
        matched = sum(e[5] for e in entries[:nblocks])
        kv_bytes = sum(e[2] for e in entries[skip:nblocks])  # what moved
        if short and nblocks < len(prompt.keys):
            log.warning("served %d of the stored blocks of a prompt: the server has no "
                        "memory room to stage the rest (%s)", nblocks, short)
        hidden = None
        if len(entries) > nblocks:  # the hidden-state entry came along: a full match
            hidden = _hidden_tensor(out[kv_bytes:], entries[nblocks][6])
        return SelectResult(matched, torch.from_numpy(out[:kv_bytes]), hidden,
                            short if nblocks < len(prompt.keys) else "")

    def _acquire(self, req: p.Acquire, deadline: float,
                 take: Take | None = None) -> dict[str, Any]:
        """``req``'s reply; ``take`` copies inline bytes that come in parts as they
        arrive (``Requests.call``). A server that refuses its ``inline`` or
        ``inline_part`` as an unknown field predates inline replies, or parts of them:
        one that replaced a newer server at this address while this client kept the
        newer one's hello. Such a refusal is the decoder's, before any work, so the
        same acquire is asked again without them, and the hello is read afresh at the
        next call."""
        try:
            return self._call(req, _left(deadline), take)
        except InvalidRequestError as exc:
            refused = [name for name in ("inline", "inline_part", "deadline", "wait_s",
                                         "release_sent")
                       if f"unknown field {name!r}" in str(exc)]
            if not refused:
                raise
        log.info("the server at %s refuses the acquire's %s (an older build): asking "
                 "without", self.server, " and ".join(refused))
        self._hello = None
        left_out = set(refused)
        # (inline_part and release_sent need inline: a server that refuses inline or
        # inline_part reads over TE.)
        if left_out - {"deadline", "wait_s", "release_sent"}:
            left_out |= {"inline", "inline_part", "release_sent"}
        unset: dict[str, Any] = dict.fromkeys(left_out)  # (each field's "left out": None)
        return self._call(dataclasses.replace(req, **unset), _left(deadline))

    def _inline(self, skip: int) -> int | None:
        """What an acquire asks to get in its reply (``Acquire.inline``): this client's
        ``inline_max_bytes`` when the server sends bytes so (its hello says how many:
        no more is asked, so a server from before larger replies is never asked past
        its protocol's bound), at most ``ROUTER_INLINE_BYTES`` unless the request goes
        over the stream door, and this client reads over TE (not its node's shared
        arena, not skipping blocks: those would travel for nothing); else None (the
        field left out, for servers that predate it)."""
        hello = self._hello
        limit = hello.get("inline_max") if hello is not None else None
        if not self._inline_max or skip > 0 or type(limit) is not int or limit <= 0 \
                or self._data.uses_shared_memory:
            return None
        ask = min(self._inline_max, limit)
        return ask if self._rpc.stream else min(ask, p.ROUTER_INLINE_BYTES)

    def _release_sent(self, inline: int | None) -> bool | None:
        """``Acquire.release_sent`` beside ``inline`` over the stream door, where the
        server ends leases so (hello's ``release_sent``) and ``client.release_sent``
        is on: True; else None (left out).
        A reply whose bytes then come over the door needs no release after a good
        read: the one-way release's ``sendmsg``, which wakes the server's thread (the
        waker pays for that on a VM), was ~0.1 - 0.25 ms of a 2 MiB drop_select."""
        hello = self._hello
        if inline is None or not self._release_sent_ok or not self._rpc.stream \
                or hello is None or not hello.get("release_sent"):
            return None
        return True

    def _inline_part(self) -> int | None:
        """``Acquire.inline_part`` beside ``inline``: ``client.inline_part_bytes`` where
        the server sends parts (hello's ``inline_parts``), else None (left out)."""
        hello = self._hello
        if not self._inline_part_bytes or hello is None or not hello.get("inline_parts"):
            return None
        return self._inline_part_bytes

    def _read_round(self, acq: dict, drop: bool, deadline: float,
                    into: Any, skip: int = 0) -> tuple[np.ndarray, bool]:
        """Read one acquisition's entries but its first ``skip`` (verified) and
        release it (all of them); the bytes, and whether the release was
        acknowledged (sent, when it is the last round: the release is one-way then, and
        this client's next request is served after it). Once the bytes are verified
        they are the caller's: a release
        that fails (server stopped, timed out) loses nothing, since the server keeps
        the entries until it applies a drop, or, never hearing it, the lease expires
        and they stay for the next consumer."""
        aid, entries = acq["aid"], acq["entries"]
        wanted = entries[skip:]
        try:
            start = time.perf_counter() - acq.get("take_s", 0.0)
            # Verified against the stored checksums as it lands (same node: while copying;
            # bytes that came in the reply: while copying them out of it, in parts as
            # they arrived when they came so: ``taken``, or what that raised).
            if "take_error" in acq:
                raise acq["take_error"]
            if "taken" in acq:
                out = acq["taken"]
            elif "inline" in acq:
                out = self._data.take_inline(acq, skip, into)
            else:
                out = (self._data.read(self._segment(acq["segment"], _left(deadline)), wanted,
                                       into, verify=True)
                       if wanted else np.empty(0, dtype=np.uint8))
            moved = time.perf_counter() - start
        except ChecksumError as exc:
            # The server re-checks the lease's entries and drops the ones bad at rest.
            where = exc.position
            where = None if where is None else where + skip
            self._release(aid, drop=False, timeout=_left(deadline),
                          corrupt=(where,) if where is not None else (0,))
            raise
        except PeerUnavailableError:
            self._hello = None
            self._release(aid, drop=False, timeout=_left(deadline))
            raise
        except BaseException:
            self._release(aid, drop=False, timeout=_left(deadline))
            raise
        if acq.get("release_sent") and not acq.get("short"):
            return out, True  # the server ended the lease once the bytes were out
        release = p.Release(aid=aid, drop=drop, xfer_s=moved,
                            xfer_bytes=sum(e[2] for e in wanted))
        try:
            if acq.get("short"):  # the next round's acquire needs this one applied
                self._call(release, _left(deadline))
            else:  # one-way: the server applies it before this client's next request
                self._rpc.send(release, timeout_s=max(_left(deadline), 0.5))
        except (KVTimeoutError, PeerUnavailableError) as exc:
            log.warning("release of %d verified entries not acknowledged (%s): returning "
                        "them; the server keeps them if it never applies the release",
                        len(entries), exc)
            return out, False
        return out, True

    def _release(self, aid: int, drop: bool, timeout: float,
                 corrupt: tuple[int, ...] | None = None) -> None:
        try:
            self._rpc.call(p.Release(aid=aid, drop=drop, corrupt=corrupt),
                           timeout_s=min(max(timeout, 0.5), _CLEANUP_TIMEOUT_S))
        except KVStoreError as exc:  # the read lease reclaims it anyway
            log.debug("release of %s failed: %s", aid, exc)

    def lookup(self, tokens: Sequence[int] | np.ndarray, scope: bytes | str = b"",
               timeout_s: float | None = None) -> LookupResult:
        """How much of ``tokens`` is stored (non-binding). ``timeout_s`` bounds this
        call (default: the client's)."""
        timeout_s = _timeout(timeout_s, self.timeout_s)
        prompt = self._prompt(tokens, scope)
        res = self._call_waiting(
            p.Lookup(keys=tuple(prompt.keys), tokens=tuple(prompt.tokens),
                     wait_s=self._wait_s(timeout_s)),
            lambda req: self._call(req, timeout_s))
        return LookupResult(res["matched_tokens"], res["matched_blocks"], list(res["tiers"]))

    # ----------------------------------------------------------------- admin
    def stats(self) -> dict[str, Any]:
        return self._rpc.call(p.Stats())["stats"]

    def health(self, deep: bool = False) -> dict[str, Any]:
        return self._rpc.call(p.Health(deep=deep))

    def ls(self, tier: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        """Every entry (optionally of one tier), fetched in pages of ``limit``."""
        out: list[dict[str, Any]] = []
        cursor: bytes | None = None
        while True:
            page = self._rpc.call(p.Ls(tier=tier, cursor=cursor, limit=limit))
            out.extend(page["entries"])
            cursor = page["next"]
            if cursor is None:
                return out

    def evict(self, tier: str | None = None, nbytes: int | None = None,
              fraction: float | None = None, keys: Sequence[bytes] | None = None,
              everything: bool = False, dry_run: bool = False) -> dict[str, Any]:
        return self._rpc.call(p.Evict(tier=tier, nbytes=nbytes, fraction=fraction,
                                      keys=None if keys is None else tuple(keys),
                                      everything=everything, dry_run=dry_run))

    def pin(self, keys: Sequence[bytes]) -> Any:
        return self._rpc.call(p.Pin(keys=tuple(keys)))["count"]

    def unpin(self, keys: Sequence[bytes]) -> Any:
        return self._rpc.call(p.Unpin(keys=tuple(keys)))["count"]

    def clear(self) -> dict[str, Any]:
        return self._rpc.call(p.Clear())

    def verify(self, batch: int = p.VERIFY_BATCH,
               batch_bytes: int = p.VERIFY_BATCH_BYTES) -> dict[str, Any]:
        """Re-check every entry's checksum and drop the bad ones, at most ``batch``
        keys and ``batch_bytes`` bytes per request: the server holds its lock for one
        batch's reads at a time, never for a whole NVMe tier's (which every other
        request would wait behind). Entries stored meanwhile are not checked.
        {"checked": how many, "bad": their keys}."""
        checked, bad = 0, []
        for keys in p.verify_batches(self.ls(), batch, batch_bytes):
            reply = self._rpc.call(p.Verify(keys=keys))
            checked += reply["checked"]
            bad += reply["bad"]
        return {"checked": checked, "bad": bad}

    def close(self) -> None:
        with self._room_lock:
            room, self._room = self._room, None
        if room is not None and time.monotonic() < room.usable_until:
            self._abort(room.id)
        self._rpc.close()
        self._data.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------ helpers
def _timeout(value: float | None, default: float) -> float:
    """A call's ``timeout`` argument: ``default`` for None, else a finite number of
    seconds > 0 (``InvalidRequestError`` before anything is sent)."""
    return default if value is None else seconds(value, "timeout", InvalidRequestError)


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _rest_of(into: Any, offset: int) -> np.ndarray | None:
    """The caller's ``into`` buffer from byte ``offset`` on, as flat uint8 (a round
    of a select lands after the rounds before it)."""
    if into is None:
        return None
    return flat_buffer(into)[offset:]


def _check_shared_engine(engine: TeEngine, protocol: str | None, devices: str | None) -> None:
    """A shared engine is the engine's settings: asking for others is refused, not ignored
    (a client asking for RDMA must not move its bytes over TCP unawares)."""
    asked = {"te_protocol": (protocol, engine.protocol),
             "te_devices": (None if devices is None else
                            ",".join(parse_te_devices("te_devices", devices)), engine.devices)}
    for name, (want, has) in asked.items():
        if want is not None and want != has:
            raise ConfigError(f"{name} {want!r} asked for, but the shared te_engine runs "
                              f"{has!r}: set it on the TeEngine")


def _need(sizes: list[int], page: int = 4096) -> int:
    """Bytes a room must hold for entries of ``sizes`` laid out page by page."""
    return sum(-(-n // page) * page for n in sizes)


def _per_entry(data: np.ndarray, sizes: list[int], skip: int) -> list[np.ndarray | None]:
    """An insert's buffers, one per entry: none for the ``skip`` first (no bytes), then
    views of ``data``, the rest's bytes back to back."""
    return [None] * skip + _split(data, sizes[skip:])


def _split(data: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    # Python ints, not a numpy cumsum: slicing with numpy scalars costs twice as much
    # (0.86 against 0.43 ms for 2 048 entries).
    out: list[np.ndarray] = []
    at = 0
    for n in sizes:
        out.append(data[at:at + n])
        at += n
    return out


def _hidden_bytes(hidden: torch.Tensor) -> tuple[np.ndarray, bytes]:
    """The hidden tensor's bytes and the meta that rebuilds it: any shape, a KV dtype
    or int64/int32/int16/bool/float64 (e.g. the first token, ``torch.tensor([tok])``)."""
    if not isinstance(hidden, torch.Tensor):
        raise InvalidRequestError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    t = hidden.detach().cpu().contiguous()
    name = dtype_name(t.dtype, hidden=True)
    meta = msgpack.packb({"hidden": 1, "dtype": name, "shape": list(t.shape)})
    return t.reshape(-1).view(torch.uint8).numpy(), meta


def _hidden_tensor(raw: np.ndarray, meta: bytes) -> torch.Tensor | None:
    try:
        info = msgpack.unpackb(meta, raw=False)
        dtype = getattr(torch, dtype_name(info["dtype"], hidden=True))
        return torch.from_numpy(raw.copy()).view(dtype).reshape(info["shape"])
    except Exception as exc:  # noqa: BLE001 - bad meta means the entry is unusable
        raise ChecksumError(f"hidden entry has unusable meta: {exc}") from None


def _strided_runs(new: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """``(offset in data, entry bytes, arena offset)`` entries as runs ``(offset in data,
    entry bytes, first arena offset, arena step, count)``: consecutive entries of one
    size, back to back in data, each the same step after the last in the arena."""
    runs: list[tuple[int, int, int, int, int]] = []
    for at, n, arena in new:
        if runs:
            r_at, r_n, r_arena, step, count = runs[-1]
            gap = arena - (r_arena + (count - 1) * step)
            if n == r_n and at == r_at + count * n and gap >= n and (count == 1 or gap == step):
                runs[-1] = (r_at, n, r_arena, gap, count + 1)
                continue
        runs.append((at, n, arena, n, 1))
    return runs


class PendingInsert:
    """``KVStoreClient.begin_insert``'s room in the server's shared arena (the
    client's room or a reservation), filled in parts.

    An entry is ``[layers, 2, tokens, heads, D]``, so layer i of each entry is one
    contiguous slice of it: ``write_layer(data, i)`` copies those slices from
    ``data`` (the prompt's entry bytes from block ``skip_blocks`` on, as ``insert``
    takes them) into the entries' places in the arena, and feeds
    each entry's checksum with them while layers come in order (the checksum is of
    ``data``: what the caller meant to store; the server verifies its arena bytes
    against it, as for any insert, per ``store.verify_commits``). Layer i of a run of
    equal entries that lie back to back in ``data`` and evenly apart in the arena (a
    prompt's blocks, placed together) is one strided copy, not one per entry.
    ``commit(data)`` copies and hashes the layers not done yet and stores them;
    ``abort`` gives the room back. The same ``data`` must be passed each time. Not
    thread-safe: one thread drives it.

    Nothing is written once the room's lease is nearly over (``write_until``,
    time.monotonic()): the server may then give those bytes to another entry. Such
    an insert, or one whose room the server reclaimed meanwhile, is stored whole by
    ``commit`` instead (``insert``: reserve, copy, commit)."""

    def __init__(self, client: KVStoreClient, shm: np.ndarray, rid: int, prompt: _Prompt,
                 placements: list, skip: int, layout: KVLayout, write_until: float,
                 whole: Callable[[np.ndarray], InsertResult],
                 store: Callable[[list[int], float], InsertResult]) -> None:
        self._client, self._shm, self.rid = client, shm, rid
        self._layers = layout.num_layers
        per_token = layout.token_nbytes
        # (offset in data, entry bytes, arena offset) of each entry this insert writes.
        self._new: list[tuple[int, int, int]] = []
        at = 0
        for i in range(skip, len(prompt.counts)):
            n = per_token * prompt.counts[i]
            if placements[i] is not None:
                self._new.append((at, n, placements[i][1]))
            at += n
        self.nbytes = at  # what ``data`` must hold
        self._runs = _strided_runs(self._new)
        self._written: set[int] = set()
        self._sums = [checksummer() for _ in self._new]
        self._hashed = 0  # layers fed to the checksums, in order
        self._moved_s = 0.0
        self._write_until, self._whole, self._store = write_until, whole, store
        self.expired = False  # a layer came after ``write_until``: commit stores it whole
        self.closed = False

    def _check(self, data: np.ndarray) -> np.ndarray:
        flat = np.asarray(data).reshape(-1).view(np.uint8)
        if flat.size < self.nbytes:
            raise InvalidRequestError(f"{flat.size} bytes for an insert of {self.nbytes}")
        return flat

    def write_layer(self, data: np.ndarray, layer: int) -> None:
        if self.closed or self.expired or layer in self._written \
                or not 0 <= layer < self._layers:
            return
        if time.monotonic() >= self._write_until:
            self.expired = True
            return
        flat = self._check(data)
        start = time.perf_counter()
        for at, n, arena, step, count in self._runs:  # one strided copy per run
            part = n // self._layers
            lo = layer * part
            src = as_strided(flat[at + lo:], shape=(count, part), strides=(n, 1),
                             writeable=False)
            dst = as_strided(self._shm[arena + lo:], shape=(count, part), strides=(step, 1))
            dst[...] = src
        self._written.add(layer)
        while self._hashed in self._written:  # a checksum takes its layers in order
            for (at, n, _), summer in zip(self._new, self._sums):
                part = n // self._layers
                summer.update(flat[at + self._hashed * part:
                                   at + (self._hashed + 1) * part].data)
            self._hashed += 1
        self._moved_s += time.perf_counter() - start

    def commit(self, data: np.ndarray) -> InsertResult:
        if self.closed:
            raise InvalidRequestError("this insert is already committed or aborted")
        try:
            flat = self._check(data)
            for layer in range(self._layers):
                self.write_layer(flat, layer)
        except BaseException:
            self.abort()
            raise
        if self.expired:
            self.abort()  # the room is (nearly) the server's again: never store into it
            log.debug("room %s ran out of lease while its layers came: inserting whole",
                      self.rid)
            return self._whole(flat[:self.nbytes])
        self.closed = True
        sums = [summer.intdigest() for summer in self._sums]
        try:
            return self._store(sums, self._moved_s)
        except (LeaseExpiredError, NotFoundError) as exc:
            # The server reclaimed the room meanwhile (nothing stored), or a skipped
            # block is gone (the whole insert then says which).
            log.debug("storing room %s failed (%s): inserting whole", self.rid, exc)
            return self._whole(flat[:self.nbytes])

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._client._abort(self.rid)


def clock_offset(sent: float, now: Any, got: float) -> float | None:
    """The server's wall clock less ours, from a hello sent at ``sent`` and answered
    at ``got`` (our ``time.time()``) whose reply said ``now`` (the server's, taken
    between the two): the round trip's midpoint, which is at most half the round
    trip off. None where that could be more than ``_CLOCK_ERROR_S`` (or ``now`` is
    missing: an older server), and the client then sends no deadline."""
    if not isinstance(now, (int, float)) or isinstance(now, bool) \
            or not math.isfinite(now) or not 0 <= got - sent <= 2 * _CLOCK_ERROR_S:
        return None
    return float(now) - (sent + got) / 2


def _write_until(expires: float, lease_s: float) -> float:
    """When a layer-wise insert stops writing into a room that the server may reclaim
    at ``expires`` (time.monotonic()), ``lease_s`` after it was granted."""
    return expires - min(_WRITE_MARGIN_S, lease_s / 4)


def _room_layout(room: _Room, sizes: list[int]) -> tuple[list[int], list[list]]:
    """Entries of ``sizes`` back to back in ``room``, each page-aligned: their offsets
    from the room's start and their placements ``[tier, offset, nbytes, address]``."""
    offsets, placements, at = [], [], 0
    for n in sizes:
        offsets.append(at)
        placements.append([room.tier, room.offset + at, n,
                           None if room.address is None else room.address + at])
        at += -(-n // room.page) * room.page
    assert at <= room.nbytes  # _take_room measured it
    return offsets, placements
