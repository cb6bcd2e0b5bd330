"""The v1 connector's kvstore calls, each turned into a result vLLM can use.

One client per server address: a ``KVStoreClient`` for ``tcp://``, a
``ClusterClient`` (same methods) for an ``etcd://`` cluster; all of them share one
TE engine and staging buffer (``TeEngine``: one engine per process, however many
producers' servers a consumer loads from). Every method here returns normally
whatever the store or the network does: a lookup that fails is 0 tokens, a load
that fails names the blocks vLLM must recompute, a save that fails is logged and
skipped (a later reader recomputes). A server that timed out or is gone is skipped
for ``down_s`` seconds (v1_config), so a dead peer costs one timeout, not one per
request.

Addresses come from requests (``kv_transfer_params``), so ``source`` admits only the
configured ones; clients are kept for at most ``_CLIENTS_KEPT`` addresses (least
recently used closed first), so no stream of addresses grows the process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvstore.client.client import KVStoreClient, PendingInsert
from kvstore.core.config import ClientConfig, client_config_from_env
from kvstore.cluster.client import ClusterClient, connect
from kvstore.client.datapath import TeEngine
from kvstore.connector.v1_config import ConnectorSettings
from kvstore.core.errors import KVTimeoutError, MissError, PeerUnavailableError, TransferError
from kvstore.core.layout import KVLayout

log = logging.getLogger(__name__)

_CLIENTS_KEPT = 32


class Fetched(NamedTuple):
    tokens: int  # the prompt's tokens whose entries are there (skipped blocks included)
    moved: int  # bytes that came over (the skipped blocks' are not)


class StoreClients:
    def __init__(self, settings: ConnectorSettings, layout: KVLayout, tp_rank: int,
                 tp_size: int, worker: bool, pp_rank: int = 0, pp_size: int = 1) -> None:
        self.settings, self.layout = settings, layout
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        # The scheduler only looks up: its clients never move bytes.
        staging = settings.staging_bytes if worker else 1 << 20
        # How the clients move bytes, which the extra config does not set, comes from
        # KVSTORE_CLIENT_* (docs/operations.md); the rest (server, timeouts, TE host
        # and protocol) is the extra config's, and CURVE is not the connector's.
        env = client_config_from_env()
        self._client_cfg = ClientConfig(
            inline_max_bytes=settings.inline_max_bytes, inline_part_bytes=env.inline_part_bytes,
            te_piece_bytes=env.te_piece_bytes, te_wait=env.te_wait,
            prefault_arena=env.prefault_arena, stream_copies=env.stream_copies,
            stream_socket=env.stream_socket)
        self._engine = TeEngine(settings.te_host, staging, settings.timeout_s,
                                settings.te_protocol, settings.te_devices,
                                self._client_cfg.te_piece_bytes, self._client_cfg.te_wait)
        self._clients: OrderedDict[tuple[str, int, int], KVStoreClient | ClusterClient] = \
            OrderedDict()
        self.worker = worker
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self.rejected_sources = 0  # request-named addresses nobody configured

    def client(self, server: str, rank: tuple[int, int] | None = None
               ) -> KVStoreClient | ClusterClient:
        """The client of ``server`` for this process's (TP, PP) rank, or for ``rank``
        (the scheduler looks up every rank's entries)."""
        tp_rank, pp_rank = rank if rank is not None else (self.tp_rank, self.pp_rank)
        key = (server, tp_rank, pp_rank)
        with self._lock:
            client = self._clients.get(key)
            if client is not None:
                self._clients.move_to_end(key)
                return client
            s = self.settings
            client = self._clients[key] = connect(
                server, self.layout, prefix=s.cluster_prefix, model_id=s.model_id,
                tp_rank=tp_rank, tp_size=self.tp_size, salt=s.salt,
                pp_rank=pp_rank, pp_size=self.pp_size,
                timeout_s=s.timeout_s, same_node=s.same_node, te_engine=self._engine,
                config=self._client_cfg)
            kept = _CLIENTS_KEPT * self.tp_size * self.pp_size
            old = self._clients.popitem(last=False)[1] if len(self._clients) > kept else None
        if old is not None:
            _close(old)
        return client

    def source(self, named: Any) -> str:
        """The server to load from when a request names ``named``: that one if the
        operator configured it (``server``, ``allowed_servers``, or a member of
        ``server``'s cluster), else this node's ``server``."""
        own = self.settings.server
        if named is None or named == own:
            return own
        if isinstance(named, str) and (named in self.settings.allowed_servers
                                       or self._cluster_member(named)):
            return named
        self.rejected_sources += 1
        log.warning("ignoring kv_transfer_params server %.100r: not this connector's server, "
                    "in allowed_servers or in its cluster (%d ignored so far)", named,
                    self.rejected_sources)
        return own

    def _cluster_member(self, address: str) -> bool:
        if not self.settings.server.startswith("etcd://"):
            return False
        try:
            cluster = self.client(self.settings.server)  # etcd://: a ClusterClient
            return isinstance(cluster, ClusterClient) and any(
                node.address == address for node in cluster.nodes.nodes().values())
        except Exception as exc:  # noqa: BLE001 - an unknown cluster admits nobody
            log.warning("cluster membership of %.100r unknown: %s", address, exc)
            return False

    def usable(self, server: str) -> bool:
        """False while ``server`` is remembered as down (it failed recently)."""
        return time.monotonic() >= self._down_until.get(server, 0.0)

    _usable = usable

    def _failed(self, server: str, what: str, exc: BaseException,
                mark_down: bool = True) -> None:
        if not isinstance(exc, MissError):
            log.exception("kvstore %s via %s failed unexpectedly", what, server)
        else:
            log.warning("kvstore %s via %s: %s (recomputing)", what, server, exc)
        if mark_down and isinstance(exc, (PeerUnavailableError, KVTimeoutError)):
            self._down_until[server] = time.monotonic() + self.settings.down_s

    # ------------------------------------------------------------------ calls
    def lookup(self, server: str, tokens: Sequence[int], scope: str = "",
               timeout_s: float | None = None, mark_down: bool = True) -> int:
        """Prompt tokens the store holds (a non-binding answer); 0 on any failure.
        ``mark_down``: a server that did not answer is skipped for ``down_s``."""
        if not tokens or not self._usable(server):
            return 0
        # A worker holds one rank's part of each block; the scheduler counts a token
        # only where every rank's part is there (the least any rank holds).
        ranks = [None] if self.worker else \
            [(t, p) for p in range(self.pp_size) for t in range(self.tp_size)]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        held = len(tokens)
        try:
            for rank in ranks:
                left = None if deadline is None else max(0.001, deadline - time.monotonic())
                held = min(held, self.client(server, rank).lookup(
                    tokens, scope=scope, timeout_s=left).matched_tokens)
                if not held:
                    break
            return held
        except Exception as exc:  # noqa: BLE001 - never into the scheduler
            self._failed(server, "lookup", exc, mark_down)
            return 0

    def fetch(self, order: Any, into: torch.Tensor) -> Fetched:
        """Take (drop mode) or read (keep mode) ``order``'s stored tokens into ``into``
        (the prompt's entry bytes, in entry order): the tokens whose entries are
        there and the bytes that moved (nothing on any failure: logged, never
        raised). The blocks before ``order.first_block`` (vLLM holds them) are taken
        but not moved: that part of ``into`` is left as it was. An order without
        blocks (a drop of entries vLLM needs none of) moves nothing."""
        bt = self.layout.block_tokens
        skip = order.first_block if order.block_ids else -(-len(order.token_ids) // bt)
        into = into[self.layout.nbytes(min(len(order.token_ids), skip * bt)):]
        for attempt in (1, 2):
            try:
                if not self._usable(order.server):
                    raise MissError(f"{order.server} failed recently")
                client = self.client(order.server)
                fetch = client.drop_select if self.settings.load_mode == "drop" else client.get
                got = fetch(order.token_ids, scope=order.scope, into=into, skip_blocks=skip)
                return Fetched(got.matched_tokens,
                               0 if got.kv is None else int(got.kv.numel()))
            except (KVTimeoutError, TransferError) as exc:
                # One slow or failed move is no verdict on the server: try once more
                # before remembering it as down (which fails every load for down_s).
                if attempt == 2:
                    self._failed(order.server, f"load of {order.req_id}", exc)
                else:
                    log.warning("load of %s via %s: %s; trying once more", order.req_id,
                                order.server, exc)
            except Exception as exc:  # noqa: BLE001 - reported as load errors, never raised
                self._failed(order.server, f"load of {order.req_id}", exc)
                return Fetched(0, 0)
        return Fetched(0, 0)

    def insert(self, order: Any, data: torch.Tensor, skip_blocks: int = 0) -> bool:
        """Insert a prompt's entry bytes into this node's server (``data`` from block
        ``skip_blocks`` on: the server holds the ones before); False if skipped."""
        server = self.settings.server
        if not self._usable(server):
            return False
        try:
            client = self.client(server)
            if getattr(order, "continues", False) and isinstance(client, KVStoreClient):
                client.insert(order.token_ids, data, scope=order.scope,
                              skip_blocks=skip_blocks, count_skipped=False)
            else:
                client.insert(order.token_ids, data, scope=order.scope,
                              skip_blocks=skip_blocks)
            return True
        except Exception as exc:  # noqa: BLE001 - a failed save only costs a later miss
            self._failed(server, f"save of {order.req_id}", exc)
            return False

    def begin_insert(self, order: Any, skip_blocks: int = 0) -> PendingInsert | None:
        """Reserve a save whose layers are written as they are computed (a server on
        this node); None where that cannot be (a remote or cluster server, a failure:
        logged), and the save is then inserted whole."""
        server = self.settings.server
        if not self._usable(server):
            return None
        client = self.client(server)
        if not isinstance(client, KVStoreClient):
            return None
        try:
            return client.begin_insert(order.token_ids, scope=order.scope,
                                       skip_blocks=skip_blocks,
                                       count_skipped=not getattr(order, "continues", False))
        except Exception as exc:  # noqa: BLE001 - the whole insert at the end decides
            self._failed(server, f"reserving the save of {order.req_id}", exc)
            return None

    def commit_insert(self, order: Any, pending: PendingInsert, data: torch.Tensor) -> bool:
        """Write what is left of ``pending`` and commit it; False if that failed."""
        try:
            pending.commit(data.numpy())
            return True
        except Exception as exc:  # noqa: BLE001 - a failed save only costs a later miss
            self._failed(self.settings.server, f"save of {order.req_id}", exc)
            return False

    def close(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            _close(client)
        self._engine.close()


def _close(client: KVStoreClient | ClusterClient) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing is best effort
        log.debug("closing a kvstore client failed", exc_info=True)
