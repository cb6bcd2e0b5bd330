"""What the connector tells vLLM about its transfers: stats for vLLM's log line and
Prometheus ``/metrics``, and KV cache events for the blocks the store holds.

Stats (``KVStoreConnectorStats``): each worker records its loads and saves, the
scheduler its lookups and the request-named servers it refused; vLLM takes them every
step (``get_kv_connector_stats``: the recorder is taken and reset), sums them over TP
workers (``aggregate``), carries ``to_dict()`` from the engine core to the front end
and, per logging interval, prints ``reduce()`` ("KV Transfer metrics: ...") and feeds
``KVStorePromMetrics`` (``vllm:kvstore_*``). Request and token counts come from the
first rank only (every rank moves the same tokens, its own heads); bytes, times and
failures from every rank (each is a transfer of its own).

Events: vLLM's block hashes live on the scheduler's ``Request.block_hashes``, so the
events are made there (``StoreEvents``), from what the workers report back
(``TransferReports``, vLLM's worker metadata): ``BlockStored`` once every worker's save
of a prompt committed (as many full blocks as all of them stored), ``BlockRemoved``
once a drop-mode load took them (as many as any worker took). A prompt's last,
partial block has no vLLM hash and is never announced. The store announces nothing
itself: entries it evicts or expires are not seen here (a router's later hit there
is a connector miss, recomputed). Saves of blocks the store already has and drops of
blocks another producer also saved are announced as they happen: consumers count
announcements per hash, as the store counts pending consumers per entry.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)
from vllm.v1.metrics.utils import create_metric_per_engine

log = logging.getLogger(__name__)

MEDIUM = "kvstore"  # the ``medium`` of this connector's events
REPORT_WAIT_S = 120.0  # a transfer whose reports have not all come by then is dropped
SKIP_LOG_EVERY_S = 10.0  # saves not made for a cap: one warning per interval at most

# Counters: name -> what it counts (the Prometheus counter is vllm:kvstore_<name>).
COUNTERS = {
    "loads": "Requests whose KV was loaded from kvstore (first TP rank).",
    "loaded_tokens": "Tokens written into vLLM's KV cache from kvstore (first TP rank).",
    "loaded_bytes": "Entry bytes received from kvstore (every rank).",
    "load_failures": "Loads that brought fewer tokens than ordered: their blocks are "
                     "recomputed (every rank).",
    "saves": "Prompts whose KV kvstore committed (first TP rank).",
    "saved_tokens": "Tokens whose KV kvstore committed (first TP rank).",
    "saved_bytes": "Entry bytes handed to kvstore by committed saves (every rank).",
    "save_failures": "Saves that were not stored: copy, network or server failures "
                     "(every rank).",
    "saves_skipped": "Saves not made: the queued saves held save_queue_bytes of the "
                     "workers' host memory already (the scheduler's count; a worker's "
                     "own guard counts per rank).",
    "hits": "Requests the scheduler found (or the producer claimed) stored in kvstore.",
    "misses": "Requests the scheduler asked kvstore for that it held nothing of.",
    "rejected_servers": "Request-named servers refused: not configured (kv_transfer_params).",
}
DURATIONS = {
    "load_seconds": "Time of a load: taking the entries and writing them into the cache.",
    "save_seconds": "Time of a save: handing the copied entries to kvstore until commit.",
}
_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """One interval's counts; ``data`` holds only ints and lists of floats (it is
    pickled from worker to engine core, then msgpack'd to the front end)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # rebuilt from to_dict(): a newer peer's extra keys are kept, missing ones 0
            for name in COUNTERS:
                self.data.setdefault(name, 0)
            for name in DURATIONS:
                self.data.setdefault(name, [])

    def reset(self) -> None:
        self.data = {**{name: 0 for name in COUNTERS}, **{name: [] for name in DURATIONS}}

    # ------------------------------------------------------------ recording
    def record_load(self, tokens: int, nbytes: int, seconds: float, failed: bool,
                    count_request: bool) -> None:
        d = self.data
        if count_request and tokens > 0:
            d["loads"] += 1
            d["loaded_tokens"] += tokens
        d["loaded_bytes"] += nbytes
        d["load_failures"] += int(failed)
        d["load_seconds"].append(seconds)

    def record_save(self, tokens: int, nbytes: int, seconds: float, ok: bool,
                    count_request: bool) -> None:
        d = self.data
        if not ok:
            d["save_failures"] += 1
            return
        if count_request:
            d["saves"] += 1
            d["saved_tokens"] += tokens
        d["saved_bytes"] += nbytes
        d["save_seconds"].append(seconds)

    def record_skipped_save(self) -> None:
        self.data["saves_skipped"] += 1

    def record_lookup(self, stored_tokens: int) -> None:
        self.data["hits" if stored_tokens > 0 else "misses"] += 1

    def record_rejected(self, count: int) -> None:
        self.data["rejected_servers"] += count

    def take(self) -> KVStoreConnectorStats | None:
        """This interval's stats (None if nothing happened); the recorder starts over."""
        if self.is_empty():
            return None
        taken = KVStoreConnectorStats(data=self.data)
        self.reset()
        return taken

    # ------------------------------------------------------------ vLLM's contract
    def is_empty(self) -> bool:
        return not any(self.data[name] for name in (*COUNTERS, *DURATIONS))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(name, []).extend(value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "Loads": d["loads"], "Loaded tokens": d["loaded_tokens"],
            "Loaded MiB": round(d["loaded_bytes"] / 2**20, 3),
            "Avg load ms": _avg_ms(d["load_seconds"]), "Load failures": d["load_failures"],
            "Saves": d["saves"], "Saved tokens": d["saved_tokens"],
            "Saved MiB": round(d["saved_bytes"] / 2**20, 3),
            "Avg save ms": _avg_ms(d["save_seconds"]), "Save failures": d["save_failures"],
            "Saves skipped": d["saves_skipped"],
            "Hits": d["hits"], "Misses": d["misses"],
            "Rejected servers": d["rejected_servers"],
        }
        return out


