"""The server's side of cluster mode: check etcd, register, deregister.

``kvstore-server --cluster etcd://host:2379`` calls ``connect_etcd`` before it opens
anything (so an unreachable etcd is a one-line error within a few seconds, not a
half-started node), then ``register_server`` once the control socket and TE are
up. The registration lives on an etcd lease the server keeps alive; a clean stop
revokes it, a crash lets it expire after ``cluster.ttl_s``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvstore.cluster.membership import NodeInfo, Registration
from kvstore.core.config import KVStoreConfig
from kvstore.core.errors import ConfigError, PeerUnavailableError
from kvstore.cluster.etcd import EtcdClient

if TYPE_CHECKING:
    from kvstore.server.loop import Server

log = logging.getLogger(__name__)

_WILDCARDS = ("0.0.0.0", "*", "::", "")
ETCD_TIMEOUT_S = 2.0


def connect_etcd(cfg: KVStoreConfig) -> EtcdClient | None:
    """The cluster's etcd, verified to answer; None in single-node mode."""
    if not cfg.cluster.etcd:
        return None
    etcd = EtcdClient(cfg.cluster.etcd, timeout_s=ETCD_TIMEOUT_S)
    try:
        etcd.status()
    except PeerUnavailableError as exc:
        raise PeerUnavailableError(f"cluster mode: cannot reach etcd {cfg.cluster.etcd} "
                                   f"({exc}); start etcd or drop --cluster") from None
    return etcd


def node_info(cfg: KVStoreConfig, server: Server) -> NodeInfo:
    """What clients need to reach this node: control address, TE segment, tiers."""
    srv = cfg.server
    # A wildcard bind is not an address anyone can dial; TE's advertised host is.
    host = srv.te_host if srv.host in _WILDCARDS else srv.host
    return NodeInfo(node_id=cfg.cluster.node_id or f"{host}:{srv.port}",
                    address=f"tcp://{host}:{srv.port}",
                    te_segment=server.transport.segment,
                    tiers=server.capacities(), started=time.time())


def register_server(etcd: EtcdClient, cfg: KVStoreConfig, server: Server) -> Registration:
    if cfg.server.te_metadata != "P2PHANDSHAKE":
        # Clients adopt the metadata named in hello, but one client process has one
        # TE engine: a node whose metadata differs from the others' is unreachable
        # (ConfigError) from clients that met those first.
        log.info("TE segment registered in %s: every node of this cluster needs the "
                 "same server.te_metadata", cfg.server.te_metadata)
    info = node_info(cfg, server)
    _refuse_duplicate(etcd, cfg.cluster.prefix, info)
    reg = Registration(etcd, cfg.cluster.prefix, info, cfg.cluster.ttl_s)
    log.info("joined cluster %s as %s (prefix %s, lease ttl %ss)", cfg.cluster.etcd,
             info.node_id, cfg.cluster.prefix, cfg.cluster.ttl_s)
    return reg


def _refuse_duplicate(etcd: EtcdClient, prefix: str, info: NodeInfo) -> None:
    """Two live servers under one node id would overwrite each other's record and the
    first to stop would deregister both. The same id *at the same address* is this
    node's crashed predecessor (its lease not yet expired): we hold its port now."""
    key = (prefix + info.node_id).encode()
    for kv in etcd.get_prefix(key).kvs:
        if kv.key != key:
            continue
        try:
            other = NodeInfo.decode(kv.value)
        except ConfigError:
            return  # a malformed record is overwritten
        if other.address != info.address:
            raise ConfigError(f"node id {info.node_id!r} is already registered by "
                              f"{other.address}; give this server its own --node-id")
