"""Settings of the vLLM v1 connector: ``kv_connector_extra_config`` keys, checked once.

Every key (docs/vllm.md lists them with examples):

* ``server`` — this node's kvstore-server (``tcp://host:port``), or a cluster's etcd
  (``etcd://host:port``: prompts are placed on the registered nodes by rendezvous
  hashing, kvstore.cluster.client). A producer saves there and names it in
  ``kv_transfer_params``; a consumer loads from the address a request's
  ``kv_transfer_params`` names, else from here. [tcp://127.0.0.1:7700]
* ``allowed_servers`` — further ``tcp://`` servers a consumer may load from when a
  request's ``kv_transfer_params`` name them (the prefill nodes' servers). Those
  params arrive in an HTTP request: an address that is neither ``server``, nor
  listed here, nor a member of ``server``'s cluster is ignored (warned, counted),
  never connected to. [[]]
* ``cluster_prefix`` — the etcd key prefix the cluster's servers register under
  (their ``--cluster-prefix``); only with an ``etcd://`` server. [/kvstore/nodes/]
* ``model_id`` — part of the key namespace; producer and consumer must agree.
  [the served model's name]
* ``salt`` — optional tenant salt, also in the namespace. [""]
* ``timeout_s`` — bound of every store call; a late answer is a miss. [5.0]
* ``lookup_timeout_s`` — bound of the scheduler's lookup (a request without
  kv_transfer_params naming the server: prefix-cache mode, or a decode request the
  proxy sent without them; and a request whose claimed load failed, on its retry);
  the scheduler must never wait on the network long. [0.25]
* ``down_s`` — how long a server that timed out or is gone is skipped (every lookup,
  load and save to it is a miss at once) before it is tried again. [10.0]
* ``load_wait_s`` — how long a decode's load waits for the producer's entries to
  appear (its save may still be on its way when the proxy forwards the request).
  [the ``timeout_s``]
* ``te_host`` — the address this worker's Transfer Engine binds and advertises
  (the node's RDMA/TCP interface on real clusters). [127.0.0.1]
* ``te_protocol`` — this worker's TE transport, "tcp" or "rdma": the servers'
  ``server.te_protocol``. "rdma" needs an RDMA NIC on the node. ["tcp"]
* ``te_devices`` — the RDMA NICs this worker's TE may use, e.g. "mlx5_0,mlx5_1"
  (the ones nearest its GPU); empty: every NIC TE finds. [""]
* ``staging_bytes`` — the worker's registered TE staging buffer. [256MiB]
* ``save_queue_bytes`` — the most host memory a worker's saves may hold while they
  wait for the transfer thread (each holds a host copy of its prompt's KV from its
  step until it is sent): a save that would take the queue past it is not made
  (counted as ``saves_skipped``, logged; the scheduler does not order it, so the
  request gets no params and its decode recomputes at once), unless nothing else is
  queued, so a prompt larger than the cap is still saved, alone. A server slower than
  the prefill rate then costs saves, not the engine's host memory. The free host
  buffers a worker keeps for reuse are bounded by it too. [4GiB]
* ``inline_max_bytes`` — a load of at most this many bytes from a server on another
  node asks for them in the acquire's reply instead of a TE read (TCP only; the
  client's ``client.inline_max_bytes``); 0: always TE. [4GiB]
* ``same_node`` — "auto" memcpys through a same-node server's shared DRAM arena;
  false forces TE. ["auto"]
* ``load_mode`` — "drop" (disaggregated: the store forgets what a decode took) or
  "keep" (prefix cache: non-destructive reads). ["drop" for kv_consumer, else "keep"]
* ``save`` — save finished prompts' KV. [true for kv_producer / kv_both]
* ``load`` — load prompt KV from the store. [true for kv_consumer / kv_both]
* ``layerwise_saves`` — copy each layer of a saved prompt off the device as soon as
  the forward has computed it (``save_kv_layer``), so on a GPU the copies overlap
  the later layers; false copies the whole prompt at the step's end
  (``wait_for_save``), which only ``tools/bench/connector.py`` uses, to compare.
  [true]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
import re
from typing import Any, NamedTuple

from kvstore.core.config import check_te_protocol, parse_size, parse_te_devices
from kvstore.core.errors import ConfigError
from kvstore.core.protocol import MAX_INLINE_BYTES
from kvstore.core.layout import KVLayout, dtype_name

SERVER_SCHEMES = ("tcp://", "etcd://")  # one server / a cluster's registry
_KEYS = {"server", "allowed_servers", "cluster_prefix", "model_id", "salt", "timeout_s",
         "lookup_timeout_s", "load_wait_s", "down_s", "te_host", "te_protocol", "te_devices",
         "staging_bytes", "same_node", "load_mode", "save", "load", "layerwise_saves",
         "inline_max_bytes", "save_queue_bytes"}


@dataclass(frozen=True)
class ConnectorSettings:
    server: str
    allowed_servers: tuple[str, ...]
    cluster_prefix: str
    model_id: str
    salt: str
    timeout_s: float
    lookup_timeout_s: float
    load_wait_s: float
    down_s: float
    te_host: str
    te_protocol: str
    te_devices: str  # comma-separated; "" = every NIC TE finds
    staging_bytes: int
    same_node: bool | str
    load_mode: str
    save: bool
    load: bool
    layerwise_saves: bool = True
    inline_max_bytes: int = 4 << 30
    # A backlog, not a prompt size (a larger prompt is still saved, alone): 32k tokens
    # of a 7-8B model's KV at TP 1 (128 KiB a token), four 8k-token prompts; eight
    # GPU workers of a node pin 32 GiB at most.
    save_queue_bytes: int = 4 << 30

    @classmethod
    def from_extra(cls, role: str | None, extra: Mapping[str, Any] | None,
                   default_model_id: str) -> ConnectorSettings:
        """``role`` is vLLM's kv_role: kv_producer, kv_consumer or kv_both."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; "
                              f"known: {sorted(_KEYS)}")
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}")
        same_node = extra.get("same_node", "auto")
        if isinstance(same_node, str) and same_node.lower() in ("true", "false"):
            same_node = same_node.lower() == "true"
        settings = cls(
            server=str(extra.get("server", "tcp://127.0.0.1:7700")),
            allowed_servers=_addresses(extra.get("allowed_servers", ())),
            cluster_prefix=str(extra.get("cluster_prefix", "/kvstore/nodes/")),
            model_id=str(extra.get("model_id", default_model_id)),
            salt=str(extra.get("salt", "")),
            timeout_s=float(extra.get("timeout_s", 5.0)),
            lookup_timeout_s=float(extra.get("lookup_timeout_s", 0.25)),
            load_wait_s=float(extra.get("load_wait_s", extra.get("timeout_s", 5.0))),
            down_s=float(extra.get("down_s", 10.0)),
            te_host=str(extra.get("te_host", "127.0.0.1")),
            te_protocol=str(extra.get("te_protocol", "tcp")),
            te_devices=",".join(parse_te_devices("te_devices", extra.get("te_devices", ""))),
            staging_bytes=parse_size(extra.get("staging_bytes", "256MiB")),
            same_node=same_node,
            load_mode=str(extra.get("load_mode", "drop" if role == "kv_consumer" else "keep")),
            save=flag(extra.get("save", role != "kv_consumer")),
            load=flag(extra.get("load", role != "kv_producer")),
            layerwise_saves=flag(extra.get("layerwise_saves", True)),
            inline_max_bytes=parse_size(extra.get("inline_max_bytes", "4GiB")),
            save_queue_bytes=parse_size(extra.get("save_queue_bytes", "4GiB")),
        )
        settings.check()
        return settings

    def check(self) -> None:
        if not self.server.startswith(SERVER_SCHEMES):
            raise ConfigError(f"server must be tcp://host:port or etcd://host:port, "
                              f"got {self.server!r}")
        for address in self.allowed_servers:
            if not address.startswith("tcp://"):
                raise ConfigError(f"allowed_servers entries must be tcp://host:port, "
                                  f"got {address!r}")
        if not self.cluster_prefix:
            raise ConfigError("cluster_prefix must not be empty")
        for name in ("timeout_s", "lookup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("load_wait_s", "down_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.load_mode not in ("drop", "keep"):
            raise ConfigError(f"load_mode must be 'drop' or 'keep', got {self.load_mode!r}")
        check_te_protocol("te_protocol", self.te_protocol)
        if not 0 <= self.inline_max_bytes <= MAX_INLINE_BYTES:
            raise ConfigError(f"inline_max_bytes must be 0 .. {MAX_INLINE_BYTES} (1TiB), "
                              f"got {self.inline_max_bytes}")
        if self.save_queue_bytes <= 0:
            raise ConfigError(f"save_queue_bytes must be > 0, got {self.save_queue_bytes}")
        if self.same_node not in (True, False, "auto"):
            raise ConfigError(f"same_node must be true, false or 'auto', got {self.same_node!r}")


def _addresses(value: Any) -> tuple[str, ...]:
    """A list of addresses, or one string of them separated by commas."""
    if isinstance(value, str):
        value = [v for v in value.split(",")]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"allowed_servers must be a list of tcp://host:port, got {value!r}")
    return tuple(str(v).strip() for v in value if str(v).strip())


def flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class KVGroups(NamedTuple):
    """Where each layer's blocks come from when vLLM keeps several KV cache groups
    (its hybrid allocator: a group per attention kind, each with its own block table).

    ``layer_names``: every transferred layer, in the model's layer order (an entry's
    layer order: the same whether vLLM groups the layers or not); ``layer_group``:
    the group of each (vLLM's group number); ``windowed``: per vLLM group, whether it
    frees its blocks once they fall out of a sliding window or attention chunk (they
    become its null block)."""

    layout: KVLayout
    layer_names: list[str]
    layer_group: list[int]
    windowed: tuple[bool, ...]

    @property
    def many(self) -> bool:
        return len(self.windowed) > 1 or any(self.windowed)


def kv_groups_of(kv_cache_config: Any) -> KVGroups:
    """The entry layout and the layers' groups of a vLLM KVCacheConfig.

    vLLM 0.33 views each layer's cache as ``[blocks, kv_heads, block_size, C]`` with
    ``C = head_size + head_size_v`` (K then V). An entry keeps ``C`` split in two
    halves as ``[layers, 2, tokens, kv_heads, C/2]``: for ordinary attention that is
    exactly K and V; for MLA (one latent vector) it is a byte-exact split that the
    loading side joins back. Several groups (full and sliding-window attention)
    must agree on heads, head size, dtype and block size: one entry holds a block
    of every layer. A group that is not attention (Mamba state) is refused.
    """
    every = list(kv_cache_config.kv_cache_groups)
    # vLLM's block-id tuples cover every group: keep its own group numbers.
    groups = [(gi, g) for gi, g in enumerate(every) if getattr(g, "enable_kv_transfer", True)]
    if not groups:
        raise ConfigError("no KV cache group to transfer")
    shapes = []
    for _, g in groups:
        spec = g.kv_cache_spec
        odd = {c.__name__ for c in type(spec).__mro__} & _REFUSED_SPECS
        if odd:
            raise ConfigError(f"KV cache spec {type(spec).__name__}: its blocks do not map "
                              "tokens in order; the connector cannot move them")
        heads, head = getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None)
        if heads is None or head is None:
            raise ConfigError(f"KV cache spec {type(spec).__name__} is not an attention spec "
                              "(models with Mamba or other state layers are not supported)")
        head_v = getattr(spec, "head_size_v", head)
        channels = head + (head if head_v is None else head_v)
        shapes.append((int(heads), channels, dtype_name(spec.dtype), int(spec.block_size)))
    if len(set(shapes)) != 1:
        raise ConfigError("KV cache groups differ in heads, K+V channels, dtype or block size "
                          f"({sorted(set(shapes))}); one entry layout must fit every layer "
                          "(vLLM's --disable-hybrid-kv-cache-manager puts them in one group)")
    heads, channels, dtype, block = shapes[0]
    if channels % 2:
        raise ConfigError(f"K+V channels {channels} are odd; cannot split into K/V halves")
    named = [(name, gi) for gi, g in groups for name in g.layer_names]
    if len({n for n, _ in named}) != len(named):
        raise ConfigError("a layer is in more than one KV cache group")
    named.sort(key=lambda item: _layer_order(item[0]))
    moved = {gi for gi, _ in groups}
    windowed = tuple(gi in moved and _windowed(g.kv_cache_spec) for gi, g in enumerate(every))
    layout = KVLayout(num_layers=len(named), kv_heads=heads, head_dim=channels // 2,
                      dtype=dtype, block_tokens=block)
    return KVGroups(layout, [n for n, _ in named], [gi for _, gi in named], windowed)


