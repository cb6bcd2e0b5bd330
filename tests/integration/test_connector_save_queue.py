"""The cap on queued saves (``save_queue_bytes``), against a real kvstore-server frozen
with SIGSTOP: the engine's steps go on while saves pile up on the transfer thread,
each holding a host copy of its prompt's KV until it is sent.

Connectors come from vLLM's factory (KV events on), requests from vLLM's own Request
with its block hasher; each step calls the worker as vLLM's model runner does, and
hands the worker's output to the scheduler as vLLM does after every step. Past the
cap the scheduler does not order the save (``QueuedSaveOrders``) and the request
gets no kv_transfer_params, so its decode recomputes at once; the rest commit once
the server goes on, and the room they held is given back. The worker's own cap
(``QueuedSaves``), which the scheduler's keeps from ever being the one to skip, is
tested with the scheduler's raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")

from vllm.distributed.kv_events import BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402

from kvstore.client.client import KVStoreClient  # noqa: E402
from tests.integration.conftest import LAYOUT, ServerProc  # noqa: E402
from tests.integration.test_vllm_v1_connector import (  # noqa: E402, F401 - autouse fixture
    LAYERS,
    make_connectors,
    request,
    schedule,
    view_truthful_backend,
)
from tests.integration.test_vllm_v1_observability import (  # noqa: E402
    Observed,
    connectors,
    hashed,
)

pytestmark = pytest.mark.timeout(120)
STORED = 10  # tokens stored of each 11-token prompt: blocks of 4, 4, 2
BLOCKS = [1, 2, 3]


def prompt(i: int) -> list[int]:
    return list(range(5000 + 100 * i, 5011 + 100 * i))


@contextlib.contextmanager
def stopped(server: ServerProc) -> Iterator[None]:
    """The server frozen for the block (SIGSTOP): it answers nothing until SIGCONT."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def prefill_step(sched, worker, req, seen: Observed) -> dict | None:
    """One engine step that computes ``req``'s whole prompt, the worker called as
    vLLM's model runner calls it (layer-wise saves), not waiting for the save; then
    the request finishes (max_tokens=1): the params the decode would get. The
    worker's output reaches the scheduler after that, as in vLLM's
    ``update_from_output``."""
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, KVCacheBlocks(([],)), 0)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (list(BLOCKS),))]
    out.num_scheduled_tokens = {req.request_id: len(req.prompt_token_ids)}
    out.total_num_scheduled_tokens = len(req.prompt_token_ids)
    worker.bind_connector_metadata(sched.build_connector_meta(out))
    worker.start_load_kv(None)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, None, None)
    worker.wait_for_save()
    worker.get_finished(set())
    worker.clear_connector_metadata()
    params = sched.request_finished(req, BLOCKS)[1]
    seen.collect()
    return params


def stored_tokens(server: ServerProc, layout, tokens: list[int]) -> int:
    with KVStoreClient(server.address, layout=layout, model_id="tiny-llama",
                       timeout_s=5.0) as reader:
        return reader.lookup(tokens[:-1]).matched_tokens


def test_saves_past_the_cap_are_not_made_and_their_room_comes_back(server, caplog):
    """The cap holds two prompts. The server freezes; four prompts are prefilled in
    four steps, none of which waits: the first two saves are ordered and queued
    (their host bytes counted on the worker and by the scheduler), the other two
    are not ordered and get no params (one warning for both). Once the server goes
    on, the two commit and both counts are back to 0; the two not made are counted
    and left no room on the server. A decode of a skipped prompt, sent without
    params, finds nothing and recomputes at once; a later save is made again."""
    one = LAYOUT.nbytes(STORED)  # the test connectors' layout
    sched, worker = connectors("kv_producer", server=server.address, timeout_s=5.0,
                               save_queue_bytes=2 * one)
    layout = sched.layout
    assert layout.token_nbytes == LAYOUT.token_nbytes
    seen = Observed(sched, worker)
    queue, orders = worker.worker.queued_saves, sched.scheduler.save_queue
    reqs = [hashed(f"q{i}", prompt(i)) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="kvstore.connector"):
        with stopped(server):
            params = [prefill_step(sched, worker, req, seen) for req in reqs]
            assert queue.queued == orders.queued == 2 * one  # not 4: two not ordered
    assert [bool(p) for p in params] == [True, True, False, False]
    assert worker.worker.drain(30)
    assert queue.queued == 0
    seen.collect()  # the next step's hand-over: the workers let the bytes go
    assert orders.queued == 0
    skips = [r.getMessage() for r in caplog.records if "not made" in r.getMessage()]
    assert len(skips) == 1 and "no kv_transfer_params" in skips[0], skips  # rate-limited

    assert (seen.count("saves"), seen.count("saves_skipped")) == (2, 2), seen.stats
    assert seen.count("save_failures") == 0, seen.stats
    assert not sched.has_pending_push_work()  # every save reported
    assert [type(e) for e in seen.events] == [BlockStored, BlockStored]
    assert [stored_tokens(server, layout, p) for p in map(prompt, range(4))] == \
        [STORED, STORED, 0, 0]
    with KVStoreClient(server.address, timeout_s=5.0) as admin:
        assert admin.stats()["reservations"] == 0  # a save not made opened no room

    # No params: the decode asks its store, finds nothing, and computes the prompt
    # now (it used to get params and wait load_wait_s for a save never made).
    d_sched, d_worker, _ = make_connectors("kv_consumer", server=server.address,
                                           load_wait_s=30.0, lookup_timeout_s=5.0)
    decode = request("d2", prompt(2), params[2])
    assert d_sched.get_num_new_matched_tokens(decode, 0) == (0, False)
    d_worker.shutdown(), d_sched.shutdown()

    assert prefill_step(sched, worker, hashed("q4", prompt(4)), seen)
    assert worker.worker.drain(30) and queue.queued == 0
    assert stored_tokens(server, layout, prompt(4)) == STORED
    assert seen.collect().count("saves") == 3 and orders.queued == 0
    worker.shutdown(), sched.shutdown()


