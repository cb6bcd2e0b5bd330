"""ClusterClient: the KVStoreClient API over every node registered in etcd.

Producers and consumers know only the etcd address. Each prompt is placed by
rendezvous hashing of its *placement key* (kvstore.cluster.placement): the chained
key of its last block before the block holding its last token, at most P blocks
deep (``placement_blocks``, config ``cluster.placement_blocks``). All of a prompt's
blocks and its hidden entry go to that one node:

* prompts that share a system prompt or chat template but not their tails have
  different homes, so a popular template no longer loads one node (each node ends
  up with its own copy of the template's blocks, deduplicated there);
* lists of one prompt that differ by a token have the same placement unless that
  token opens a block; a read of such a list asks the homes of both neighbours how
  much they hold and reads from the one that holds most, so a consumer asking for
  ``n`` tokens finds a producer's ``n - 1`` (or ``n + 1``);
* lists of at least P + 1 blocks are all placed by their first P blocks: a longer
  or shorter list of a long prompt finds it whatever the lengths. P = 1 is the old
  rule: every prompt under one first block on one node, prefix hits across prompts
  of any length, one hot node per template.

Every client of a cluster must use the same P: a producer and a consumer with the
same node list compute the same home without talking. When a node fails a call
(unavailable, timed out, TE error) it is forgotten (``NodeSet.forget``) and:

* inserts retry on the next node of the rendezvous order, so new work goes to the
  live nodes;
* reads retry on the next node while their deadline allows (a producer may have
  failed over there) and otherwise report a miss (``matched_tokens == 0``): a dead
  node's entries are recomputed, never waited for beyond the bound.

A node that comes back (with its NVMe tier) registers again, wins its prompts
back, and its surviving entries are found again. Nothing is replicated.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvstore.client.client import InsertResult, KVStoreClient, LookupResult, SelectResult
from kvstore.cluster.membership import NodeInfo, NodeSet
from kvstore.cluster.placement import key_at, placement_keys
from kvstore.core.config import client_config_from_env, load_config, seconds
from kvstore.client.datapath import TeEngine
from kvstore.core.errors import (InvalidRequestError, KVTimeoutError, NotFoundError,
                                 PeerUnavailableError, TransferError)
from kvstore.cluster.etcd import EtcdClient
from kvstore.core.hashing import block_keys, namespace_of, tokens_to_array
from kvstore.core.layout import KVLayout

log = logging.getLogger(__name__)

# What a node failure looks like from here; anything else is the request's own fault
# (bad input, tier full, checksum) and is raised as KVStoreClient would.
NODE_FAILURES = (PeerUnavailableError, KVTimeoutError, TransferError)
T = TypeVar("T")


class ClusterClient:
    """Places prompts on the nodes under ``prefix`` in etcd; one KVStoreClient per node.

    ``placement_blocks``: P of the placement rule (module doc); None takes
    ``cluster.placement_blocks`` from ``KVSTORE_CLUSTER_PLACEMENT_BLOCKS`` or its
    default, as ``prefix`` None takes ``cluster.prefix`` (``KVSTORE_CLUSTER_PREFIX``).
    ``timeout_s`` None: the client config's (``config=``, else
    ``KVSTORE_CLIENT_TIMEOUT_S``, else 10 s). ``client_opts`` go to each per-node ``KVStoreClient`` (same_node, CURVE
    keys, ...), except ``te_host`` and ``staging_bytes``: they make the one ``TeEngine``
    (TE engine + registered staging buffer) every per-node client shares, since each
    engine registers its own memory and busy-waits its own threads. A ``te_engine``
    given instead is used as is (and left open: its creator closes it).
    Thread-safe per call, like KVStoreClient (the shared staging buffer serialises
    the transfers themselves).
    """

    def __init__(self, etcd: str, layout: KVLayout, model_id: str = "default",
                 tp_rank: int = 0, tp_size: int = 1, salt: bytes | str = b"",
                 prefix: str | None = None, placement_blocks: int | None = None,
                 pp_rank: int = 0, pp_size: int = 1,
                 timeout_s: float | None = None, refresh_s: float = 1.0,
                 forget_s: float = 10.0, **client_opts: Any) -> None:
        if placement_blocks is None or prefix is None:  # KVSTORE_CLUSTER_*, else defaults
            cluster = load_config(sections=("cluster",)).cluster
            if placement_blocks is None:
                placement_blocks = cluster.placement_blocks
            if prefix is None:
                prefix = cluster.prefix
        if placement_blocks < 1:
            raise InvalidRequestError(f"placement_blocks must be >= 1, got {placement_blocks}")
        self.layout = layout
        self.placement_blocks = placement_blocks
        cfg = client_opts.get("config") or client_config_from_env()  # else KVSTORE_CLIENT_*
        self.timeout_s = timeout_s = seconds(cfg.timeout_s if timeout_s is None else timeout_s,
                                             "timeout_s")
        self._namespace_of = functools.partial(
            namespace_of, model_id=model_id, tp_rank=tp_rank, tp_size=tp_size, salt=salt,
            pp_rank=pp_rank, pp_size=pp_size)
        self.namespace = self._namespace_of(layout=layout)
        te_host = client_opts.pop("te_host", None) or cfg.te_host
        staging_bytes = client_opts.pop("staging_bytes", None) or cfg.staging_bytes
        # The TE settings configure the one engine every node's client shares.
        te_protocol = client_opts.pop("te_protocol", None) or cfg.te_protocol
        te_devices = client_opts.pop("te_devices", None) or cfg.te_devices
        shared = client_opts.pop("te_engine", None)
        self._owns_engine = shared is None
        self.te_engine = shared or TeEngine(te_host, staging_bytes, timeout_s,
                                            te_protocol, te_devices, cfg.te_piece_bytes,
                                            cfg.te_wait)
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
        return self._namespace_of(layout=self.layout, scope=scope)

    def placement_key(self, tokens: Sequence[int] | np.ndarray,
                      scope: bytes | str = b"") -> bytes:
        """The key whose rendezvous order places ``tokens`` (kvstore.cluster.placement)."""
        return self._placement_keys(tokens, scope)[0]

    def placement(self, tokens: Sequence[int] | np.ndarray,
                  scope: bytes | str = b"") -> list[NodeInfo]:
        """Live nodes in the order this prompt tries them; the first is its home."""
        return self.nodes.order(self.placement_key(tokens, scope))

    def _placement_keys(self, tokens: Sequence[int] | np.ndarray,
                        scope: bytes | str) -> list[bytes]:
        """Its own placement key, then those of the lists one token shorter or longer
        where they differ (kvstore.cluster.placement)."""
        arr = tokens_to_array(tokens)
        if arr.size == 0:
            raise InvalidRequestError("empty prompt")
        return placement_keys(self._namespace(scope), arr, self.layout.block_tokens,
                              self.placement_blocks)

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
                          LookupResult(0, 0, []), scope, probe_answers=True)

    def pin(self, keys: Sequence[bytes]) -> Any:
        """Pin on the node holding the prompt whose chain ``keys`` is (a prompt's
        ``keys_for``, optionally followed by its hidden key)."""
        return self._on_holder_of(keys, lambda c: c.pin(keys))

    def unpin(self, keys: Sequence[bytes]) -> Any:
        return self._on_holder_of(keys, lambda c: c.unpin(keys))

    def _on_holder_of(self, keys: Sequence[bytes], call: Callable[[KVStoreClient], T]) -> T:
        """``call`` on the first node that holds every key: the chain's home with and
        without a trailing hidden key first, then the others (a scoped or failed-over
        prompt). Only a node that stores the prompt holds its whole chain."""
        if not keys:
            raise InvalidRequestError("no keys given")
        depths = dict.fromkeys(min(self.placement_blocks, len(keys) - drop)
                               for drop in (1, 2) if len(keys) - drop >= 0)
        orders = [self.nodes.order(key_at(d, keys, self.namespace)) for d in depths]
        nodes = {o[0].node_id: o[0] for o in orders}  # the homes first, then the rest
        for node in orders[0]:
            nodes.setdefault(node.node_id, node)
        missing: NotFoundError | None = None
        for node in nodes.values():
            try:
                return call(self.client_for(node))
            except NotFoundError as exc:
                missing = exc
            except NODE_FAILURES as exc:
                self._node_failed(node, exc)
                raise
        assert missing is not None  # nodes is never empty: order() raises first
        raise missing

    def _read(self, tokens: Any, timeout: float | None,
              call: Callable[[KVStoreClient, float], T], miss: T,
              scope: bytes | str = b"", probe_answers: bool = False) -> T:
        """``call`` on the node that holds ``tokens`` (``_route``); a failed node is
        forgotten and the next one tried while time is left; a miss once the deadline
        passes or no node is left. ``probe_answers``: ``call`` is a lookup, so the
        route's own lookup is the answer."""
        deadline = time.monotonic() + (self.timeout_s if timeout is None else
                                       seconds(timeout, "timeout", InvalidRequestError))
        try:
            order, probed = self._route(tokens, scope, deadline)
        except PeerUnavailableError as exc:  # no node registered, or etcd unreachable
            log.warning("read is a miss: %s", exc)
            return miss
        if probe_answers and probed is not None:
            return probed  # type: ignore[return-value]  # call is a lookup
        for node in order:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return call(self.client_for(node), left)
            except NODE_FAILURES as exc:
                self._node_failed(node, exc)
        return miss

    def _route(self, tokens: Any, scope: bytes | str,
               deadline: float) -> tuple[list[NodeInfo], LookupResult | None]:
        """The nodes to read ``tokens`` from, in order, and the lookup that chose them.

        Its home and failover order, unless a list one token shorter or longer has
        another home (the token opens a block): then whichever of those homes holds
        most of it (one lookup each; ties go to its own) comes first."""
        keys = self._placement_keys(tokens, scope)
        order = self.nodes.order(keys[0])
        homes = {order[0].node_id: order[0]}
        for key in keys[1:]:
            home = self.nodes.home(key)
            homes.setdefault(home.node_id, home)
        if len(homes) == 1:
            return order, None
        best: tuple[NodeInfo, LookupResult] | None = None
        for node in homes.values():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                held = self.client_for(node).lookup(tokens, scope=scope, timeout_s=left)
            except NODE_FAILURES as exc:
                self._node_failed(node, exc)
                continue
            if best is None or held.matched_tokens > best[1].matched_tokens:
                best = node, held
        if best is None:  # every home failed: what is left of the failover order
            return self.nodes.order(keys[0]), None
        return [best[0], *(n for n in self.nodes.order(keys[0]) if n != best[0])], best[1]

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
        if prefix:  # a parameter of its own, so never also in opts
            opts["prefix"] = prefix
        return ClusterClient(address, layout, **opts)
    if not address.startswith("tcp://"):
        raise InvalidRequestError(f"server address must be tcp://host:port or "
                                  f"etcd://host:port, got {address!r}")
    return KVStoreClient(address, layout=layout, **opts)
