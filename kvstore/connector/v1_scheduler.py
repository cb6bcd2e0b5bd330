"""The connector's scheduler side: which tokens a request gets from the store, and the
load and save orders of each step.

The scheduler never waits on the network for a disaggregated decode: a request whose
``kv_transfer_params`` come from a producer (``kvstore_server`` + ``kvstore_tokens``)
is told "that many tokens, loading asynchronously" at once, and the worker finds the
entries (waiting for the producer's save if it is still on its way). Without such
params (a prefix cache, ``kv_both``) the scheduler asks the store with
``lookup_timeout_s``; a server that fails is skipped for a while (StoreClients), so a
dead server costs one short timeout, not one per request. Such a hit loads in the
step that computes the rest of the prompt, layer by layer.

State, all keyed by request id and dropped at ``request_finished``:
``_scopes`` (request_scope, from the first sight of the request), ``_matched``
(what get_num_new_matched_tokens answered, until update_state_after_alloc),
``_loads`` (orders for the next metadata), ``_tracked`` (prompts still to save),
``_held`` (what a keep-mode lookup found stored: the save skips those blocks),
``_requests`` (vLLM's Request: its block hashes, for the KV events of its saves and
drops, which ``events`` keeps until the workers have reported them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvstore.connector.v1_config import ConnectorSettings
from kvstore.connector.v1_orders import (
    PARAM_GENERATION,
    PARAM_SERVER,
    PARAM_TOKENS,
    KVStoreConnectorMetadata,
    LoadOrder,
    SaveOrder,
    claimed_tokens,
    request_scope,
    stored_part,
)
from kvstore.connector.v1_stats import (
    REPORT_WAIT_S,
    SKIP_LOG_EVERY_S,
    Every,
    KVStoreConnectorStats,
    StoreEvents,
    TransferReports,
)
from kvstore.connector.v1_stores import StoreClients
from kvstore.core.layout import KVLayout

log = logging.getLogger(__name__)


_LOOKUP_MEMO_S = 1.0


class _Match(NamedTuple):
    local: int  # vLLM's own (block-aligned) prefix-cache hit
    server: str
    stored: int  # tokens the store has (or the producer claims) for this prompt
    claimed: bool  # from the producer's kv_transfer_params, not a lookup


@dataclass
class _Tracked:
    """A running request whose prompt may need saving."""

    token_ids: list[int]  # what will be saved: the prompt but its last token
    groups: list[list[int]]  # its blocks, per KV cache group
    scope: str
    first_block: int = 0  # blocks before it were on the server at the lookup
    ordered: int = 0  # blocks its chunk orders have saved (chunk saves only)


class QueuedSaveOrders:
    """The scheduler's cap on queued saves (``save_queue_bytes``): the host bytes of
    the save orders it made that a worker still holds, counted from the order until
    every worker has reported letting them go (``TransferReports.released``, one per
    order and worker). A worker holds a save's bytes from its step's start until its
    transfer thread is done with it, inside that span, so a worker's own cap
    (``QueuedSaves``) is not the one that skips while this one holds (with pipeline
    parallelism, only where a later stage holds more layers than the first, whose
    layout the scheduler has). Skipping here is what lets the prompt go without
    params: a decode then recomputes it at once instead of waiting ``load_wait_s``
    for a save that never comes. A save always gets into an empty queue, as on the
    worker. A request whose reports have not all come ``REPORT_WAIT_S`` after its
    last order is let go (logged): a lost report must not shrink the cap for ever."""

    def __init__(self, limit: int, workers: int) -> None:
        self.limit, self.workers = limit, workers
        self.queued = 0
        # req -> [bytes, reports still due, when its last order was made]
        self._held: dict[str, list[float]] = {}
        self._expired = Every(SKIP_LOG_EVERY_S)

    def admit(self, req_id: str, nbytes: int) -> bool:
        """Count an order of ``nbytes`` in, if it fits; False: it is not to be made."""
        self._expire()
        if self.queued and self.queued + nbytes > self.limit:
            return False
        entry = self._held.setdefault(req_id, [0, 0, 0.0])
        entry[0] += nbytes
        entry[1] += self.workers
        entry[2] = time.monotonic()
        self.queued += nbytes
        return True

    def released(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            entry = self._held.get(req_id)
            if entry is None:
                continue  # (given up on after REPORT_WAIT_S)
            entry[1] -= 1
            if entry[1] <= 0:
                self._drop(req_id)

    def pending(self) -> bool:
        """Orders whose reports are still due (those past ``REPORT_WAIT_S`` let go)."""
        self._expire()
        return bool(self._held)

    def _drop(self, req_id: str) -> None:
        self.queued -= int(self._held.pop(req_id)[0])

    def _expire(self) -> None:
        cutoff = time.monotonic() - REPORT_WAIT_S
        for req_id in [r for r, e in self._held.items() if e[2] < cutoff]:
            self._drop(req_id)
            if count := self._expired.due():
                log.warning("request %s: the workers' reports of its save never came in "
                            "%.0f s; its bytes no longer count against save_queue_bytes "
                            "(%d such request(s) since the last warning)", req_id,
                            REPORT_WAIT_S, count)


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, layout: KVLayout,
                 stores: StoreClients, events: StoreEvents | None = None,
                 windowed: tuple[bool, ...] = (False,)) -> None:
        self.settings, self.layout, self.stores = settings, layout, stores
        self.many_groups = len(windowed) > 1
        self.windowed = windowed
        # vLLM frees a sliding window's blocks as the prefill moves on, so each step
        # of a chunked prefill saves the blocks it computed (SaveOrder.last). Not to
        # an etcd cluster: it places a prompt by its blocks, so its chunks could land
        # on other nodes than the whole; there a prompt whose window was freed is not
        # saved (_freed), and a decode recomputes it.
        self.chunk_saves = any(windowed) and not settings.server.startswith("etcd://")
        self.events = events or StoreEvents(False, 1, layout.block_tokens, None)
        self._stats = KVStoreConnectorStats()
        self._rejected_seen = 0  # stores.rejected_sources already counted
        self._requests: dict[str, Any] = {}
        self._scopes: dict[str, str] = {}
        self._matched: dict[str, _Match] = {}
        self._loads: dict[str, LoadOrder] = {}
        self._claims_used: set[str] = set()  # requests whose params' claim was loaded
        self._looked: dict[str, tuple[float, int]] = {}  # req -> (when, tokens) of a lookup
        self._tracked: dict[str, _Tracked] = {}
        self._saved: set[str] = set()  # requests whose save was ordered
        self._held: dict[str, int] = {}  # req -> tokens a keep-mode lookup found stored
        self._generation = 0  # key generation: reset() starts a new one
        self._seen_since_reset = False  # a request was scoped in this generation
        self.save_queue = QueuedSaveOrders(settings.save_queue_bytes, self.events.workers)
        self._skips = Every(SKIP_LOG_EVERY_S)

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (after a weight update,
        ``pause_generation(clear_cache=True)``): KV computed so far must not be loaded
        again. The store is shared with other engines and keeps what it holds; this
        engine's requests get keys of a new generation from now on (a ``weights=N``
        part of their scope, kvstore.connector.v1_orders.request_scope), so nothing
        stored before is found here. A reset with no request since the last one (a
        retried or repeated reset) keeps the generation: engines reset together stay
        together. A producer's kv_transfer_params carry its generation
        (``PARAM_GENERATION``), and a decode loads a request with params under the
        producer's, so the two need not agree; lookups without params (a prefix
        cache) find what engines of the same generation stored. Requests in flight
        are not saved, nor are params handed out for saves ordered before (vLLM
        recomputes them with the new weights). True: done."""
        if self._seen_since_reset:
            self._generation += 1
            self._seen_since_reset = False
        for state in (self._tracked, self._matched, self._scopes, self._looked, self._held):
            state.clear()
        self._saved.clear()
        log.info("kvstore connector: reset; new requests use keys of generation %d",
                 self._generation)
        return True

    def _scope_of(self, request: Any) -> str:
        """``request_scope`` in this engine's key generation, or, for a request whose
        kv_transfer_params name the producer's, in that one."""
        self._seen_since_reset = True
        generation = self._generation
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and PARAM_SERVER in params:
            named = params.get(PARAM_GENERATION, 0)
            # (untrusted: an int, else the request's keys are this engine's own)
            generation = named if type(named) is int and named >= 0 else generation
        scope = request_scope(request)
        if not generation:
            return scope
        return f"{scope}\nweights={generation}" if scope else f"weights={generation}"

    # ------------------------------------------------------------ loading
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        first_sight = request.request_id not in self._scopes
        scope = self._scopes.get(request.request_id)
        if scope is None:
            scope = self._scopes[request.request_id] = self._scope_of(request)
        self._requests.setdefault(request.request_id, request)
        if not self.settings.load:
            return 0, False
        stored_tokens = stored_part(list(request.prompt_token_ids or []))
        if not stored_tokens:
            return 0, False
        params = getattr(request, "kv_transfer_params", None)
        named = params.get(PARAM_SERVER) if isinstance(params, dict) else None
        server = self.stores.source(named)
        # A claim is taken once: a request whose claimed load failed (or that was
        # preempted after taking its entries) comes back, and then only what a lookup
        # finds is loaded, else vLLM recomputes; believing the claim again would
        # send it round WAITING_FOR_REMOTE_KVS for ever.
        claimed = (claimed_tokens(params, len(stored_tokens))
                   if server == named and request.request_id not in self._claims_used
                   else None)
        if claimed is not None:
            stored = claimed
        else:
            stored = self._lookup(request.request_id, server, stored_tokens, scope)
        if first_sight:  # vLLM asks again each step a request waits for room
            self._stats.record_lookup(stored)
        new = max(0, stored - num_computed_tokens)
        self._matched[request.request_id] = _Match(num_computed_tokens, server, stored,
                                                   claimed is not None)
        # With several groups vLLM cannot map failed block ids back to a request
        # (block ids repeat across groups): every load is then a background one,
        # whose failure is reported per request (failed_recving) and recomputed.
        return new, bool(new) and (claimed is not None or self.many_groups)

    def _lookup(self, rid: str, server: str, tokens: list[int], scope: str) -> int:
        """The store's answer for a request, remembered for ``_LOOKUP_MEMO_S``: vLLM
        asks again every step a request waits for room, and each ask would be a
        round trip on the scheduler's thread."""
        now = time.monotonic()
        seen = self._looked.get(rid)
        if seen is not None and now - seen[0] < _LOOKUP_MEMO_S:
            return seen[1]
        stored = self.stores.lookup(server, tokens, scope,
                                    timeout_s=self.settings.lookup_timeout_s)
        self._looked[rid] = (now, stored)
        return stored

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._requests.setdefault(request.request_id, request)
        match = self._matched.pop(request.request_id, None)
        self._looked.pop(request.request_id, None)
        if match is None:
            return
        if self.settings.load_mode == "keep" and match.stored:
            # Left on the server by the reads (a drop takes them): its save skips them.
            self._held[request.request_id] = match.stored
        if match.claimed and num_external_tokens > 0:
            self._claims_used.add(request.request_id)
        drop = self.settings.load_mode == "drop"
        if num_external_tokens <= 0 and not (match.stored and drop):
            return
        # With nothing new to load, a drop still takes the entries (an order that
        # writes no block): left behind, they would wait for a consumer forever.
        background = num_external_tokens > 0 and (match.claimed or self.many_groups)
        per_group = [list(ids) for ids in blocks.get_block_ids()] \
            if num_external_tokens > 0 else [[]]
        self._loads[request.request_id] = LoadOrder(
            req_id=request.request_id,
            token_ids=stored_part(list(request.prompt_token_ids or [])),
            block_ids=per_group[0],
            groups=tuple(per_group) if self.many_groups and num_external_tokens > 0 else (),
            ntokens=match.local + max(0, num_external_tokens),
            first_block=match.local // self.layout.block_tokens,
            server=match.server, scope=self._scopes.get(request.request_id, ""),
            wait=match.claimed, background=background)
        if drop:
            self.events.expect_drop(request)

    # ------------------------------------------------------------ each step
    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=list(self._loads.values()),
                                        preempted=set(getattr(scheduler_output,
                                                              "preempted_req_ids", None)
                                                      or ()),
                                        idle=not getattr(scheduler_output,
                                                         "total_num_scheduled_tokens", 1))
        self._loads.clear()
        for new in scheduler_output.scheduled_new_reqs:
            tokens = stored_part(list(new.prompt_token_ids or []))
            if self.settings.save and tokens:
                self._tracked[new.req_id] = _Tracked(
                    tokens, [list(ids) for ids in new.block_ids],
                    self._scopes.get(new.req_id, ""),
                    self._held_blocks(self._held.pop(new.req_id, 0), len(tokens)))
                self._maybe_save(meta, new.req_id, new.num_computed_tokens,
                                 scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_blocks is not None:
                # A resumed request's whole lists. Its chunk orders so far stay
                # done: their blocks are on the server (else the rest fails whole).
                tracked.groups = [list(ids) for ids in new_blocks]
            elif new_blocks is not None:
                for ids, more in zip(tracked.groups, new_blocks):
                    ids.extend(more)
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i],
                             scheduler_output.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _held_blocks(self, held: int, ntokens: int) -> int:
        """The blocks of a stored part of ``ntokens`` tokens that ``held`` stored
        tokens cover (a partial last block only when all of them are held)."""
        if held >= ntokens:
            return -(-ntokens // self.layout.block_tokens)
        return held // self.layout.block_tokens

    def _maybe_save(self, meta: KVStoreConnectorMetadata, req_id: str, computed: int,
                    scheduled: int) -> None:
        """Order the save in the step that computes the last stored token (and, with
        chunk saves, each earlier step's newly full blocks in that step)."""
        tracked = self._tracked[req_id]
        stored, bt = len(tracked.token_ids), self.layout.block_tokens
        done = computed + scheduled
        if done < stored:
            full = done // bt
            if self.chunk_saves and full > max(tracked.ordered, tracked.first_block):
                if self._freed(tracked, full):
                    del self._tracked[req_id]
                    return
                if self._admit(req_id, full * bt):
                    meta.saves.append(self._order(req_id, tracked, full * bt, last=False))
                    tracked.ordered = full
            return
        if self._freed(tracked, -(-stored // bt)):
            del self._tracked[req_id]  # never saved: no params claim it
            return
        if not self._admit(req_id, stored):
            return
        meta.saves.append(self._order(req_id, tracked, stored, last=True))
        if (request := self._requests.get(req_id)) is not None:
            self.events.expect_save(request)
        self._saved.add(req_id)
        del self._tracked[req_id]

    def _admit(self, req_id: str, ntokens: int) -> bool:
        """Whether a save order of ``ntokens`` (the bytes a worker holds for it: all of
        them, as its host buffer does) fits ``save_queue_bytes``. Not: the request is
        not saved at all (no later chunk, no params), counted and logged."""
        nbytes = self.layout.nbytes(ntokens)
        if self.save_queue.admit(req_id, nbytes):
            return True
        del self._tracked[req_id]
        self._stats.record_skipped_save()
        if skipped := self._skips.due():
            log.warning("save of %s (%d bytes): not made, and the request gets no "
                        "kv_transfer_params: saves holding %d bytes of the workers' host "
                        "memory wait for the server already (save_queue_bytes %d); %d "
                        "save(s) not made since the last warning. The server is slower "
                        "than this engine's prefills", req_id, nbytes,
                        self.save_queue.queued, self.save_queue.limit, skipped)
        return False

    def _freed(self, tracked: _Tracked, nblocks: int) -> bool:
        """Whether a block to save (below ``nblocks``, past what the server has) is
        one vLLM already freed behind a sliding window (its null block, id 0): the
        request came with a local prefix hit longer than the window, or was
        resumed with one; its KV there is gone, so the prompt is not saved."""
        first = max(tracked.first_block, tracked.ordered)
        return any(self.windowed[g] and 0 in ids[first:nblocks]
                   for g, ids in enumerate(tracked.groups) if g < len(self.windowed))

    def _order(self, req_id: str, tracked: _Tracked, ntokens: int, last: bool) -> SaveOrder:
        groups = [list(ids) for ids in tracked.groups]
        return SaveOrder(req_id, tracked.token_ids[:ntokens], groups[0], tracked.scope,
                         max(tracked.first_block, tracked.ordered),
                         groups=tuple(groups) if self.many_groups else (), last=last,
                         continues=tracked.ordered > 0)

    # ------------------------------------------------------------ finishing
    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The blocks may always be freed at once: a save copies them to the host in
        the step that orders it (worker side), and a load in flight holds them
        through vLLM's WAITING_FOR_REMOTE_KVS. The params name this node's server and
        how many tokens it stores, so the decode side needs no lookup."""
        rid = request.request_id
        # Not _loads: an order vLLM is waiting on (WAITING_FOR_REMOTE_KVS) must reach
        # the worker, whose report is what lets vLLM free the request's blocks.
        for state in (self._tracked, self._matched, self._scopes, self._requests,
                      self._looked, self._held):
            state.pop(rid, None)
        self._claims_used.discard(rid)
        if rid not in self._saved:
            return False, None
        self._saved.discard(rid)
        stored = len(stored_part(list(request.prompt_token_ids or [])))
        params = {PARAM_SERVER: self.settings.server, PARAM_TOKENS: stored}
        if self._generation:
            params[PARAM_GENERATION] = self._generation
        return False, params

    # ------------------------------------------------------------ observability
    def take_stats(self) -> KVStoreConnectorStats | None:
        """Lookups and refused servers since the last call (None if none)."""
        rejected = self.stores.rejected_sources
        self._stats.record_rejected(rejected - self._rejected_seen)
        self._rejected_seen = rejected
        return self._stats.take()

    def observe_reports(self, reports: Any) -> None:
        """The workers' reports of this step (vLLM's aggregated worker metadata)."""
        if isinstance(reports, TransferReports):
            self.save_queue.released(reports.released)
            self.events.observe(reports)