def _avg_ms(seconds: list[float]) -> float:
    return round(1000 * sum(seconds) / len(seconds), 3) if seconds else 0.0


class KVStorePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvstore_<counter>_total`` per COUNTERS and ``vllm:kvstore_<duration>``
    histograms, labelled per engine like vLLM's own metrics. Each observation is one
    interval's stats (reset after each): counters are incremented by it."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types every metric class it hands over, and every per-engine child, as
        # Gauge | Counter | Histogram (under Ray they are wrappers of none of them):
        # each is used here as the kind it was asked for.
        counter_cls: Callable[..., Any] = self._counter_cls
        histogram_cls: Callable[..., Any] = self._histogram_cls
        self.counters: dict[str, dict[int, Any]] = {
            name: create_metric_per_engine(
                counter_cls(name=f"vllm:kvstore_{name}", documentation=doc,
                            labelnames=labelnames), per_engine_labelvalues)
            for name, doc in COUNTERS.items()}
        self.histograms: dict[str, dict[int, Any]] = {
            name: create_metric_per_engine(
                histogram_cls(name=f"vllm:kvstore_{name}", documentation=doc,
                              buckets=_TIME_BUCKETS, labelnames=labelnames),
                per_engine_labelvalues)
            for name, doc in DURATIONS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self.counters.items():
            if value := transfer_stats_data.get(name, 0):
                per_engine[engine_idx].inc(value)
        for name, per_engine in self.histograms.items():
            for seconds in transfer_stats_data.get(name, ()):
                per_engine[engine_idx].observe(seconds)


# ================================================================== events
@dataclass
class TransferReports(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: per request, the tokens each worker's finished
    save committed (0: failed) and each drop-mode load took from the store; and
    ``released``, one request id per save order (chunk or whole, made or not) whose
    host bytes a worker has let go (the scheduler's cap on queued saves,
    kvstore.connector.v1_scheduler.QueuedSaveOrders)."""

    saved: dict[str, list[int]] = field(default_factory=dict)
    dropped: dict[str, list[int]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TransferReports)
        for mine, theirs in ((self.saved, other.saved), (self.dropped, other.dropped)):
            for req_id, tokens in theirs.items():
                mine.setdefault(req_id, []).extend(tokens)
        self.released.extend(other.released)
        return self

    def __bool__(self) -> bool:
        return bool(self.saved or self.dropped or self.released)


class Every:
    """At most one warning per ``interval_s``: ``due()`` counts an occurrence and
    says how many there were since the last warning when one is due (else 0)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._unlogged = 0
        self._logged_at = -interval_s
        self._lock = threading.Lock()

    def due(self) -> int:
        now = time.monotonic()
        with self._lock:
            self._unlogged += 1
            if now - self._logged_at < self.interval_s:
                return 0
            count, self._unlogged, self._logged_at = self._unlogged, 0, now
            return count


@dataclass
class _Pending:
    request: Any  # vllm.v1.request.Request: its block hashes, tokens, LoRA, salt
    expected: int  # reports still to come
    tokens: list[int] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)


class StoreEvents:
    """Scheduler side: which saves and drops are waiting for their workers' reports,
    and the events of those that have them all. ``enabled`` False (vLLM's KV events
    off) still tracks the reports, so ``pending`` keeps the engine stepping until the
    workers' stats of the last transfers have come back."""

    def __init__(self, enabled: bool, workers: int, block_size: int,
                 hash_block_size: int | None) -> None:
        self.enabled, self.workers, self.block_size = enabled, workers, block_size
        self.hash_block_size = hash_block_size or block_size
        self._saves: dict[str, _Pending] = {}
        self._drops: dict[str, _Pending] = {}
        self._events: list[KVCacheEvent] = []

    def expect_save(self, request: Any) -> None:
        self._expect(self._saves, request)

    def expect_drop(self, request: Any) -> None:
        self._expect(self._drops, request)

    def _expect(self, pending: dict[str, _Pending], request: Any) -> None:
        entry = pending.get(request.request_id)
        if entry is None:
            pending[request.request_id] = _Pending(request, self.workers)
        else:  # the same request again (resumed after preemption)
            entry.expected += self.workers

    def observe(self, reports: TransferReports) -> None:
        for req_id, tokens in reports.saved.items():
            if (entry := self._arrived(self._saves, req_id, tokens)) is not None:
                self._stored(entry.request, min(entry.tokens))
        for req_id, tokens in reports.dropped.items():
            if (entry := self._arrived(self._drops, req_id, tokens)) is not None:
                self._removed(entry.request, max(entry.tokens))

    def _arrived(self, pending: dict[str, _Pending], req_id: str,
                 tokens: list[int]) -> _Pending | None:
        entry = pending.get(req_id)
        if entry is None:
            return None
        entry.tokens.extend(tokens)
        entry.expected -= len(tokens)
        if entry.expected > 0:
            return None
        return pending.pop(req_id)

    def pending(self) -> bool:
        """Transfers whose reports are still due (the oldest given up on after
        ``REPORT_WAIT_S``: a worker that never reports must not keep vLLM stepping)."""
        cutoff = time.monotonic() - REPORT_WAIT_S
        for pending in (self._saves, self._drops):
            for req_id in [r for r, e in pending.items() if e.since < cutoff]:
                log.warning("request %s: workers' transfer reports never came; no event",
                            req_id)
                del pending[req_id]
        return bool(self._saves or self._drops)

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------ building
    def _stored(self, request: Any, tokens: int) -> None:
        if self.enabled and (event := block_stored(request, tokens // self.block_size,
                                                   self.block_size,
                                                   self.hash_block_size)) is not None:
            self._events.append(event)

    def _removed(self, request: Any, tokens: int) -> None:
        if not self.enabled:
            return
        hashes = _hashes(request, tokens // self.block_size, self.block_size,
                         self.hash_block_size)
        if hashes:
            self._events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM, group_idx=0))


