"""``KVStoreConnectorV1``: vLLM's v1 KV connector over kvstore.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnectorV1",
      "kv_connector_module_path": "kvstore.connector.vllm_v1",
      "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"server": "tcp://10.0.0.1:7700", ...}}'

(keys: kvstore.connector.v1_config; docs/vllm.md). vLLM imports this module itself,
so it imports vLLM at the top; nothing else in kvstore imports it.

What is stored for a prompt of ``n`` tokens is the KV of its first ``n - 1``: a decode
engine computes the last prompt token itself (it needs its logits), so it can never
use more, and a 1-token prompt stores nothing that no consumer could ever take.
Keys are scoped per request (``request_scope``: LoRA adapter, multimodal inputs,
``cache_salt``), so two requests share KV only where vLLM's prefix cache would.

Scheduler side (one per engine): ``get_num_new_matched_tokens`` asks the store
(``lookup``, non-binding) how many prompt tokens it holds; ``update_state_after_alloc``
notes where they go; ``build_connector_meta`` turns that, and every prompt whose
prefill finishes this step, into load and save orders for the workers;
``request_finished`` hands the server's address to the decode side.

Worker side (one per GPU worker): ``register_kv_caches`` asks the attention backend
where it keeps K/V inside a block (kvstore.connector.v1_backend: its own cache
write, probed; a backend it cannot place is a ConfigError at start);
``start_load_kv`` drop_selects (or gets) each order's prefix and scatters it into the
allocated blocks before the forward (synchronous load); ``wait_for_save`` gathers each finished prompt's blocks after
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

from kvstore.connector.block_format import BlockFormat
from kvstore.connector.v1_backend import block_format_of
from kvstore.connector.v1_config import (
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


@dataclass(frozen=True)
class LoadOrder:
    req_id: str
    token_ids: list[int]  # the stored part of the prompt: all but its last token
    block_ids: list[int]  # the request's blocks, in token order
    ntokens: int  # tokens whose KV must be present after the load
    first_block: int  # blocks before this one are local prefix-cache hits
    server: str
    scope: str = ""  # request_scope(): part of the keys


@dataclass(frozen=True)
class SaveOrder:
    req_id: str
    token_ids: list[int]  # the stored part of the prompt: all but its last token
    block_ids: list[int]
    scope: str = ""


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side view of a running request whose prompt may need saving."""

    token_ids: list[int]  # what will be saved: the prompt but its last token
    block_ids: list[int]
    scope: str


def stored_part(prompt: list[int]) -> list[int]:
    """The prompt tokens whose KV is stored: all but the last (see the module doc)."""
    return prompt[:-1]


def request_scope(request: Request) -> str:
    """What a request's KV depends on besides its tokens, as vLLM's prefix-cache block
    hashes see it: its cache_salt, LoRA adapter and multimodal inputs (by content
    hash and position). Requests with prompt embeddings get a scope no other
    request has (their KV depends on the embeddings), so they never share."""
    parts = []
    if getattr(request, "prompt_embeds", None) is not None:
        parts.append(f"embeds={request.request_id}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}@{getattr(lora, 'lora_path', '')}")
    for feature in getattr(request, "mm_features", None) or []:
        pos = feature.mm_position
        parts.append(f"mm={feature.identifier}@{pos.offset}+{pos.length}")
    return "\n".join(parts)