def test_the_workers_own_cap_skips_when_the_schedulers_does_not(server, caplog):
    """The worker's guard (``QueuedSaves``), reached here only with the scheduler's
    cap raised past it: a save over it is not made although its params went out,
    so a decode holding them waits ``load_wait_s``, misses and recomputes."""
    one = LAYOUT.nbytes(STORED)
    sched, worker = connectors("kv_producer", server=server.address, timeout_s=5.0,
                               save_queue_bytes=one)
    sched.scheduler.save_queue.limit = 1 << 40
    seen = Observed(sched, worker)
    with caplog.at_level(logging.WARNING, logger="kvstore.connector.v1_worker"):
        with stopped(server):
            params = [prefill_step(sched, worker, hashed(f"w{i}", prompt(20 + i)), seen)
                      for i in range(2)]
            assert worker.worker.queued_saves.queued == one
    assert all(params)
    assert worker.worker.drain(30)
    seen.collect()
    assert (seen.count("saves"), seen.count("saves_skipped")) == (1, 1), seen.stats
    assert any("not made: saves holding" in r.getMessage() for r in caplog.records)
    assert sched.scheduler.save_queue.queued == 0  # every order's report came
    d_sched, d_worker, _ = make_connectors("kv_consumer", server=server.address,
                                           load_wait_s=0.3)
    decode = request("d1", prompt(21), params[1])
    assert d_sched.get_num_new_matched_tokens(decode, 0) == (STORED, True)
    assert schedule(d_sched, d_worker, decode, [5, 6, 7], STORED) == {5, 6, 7}
    d_worker.shutdown(), d_sched.shutdown()
    worker.shutdown(), sched.shutdown()


def test_a_save_larger_than_the_cap_is_made_when_nothing_else_is_queued(server):
    """A cap below one prompt's KV does not stop every save: a save gets into an
    empty queue whatever its size (the queue then holds one prompt, which the KV
    cache bounds), the next one only once that one is sent."""
    sched, worker = connectors("kv_producer", server=server.address, timeout_s=5.0,
                               save_queue_bytes=1)
    seen = Observed(sched, worker)
    with stopped(server):
        assert prefill_step(sched, worker, hashed("b0", prompt(10)), seen)
        assert not prefill_step(sched, worker, hashed("b1", prompt(11)), seen)
        assert worker.worker.queued_saves.queued == sched.layout.nbytes(STORED)
    assert worker.worker.drain(30)
    seen.collect()
    assert prefill_step(sched, worker, hashed("b2", prompt(12)), seen)
    assert worker.worker.drain(30) and worker.worker.queued_saves.queued == 0
    seen.collect()
    assert (seen.count("saves"), seen.count("saves_skipped")) == (2, 1), seen.stats
    assert [stored_tokens(server, sched.layout, prompt(i)) for i in (10, 11, 12)] == \
        [STORED, 0, STORED]
    worker.shutdown(), sched.shutdown()


def test_save_queue_bytes_is_checked_at_start(server):
    from kvstore.core.errors import ConfigError

    for bad in (0, "0MiB", "lots"):
        with pytest.raises(ConfigError, match="save_queue_bytes|not a size"):
            connectors("kv_producer", server=server.address, save_queue_bytes=bad)


def test_a_save_that_fails_gives_its_room_back(server):
    """The server is gone: the queued save fails (after timeout_s), and the host bytes
    it held leave the queue with it, so the next save is queued, not refused."""
    sched, worker = connectors("kv_producer", server=server.address, timeout_s=1.0,
                               save_queue_bytes=LAYOUT.nbytes(STORED))
    seen = Observed(sched, worker)
    server.kill()
    assert prefill_step(sched, worker, hashed("f0", prompt(20)), seen)
    assert worker.worker.queued_saves.queued == LAYOUT.nbytes(STORED)
    assert worker.worker.drain(30)
    assert worker.worker.queued_saves.queued == 0
    seen.collect()  # the failed save's report: the scheduler counts it out too
    assert sched.scheduler.save_queue.queued == 0
    # the server still down
    assert prefill_step(sched, worker, hashed("f1", prompt(21)), seen)
    assert worker.worker.drain(30) and worker.worker.queued_saves.queued == 0
    seen.collect()
    assert (seen.count("save_failures"), seen.count("saves_skipped")) == (2, 0), seen.stats
    assert not sched.has_pending_push_work()
    worker.shutdown(), sched.shutdown()
