"""What KVStoreConnectorV1 tells vLLM about its transfers, against real kvstore-servers.

Connectors come from vLLM's factory with vLLM's KV events switched on; requests are
real ``vllm.v1.request.Request`` objects hashed by vLLM's own block hasher, as the
engine core makes them. After each step the test hands the worker's stats and reports
to the scheduler side the way vLLM's engine does (``KVConnectorOutput`` ->
``update_connector_output``, then ``take_events`` and ``get_kv_connector_stats``), and
checks the counts of real saves, loads, misses and failures, and that the events name
exactly the hashes vLLM's own prefix cache gives the same blocks.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")

from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvstore.connector.v1_stats import MEDIUM  # noqa: E402
from tests.integration.conftest import LAYOUT, free_port  # noqa: E402
from tests.integration.test_vllm_v1_connector import (  # noqa: E402, F401 - autouse fixture
    BS,
    LAYERS,
    NUM_BLOCKS,
    HEADS,
    HEAD,
    entries,
    fill_random,
    kv_cache_config,
    schedule,
    view_truthful_backend,
)

pytestmark = pytest.mark.timeout(120)
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def connectors(role: str, events: bool = True, **extra):
    extra.setdefault("timeout_s", 3.0)
    # (These tests check what a lookup finds, not its budget: 0.25 s by default, which a
    # loaded CI machine can miss, and a missed lookup is a recompute, not a load.)
    extra.setdefault("lookup_timeout_s", 3.0)
    extra.setdefault("staging_bytes", "1MiB")
    extra.setdefault("model_id", "tiny-llama")
    kvt = KVTransferConfig(kv_connector="KVStoreConnectorV1",
                           kv_connector_module_path="kvstore.connector.vllm_v1",
                           kv_role=role, kv_load_failure_policy="recompute",
                           kv_connector_extra_config=extra)
    cfg = VllmConfig(kv_transfer_config=kvt, cache_config=CacheConfig(block_size=BS),
                     kv_events_config=KVEventsConfig(enable_kv_cache_events=events))
    kcc = kv_cache_config()
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kcc)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    caches = {name: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.float16)
              for name in LAYERS}
    worker.register_kv_caches(caches)
    fill_random(caches, seed=7)
    return sched, worker


def hashed(req_id: str, prompt: list[int], params: dict | None = None,
           cache_salt: str | None = None) -> Request:
    """A request as vLLM's engine core makes it: block hashes from its block hasher."""
    sp = SamplingParams(max_tokens=1,
                        extra_args={"kv_transfer_params": params} if params else None)
    return Request(req_id, prompt, sp, None, cache_salt=cache_salt, block_hasher=HASHER)


class Observed:
    """What vLLM would have seen of the steps so far: summed stats, all events."""

    def __init__(self, sched, worker) -> None:
        self.sched, self.worker = sched, worker
        self.stats: dict = {}
        self.events: list = []

    def collect(self) -> Observed:
        """One engine step's hand-over, worker -> scheduler, as vLLM makes it."""
        out = KVConnectorOutput(kv_connector_stats=self.worker.get_kv_connector_stats(),
                                kv_connector_worker_meta=self.worker.build_connector_worker_meta())
        self.sched.update_connector_output(out)
        self.events.extend(self.sched.take_events())
        for stats in (out.kv_connector_stats, self.sched.get_kv_connector_stats()):
            for name, value in (stats.data.items() if stats is not None else ()):
                if isinstance(value, list):
                    self.stats.setdefault(name, []).extend(value)
                else:
                    self.stats[name] = self.stats.get(name, 0) + value
        return self

    def count(self, name: str) -> int:
        return self.stats.get(name, 0)


def vllm_block_stored(req: Request, nblocks: int) -> BlockStored:
    """vLLM's own prefix-cache event for the same blocks (a real BlockPool)."""
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BS,
                     enable_kv_cache_events=True)
    pool.emit_cached_block_events(req, nblocks, BS, 0)
    (event,) = pool.take_events()
    return event