class KVStoreConnectorV1(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(kvt.kv_role, kvt.kv_connector_extra_config,
                                                     _model_name(vllm_config))
        self.layout, self.layer_names = layout_from_kv_cache_config(kv_cache_config)
        parallel = vllm_config.parallel_config
        worker = role == KVConnectorRole.WORKER
        tp_rank, pp_rank = (_tp_rank(), _pp_rank()) if worker else (0, 0)
        self.stores = StoreClients(self.settings, self.layout, tp_rank,
                                   parallel.tensor_parallel_size, worker=worker,
                                   pp_rank=pp_rank,
                                   pp_size=parallel.pipeline_parallel_size)
        # scheduler side
        self._scopes: dict[str, str] = {}  # req -> request_scope(), from its first sight
        self._matched: dict[str, tuple[int, str, int]] = {}  # req -> (local, server, stored)
        self._pending_loads: dict[str, tuple[int, int, str]] = {}  # req -> (ntokens, first, server)
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._caches: list[torch.Tensor] = []
        self._format: BlockFormat | None = None
        self._load_errors: set[int] = set()

    # ============================================================ scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        scope = self._scopes.setdefault(request.request_id, request_scope(request))
        if not self.settings.load:
            return 0, False
        stored_tokens = stored_part(list(request.prompt_token_ids or []))
        if not stored_tokens:
            return 0, False
        server = self._source(request)
        stored = self.stores.lookup(server, stored_tokens, scope)
        new = max(0, stored - num_computed_tokens)
        self._matched[request.request_id] = (num_computed_tokens, server, stored)
        return new, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None:
            return
        local, server, stored = matched  # local: vLLM's block-aligned prefix-cache hit
        if num_external_tokens <= 0 and not (stored and self.settings.load_mode == "drop"):
            return
        # With nothing new to load, a drop still takes the entries (an order that
        # writes no block): left behind, they would wait for a consumer forever.
        self._pending_loads[request.request_id] = (local + max(0, num_external_tokens),
                                                   local // self.layout.block_tokens, server)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            tokens = stored_part(list(new.prompt_token_ids or []))
            blocks = list(new.block_ids[0])
            scope = self._scopes.get(new.req_id, "")
            load = self._pending_loads.pop(new.req_id, None)
            if load is not None:
                meta.loads.append(LoadOrder(new.req_id, tokens, blocks, *load, scope=scope))
            if self.settings.save and tokens:
                self._tracked[new.req_id] = _Tracked(tokens, blocks, scope)
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
        """Order the save in the step that computes the last stored token."""
        tracked = self._tracked[req_id]
        if computed + scheduled >= len(tracked.token_ids):
            meta.saves.append(SaveOrder(req_id, tracked.token_ids, list(tracked.block_ids),
                                        tracked.scope))
            del self._tracked[req_id]

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._scopes.pop(request.request_id, None)
        if not self.settings.save:
            return False, None
        # The save ran synchronously in the step that finished the prompt, so the
        # blocks may be freed now.
        return False, {PARAM_SERVER: self.settings.server}

    def _source(self, request: Request) -> str:
        """Where to load from: the request's kv_transfer_params may name a server,
        but they come from an HTTP request, so only an address the operator
        configured is used (StoreClients.source)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        return self.stores.source(params.get(PARAM_SERVER) if isinstance(params, dict)
                                  else None)

    # =============================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Fatal (``ConfigError``, at start-up) if the caches are not the per-layer
        views the layout was derived for, or the backend keeps its blocks in a way
        the connector cannot place (v1_backend)."""
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"kv caches lack attention layers {missing[:3]}")
        lay = self.layout
        attn = (lay.kv_heads, lay.block_tokens, 2 * lay.head_dim)
        mla = (lay.block_tokens, 2 * lay.head_dim)
        for name in self.layer_names:
            cache = kv_caches[name]
            shape = tuple(cache.shape[1:])
            if shape not in (attn, mla) or cache.dtype != lay.torch_dtype or \
                    (shape == mla and lay.kv_heads != 1):
                raise ConfigError(
                    f"layer {name}: KV cache view {tuple(cache.shape)} {cache.dtype}, expected "
                    f"[blocks, {attn[0]}, {attn[1]}, {attn[2]}] {lay.dtype} (MLA: [blocks, "
                    f"{mla[0]}, {mla[1]}]); if the kernel block size differs from "
                    f"--block-size, set --block-size to it")
        self._format = block_format_of(self._vllm_config, self.layer_names, kv_caches)
        self._caches = [kv_caches[n] for n in self.layer_names]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        for order in meta.loads:
            self._load_errors.update(self.stores.load(order, self._format, self._caches))

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
            self.stores.save(order, self._format, self._caches)

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


def _pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return get_pp_group().rank_in_group
    except (AssertionError, ImportError, AttributeError):  # no PP group: one stage
        return 0


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError, AttributeError):  # no TP group: a single worker
        return 0
