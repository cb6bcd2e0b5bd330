"""The connector's worker side: moving KV between vLLM's paged caches and the store
without stopping the engine for the network.

One transfer thread per worker does every store call (TE runs fastest with one
transfer thread per process, and the shared staging buffer serialises them anyway),
taking jobs in priority order: loads this step's forward waits for, then everything
else in arrival order.

* Background loads (a disaggregated decode: the request waits in vLLM's
  WAITING_FOR_REMOTE_KVS): wait for the producer's entries if they are not there
  yet, take them, scatter them into the request's blocks, and report the request
  through ``get_finished`` — its failed blocks through
  ``get_block_ids_with_load_errors`` in the same pass, so vLLM recomputes them.
* Same-step loads (a prefix-cache hit): the forward waits in
  ``wait_for_layer_load`` for just its layer; the thread scatters layer by layer.
* Saves: ``save_kv_layer`` copies layer i of every prompt saved this step into host
  memory as soon as layer i is computed; ``wait_for_save`` copies what no layer
  hook covered and hands the bytes to the thread. From then on the blocks are not
  needed: vLLM may free or reuse them at once. The host bytes of saves not yet sent
  are capped (``QueuedSaves``, ``save_queue_bytes``): past it a save is not made. The
  scheduler caps the orders it makes by the same limit first (``QueuedSaveOrders``,
  from this side's ``released`` reports), so this cap is a guard that does not skip
  (bar a pipeline stage with more layers than the first).

Invariants: nothing writes into a block after the step in which it stops being the
request's (same-step loads finish inside their step; background loads write only
into blocks vLLM holds for the waiting request until ``get_finished`` reports it);
every background load is reported exactly once; no kvstore error reaches vLLM;
every save ordered is reported once (its committed tokens, 0 if not stored), made or
not, so the scheduler's KV events never wait for it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.connector.block_format import BlockFormat
from kvstore.connector.paged_io import gather_layer, scatter_layer
from kvstore.connector.v1_config import ConnectorSettings
from kvstore.connector.v1_orders import KVStoreConnectorMetadata, LoadOrder, SaveOrder
from kvstore.connector.v1_requests import RequestStates
from kvstore.connector.v1_stats import (
    SKIP_LOG_EVERY_S,
    Every,
    KVStoreConnectorStats,
    TransferReports,
)
from kvstore.client.client import PendingInsert
from kvstore.connector.v1_stores import StoreClients
from kvstore.core.errors import InvalidRequestError
from kvstore.core.layout import KVLayout

log = logging.getLogger(__name__)

_SYNC, _OTHER = 0, 1  # job priorities
_NULL_BLOCK = 0  # vLLM's null block (BlockPool.null_block): a freed window's place
_KEEP_BUFFERS = 4  # host buffers kept for reuse
# The longest an idle step (nothing scheduled: every request waits for its KV) waits
# in get_finished for a background load to finish. Without it vLLM's loop steps
# empty steps back to back, and the Python thread that runs them keeps the GIL from
# the transfer thread, which takes it again after each of its hundreds of short
# torch and socket calls: on 2 cores a 25 ms scatter took 0.4-1.5 s that way
# (docs/benchmarks.md, "connector"). A load that finishes wakes the step at once.
IDLE_STEP_WAIT_S = 0.02


class HostBuffers:
    """Reused host buffers for entry bytes (pinned when the caches are on a GPU, so
    device copies can overlap compute). At most ``_KEEP_BUFFERS`` are kept free, and
    at most ``keep_bytes`` of them (the worker's ``save_queue_bytes``): four free
    buffers of the largest prompts seen would otherwise stay pinned outside the cap.
    Past either bound the smallest go, or the largest when it alone is over."""

    def __init__(self, pinned: bool, keep_bytes: int = 1 << 62) -> None:
        self.pinned = pinned
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                self._drop(best)
                return best[:nbytes]
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pinned)[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        with self._lock:
            self._free.append(base)
            while len(self._free) > _KEEP_BUFFERS or self.free_bytes > self.keep_bytes:
                largest = max(self._free, key=lambda b: b.numel())
                self._drop(largest if largest.numel() > self.keep_bytes else
                           min(self._free, key=lambda b: b.numel()))

    @property
    def free_bytes(self) -> int:
        return sum(b.numel() for b in self._free)

    def _drop(self, buf: torch.Tensor) -> None:
        # By identity: list.remove compares tensors with ==, elementwise (it raises on
        # two buffers of different sizes).
        self._free = [b for b in self._free if b is not buf]


class QueuedSaves:
    """The host bytes saves hold from their step's start (``bind`` takes their
    buffers) until the transfer thread is done with them (sent, failed, or not made):
    at most ``limit``, except that a save always gets into an empty queue (a prompt
    larger than the limit is saved alone: the queue holds at most the larger of the
    limit and one prompt, which the KV cache bounds). Without it a server slower than
    the prefill rate grows the worker's host memory without bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._queued = 0
        self._lock = threading.Lock()

    def admit(self, nbytes: int) -> bool:
        """Count a save of ``nbytes`` in, if it fits; False: it is not to be made."""
        with self._lock:
            if self._queued and self._queued + nbytes > self.limit:
                return False
            self._queued += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._queued -= nbytes
            assert self._queued >= 0, "a save's bytes released twice"

    @property
    def queued(self) -> int:
        return self._queued


