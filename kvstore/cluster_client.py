"""ClusterClient: the KVStoreClient API over every node registered in etcd.

Producers and consumers know only the etcd address. Each prompt is placed by
rendezvous hashing of its *placement key*: the chained key of block
``min(P, nblocks) - 1``. Since a block key names the whole prefix up to it, every
prompt that shares its first P blocks has the same home node:

* P = 1 (default): prompts that share a system prompt of at least one block land on
  one node, so ``get`` finds their common prefix there (prefix hits), at the price
  of that node carrying every prompt of a popular system prompt;
* larger P spreads such prompts over the nodes, but a prefix shorter than P blocks
  is found only when the rest of the prompt also matches.

A producer and a consumer with the same node list compute the same home without
talking. When a node fails a call (unavailable, timed out, TE error) it is
forgotten (``NodeSet.forget``) and:

* inserts retry on the next node of the rendezvous order, so new work goes to the
  live nodes;
* reads retry on the next node while their deadline allows (a producer may have
  failed over there) and otherwise report a miss (``matched_tokens == 0``): a dead
  node's entries are recomputed, never waited for beyond the bound.

A node that comes back (with its NVMe tier) registers again, wins its prompts
back, and its surviving entries are found again. Nothing is replicated.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvstore.client import InsertResult, KVStoreClient, LookupResult, SelectResult
from kvstore.cluster import NodeInfo, NodeSet
from kvstore.config import ClientConfig
from kvstore.datapath import TeEngine
from kvstore.errors import InvalidRequestError, KVTimeoutError, PeerUnavailableError, TransferError
from kvstore.etcd import EtcdClient
from kvstore.hashing import block_keys, namespace_of, tokens_to_array
from kvstore.layout import KVLayout

log = logging.getLogger(__name__)

# What a node failure looks like from here; anything else is the request's own fault
# (bad input, tier full, checksum) and is raised as KVStoreClient would.
NODE_FAILURES = (PeerUnavailableError, KVTimeoutError, TransferError)
T = TypeVar("T")


class ClusterClient:
    """Places prompts on the nodes under ``prefix`` in etcd; one KVStoreClient per node.

    ``client_opts`` go to each per-node ``KVStoreClient`` (same_node, CURVE keys,
    ...), except ``te_host`` and ``staging_bytes``: they make the one ``TeEngine``
    (TE engine + registered staging buffer) every per-node client shares, since each
    engine registers its own memory and busy-waits its own threads. A ``te_engine``
    given instead is used as is (and left open: its creator closes it).
    Thread-safe per call, like KVStoreClient (the shared staging buffer serialises
    the transfers themselves).
    """

    def __init__(self, etcd: str, layout: KVLayout, model_id: str = "default",
                 tp_rank: int = 0, tp_size: int = 1, salt: bytes | str = b"",
                 prefix: str = "/kvstore/nodes/", placement_blocks: int = 1,
                 pp_rank: int = 0, pp_size: int = 1,
                 timeout_s: float = 10.0, refresh_s: float = 1.0, forget_s: float = 10.0,
                 **client_opts: Any) -> None:
        if placement_blocks < 1:
            raise InvalidRequestError(f"placement_blocks must be >= 1, got {placement_blocks}")
        self.layout = layout
        self.placement_blocks = placement_blocks
        self.timeout_s = timeout_s
        self._ns_args = dict(model_id=model_id, tp_rank=tp_rank, tp_size=tp_size, salt=salt,
                             pp_rank=pp_rank, pp_size=pp_size)
        self.namespace = namespace_of(layout=layout, **self._ns_args)
        cfg = client_opts.get("config") or ClientConfig()
        te_host = client_opts.pop("te_host", None) or cfg.te_host
        staging_bytes = client_opts.pop("staging_bytes", None) or cfg.staging_bytes
        shared = client_opts.pop("te_engine", None)
        self._owns_engine = shared is None
        self.te_engine = shared or TeEngine(te_host, staging_bytes, timeout_s)
        self._client_args = dict(layout=layout, model_id=model_id, tp_rank=tp_rank,
                                 tp_size=tp_size, salt=salt, pp_rank=pp_rank,
                                 pp_size=pp_size, timeout_s=timeout_s,
                                 te_engine=self.te_engine, **client_opts)
        self.nodes = NodeSet(EtcdClient(etcd, timeout_s=min(timeout_s, 2.0)), prefix,
                             refresh_s=refresh_s, forget_s=forget_s).watch()
        self._clients: dict[str, tuple[NodeInfo, KVStoreClient]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ placement
    def _namespace(self, scope: bytes | str) -> bytes:
        if not scope:
            return self.namespace
        return namespace_of(layout=self.layout, scope=scope, **self._ns_args)

    def placement_key(self, tokens: Sequence[int] | np.ndarray,
                      scope: bytes | str = b"") -> bytes:
        arr = tokens_to_array(tokens)
        if arr.size == 0:
            raise InvalidRequestError("empty prompt")
        keys = block_keys(self._namespace(scope), arr, self.layout.block_tokens).keys
        return keys[min(self.placement_blocks, len(keys)) - 1]

    def placement(self, tokens: Sequence[int] | np.ndarray,
                  scope: bytes | str = b"") -> list[NodeInfo]:
        """Live nodes in the order this prompt tries them; the first is its home."""
        return self.nodes.order(self.placement_key(tokens, scope))

    def keys_for(self, tokens: Sequence[int] | np.ndarray,
                 scope: bytes | str = b"") -> list[bytes]:
        """The prompt's chained block keys (as KVStoreClient.keys_for; no node needed)."""
        return block_keys(self._namespace(scope), tokens_to_array(tokens),
                          self.layout.block_tokens).keys

    def client_for(self, node: NodeInfo) -> KVStoreClient:
        """The (lazily made) client of ``node``; remade when its address changed."""
        with self._lock:
            known = self._clients.get(node.node_id)
            if known is not None and known[0].address == node.address:
                return known[1]
            client = KVStoreClient(node.address, **self._client_args)
            self._clients[node.node_id] = (node, client)
        if known is not None:
            known[1].close()
        return client

    # ------------------------------------------------------------ data API
    def insert(self, tokens: Sequence[int] | np.ndarray, kv: Any, hidden: Any = None,
               pin: bool = False, scope: bytes | str = b"",
               skip_blocks: int = 0) -> InsertResult:
        """Insert on the prompt's home node; on a node failure, on the next live one
        (which, lacking the ``skip_blocks`` the caller found, stores nothing)."""
        order = self.placement(tokens, scope)
        for attempt, node in enumerate(order):
            try:
                return self.client_for(node).insert(tokens, kv, hidden, pin=pin, scope=scope,
                                                    skip_blocks=skip_blocks)
            except NODE_FAILURES as exc:
                self._node_failed(node, exc)
                if attempt == len(order) - 1:
                    raise
        raise AssertionError("unreachable: order is never empty")

    def drop_select(self, tokens: Sequence[int] | np.ndarray, timeout: float | None = None,
                    into: Any = None, scope: bytes | str = b"",
                    skip_blocks: int = 0) -> SelectResult:
        return self._read(tokens, timeout,
                          lambda c, t: c.drop_select(tokens, timeout=t, into=into, scope=scope,
                                                     skip_blocks=skip_blocks),
                          SelectResult(0, None, None), scope)

    def get(self, tokens: Sequence[int] | np.ndarray, timeout: float | None = None,
            into: Any = None, scope: bytes | str = b"", skip_blocks: int = 0) -> SelectResult:
        return self._read(tokens, timeout,
                          lambda c, t: c.get(tokens, timeout=t, into=into, scope=scope,
                                             skip_blocks=skip_blocks),
                          SelectResult(0, None, None), scope)

    def lookup(self, tokens: Sequence[int] | np.ndarray, scope: bytes | str = b"",
               timeout_s: float | None = None) -> LookupResult:
        return self._read(tokens, timeout_s,
                          lambda c, t: c.lookup(tokens, scope=scope, timeout_s=t),
                          LookupResult(0, 0, []), scope)

    def pin(self, keys: Sequence[bytes]) -> Any:
        """Pin on the home node of the prompt whose chain ``keys`` starts with (a
        prompt's ``keys_for``, optionally followed by its hidden key when P == 1)."""
        return self._on_home_of(keys, lambda c: c.pin(keys))

    def unpin(self, keys: Sequence[bytes]) -> Any:
        return self._on_home_of(keys, lambda c: c.unpin(keys))

    def _on_home_of(self, keys: Sequence[bytes], call: Callable[[KVStoreClient], T]) -> T:
        if not keys:
            raise InvalidRequestError("no keys given")
        node = self.nodes.home(keys[min(self.placement_blocks, len(keys)) - 1])
        try:
            return call(self.client_for(node))
        except NODE_FAILURES as exc:
            self._node_failed(node, exc)
            raise

    def _read(self, tokens: Any, timeout: float | None,
              call: Callable[[KVStoreClient, float], T], miss: T,
              scope: bytes | str = b"") -> T:
        """``call`` on the home node; a failed node is forgotten and the next one tried
        while time is left; a miss once the deadline passes or no node is left."""
        deadline = time.monotonic() + (timeout or self.timeout_s)
        try:
            order = self.placement(tokens, scope)
        except PeerUnavailableError as exc:  # no node registered, or etcd unreachable
            log.warning("read is a miss: %s", exc)
            return miss
        for node in order:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return call(self.client_for(node), left)
            except NODE_FAILURES as exc:
                self._node_failed(node, exc)
        return miss

    def _node_failed(self, node: NodeInfo, exc: Exception) -> None:
        log.warning("node %s (%s) failed: %s; forgetting it", node.node_id, node.address, exc)
        self.nodes.forget(node.node_id)

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self.nodes.close()
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for _, client in clients:
            client.close()
        if self._owns_engine:
            self.te_engine.close()  # after its clients: none of them is moving bytes now

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str, layout: KVLayout, prefix: str | None = None,
            **opts: Any) -> ClusterClient | KVStoreClient:
    """``etcd://host:port`` -> a ClusterClient of the nodes under ``prefix`` (default
    ``/kvstore/nodes/``); ``tcp://host:port`` -> a KVStoreClient of that one server
    (the explicit-address mode; ``prefix`` means nothing there and is ignored, so a
    caller can pass its configured prefix whichever address it got). ``opts`` go to
    the chosen class."""
    if address.startswith("etcd://"):
        return ClusterClient(address, layout, **({"prefix": prefix} if prefix else {}), **opts)
    if not address.startswith("tcp://"):
        raise InvalidRequestError(f"server address must be tcp://host:port or "
                                  f"etcd://host:port, got {address!r}")
    return KVStoreClient(address, layout=layout, **opts)