def produce(server, prompt, req_id="p1", **extra):
    sched, worker = connectors("kv_producer", server=server.address, **extra)
    seen = Observed(sched, worker)
    req = hashed(req_id, prompt)
    sched.get_num_new_matched_tokens(req, 0)
    assert schedule(sched, worker, req, list(range(1, 1 + -(-len(prompt) // BS))), 0) == set()
    _, params = sched.request_finished(req, [])
    return seen, req, params


def test_save_then_drop_load_counts_and_events_match_vllms_hashes(clean_server):
    prompt = list(range(1000, 1011))  # 11 tokens: 10 stored, 2 full blocks
    producer, req, params = produce(clean_server, prompt)
    assert producer.sched.has_pending_push_work()  # its save's report is still due
    producer.collect()
    assert not producer.sched.has_pending_push_work()
    assert (producer.count("saves"), producer.count("saved_tokens")) == (1, 10)
    assert producer.count("saved_bytes") == LAYOUT.nbytes(10)
    assert len(producer.stats["save_seconds"]) == 1 and producer.count("save_failures") == 0

    (stored,) = producer.events
    want = vllm_block_stored(req, 2)
    assert isinstance(stored, BlockStored) and stored.medium == MEDIUM
    for f in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
              "lora_name", "extra_keys", "group_idx"):
        assert getattr(stored, f) == getattr(want, f), f
    assert stored.token_ids == prompt[:8] and len(stored.block_hashes) == 2

    sched, worker = connectors("kv_consumer", server=f"tcp://127.0.0.1:{free_port()}",
                               allowed_servers=[clean_server.address])
    consumer = Observed(sched, worker)
    dreq = hashed("d1", prompt, params)
    matched, _ = sched.get_num_new_matched_tokens(dreq, 0)
    assert schedule(sched, worker, dreq, [5, 9, 2], matched) == set()
    consumer.collect()
    assert (consumer.count("loads"), consumer.count("loaded_tokens")) == (1, 10)
    assert consumer.count("loaded_bytes") == LAYOUT.nbytes(10)
    assert (consumer.count("hits"), consumer.count("misses"), consumer.count("load_failures")) \
        == (1, 0, 0)
    assert entries(clean_server, settle_to=0) == 0  # after the load's one-way release
    # The consumer's own hashes of the prompt are the producer's: a router matches them.
    assert consumer.events == [BlockRemoved(block_hashes=stored.block_hashes, medium=MEDIUM,
                                            group_idx=0)]
    for c in (producer.worker, producer.sched, worker, sched):
        c.shutdown()


def test_miss_counts_a_miss_and_announces_nothing(clean_server):
    sched, worker = connectors("kv_consumer", server=clean_server.address)
    seen = Observed(sched, worker)
    req = hashed("m1", list(range(50, 61)))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.get_num_new_matched_tokens(req, 0)  # vLLM asks again while it waits: one miss
    assert schedule(sched, worker, req, [1, 2, 3], 0) == set()
    seen.collect()
    assert (seen.count("misses"), seen.count("hits"), seen.count("loads")) == (1, 0, 0)
    assert seen.events == [] and not sched.has_pending_push_work()
    worker.shutdown(), sched.shutdown()


def test_dead_server_counts_failed_loads_and_failed_saves(server_factory):
    server = server_factory()
    prompt = list(range(7, 20))  # 13 tokens
    producer, _, params = produce(server, prompt)
    producer.collect()
    sched, worker = connectors("kv_consumer", server=server.address, timeout_s=1.0)
    seen = Observed(sched, worker)
    req = hashed("d3", prompt, params)
    matched, _ = sched.get_num_new_matched_tokens(req, 0)
    server.kill()
    assert schedule(sched, worker, req, [4, 5, 6, 8], matched) == {4, 5, 6}
    seen.collect()
    assert (seen.count("load_failures"), seen.count("loads"), seen.count("loaded_bytes")) \
        == (1, 0, 0)
    assert seen.events == [] and not sched.has_pending_push_work()  # nothing was taken

    # The producer's server is gone too: its next save fails, is counted, announced never.
    psched, pworker = producer.sched, producer.worker
    again = hashed("p2", list(range(100, 109)))
    psched.get_num_new_matched_tokens(again, 0)
    assert schedule(psched, pworker, again, [1, 2, 3], 0) == set()
    assert psched.has_pending_push_work()
    producer.collect()
    assert producer.count("save_failures") == 1 and producer.count("saves") == 1  # the first
    assert len(producer.events) == 1  # only the first, committed save's BlockStored
    assert not psched.has_pending_push_work()
    for c in (worker, sched, pworker, psched):
        c.shutdown()


def test_entry_lost_before_the_load_removes_only_what_was_taken(clean_server):
    prompt = list(range(500, 511))  # blocks of 4, 4, 3
    producer, _, _ = produce(clean_server, prompt)
    producer.collect()
    sched, worker = connectors("kv_consumer", server=clean_server.address)
    seen = Observed(sched, worker)
    req = hashed("e1", prompt)
    matched, _ = sched.get_num_new_matched_tokens(req, 0)
    client = sched.stores.client(clean_server.address)
    client.evict(keys=[client.keys_for(prompt)[1]])  # the second block goes
    assert schedule(sched, worker, req, [5, 9, 2], matched) == {9, 2}
    seen.collect()
    assert (seen.count("loads"), seen.count("loaded_tokens"), seen.count("load_failures")) \
        == (1, 4, 1)
    assert seen.count("loaded_bytes") == LAYOUT.nbytes(4)
    assert seen.events == [BlockRemoved(block_hashes=producer.events[0].block_hashes[:1],
                                        medium=MEDIUM, group_idx=0)]
    for c in (producer.worker, producer.sched, worker, sched):
        c.shutdown()


def test_rejected_request_named_server_is_counted_once_per_refusal(clean_server):
    sched, worker = connectors("kv_consumer", server=clean_server.address)
    seen = Observed(sched, worker)
    evil = {"kvstore_server": f"tcp://127.0.0.1:{free_port()}"}
    for i in range(3):
        sched.get_num_new_matched_tokens(hashed(f"x{i}", list(range(10)), evil), 0)
    seen.collect()
    assert seen.count("rejected_servers") == 3
    seen.collect()
    assert seen.count("rejected_servers") == 3  # reset per interval: no new ones
    worker.shutdown(), sched.shutdown()


def test_salted_prompt_events_carry_the_salt_like_vllms(clean_server):
    prompt = list(range(900, 913))  # 12 stored tokens: 3 full blocks
    sched, worker = connectors("kv_producer", server=clean_server.address)
    seen = Observed(sched, worker)
    req = hashed("s1", prompt, cache_salt="alice")
    sched.get_num_new_matched_tokens(req, 0)
    assert schedule(sched, worker, req, [3, 7, 1, 4], 0) == set()
    seen.collect()
    (stored,) = seen.events
    want = vllm_block_stored(req, 3)
    assert stored.block_hashes == want.block_hashes
    assert stored.extra_keys == want.extra_keys and stored.extra_keys[0] == ("alice",)
    assert stored.block_hashes != vllm_block_stored(hashed("u", prompt), 3).block_hashes
    worker.shutdown(), sched.shutdown()


def test_events_off_announces_nothing_but_still_counts(clean_server):
    """vLLM's KV events disabled: no events, but the engine still steps until the
    save's stats are back (has_pending_push_work), and they count."""
    sched, worker = connectors("kv_producer", events=False, server=clean_server.address)
    seen = Observed(sched, worker)
    req = hashed("q1", list(range(300, 309)))
    sched.get_num_new_matched_tokens(req, 0)
    assert schedule(sched, worker, req, [1, 2, 3], 0) == set()
    assert sched.has_pending_push_work()
    seen.collect()
    assert seen.events == [] and seen.count("saves") == 1
    assert not sched.has_pending_push_work()
    worker.shutdown(), sched.shutdown()


def test_background_save_reports_arrive_in_a_later_step(clean_server):
    """A save still running when the step ends reports in a later step's output; until
    then vLLM is kept stepping."""
    sched, worker = connectors("kv_producer", server=clean_server.address)
    seen = Observed(sched, worker)
    req = hashed("b1", list(range(400, 409)))
    sched.get_num_new_matched_tokens(req, 0)
    assert schedule(sched, worker, req, [1, 2, 3], 0) == set()
    deadline = time.monotonic() + 10
    while sched.has_pending_push_work() and time.monotonic() < deadline:
        seen.collect()  # an empty step
    assert not sched.has_pending_push_work() and len(seen.events) == 1
    worker.shutdown(), sched.shutdown()


def test_same_step_load_is_in_its_own_steps_stats(clean_server):
    """A prefix-cache hit loads inside its step: the step's stats already count it
    (vLLM may have no next step to carry them)."""
    from kvstore.connector.v1_stats import KVStoreConnectorStats

    prompt = list(range(600, 609))
    sched, worker = connectors("kv_both", server=clean_server.address)
    first = hashed("k0", prompt)
    sched.get_num_new_matched_tokens(first, 0)
    assert schedule(sched, worker, first, [0, 1, 2], 0) == set()
    worker.get_kv_connector_stats()  # that step's save

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    again = hashed("k1", prompt)
    assert sched.get_num_new_matched_tokens(again, 0) == (8, False)
    blocks = KVCacheBlocks(([KVCacheBlock(b) for b in (3, 4, 5)],))
    sched.update_state_after_alloc(again, blocks, 8)
    again.num_computed_tokens = 8
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(again, ([3, 4, 5],))]
    out.num_scheduled_tokens = {"k1": 1}
    worker.bind_connector_metadata(sched.build_connector_meta(out))
    worker.start_load_kv(None)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    stats = worker.get_kv_connector_stats()  # this step's, taken before any drain
    worker.clear_connector_metadata()
    assert isinstance(stats, KVStoreConnectorStats)
    assert (stats.data["loads"], stats.data["loaded_tokens"]) == (1, 8)
    assert worker.worker.drain(30)
    worker.shutdown(), sched.shutdown()