@dataclass
class _LoadJob:
    order: LoadOrder
    layers: list[threading.Event]  # set as each layer is in the cache (same-step loads)
    done: threading.Event = field(default_factory=threading.Event)
    failed_blocks: set[int] = field(default_factory=set)
    failed: bool = False  # fewer tokens landed in the cache than ordered
    deadline: float | None = None  # waiting for the producer's entries until then
    # Before the next look: 1 ms, growing by half to 20 ms. A save's tail is 10-40 ms
    # (docs/benchmarks.md, "exposed transfer"): finer looks find it sooner, and a
    # look is one lookup round trip (<1 ms), ~50 a second at most while it waits.
    pause: float = 0.001

    @property
    def reported(self) -> bool:
        """vLLM waits for this load through get_finished."""
        return self.order.background and bool(self.order.block_ids)


@dataclass
class _SaveJob:
    order: SaveOrder
    host: torch.Tensor  # (empty when not admitted)
    admitted: bool = True  # False: over save_queue_bytes, not made (no host bytes)
    gathered: set[int] = field(default_factory=set)  # layers already copied; -1: not made
    first_block: int = 0  # the blocks before it are on the server: not copied, not sent
    # Layer-wise saves to a server on this node: the room is reserved while the
    # forward goes on and each copied layer goes into it at once (thread only).
    opened: bool = False  # the reservation job was queued
    pending: PendingInsert | None = None


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, layout: KVLayout, stores: StoreClients,
                 layer_names: Sequence[str], layer_group: Sequence[int] | None = None,
                 windowed: Sequence[bool] = (False,)) -> None:
        self.settings, self.layout, self.stores = settings, layout, stores
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        # Per layer, its KV cache group; per group, whether vLLM replaces its blocks
        # behind a sliding window with its null block (block id 0).
        self.layer_group = list(layer_group) if layer_group is not None \
            else [0] * len(layer_names)
        self.windowed = tuple(windowed)
        self.caches: list[torch.Tensor] = []
        self.fmt: BlockFormat | None = None
        self.buffers = HostBuffers(pinned=False, keep_bytes=settings.save_queue_bytes)
        self.queued_saves = QueuedSaves(settings.save_queue_bytes)
        self._skips = Every(SKIP_LOG_EVERY_S)  # saves not made for the cap: warnings
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._loaded: set[str] = set()  # background loads done, not yet reported
        self._load_errors: dict[str, set[int]] = {}  # their failed blocks
        # What a keep-mode load found stored, whether a chunk save failed: per request,
        # until it finishes and its last job ends (v1_requests).
        self.requests = RequestStates()
        self._ready_errors: set[int] = set()  # for get_block_ids_with_load_errors
        # With several KV cache groups block ids are not unique, so a failed load is
        # reported by request (failed_recving) and vLLM recomputes all of it.
        self._failed_loads: set[str] = set()  # background loads done, failed
        self._ready_failed: set[str] = set()  # for this pass's failed_recving
        self._step_loads: list[_LoadJob] = []  # same-step loads of the bound step
        # What the bound step's same-step loads could not fill: those requests, and
        # blocks (``_settle_step_loads``). A save touching them is not made.
        self._step_failed: tuple[set[str], set[int]] = (set(), set())
        self._step_saves: list[_SaveJob] = []
        self._busy = 0  # jobs queued or running (for drain)
        # Taken each step by vLLM (get_kv_connector_stats, build_connector_worker_meta).
        self._stats = KVStoreConnectorStats()
        self._reports = TransferReports()
        self._first_rank = stores.tp_rank == 0 and stores.pp_rank == 0
        self._idle = threading.Condition(self._lock)
        self._reported_pending = 0  # background loads queued whose report is not out
        self._load_finished = threading.Condition(self._lock)
        self._step_idle = False  # the bound step computes nothing
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-connector",
                                        daemon=True)
        self._thread.start()

    def register(self, caches: list[torch.Tensor], fmt: BlockFormat) -> None:
        self.caches, self.fmt = caches, fmt
        self.buffers = HostBuffers(pinned=caches[0].device.type == "cuda",
                                   keep_bytes=self.settings.save_queue_bytes)
        if caches[0].device.type == "cpu":
            self._one_intraop_thread()

    def _one_intraop_thread(self) -> None:
        """Make the transfer thread run its torch ops on one OpenMP thread.

        On a CPU engine the forward's matmuls use every core through the main
        thread's OpenMP team. A torch op on another thread starts a second team on
        the same cores, and from then on the engine's decode steps took 2.7x as
        long (21 vs 8 ms per step of 4 requests, 24 layers; tools/bench/connector.py,
        "inter-token latency"), for good. The copies this thread makes are
        memory-bound: one thread loses nothing.

        ``torch.set_num_threads`` sets the calling thread's OpenMP thread count and
        also the process's default for threads that have not run a torch op yet;
        vLLM's CPU worker forbids it after binding its threads to cores, so the C
        function is called: here on the transfer thread (after its own first op),
        then on this thread with its own count, so that default is as it was."""
        mine = torch.get_num_threads()  # also fixes this thread's count before the change
        done = threading.Event()

        def pin() -> None:
            torch.get_num_threads()  # the thread's own lazy init, before the change
            torch._C.set_num_threads(1)
            done.set()

        self._submit(_SYNC, pin)
        if not done.wait(timeout=10.0):
            log.warning("kvstore connector: transfer thread did not start; torch threads "
                        "left as they are")
            return
        torch._C.set_num_threads(mine)

    def _format(self) -> BlockFormat:
        # vLLM registers the caches before its first step, so before any load or save.
        assert self.fmt is not None, "no KV caches registered"
        return self.fmt

    # ------------------------------------------------------------ per step
    def bind(self, meta: KVStoreConnectorMetadata) -> None:
        """A step begins (before its forward): its saves get their host buffers, as
        far as ``save_queue_bytes`` allows."""
        self._step_idle = meta.idle
        self._step_failed = (set(), set())
        if self._step_saves:  # a step vLLM never finished (no wait_for_save): not made
            log.warning("kvstore connector: a step ended without wait_for_save; its %d "
                        "save(s) not made", len(self._step_saves))
            for unfinished in self._step_saves:
                unfinished.gathered.add(-1)
            self._hand_over_saves()
        self._step_saves = [self._save_job(order) for order in meta.saves]

    def _save_job(self, order: SaveOrder) -> _SaveJob:
        """A save with its host buffer; or, when the saves queued already hold
        ``save_queue_bytes``, one that is not made: no buffer, no copy, no room on the
        server (layer-wise saves open theirs at the first layer copied). It still goes
        through the thread like a save that failed (``_save``): reported as 0 tokens
        stored, so the scheduler's KV events do not wait for it, and a chunk's later
        orders are dropped. The scheduler caps the saves it orders by the same
        limit, counted from the order until this worker's report that the bytes
        are let go (``QueuedSaveOrders``), so it skips first and the prompt gets no
        params; this cap is the worker's own guard. A save skipped here, whose
        params went out with the order, costs its decode ``load_wait_s`` before it
        recomputes."""
        nbytes = self.layout.nbytes(len(order.token_ids))
        if self.queued_saves.admit(nbytes):
            return _SaveJob(order, self.buffers.take(nbytes))
        self._skipped_for_cap(order, nbytes)
        return _SaveJob(order, torch.empty(0, dtype=torch.uint8), admitted=False,
                        gathered={-1})

    def _skipped_for_cap(self, order: SaveOrder, nbytes: int) -> None:
        if not (skipped := self._skips.due()):
            return
        log.warning("save of %s (%d bytes): not made: saves holding %d bytes of host memory "
                    "wait for the server already (save_queue_bytes %d); %d save(s) not made "
                    "since the last warning. The server is slower than this engine's "
                    "prefills", order.req_id, nbytes, self.queued_saves.queued,
                    self.queued_saves.limit, skipped)

    def _skippable(self, job: _SaveJob) -> int:
        """The blocks of a save the server holds: what the scheduler's lookup found,
        but no more than this request's load found (same-step loads have fetched
        before any layer is saved: each layer waits for its load first)."""
        order = job.order
        held = self.requests.take_held(order.req_id)
        if held is None or held >= len(order.token_ids):
            return order.first_block
        return min(order.first_block, held // self.layout.block_tokens)

    def start(self, meta: KVStoreConnectorMetadata) -> None:
        """Queue the step's loads (vLLM calls this before the forward when it has
        same-step loads, else after it)."""
        for order in meta.loads:
            job = _LoadJob(order, [threading.Event() for _ in self.caches])
            self.requests.job_queued(order.req_id)
            same_step = not order.background and bool(order.block_ids)
            if same_step:
                self._step_loads.append(job)
            if job.reported:
                with self._lock:
                    self._reported_pending += 1
            self._submit(_SYNC if same_step else _OTHER, functools.partial(self._load, job))

    def wait_for_layer(self, layer_name: str) -> None:
        i = self.layer_index.get(layer_name)
        if i is None:
            return
        for job in self._step_loads:
            job.layers[i].wait()  # every store call inside is bounded

    def save_layer(self, layer_name: str) -> None:
        i = self.layer_index.get(layer_name)
        if i is None or not self.settings.layerwise_saves:
            return  # (not layer-wise: finish_step copies every layer)
        for job in self._step_saves:
            self._gather(job, i)

    def finish_step(self) -> None:
        """End of the step's forward: same-step loads are complete (their errors are
        this pass's), saves' bytes are on the host and go to the thread. A save
        whose request, or any of whose blocks, a same-step load failed to fill is
        not made: those blocks hold no KV of its prompt, nor does anything computed
        on top of them in this forward (vLLM recomputes them; stored, they would be
        every later reader's wrong KV)."""
        self._settle_step_loads()
        failed_reqs, failed_blocks = self._step_failed
        for save in self._step_saves:
            order = save.order
            ids = set(order.block_ids).union(*order.groups)
            if order.req_id in failed_reqs or not failed_blocks.isdisjoint(ids):
                log.warning("save of %s: not made: a load into its blocks failed in this "
                            "step", order.req_id)
                save.gathered.add(-1)  # (layer-wise: its open room is given back)
                continue
            for i in range(len(self.caches)):
                self._gather(save, i)
        if self._step_saves and self.caches and self.caches[0].device.type == "cuda":
            torch.cuda.current_stream(self.caches[0].device).synchronize()
        self._hand_over_saves()

    def _hand_over_saves(self) -> None:
        """The bound step's saves go to the thread, made or not (``_save`` reports
        each, gives back its buffer and its room)."""
        for save in self._step_saves:
            self.requests.job_queued(save.order.req_id)
            self._submit(_OTHER, functools.partial(self._save, save))
        self._step_saves = []

    def _settle_step_loads(self) -> None:
        """Wait for the bound step's same-step loads to finish (the forward waited for
        all their layers) and make their failed blocks this pass's load errors.
        Runs at the first of ``load_errors`` and ``finish_step``: vLLM asks for the
        errors before ``wait_for_save`` where it finalizes late (speculative
        decoding), and they are this step's then too."""
        failed_reqs, failed_blocks = self._step_failed
        for load in self._step_loads:
            load.done.wait()
            if load.failed:
                failed_reqs.add(load.order.req_id)
                failed_blocks |= load.failed_blocks
            with self._lock:
                self._ready_errors |= load.failed_blocks
        self._step_loads = []

    def _gather(self, job: _SaveJob, layer: int) -> None:
        if layer in job.gathered or -1 in job.gathered:
            return
        if not job.gathered:
            job.first_block = self._skippable(job)
        job.gathered.add(layer)
        order = job.order
        try:
            ids = self._ids(order.block_ids, order.groups, layer)
            if self._freed(ids, layer, job.first_block, len(order.token_ids)):
                raise InvalidRequestError("blocks to save were freed behind the sliding "
                                          "window (null blocks)")
            gather_layer(self.layout, self._format(), self.caches[layer], layer,
                         ids, len(order.token_ids), job.host, job.first_block)
        except Exception:  # noqa: BLE001 - a save that cannot be made is skipped
            log.exception("save of %s: copying layer %d failed; not saved", order.req_id, layer)
            job.gathered.add(-1)
            return
        if self.settings.layerwise_saves:
            self._stream(job, layer)

    def _stream(self, job: _SaveJob, layer: int) -> None:
        """Hand layer ``layer`` of a save to the thread as soon as it is on the host:
        it goes into the server's reserved room while the next layers compute."""
        if not job.opened:
            job.opened = True
            self._submit(_OTHER, functools.partial(self._open, job))
        ready = None
        if self.caches[layer].device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.caches[layer].device))
        self._submit(_OTHER, functools.partial(self._write_layer, job, layer, ready))

    def _sent(self, job: _SaveJob) -> torch.Tensor:
        """The part of a save's host bytes that is sent (from its first block on)."""
        lay = self.layout
        ntokens = len(job.order.token_ids)
        return job.host[lay.nbytes(min(ntokens, job.first_block * lay.block_tokens)):]

    def _open(self, job: _SaveJob) -> None:
        broken = job.order.continues and self.requests.chunks_failed(job.order.req_id)
        if -1 not in job.gathered and not broken:
            job.pending = self.stores.begin_insert(job.order, job.first_block)

    def _write_layer(self, job: _SaveJob, layer: int, ready: torch.cuda.Event | None) -> None:
        if job.pending is None or -1 in job.gathered:
            return
        if ready is not None:
            ready.synchronize()
        try:
            job.pending.write_layer(self._sent(job).numpy(), layer)
        except Exception:  # noqa: BLE001 - the commit writes what is missing, or fails
            log.exception("save of %s: writing layer %d early failed", job.order.req_id,
                          layer)

    def _ids(self, block_ids: list[int], groups: tuple[list[int], ...],
             layer: int) -> list[int]:
        """The blocks of ``layer``: its group's, when the order has several."""
        return groups[self.layer_group[layer]] if groups else block_ids

    def _nulls(self, ids: Sequence[int], layer: int) -> int:
        """Leading null blocks of a windowed group's list (the window's past)."""
        if not self.windowed[self.layer_group[layer]]:
            return 0
        return next((i for i, b in enumerate(ids) if b != _NULL_BLOCK), len(ids))

    def _freed(self, ids: Sequence[int], layer: int, first_block: int, ntokens: int) -> bool:
        """Whether a block of ``layer`` to save (from ``first_block``) is a null block."""
        need = -(-ntokens // self.layout.block_tokens)
        return self.windowed[self.layer_group[layer]] and \
            _NULL_BLOCK in list(ids[first_block:need])

    # ------------------------------------------------------------ reports
    def finished_loads(self, finished_req_ids: Collection[str] = frozenset()) -> set[str]:
        """Background loads done since the last call; their failed blocks become this
        pass's load errors. ``finished_req_ids``: requests vLLM finished since.

        In an idle step with loads in flight it first waits (``IDLE_STEP_WAIT_S`` at
        most) for one to finish, so vLLM's empty steps do not starve the transfer
        thread they wait for."""
        with self._lock:
            if self._step_idle and self._reported_pending and not self._loaded:
                self._load_finished.wait(IDLE_STEP_WAIT_S)
            self.requests.finished(finished_req_ids)
            done, self._loaded = self._loaded, set()
            for rid in done:
                self._ready_errors |= self._load_errors.pop(rid, set())
                if rid in self._failed_loads:
                    self._failed_loads.discard(rid)
                    self._ready_failed.add(rid)
            return done

    def failed_loads(self) -> set[str]:
        """Requests reported done by ``finished_loads`` whose load failed (several KV
        cache groups only: then their blocks are not named in load errors)."""
        with self._lock:
            failed, self._ready_failed = self._ready_failed, set()
            return failed

    def load_errors(self) -> set[int]:
        self._settle_step_loads()
        with self._lock:
            errors, self._ready_errors = self._ready_errors, set()
            return errors

    def take_stats(self) -> KVStoreConnectorStats | None:
        """The transfers finished since the last call (None if none)."""
        with self._lock:
            return self._stats.take()

    def take_reports(self) -> TransferReports | None:
        """What finished saves committed and drop-mode loads took, per request,
        since the last call (the scheduler side makes the KV events of them)."""
        with self._lock:
            reports, self._reports = self._reports, TransferReports()
        return reports if reports else None

    # ------------------------------------------------------------ the thread
    def _submit(self, priority: int, work: Callable[[], None]) -> None:
        with self._lock:
            self._busy += 1
        self._jobs.put((priority, next(self._seq), work))

    def _run(self) -> None:
        while True:
            _, _, work = self._jobs.get()
            if work is None:
                return
            try:
                work()
            except Exception:  # noqa: BLE001 - the thread must outlive any job
                log.exception("kvstore connector job failed")
            finally:
                with self._lock:
                    self._busy -= 1
                    self._idle.notify_all()

    def _arrived(self, job: _LoadJob) -> bool:
        """Whether a load that waits for the producer may go on now: its entries are
        all there, or its time is up. Otherwise it is queued again after a pause, so
        waiting never holds the thread other loads and saves need."""
        order = job.order
        now = time.monotonic()
        if job.deadline is None:
            job.deadline = now + self.settings.load_wait_s
        want = min(order.ntokens, len(order.token_ids))
        held = self.stores.lookup(order.server, order.token_ids, order.scope,
                                  timeout_s=max(0.25, min(job.deadline - now, 1.0)),
                                  mark_down=False)
        if held >= want or time.monotonic() >= job.deadline or \
                not self.stores.usable(order.server):
            return True  # (a server known to be down: the load fails at once)
        delay, job.pause = job.pause, min(job.pause * 1.5, 0.02)
        with self._lock:
            self._busy += 1  # still pending: drain() must wait for it
        timer = threading.Timer(delay, lambda: self._jobs.put(
            (_OTHER, next(self._seq), lambda: self._load(job))))
        timer.daemon = True
        timer.start()
        return False

    def _load(self, job: _LoadJob) -> None:
        order, lay = job.order, self.layout
        host = None
        got = held = moved = 0
        start = time.perf_counter()
        try:
            if order.wait and not self._arrived(job):
                return  # queued again; nothing of it is done yet
            start = time.perf_counter()  # the load's time is the transfer's, not the wait
            host = self.buffers.take(lay.nbytes(len(order.token_ids)))
            held, moved = self.stores.fetch(order, host)
            if self.settings.load_mode == "keep":
                self.requests.hold(order.req_id, held)
            got = self._scatter(job, host, held) if order.block_ids else held
        except Exception:  # noqa: BLE001 - reported as load errors, never raised
            log.exception("load of %s failed", order.req_id)
        finally:
            if host is not None:
                self.buffers.give(host)
        try:
            # Recorded before the load is done: a same-step load's stats go out with
            # its step.
            self._record_load(order, held, moved, got, time.perf_counter() - start)
        finally:
            for event in job.layers:
                event.set()
            self._finish_load(job, got)  # always: vLLM waits for this report

    def _record_load(self, order: LoadOrder, held: int, moved: int, got: int,
                     seconds: float) -> None:
        into_cache = max(0, got - order.first_block * self.layout.block_tokens) \
            if order.block_ids else 0
        with self._lock:
            self._stats.record_load(into_cache, moved, seconds,
                                    failed=bool(order.block_ids) and got < order.ntokens,
                                    count_request=self._first_rank)
            if self.settings.load_mode == "drop":
                self._reports.dropped.setdefault(order.req_id, []).append(held)

    def _scatter(self, job: _LoadJob, host: torch.Tensor, held: int) -> int:
        """Scatter layer by layer what arrived; the tokens now in the cache."""
        order, lay = job.order, self.layout
        got = min(held, order.ntokens)
        # A partially received block is recomputed whole: keep only full ones.
        good = got if got == order.ntokens else got - got % lay.block_tokens
        if good <= order.first_block * lay.block_tokens:
            return good
        fmt = self._format()
        for i, cache in enumerate(self.caches):
            ids = self._ids(order.block_ids, order.groups, i)
            # A sliding window's layers get only the blocks vLLM gave them (the rest
            # is behind the window: null blocks, never read).
            first = max(order.first_block, self._nulls(ids, i))
            if first * lay.block_tokens < good:
                scatter_layer(lay, fmt, host, cache, i, ids, good, first, data_tokens=held)
            if cache.device.type == "cuda":
                torch.cuda.current_stream(cache.device).synchronize()
            job.layers[i].set()
        return good

    def _finish_load(self, job: _LoadJob, got: int) -> None:
        order, bt = job.order, self.layout.block_tokens
        if order.block_ids and got < order.ntokens:
            nblocks = -(-order.ntokens // bt)
            first_bad = max(order.first_block, got // bt)
            for g, ids in enumerate(order.groups or (order.block_ids,)):
                bad = ids[first_bad:nblocks]
                job.failed_blocks |= {b for b in bad if b != _NULL_BLOCK} \
                    if self.windowed[g] else set(bad)
            log.info("request %s: %d of %d tokens loaded; %d blocks to recompute",
                     order.req_id, got, order.ntokens, nblocks - first_bad)
            job.failed = True
        with self._lock:
            if job.reported:
                self._loaded.add(order.req_id)
                if job.failed_blocks and len(self.windowed) > 1:
                    self._failed_loads.add(order.req_id)
                elif job.failed_blocks:
                    self._load_errors[order.req_id] = job.failed_blocks
                self._reported_pending -= 1
                self._load_finished.notify_all()
        self.requests.job_ended(order.req_id)
        job.done.set()

    def _save(self, job: _SaveJob) -> None:
        ok, start = False, time.perf_counter()
        lay, ntokens = self.layout, len(job.order.token_ids)
        skipped = lay.nbytes(min(ntokens, job.first_block * lay.block_tokens))
        order = job.order
        broken = order.continues and self.requests.chunks_failed(order.req_id)
        try:
            if -1 in job.gathered or broken:
                # (after a failed chunk the rest would be stored unreachable)
                if job.pending is not None:
                    job.pending.abort()
            elif job.pending is not None:
                ok = self.stores.commit_insert(job.order, job.pending, job.host[skipped:])
            else:
                ok = self.stores.insert(job.order, job.host[skipped:], job.first_block)
        finally:
            if job.admitted:
                self.buffers.give(job.host)
                self.queued_saves.release(lay.nbytes(ntokens))
            last = job.order.last
            if last:
                self.requests.chunks_done(order.req_id)
            elif not ok:
                self.requests.fail_chunks(order.req_id)
            with self._lock:
                self._reports.released.append(order.req_id)  # (the scheduler's cap)
                if job.admitted:
                    self._stats.record_save(ntokens, lay.nbytes(ntokens) - skipped,
                                            time.perf_counter() - start, ok,
                                            count_request=self._first_rank and last)
                else:
                    self._stats.record_skipped_save()
                if last:  # a chunk's save is not the prompt's (its KV events wait)
                    self._reports.saved.setdefault(job.order.req_id, []).append(
                        ntokens if ok else 0)
            self.requests.job_ended(order.req_id)

    # ------------------------------------------------------------ lifecycle
    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued job has run; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.drain(timeout_s):
            log.warning("kvstore connector: transfers still running at shutdown")
        self._jobs.put((_OTHER + 1, next(self._seq), None))
        self._thread.join(timeout=1.0)
