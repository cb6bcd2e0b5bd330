"""``KVStoreConnectorV1``: vLLM's v1 KV connector over kvstore.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnectorV1",
      "kv_connector_module_path": "kvstore.connector.vllm_v1",
      "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"server": "tcp://10.0.0.1:7700", ...}}'

(keys: kvstore.connector.v1_config; docs/vllm.md). vLLM imports this module itself,
so it imports vLLM at the top; nothing else in kvstore imports it.

Scheduler side (one per engine): ``get_num_new_matched_tokens`` asks the store
(``lookup``, non-binding) how many prompt tokens it holds; ``update_state_after_alloc``
notes where they go; ``build_connector_meta`` turns that, and every prompt whose
prefill finishes this step, into load and save orders for the workers;
``request_finished`` hands the server's address to the decode side.

Worker side (one per GPU worker): ``start_load_kv`` drop_selects (or gets) each
order's prefix and scatters it into the allocated blocks before the forward
(synchronous load); ``wait_for_save`` gathers each finished prompt's blocks after
the forward and inserts them. Invariant: no kvstore error ever reaches vLLM — a
miss, timeout or dead server turns into "0 tokens matched" (scheduler) or into the
block ids returned by ``get_block_ids_with_load_errors`` (worker), which vLLM
recomputes when ``kv_load_failure_policy`` is "recompute".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.connector.v1_config import (
    SERVER_SCHEMES,
    ConnectorSettings,
    layout_from_kv_cache_config,
)
from kvstore.connector.v1_stores import StoreClients
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PARAM_SERVER = "kvstore_server"  # kv_transfer_params key: where the prompt's KV is
PARAM_TOKENS = "kvstore_tokens"


@dataclass(frozen=True)
class LoadOrder:
    req_id: str
    token_ids: list[int]  # the prompt
    block_ids: list[int]  # the request's blocks, in token order
    ntokens: int  # tokens whose KV must be present after the load
    first_block: int  # blocks before this one are local prefix-cache hits
    server: str


@dataclass(frozen=True)
class SaveOrder:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side view of a running request whose prompt may need saving."""

    token_ids: list[int]
    block_ids: list[int]


class KVStoreConnectorV1(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(kvt.kv_role, kvt.kv_connector_extra_config,
                                                     _model_name(vllm_config))
        self.layout, self.layer_names = layout_from_kv_cache_config(kv_cache_config)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        tp_rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.stores = StoreClients(self.settings, self.layout, tp_rank, tp_size,
                                   worker=role == KVConnectorRole.WORKER)
        # scheduler side
        self._matched: dict[str, tuple[int, str]] = {}  # req -> (local tokens, server)
        self._pending_loads: dict[str, tuple[int, int, str]] = {}  # req -> (ntokens, first, server)
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._caches: list[torch.Tensor] = []
        self._load_errors: set[int] = set()

    # ============================================================ scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.settings.load:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        server = self._source(request)
        # vLLM must compute at least the last prompt token itself (its logits).
        stored = min(self.stores.lookup(server, prompt), len(prompt) - 1)
        new = max(0, stored - num_computed_tokens)
        self._matched[request.request_id] = (num_computed_tokens, server)
        return new, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        local, server = matched  # local: vLLM's block-aligned prefix-cache hit
        self._pending_loads[request.request_id] = (local + num_external_tokens,
                                                   local // self.layout.block_tokens, server)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            tokens, blocks = list(new.prompt_token_ids or []), list(new.block_ids[0])
            load = self._pending_loads.pop(new.req_id, None)
            if load is not None:
                meta.loads.append(LoadOrder(new.req_id, tokens, blocks, *load))
            if self.settings.save and tokens:
                self._tracked[new.req_id] = _Tracked(tokens, blocks)
                self._maybe_save(meta, new.req_id, new.num_computed_tokens,
                                 scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_blocks is not None:
                tracked.block_ids = list(new_blocks[0])  # a resumed request's whole list
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i],
                             scheduler_output.num_scheduled_tokens.get(req_id, 0))
        self._pending_loads.clear()  # orders not scheduled now are stale
        return meta

    def _maybe_save(self, meta: KVStoreConnectorMetadata, req_id: str, computed: int,
                    scheduled: int) -> None:
        """Order the save in the step that computes the prompt's last token."""
        tracked = self._tracked[req_id]
        if computed + scheduled >= len(tracked.token_ids):
            meta.saves.append(SaveOrder(req_id, tracked.token_ids, list(tracked.block_ids)))
            del self._tracked[req_id]

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        if not self.settings.save:
            return False, None
        # The save ran synchronously in the step that finished the prompt, so the
        # blocks may be freed now.
        return False, {PARAM_SERVER: self.settings.server,
                       PARAM_TOKENS: len(request.prompt_token_ids or [])}

    def _source(self, request: Request) -> str:
        params = getattr(request, "kv_transfer_params", None) or {}
        server = params.get(PARAM_SERVER)
        return server if isinstance(server, str) and server.startswith(SERVER_SCHEMES) \
            else self.settings.server

    # =============================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Fatal (``ConfigError``, at start-up) if the caches are not the per-layer
        ``[blocks, kv_heads, block_size, K+V]`` views the layout was derived for."""
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"kv caches lack attention layers {missing[:3]}")
        lay = self.layout
        want = (lay.kv_heads, lay.block_tokens, 2 * lay.head_dim)
        for name in self.layer_names:
            cache = kv_caches[name]
            if cache.dim() != 4 or tuple(cache.shape[1:]) != want or \
                    cache.dtype != lay.torch_dtype:
                raise ConfigError(
                    f"layer {name}: KV cache view {tuple(cache.shape)} {cache.dtype}, expected "
                    f"[blocks, {want[0]}, {want[1]}, {want[2]}] {lay.dtype}; if the kernel "
                    f"block size differs from --block-size, set --block-size to it")
        self._caches = [kv_caches[n] for n in self.layer_names]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        for order in meta.loads:
            self._load_errors.update(self.stores.load(order, self._caches))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole prompts are saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        for order in meta.saves:
            self.stores.save(order, self._caches)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.stores.close()


def _model_name(vllm_config: VllmConfig) -> str:
    model_config = vllm_config.model_config
    name = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or "default")


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError, AttributeError):  # no TP group: a single worker
        return 0