def layout_from_kv_cache_config(kv_cache_config: Any) -> tuple[KVLayout, list[str]]:
    """``kv_groups_of`` without the groups: the layout and the ordered layer names."""
    groups = kv_groups_of(kv_cache_config)
    return groups.layout, groups.layer_names


def _layer_order(name: str) -> tuple[int, str]:
    """A layer's place in the model: the first number in its name (vLLM names them
    ``model.layers.N...``), then the name."""
    digits = re.search(r"\.(\d+)(\.|$)", name)
    return (int(digits.group(1)) if digits else -1, name)


# Block tables that are not "block i holds tokens [i*B, (i+1)*B)": a ring buffer, a
# decode-time window over generated tokens, caches of another sequence.
_REFUSED_SPECS = {"CircularBufferSpec", "RSWASpec", "CrossAttentionSpec",
                  "EncoderOnlyAttentionSpec", "HiSparseHotSpec", "HiSparseResidentSpec"}
_WINDOWED_SPECS = {"SlidingWindowSpec", "ChunkedLocalAttentionSpec", "SlidingWindowMLASpec"}


def _windowed(spec: Any) -> bool:
    """vLLM frees this group's blocks behind the window (sliding window, chunked local
    attention). Not so for a full-attention spec that only carries a window for the
    kernel (a sliding layer with the hybrid allocator off keeps every block)."""
    return any(c.__name__ in _WINDOWED_SPECS for c in type(spec).__mro__)
