"""Cluster membership through etcd, and placement of prompts on nodes.

Each ``kvstore-server`` started with ``--cluster etcd://...`` registers a
``NodeInfo`` under ``<prefix><node_id>`` attached to an etcd lease it keeps
alive; when the server dies the lease expires and the key disappears. Clients
watch the prefix and place each prompt by rendezvous (highest-random-weight)
hashing of its placement key, so producers and consumers agree on a prompt's home
node without talking to each other, and a node joining or leaving moves only the
prompts whose winner changed.

No membership protocol of our own: etcd's leases are the failure detector.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import xxhash

from kvstore.core.errors import ConfigError, KVStoreError, PeerUnavailableError
from kvstore.cluster.etcd import EtcdClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str  # control plane, tcp://host:port
    te_segment: str
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> capacity bytes
    started: float = 0.0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> NodeInfo:
        try:
            raw = json.loads(data)
            return cls(node_id=str(raw["node_id"]), address=str(raw["address"]),
                       te_segment=str(raw["te_segment"]),
                       tiers={str(k): int(v) for k, v in raw.get("tiers", {}).items()},
                       started=float(raw.get("started", 0.0)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"malformed node record: {exc}") from exc


def rendezvous_order(placement_key: bytes, node_ids: Sequence[str]) -> list[str]:
    """Node ids by descending weight for ``placement_key``; the first is its home."""
    weight = xxhash.xxh3_64_intdigest
    return sorted(node_ids, key=lambda n: (weight(n.encode() + b"\x00" + placement_key), n),
                  reverse=True)


class Registration:
    """Keeps ``info`` registered in etcd under a lease until ``close``.

    A keepalive thread refreshes the lease every ttl/3; if etcd forgot the lease
    (it expired while etcd was unreachable) a new one is granted and the key put
    again, so a node that was partitioned re-appears once it can talk to etcd.
    """

    def __init__(self, etcd: EtcdClient, prefix: str, info: NodeInfo, ttl_s: int) -> None:
        self.etcd, self.info, self.ttl_s = etcd, info, ttl_s
        self.key = (prefix + info.node_id).encode()
        self._stop = threading.Event()
        self.lease = self._register()
        self._thread = threading.Thread(target=self._keepalive_loop, name="etcd-keepalive",
                                        daemon=True)
        self._thread.start()

    def _register(self) -> int:
        lease = self.etcd.grant(self.ttl_s)
        self.etcd.put(self.key, self.info.encode(), lease)
        log.info("registered %s in etcd %s (lease %x, ttl %ss)", self.key.decode(),
                 self.etcd.base, lease, self.ttl_s)
        return lease

    def _keepalive_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.etcd.keepalive(self.lease) <= 0:
                    log.warning("etcd lease %x expired; registering again", self.lease)
                    self.lease = self._register()
            except KVStoreError as exc:
                log.warning("etcd keepalive failed: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.ttl_s)
        try:
            self.etcd.revoke(self.lease)
        except KVStoreError as exc:
            log.warning("could not revoke etcd lease on close: %s", exc)


class NodeSet:
    """The live nodes under an etcd prefix, refreshed at most every ``refresh_s``.

    Synchronous by default (``nodes()`` re-reads etcd when the listing is older than
    ``refresh_s``); after ``watch()`` a background thread re-reads it every
    ``refresh_s`` and ``nodes()`` never waits on etcd. Either way, once a listing
    exists an unreachable etcd keeps the last one (logged): etcd is the single
    point for *membership*, not for serving data.

    ``forget(node_id)`` hides a node a client saw fail. Its etcd key outlives it by
    up to one lease TTL, so the next refresh would bring it straight back and every
    request in between would pay a timeout; instead the forgotten registration
    stays hidden until it changes (a restarted server registers a new ``started``
    and TE segment) or ``forget_s`` passes (a node that was only slow returns).
    """

    def __init__(self, etcd: EtcdClient, prefix: str, refresh_s: float = 1.0,
                 forget_s: float = 10.0) -> None:
        self.etcd, self.prefix, self.refresh_s = etcd, prefix.encode(), refresh_s
        self.forget_s = forget_s
        self._nodes: dict[str, NodeInfo] = {}
        self._registered: dict[str, NodeInfo] = {}  # as etcd last listed them
        self._forgotten: dict[str, tuple[NodeInfo, float]] = {}  # id -> (record, until)
        self._fetched_at = float("-inf")
        self._etcd_down = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.refresh(force=True)  # no listing yet: an unreachable etcd raises here

    def watch(self) -> NodeSet:
        """Re-read etcd every ``refresh_s`` in a daemon thread from now on."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_loop, name="kvstore-nodeset",
                                             daemon=True)
            self._watcher.start()
        return self

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh(force=True)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=self.etcd.timeout_s + self.refresh_s)

    def refresh(self, force: bool = False) -> dict[str, NodeInfo]:
        due = force or (self._watcher is None
                        and time.monotonic() - self._fetched_at >= self.refresh_s)
        if due:
            self._try_fetch()
        with self._lock:
            self._nodes = self._visible()
            return self._nodes

    def _try_fetch(self) -> None:
        # Outside the lock: a slow etcd must not hold up readers of the last listing.
        try:
            listing = self._fetch()
        except PeerUnavailableError as exc:
            if self._fetched_at == float("-inf"):
                raise
            if not self._etcd_down:
                log.warning("etcd unreachable, keeping the last node list: %s", exc)
            self._etcd_down = True
            self._fetched_at = time.monotonic()  # retry after refresh_s, not per call
            return
        if self._etcd_down:
            log.info("etcd reachable again")
        with self._lock:
            self._registered, self._fetched_at, self._etcd_down = listing, time.monotonic(), False

    def _fetch(self) -> dict[str, NodeInfo]:
        nodes = {}
        for kv in self.etcd.get_prefix(self.prefix).kvs:
            try:
                info = NodeInfo.decode(kv.value)
            except ConfigError as exc:
                log.warning("skipping node record %r: %s", kv.key, exc)
                continue
            nodes[info.node_id] = info
        return nodes

    def _visible(self) -> dict[str, NodeInfo]:
        now = time.monotonic()
        for node_id, (info, until) in list(self._forgotten.items()):
            if now >= until or self._registered.get(node_id, info) != info:
                del self._forgotten[node_id]
        return {n: i for n, i in self._registered.items() if n not in self._forgotten}

    def nodes(self) -> dict[str, NodeInfo]:
        return self.refresh()

    def registered(self) -> dict[str, NodeInfo]:
        """Every node etcd lists, forgotten ones included (for admin views)."""
        self.refresh()
        return dict(self._registered)

    def forget(self, node_id: str) -> None:
        """Hide a node seen dead until it registers anew or ``forget_s`` passes."""
        with self._lock:
            info = self._registered.get(node_id)
            if info is not None:
                self._forgotten[node_id] = (info, time.monotonic() + self.forget_s)
                log.info("forgetting node %s for up to %ss", node_id, self.forget_s)
            self._nodes.pop(node_id, None)

    def home(self, placement_key: bytes) -> NodeInfo:
        return self.order(placement_key)[0]

    def order(self, placement_key: bytes) -> list[NodeInfo]:
        """Live nodes by rendezvous weight for ``placement_key``; the first is home."""
        nodes = self.nodes()
        if not nodes:
            raise PeerUnavailableError(f"no kvstore nodes registered under {self.prefix!r}")
        return [nodes[n] for n in rendezvous_order(placement_key, list(nodes))]