def _hashes(request: Any, nblocks: int, block_size: int, hash_block_size: int) -> list:
    hashes = resolve_block_hashes(request.block_hashes, hash_block_size, block_size)
    return [maybe_convert_block_hash(hashes[i]) for i in range(min(nblocks, len(hashes)))]


def block_stored(request: Any, nblocks: int, block_size: int,
                 hash_block_size: int) -> BlockStored | None:
    """The event for a request's first ``nblocks`` full blocks now in the store, in
    the shape vLLM's own prefix cache announces reused blocks (one event, its parent
    None: the run starts at the prompt's first block)."""
    hashes = _hashes(request, nblocks, block_size, hash_block_size)
    if not hashes:
        return None
    extra, mm_index = [], 0
    for i in range(len(hashes)):
        keys, mm_index = generate_block_hash_extra_keys(request, i * block_size,
                                                        (i + 1) * block_size, mm_index)
        extra.append(keys)
    lora = request.lora_request
    return BlockStored(
        block_hashes=hashes, parent_block_hash=None,
        token_ids=list(request.all_token_ids[:len(hashes) * block_size]),
        block_size=block_size, lora_id=lora.adapter_id if lora else None, medium=MEDIUM,
        lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra),
        group_idx=0, session_id=getattr(request, "session_id", None))
