"""``KVStoreConnectorV1``: vLLM's v1 KV connector over kvstore.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnectorV1",
      "kv_connector_module_path": "kvstore.connector.vllm_v1",
      "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"server": "tcp://10.0.0.1:7700", ...}}'

(keys: kvstore.connector.v1_config; docs/vllm.md). vLLM imports this module itself,
so it imports vLLM at the top; nothing else in kvstore imports it.

vLLM makes one instance per role. The scheduler's delegates to ``SchedulerSide``
(v1_scheduler: lookups, load and save orders, the params handed to the decode side),
each worker's to ``WorkerSide`` (v1_worker: the transfer thread, async loads reported
through ``get_finished``, layer-wise saves). ``register_kv_caches`` asks the attention
backend where it keeps K/V inside a block (v1_backend: its own cache write, probed; a
backend it cannot place is a ConfigError at start). Invariant: no kvstore error ever
reaches vLLM — a miss, timeout or dead server turns into "0 tokens matched" (scheduler)
or into the block ids returned by ``get_block_ids_with_load_errors`` (worker), which
vLLM recomputes when ``kv_load_failure_policy`` is "recompute".

Observability (v1_stats): each side's stats go to vLLM through
``get_kv_connector_stats`` (its "KV Transfer metrics" log line and ``vllm:kvstore_*``
in ``/metrics``); the workers report what their saves committed and their drops took
(``build_connector_worker_meta``), and the scheduler, which has vLLM's block hashes,
turns that into KV cache events (``take_events``: ``BlockStored`` / ``BlockRemoved``,
medium "kvstore"), stepping vLLM on while reports are due (``has_pending_push_work``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvstore.connector.v1_backend import block_format_of
from kvstore.connector.v1_config import ConnectorSettings, flag, kv_groups_of
from kvstore.connector.v1_orders import (  # noqa: F401 - re-exported for users and tests
    PARAM_SERVER,
    PARAM_TOKENS,
    KVStoreConnectorMetadata,
    LoadOrder,
    SaveOrder,
    request_scope,
    stored_part,
)
from kvstore.connector.v1_scheduler import SchedulerSide
from kvstore.connector.v1_stats import (
    KVStoreConnectorStats,
    KVStorePromMetrics,
    StoreEvents,
    TransferReports,
)
from kvstore.connector.v1_stores import StoreClients
from kvstore.connector.v1_worker import WorkerSide
from kvstore.core.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_IDLE_STEP_PAUSE_S = 0.002  # between vLLM's empty steps while transfer reports are due


class KVStoreConnectorV1(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(kvt.kv_role, kvt.kv_connector_extra_config,
                                                     _model_name(vllm_config))
        groups = kv_groups_of(kv_cache_config)
        self.layout, self.layer_names = groups.layout, groups.layer_names
        parallel = vllm_config.parallel_config
        worker = role == KVConnectorRole.WORKER
        tp_rank, pp_rank = (_tp_rank(), _pp_rank()) if worker else (0, 0)
        self.stores = StoreClients(self.settings, self.layout, tp_rank,
                                   parallel.tensor_parallel_size, worker=worker,
                                   pp_rank=pp_rank, pp_size=parallel.pipeline_parallel_size)
        self.scheduler = None if worker else SchedulerSide(
            self.settings, self.layout, self.stores,
            StoreEvents(_kv_events_enabled(vllm_config), parallel.world_size,
                        self.layout.block_tokens,
                        getattr(kv_cache_config, "hash_block_size", None)),
            windowed=groups.windowed)
        self.worker = WorkerSide(self.settings, self.layout, self.stores, self.layer_names,
                                 groups.layer_group, groups.windowed) if worker else None

    # vLLM calls each side's methods only on that role's instance.
    @property
    def _scheduler_side(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler call on a worker's connector"
        return self.scheduler

    @property
    def _worker_side(self) -> WorkerSide:
        assert self.worker is not None, "a worker call on the scheduler's connector"
        return self.worker

    # ============================================================ scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A load restores every transferred group (an entry holds every layer)."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator (SupportsHMA): the same answer for every group."""
        return self._scheduler_side.request_finished(request, list(block_ids[0]))

    def reset_cache(self) -> bool | None:
        """After a weight update: KV stored so far is never loaded by this engine again
        (``SchedulerSide.reset``). Called on the scheduler's connector."""
        return self.scheduler.reset() if self.scheduler is not None else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True unless loads are off (``"load": false``, as a producer runs). A
        same-step load (a prefix-cache hit of ``kv_both``, a decode without
        kv_transfer_params) is waited for layer by layer in ``wait_for_layer_load``,
        which a full CUDA graph's replay skips: attention would read blocks still
        being loaded. vLLM then runs its graphs piecewise, the connector's calls
        between the pieces. (Layer-wise saves that a replay skips are made at the
        step's end: no harm.)"""
        return flag(extra_config.get("load", True))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side.observe_reports(connector_output.kv_connector_worker_meta)

    def take_events(self) -> list[KVCacheEvent]:
        return self._scheduler_side.events.take()

    def has_pending_push_work(self) -> bool:
        """Saves or drops whose workers have not reported yet: vLLM keeps stepping
        (empty steps) so their stats and events arrive without a next request, and
        the save orders' bytes leave the scheduler's cap (``QueuedSaveOrders``: a
        chunk order has no event to wait for) before the next request is measured
        against it.

        vLLM asks only when it has no request left, so the short pause slows nothing
        but that idle loop, which would otherwise spin a core against the transfer
        thread it waits for."""
        side = self._scheduler_side
        if not side.events.pending() and not side.save_queue.pending():
            return False
        time.sleep(_IDLE_STEP_PAUSE_S)
        return True

    # ================================================================ both sides
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is not None:
            return self.worker.take_stats()
        return self._scheduler_side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=data) if data is not None else KVStoreConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames,
                                  per_engine_labelvalues)

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
        fmt = block_format_of(self._vllm_config, self.layer_names, kv_caches)
        self._worker_side.register([kv_caches[n] for n in self.layer_names], fmt)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            assert isinstance(connector_metadata, KVStoreConnectorMetadata)
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._worker_side.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        self._worker_side.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker_side.finish_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        return None, self._worker_side.finished_loads(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """get_finished's loads, and of those the ones that failed where block ids
        cannot name them (several KV cache groups): vLLM recomputes those whole."""
        done = self._worker_side.finished_loads(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=set(done),
                                          failed_recving=self._worker_side.failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.load_errors()

    def build_connector_worker_meta(self) -> TransferReports | None:
        return self._worker_side.take_reports()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close(timeout_s=2 * self.settings.timeout_s)
        self.stores.close()


def _model_name(vllm_config: VllmConfig) -> str:
    model_config = vllm_config.model_config
    name = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or "default")


def _kv_events_enabled(vllm_config: VllmConfig) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


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
