"""vLLM's v0 lookup-buffer interface, backed by a kvstore-server.

vLLM's v0 ``KVLookupBufferBase`` has three methods, kept here with their exact
signatures and meaning:

* ``insert(input_tokens, roi, key, value, hidden)`` — provider (prefill) side;
* ``drop_select(input_tokens, roi) -> [input_tokens, roi, key, value, hidden]`` —
  consumer (decode) side: the entry is moved here and forgotten there;
  a miss is ``[None] * 5``;
* ``close()``.

Unlike vLLM's old ``SimpleBuffer`` (a local deque matched by "any common prefix"),
an entry lives in the provider node's kvstore-server and is found by the exact
chained keys of the roi-masked tokens: a request never gets another request's
tensors (identical masked tokens name identical KV).

How the v0 tensors are stored. The v0 interface carries arbitrary tensors whose
shapes the consumer does not know in advance, so the key namespace cannot depend
on them. Each masked token's entry holds the token id itself (a fixed 4-byte
"layout", so the consumer can compute the keys from the tokens alone, and the
bytes it gets back are checked against the tokens it asked for); the five tensors
travel as one record in the hidden entry of the prompt's last block
(``kvstore.connector.v0_record``). The paged, per-block KV path is the v1 connector.

Flow control (vLLM's SimpleBuffer blocks the sender while its buffer is full): an
inserted entry is pinned until its consumer drops it, so the store never evicts
an unconsumed entry; when the server is full of them, ``insert`` retries until
``insert_timeout_s`` and then raises ``TierFullError`` (a miss for the writer).

``server`` may also be a cluster's etcd (``etcd://host:port``): both sides then
place the prompt by rendezvous hashing over the registered nodes
(``kvstore.cluster_client``), so neither needs to know which node provides it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import numpy as np
import torch

from kvstore.client import KVStoreClient
from kvstore.cluster_client import ClusterClient, connect
from kvstore.connector.v0_record import decode_record, encode_record
from kvstore.errors import (
    ChecksumError,
    InvalidRequestError,
    KVStoreError,
    MissError,
    TierFullError,
)
from kvstore.hashing import hidden_key, tokens_to_array
from kvstore.layout import KVLayout

log = logging.getLogger(__name__)

# One int32 token id per token: num_layers * 2 (K/V) * kv_heads * head_dim * 1 byte = 4.
_TOKEN_ID_HEADS, _TOKEN_ID_DIM = 1, 2
_POLL_START_S, _POLL_MAX_S = 0.005, 0.1


def token_id_layout(block_tokens: int) -> KVLayout:
    """The fixed layout of the v0 buffer's block entries: 4 bytes (the id) per token."""
    return KVLayout(num_layers=1, kv_heads=_TOKEN_ID_HEADS, head_dim=_TOKEN_ID_DIM,
                    dtype="uint8", block_tokens=block_tokens)


class _Masked(NamedTuple):
    ids: np.ndarray  # int32 ids of the roi-masked tokens
    keys: list[bytes]  # their block keys, then the record (hidden) key


class KVStoreLookupBuffer:
    """A v0 lookup buffer over one kvstore-server (the provider node's).

    ``server``: the provider's server address (``tcp://``), or the cluster's etcd
    (``etcd://``, with the servers' ``cluster_prefix``), on both sides. ``model_id``
    and ``salt`` separate models/tenants sharing a server. ``select_timeout_s`` bounds
    how long ``drop_select`` waits for the provider before answering a miss.
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
        self._client: KVStoreClient | ClusterClient = connect(
            server, token_id_layout(block_tokens), prefix=cluster_prefix,
            model_id=f"v0-lookup-buffer/{model_id}", salt=salt, timeout_s=timeout_s,
            **client_opts)

    # ------------------------------------------------------------ provider
    def insert(self, input_tokens: torch.Tensor, roi: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store the five tensors under the roi-masked tokens (provider side)."""
        masked = self._masked(input_tokens, roi)
        record = encode_record([input_tokens, roi, key, value, hidden])
        deadline = time.monotonic() + self.insert_timeout_s
        pause = _POLL_START_S
        while True:
            try:
                # Pinned by the commit itself: a pin sent afterwards raced other
                # writers' room-making, and an evicted entry never reached its consumer.
                self._client.insert(masked.ids, masked.ids.view(np.uint8), hidden=record,
                                    pin=self.hold_until_consumed)
                break
            except TierFullError:
                self.full_waits += 1
                # Full of unconsumed (pinned) entries: wait for consumers to drain it.
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TierFullError(f"server stayed full for {self.insert_timeout_s}s; "
                                        f"{masked.ids.size} tokens not inserted") from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, _POLL_MAX_S)

    # ------------------------------------------------------------ consumer
    def drop_select(self, input_tokens: torch.Tensor,
                    roi: torch.Tensor | None) -> list[torch.Tensor | None]:
        """``[input_tokens, roi, key, value, hidden]`` as inserted, moved to this
        process and dropped from the server; ``[None] * 5`` after ``select_timeout_s``
        without an entry for exactly these masked tokens, or on any miss."""
        masked = self._masked(input_tokens, roi)  # bad input raises InvalidRequestError
        device = input_tokens.device if isinstance(input_tokens, torch.Tensor) else "cpu"
        try:
            if not self._wait_for(masked):
                return [None] * 5
            return self._take(masked, device)
        except MissError as exc:
            log.info("lookup buffer miss for %d tokens: %s", masked.ids.size, exc)
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
            if got.matched_tokens != masked.ids.size or got.hidden is None:
                # Another consumer of the same tokens took part of it first.
                return [None] * 5
            if not np.array_equal(got.kv.numpy().view("<i4"), masked.ids):
                raise ChecksumError("stored token ids differ from the requested ones")
            return [None if t is None else t.to(device) for t in decode_record(got.hidden)]
        finally:
            if self.hold_until_consumed:
                self._unpin(self._consumed_keys(masked, got.matched_tokens, got.hidden))

    def _consumed_keys(self, masked: _Masked, matched_tokens: int,
                       hidden: torch.Tensor | None) -> list[bytes]:
        """The keys whose pending count this drop_select took: their writer's pin is ours
        to release. Keys nobody dropped keep their pins (another consumer's)."""
        nblocks = -(-matched_tokens // self._client.layout.block_tokens)
        return [*masked.keys[:nblocks], *([masked.keys[-1]] if hidden is not None else [])]

    def _unpin(self, keys: list[bytes]) -> None:
        # drop_select brought pending to 0; the pin kept the entry; unpinning frees it.
        if not keys:
            return
        try:
            self._client.unpin(keys)
        except KVStoreError as exc:  # already gone (cleared, or not pinned by its writer)
            log.debug("unpin after drop_select: %s", exc)

    # ---------------------------------------------------------------- common
    def _masked(self, input_tokens: Any, roi: Any) -> _Masked:
        tokens = torch.as_tensor(input_tokens).detach().cpu().reshape(-1)
        if roi is not None:
            mask = torch.as_tensor(roi).detach().cpu().reshape(-1).bool()
            if mask.numel() != tokens.numel():
                raise InvalidRequestError(f"roi has {mask.numel()} entries for "
                                          f"{tokens.numel()} tokens")
            tokens = tokens[mask]
        if tokens.numel() == 0:
            raise InvalidRequestError("no tokens selected by roi")
        ids = tokens_to_array(tokens.numpy()).copy()
        keys = self._client.keys_for(ids)
        return _Masked(ids, [*keys, hidden_key(keys[-1])])

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> KVStoreLookupBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
