"""vLLM's v0 lookup-buffer interface, backed by a kvstore-server.

vLLM's v0 ``KVLookupBufferBase`` has three methods, kept here with their exact
signatures and meaning:

* ``insert(input_tokens, roi, key, value, hidden)`` — provider (prefill) side;
* ``drop_select(input_tokens, roi) -> [input_tokens, roi, key, value, hidden]`` —
  consumer (decode) side: the entry is moved here and forgotten there;
  a miss is ``[None] * 5``;
* ``close()``.

What vLLM's v0 callers can handle, and so what each call may do: ``drop_select``
answers a miss (``[None] * 5``, vLLM recomputes) for every failure of the store or
the network, and ``insert`` never raises one (vLLM's ``SimpleBuffer.insert`` cannot
fail either: it blocks while full). Both raise ``InvalidRequestError`` for bad input
(an ``roi`` that does not match the tokens, no token selected, ids outside int32),
which is a bug in the caller, not something to recompute.

Unlike vLLM's old ``SimpleBuffer`` (a local deque matched by "any common prefix"),
an entry lives in the provider node's kvstore-server and is found by the exact
chained keys of the roi-masked tokens: a request never gets another request's
tensors (identical masked tokens name identical KV).

"Select any". vLLM's base class lets ``drop_select(None, None)`` pop any entry
(``SimpleBuffer``: "DROP SELECT * LIMIT 1"). An exact-key store has no queue to pop
from, and finding some entry would mean listing the server (an admin scan, not a
request path) — and handing a request KV chosen for no reason. vLLM's own v0
connectors always pass the request's tokens; here ``input_tokens=None`` is a miss,
answered at once, with a warning (once per buffer) and counted in ``select_any_calls``.

How the v0 tensors are stored. The v0 interface carries arbitrary tensors whose
shapes the consumer does not know in advance, so the key namespace cannot depend
on them. Each masked token's entry holds the token id itself (a fixed 4-byte
"layout", so the consumer can compute the keys from the tokens alone, and the
bytes it gets back are checked against the tokens it asked for); the five tensors
travel as one record in the hidden entry of the prompt's last block
(``kvstore.connector.v0_record``). The paged, per-block KV path is the v1 connector.

Records of any size. Across nodes every entry is staged through the client's
registered staging buffer (``staging_bytes``, 256 MiB by default), so one entry must
fit it; a record of a long prompt of a big model (the five tensors together) may not.
A record larger than ``record_part_bytes`` (half the staging buffer) is stored as
parts of that size, each its own small prompt in a separate key namespace (the
prompt's record key and the part's index as its tokens, so no request's tokens can
name a part), committed before the prompt itself, whose record entry then holds only
the parts' sizes (a manifest). A consumer that sees a manifest takes the parts the
same way. A consumer whose own staging buffer is too small for the producer's parts
answers a miss with a warning: give both sides the same ``staging_bytes``.

Flow control (vLLM's SimpleBuffer blocks the sender while its buffer is full): an
inserted entry is pinned until its consumer drops it, so the store never evicts
an unconsumed entry; when the server is full of them, ``insert`` waits up to
``insert_timeout_s`` for consumers to make room. If it is still full then, or the
server cannot be reached, the insert is skipped: logged, counted in
``insert_misses``, and the consumer's ``drop_select`` misses (vLLM recomputes).
Parts already stored for a skipped insert are unpinned, so nothing stays pinned.

``server`` may also be a cluster's etcd (``etcd://host:port``): both sides then
place the prompt by rendezvous hashing over the registered nodes
(``kvstore.cluster.client``), so neither needs to know which node provides it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, NamedTuple

import numpy as np
import torch

from kvstore.client.client import KVStoreClient
from kvstore.cluster.client import ClusterClient, connect
from kvstore.core.config import client_config_from_env
from kvstore.connector.v0_record import (decode_record, encode_manifest, encode_record,
                                         manifest_parts, split_record)
from kvstore.client.datapath import TeEngine
from kvstore.core.errors import (
    ChecksumError,
    InvalidRequestError,
    KVStoreError,
    MissError,
    NotFoundError,
    TierFullError,
)
from kvstore.core.hashing import hidden_key, tokens_to_array
from kvstore.core.layout import KVLayout

log = logging.getLogger(__name__)

# One int32 token id per token: num_layers * 2 (K/V) * kv_heads * head_dim * 1 byte = 4.
_TOKEN_ID_HEADS, _TOKEN_ID_DIM = 1, 2
_POLL_START_S, _POLL_MAX_S = 0.005, 0.1
_INT31 = 0x7FFFFFFF


def token_id_layout(block_tokens: int) -> KVLayout:
    """The fixed layout of the v0 buffer's block entries: 4 bytes (the id) per token."""
    return KVLayout(num_layers=1, kv_heads=_TOKEN_ID_HEADS, head_dim=_TOKEN_ID_DIM,
                    dtype="uint8", block_tokens=block_tokens)


class _Masked(NamedTuple):
    ids: np.ndarray  # int32 ids of the roi-masked tokens
    keys: list[bytes]  # their block keys, then the record (hidden) key


Client = KVStoreClient | ClusterClient


class KVStoreLookupBuffer:
    """A v0 lookup buffer over one kvstore-server (the provider node's).

    ``server``: the provider's server address (``tcp://``), or the cluster's etcd
    (``etcd://``, with the servers' ``cluster_prefix``), on both sides. ``model_id``
    and ``salt`` separate models/tenants sharing a server. ``select_timeout_s`` bounds
    how long ``drop_select`` waits for the provider before answering a miss;
    ``insert_timeout_s`` how long ``insert`` waits for room before skipping.
    ``client_opts`` go to the client (``te_host``, ``te_protocol``, ``te_devices``,
    ``staging_bytes``, ``same_node``, CURVE keys, ...); one TE engine and staging
    buffer serve the whole buffer.
    """

    def __init__(self, server: str, model_id: str = "default", salt: bytes | str = b"",
                 block_tokens: int = 16, select_timeout_s: float = 5.0,
                 insert_timeout_s: float = 30.0, timeout_s: float = 10.0,
                 hold_until_consumed: bool = True, cluster_prefix: str | None = None,
                 **client_opts: Any) -> None:
        if select_timeout_s < 0 or insert_timeout_s < 0:
            raise InvalidRequestError("timeouts must be >= 0")
        self.select_timeout_s = select_timeout_s
        self.insert_timeout_s = insert_timeout_s
        self.hold_until_consumed = hold_until_consumed
        self.full_waits = 0  # inserts that found the server full and waited
        self.insert_misses = 0  # inserts skipped: still full after the wait, or unreachable
        self.select_any_calls = 0  # drop_select(None, ...): answered with a miss
        cfg = client_opts.get("config") or client_config_from_env()  # else KVSTORE_CLIENT_*
        te_host = client_opts.pop("te_host", None) or cfg.te_host
        staging_bytes = client_opts.pop("staging_bytes", None) or cfg.staging_bytes
        protocol = client_opts.pop("te_protocol", None) or cfg.te_protocol
        devices = client_opts.pop("te_devices", None)
        shared = client_opts.pop("te_engine", None)
        self._owns_engine = shared is None
        self._engine = shared or TeEngine(te_host, staging_bytes, timeout_s, protocol,
                                          cfg.te_devices if devices is None else devices,
                                          cfg.te_piece_bytes, cfg.te_wait)
        # Half the staging buffer: a part and its prompt's few small entries always
        # fit one staged move, whatever slack the data path keeps between entries.
        self.record_part_bytes = self._engine.staging_bytes // 2
        self._layout = token_id_layout(block_tokens)
        self._connect_args = dict(server=server, layout=self._layout,
                                  prefix=cluster_prefix, salt=salt, timeout_s=timeout_s,
                                  te_engine=self._engine, **client_opts)
        self._model_id = model_id
        self._client: Client = self._connect(f"v0-lookup-buffer/{model_id}")
        self._parts: Client | None = None  # made when a record first needs parts
        self._parts_lock = threading.Lock()
        self._warned_select_any = False

    def _connect(self, model_id: str) -> Client:
        args = dict(self._connect_args)
        return connect(args.pop("server"), args.pop("layout"), model_id=model_id, **args)

    def _parts_client(self) -> Client:
        """The client of the parts' own namespace: no request's tokens name a part."""
        with self._parts_lock:
            if self._parts is None:
                self._parts = self._connect(f"v0-lookup-buffer/{self._model_id}/record-parts")
            return self._parts

    # ------------------------------------------------------------ provider
    def insert(self, input_tokens: torch.Tensor, roi: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store the five tensors under the roi-masked tokens (provider side).

        Never raises a miss: a server still full after ``insert_timeout_s``, or one
        that cannot be reached, skips the insert (a warning, ``insert_misses``); the
        consumer then misses and recomputes. Bad input: ``InvalidRequestError``."""
        masked = self._masked(input_tokens, roi)
        record = encode_record([input_tokens, roi, key, value, hidden])
        deadline = time.monotonic() + self.insert_timeout_s
        parts: list[np.ndarray] = []  # tokens of the parts stored so far (pinned)
        try:
            if record.numel() > self.record_part_bytes:
                record = self._insert_parts(masked, record, deadline, parts)
            self._insert_until(self._client, masked.ids, record, deadline)
        except MissError as exc:
            self.insert_misses += 1
            log.warning("lookup buffer: insert of %d tokens skipped, its consumer will "
                        "recompute: %s", masked.ids.size, exc)
            if self.hold_until_consumed and parts:
                self._unpin_parts(parts)  # nobody will take them: let the store reclaim them

    def _insert_until(self, client: Client, ids: np.ndarray, record: torch.Tensor,
                      deadline: float) -> None:
        """Insert ``ids`` with ``record``, waiting while the server is full."""
        pause = _POLL_START_S
        while True:
            try:
                # Pinned by the commit itself: a pin sent afterwards raced other
                # writers' room-making, and an evicted entry never reached its consumer.
                client.insert(ids, ids.view(np.uint8), hidden=record,
                              pin=self.hold_until_consumed)
                return
            except TierFullError:
                self.full_waits += 1
                # Full of unconsumed (pinned) entries: wait for consumers to drain it.
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TierFullError(f"server stayed full for {self.insert_timeout_s}s"
                                        ) from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, _POLL_MAX_S)

    def _insert_parts(self, masked: _Masked, record: torch.Tensor, deadline: float,
                      stored: list[np.ndarray]) -> torch.Tensor:
        """Store ``record`` as parts (appending each stored part's tokens to
        ``stored``); returns the manifest that takes its place."""
        pieces = split_record(record, self.record_part_bytes)
        client = self._parts_client()
        for index, piece in enumerate(pieces):
            tokens = _part_tokens(masked, index)
            self._insert_until(client, tokens, piece, deadline)
            stored.append(tokens)
        return encode_manifest([piece.numel() for piece in pieces])

    # ------------------------------------------------------------ consumer
    def drop_select(self, input_tokens: torch.Tensor | None,
                    roi: torch.Tensor | None) -> list[torch.Tensor | None]:
        """``[input_tokens, roi, key, value, hidden]`` as inserted, moved to this
        process and dropped from the server; ``[None] * 5`` after ``select_timeout_s``
        without an entry for exactly these masked tokens, or on any miss.
        ``input_tokens=None`` ("select any") is a miss at once (module docstring)."""
        if input_tokens is None:
            return self._select_any()
        masked = self._masked(input_tokens, roi)  # bad input raises InvalidRequestError
        device = input_tokens.device if isinstance(input_tokens, torch.Tensor) else "cpu"
        try:
            if not self._wait_for(masked):
                return [None] * 5
            return self._take(masked, device)
        except MissError as exc:
            log.info("lookup buffer miss for %d tokens: %s", masked.ids.size, exc)
            return [None] * 5

    def _select_any(self) -> list[torch.Tensor | None]:
        self.select_any_calls += 1
        if not self._warned_select_any:
            self._warned_select_any = True
            log.warning("lookup buffer: drop_select without input_tokens ('select any') "
                        "is always a miss here: entries are found by their exact tokens")
        return [None] * 5

    def _wait_for(self, masked: _Masked) -> bool:
        """Poll (bounded) until every masked token is stored; never binds anything."""
        deadline = time.monotonic() + self.select_timeout_s
        pause = _POLL_START_S
        while True:
            if self._client.lookup(masked.ids).matched_tokens == masked.ids.size:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)

    def _take(self, masked: _Masked, device: torch.device | str) -> list[torch.Tensor | None]:
        got = self._client.drop_select(masked.ids)
        try:
            if got.matched_tokens != masked.ids.size or got.kv is None or got.hidden is None:
                # Another consumer of the same tokens took part of it first.
                return [None] * 5
            if not np.array_equal(got.kv.numpy().view("<i4"), masked.ids):
                raise ChecksumError("stored token ids differ from the requested ones")
            record = got.hidden
            sizes = manifest_parts(record)
            if sizes is not None:
                record = self._take_parts(masked, sizes)
            return [None if t is None else t.to(device) for t in decode_record(record)]
        finally:
            if self.hold_until_consumed:
                self._unpin(self._client,
                            self._consumed_keys(masked, got.matched_tokens, got.hidden))

    def _take_parts(self, masked: _Masked, sizes: list[int]) -> torch.Tensor:
        """The record whose manifest this consumer took: its parts, joined."""
        client = self._parts_client()
        tokens = [_part_tokens(masked, index) for index in range(len(sizes))]
        pieces = []
        try:
            for index, (ids, size) in enumerate(zip(tokens, sizes)):
                got = self._take_part(client, ids, size)
                if got is None:
                    raise NotFoundError(f"record part {index + 1} of {len(sizes)} is missing")
                pieces.append(got)
        finally:
            # The manifest makes every part ours: release the writer's pin on each,
            # taken or not, so no part of a record stays pinned once its manifest is gone.
            if self.hold_until_consumed:
                self._unpin_parts(tokens)
        return torch.cat(pieces)

    def _take_part(self, client: Client, ids: np.ndarray, size: int) -> torch.Tensor | None:
        try:
            got = client.drop_select(ids)
        except InvalidRequestError as exc:
            # Our own, valid tokens: the part is larger than this consumer's staging
            # buffer (the producer's staging_bytes is bigger than ours).
            log.warning("lookup buffer: a record part of %d bytes cannot be read here (%s); "
                        "give producer and consumer the same staging_bytes", size, exc)
            raise NotFoundError(f"record part of {size} bytes does not fit: {exc}") from None
        if got.matched_tokens != ids.size or got.kv is None or got.hidden is None:
            return None
        if got.hidden.numel() != size or not np.array_equal(got.kv.numpy().view("<i4"), ids):
            raise ChecksumError("a record part differs from its manifest")
        return got.hidden.reshape(-1)

    def _consumed_keys(self, masked: _Masked, matched_tokens: int,
                       hidden: torch.Tensor | None) -> list[bytes]:
        """The keys whose pending count this drop_select took: their writer's pin is ours
        to release. Keys nobody dropped keep their pins (another consumer's)."""
        nblocks = -(-matched_tokens // self._layout.block_tokens)
        return [*masked.keys[:nblocks], *([masked.keys[-1]] if hidden is not None else [])]

    def _unpin_parts(self, tokens: list[np.ndarray]) -> None:
        # One call per part: over a cluster each part has its own home node. A part
        # is at least half a staging buffer, so the round trip is noise beside it.
        client = self._parts_client()
        for ids in tokens:
            keys = client.keys_for(ids)
            self._unpin(client, [*keys, hidden_key(keys[-1])])

    @staticmethod
    def _unpin(client: Client, keys: list[bytes]) -> None:
        # drop_select brought pending to 0; the pin kept the entry; unpinning frees it.
        if not keys:
            return
        try:
            client.unpin(keys)
        except KVStoreError as exc:  # already gone (cleared, or not pinned by its writer)
            log.debug("unpin after drop_select: %s", exc)

    # ---------------------------------------------------------------- common
    def _masked(self, input_tokens: Any, roi: Any) -> _Masked:
        if input_tokens is None:
            raise InvalidRequestError("input_tokens is required")
        try:
            tokens = torch.as_tensor(input_tokens).detach().cpu().reshape(-1)
            mask = None if roi is None else torch.as_tensor(roi).detach().cpu().reshape(-1)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidRequestError(f"input_tokens / roi are not tensors: {exc}") from None
        if mask is not None:
            if mask.numel() != tokens.numel():
                raise InvalidRequestError(f"roi has {mask.numel()} entries for "
                                          f"{tokens.numel()} tokens")
            tokens = tokens[mask.bool()]
        if tokens.numel() == 0:
            raise InvalidRequestError("no tokens selected by roi")
        ids = tokens_to_array(tokens.numpy()).copy()
        keys = self._client.keys_for(ids)
        return _Masked(ids, [*keys, hidden_key(keys[-1])])

    def close(self) -> None:
        self._client.close()
        if self._parts is not None:
            self._parts.close()
        if self._owns_engine:
            self._engine.close()  # after its clients: none of them is moving bytes now

    def __enter__(self) -> KVStoreLookupBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _part_tokens(masked: _Masked, index: int) -> np.ndarray:
    """The tokens a record part is stored under: its index, then the prompt's record
    key as four 31-bit ids (distinct per prompt and part; token ids are int32 >= 0)."""
    words = np.frombuffer(masked.keys[-1], dtype="<u4") & _INT31
    return np.concatenate(([index], words)).astype("<i4")
