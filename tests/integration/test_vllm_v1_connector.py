"""KVStoreConnectorV1's scheduler/worker protocol, driven through vLLM's own API.

vLLM's connector factory builds the connector from a KVTransferConfig inside a CPU
VllmConfig; its scheduler-side methods get real ``vllm.v1.request.Request``,
``KVCacheBlocks`` and ``SchedulerOutput`` objects, against real kvstore-servers.
These tests cover orders, failures and prefix bookkeeping, not KV placement: no
model runs, so there is no attention backend to probe, and the worker is given the
placement of a backend whose cache view is the truth (flash-attention's, a GPU
backend that cannot run here). Placement inside real engines is judged by
tests/engine (real vLLM engines, token-identical decode) and
tests/unit/test_block_format.py (vLLM's own CPU cache-write kernel).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks a platform
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")

from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvstore.client.client import KVStoreClient
from kvstore.connector import vllm_v1
from kvstore.connector.block_format import truthful
from kvstore.connector.paged_io import gather_blocks
from kvstore.connector.v1_orders import PARAM_GENERATION
from kvstore.connector.vllm_v1 import PARAM_SERVER, KVStoreConnectorV1
from tests.integration.conftest import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def view_truthful_backend(monkeypatch):
    """No engine runs here: give the worker a truthful-view backend's placement."""
    monkeypatch.setattr(vllm_v1, "block_format_of",
                        lambda _cfg, names, caches: truthful(caches[names[0]], "test-view"))

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
HEADS, HEAD, BS, NUM_BLOCKS = 2, 8, 4, 16  # block size = the test servers' block_tokens


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float16)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def make_connectors(role: str, **extra):
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
    cfg = VllmConfig(kv_transfer_config=kvt, cache_config=CacheConfig(block_size=BS))
    kcc = kv_cache_config()
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kcc)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    caches = {name: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.float16)
              for name in LAYERS}
    worker.register_kv_caches(caches)
    return sched, worker, caches


def request(req_id: str, prompt: list[int], params: dict | None = None) -> Request:
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params} if params else None)
    return Request(req_id, prompt, sp, None)


def schedule(sched, worker, req: Request, block_ids: list[int], num_external: int,
             local: int = 0) -> set[int]:
    """One engine step for ``req`` (new, rest of its prompt), ``local`` tokens being
    vLLM's own prefix-cache hit: the scheduler's calls, then the worker's around the
    (omitted) forward, as vLLM's model runner makes them; a background load is then
    waited for through ``get_finished`` like vLLM's scheduler does. Saves are drained.
    Returns the worker's load errors."""
    blocks = KVCacheBlocks(([KVCacheBlock(b) for b in block_ids],))
    sched.update_state_after_alloc(req, blocks, num_external)
    req.num_computed_tokens = local + num_external  # as vLLM's scheduler sets it
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (list(block_ids),))]
    out.num_scheduled_tokens = {req.request_id: len(req.prompt_token_ids) - local - num_external}
    out.total_num_scheduled_tokens = out.num_scheduled_tokens[req.request_id]
    meta = sched.build_connector_meta(out)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    errors = set()
    waiting = {o.req_id for o in meta.loads if o.background}
    deadline = time.monotonic() + 30
    while waiting and time.monotonic() < deadline:
        _, done = worker.get_finished(set())
        errors |= worker.get_block_ids_with_load_errors()
        waiting -= done or set()
        time.sleep(0.01)
    assert not waiting, "a background load was never reported"
    errors |= worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    assert worker.worker.drain(30)  # saves run in the background
    return errors


def fill_random(caches: dict, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=g).half())


def entries(server, settle_to: int | None = None, timeout_s: float = 10.0) -> int:
    """The server's entry count. ``settle_to``: polled for until the count is that
    (bounded), after a drop-mode load: its drop_select's last release is one-way, from
    the connector's own client, and this connection's stats may be served first."""
    with KVStoreClient(server.address, timeout_s=5.0) as admin:
        deadline = time.monotonic() + timeout_s
        while True:
            count = admin.stats()["entries"]
            if settle_to is None or count == settle_to or time.monotonic() > deadline:
                return count
            time.sleep(0.02)


def prefill(server, prompt: list[int], blocks: list[int], req_id: str = "p1"):
    """A producer prefills ``prompt`` into ``blocks`` and saves it; its caches, params."""
    sched, worker, caches = make_connectors("kv_producer", server=server.address)
    fill_random(caches, seed=len(prompt))
    req = request(req_id, prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # producers don't load
    assert schedule(sched, worker, req, blocks, 0) == set()
    free_now, params = sched.request_finished(req, blocks)
    worker.shutdown(), sched.shutdown()
    assert free_now is False and params[PARAM_SERVER] == server.address
    return caches, params


def test_factory_builds_our_class_from_the_config(clean_server):
    sched, worker, _ = make_connectors("kv_both", server=clean_server.address)
    assert type(sched) is KVStoreConnectorV1 and type(worker) is KVStoreConnectorV1
    assert sched.layout.token_nbytes == len(LAYERS) * 2 * HEADS * HEAD * 2
    worker.shutdown(), sched.shutdown()


def test_producer_saves_consumer_loads_exact_bytes_into_other_blocks(clean_server):
    prompt = list(range(1000, 1011))  # 11 tokens: 2 full blocks and a partial one
    src_blocks, dst_blocks = [3, 7, 1], [5, 9, 2]
    p_caches, params = prefill(clean_server, prompt, src_blocks)
    assert entries(clean_server) == 3

    # The consumer's own server is somewhere else (here: nowhere): the request's
    # kv_transfer_params name the producer's server, which the operator allowed.
    sched, worker, caches = make_connectors("kv_consumer",
                                            server=f"tcp://127.0.0.1:{free_port()}",
                                            allowed_servers=[clean_server.address])
    req = request("d1", prompt, params)
    matched, is_async = sched.get_num_new_matched_tokens(req, 0)
    # The producer's params say how much it stored (vLLM computes the last token
    # itself): the scheduler answers at once, and the load runs in the background.
    assert (matched, is_async) == (len(prompt) - 1, True)
    assert schedule(sched, worker, req, dst_blocks, matched) == set()
    for name in LAYERS:
        src, dst = p_caches[name], caches[name]
        assert torch.equal(dst[5], src[3]) and torch.equal(dst[9], src[7])
        assert torch.equal(dst[2, :, :2], src[1, :, :2])  # tokens 8, 9 of the partial block
        assert not dst[[0, 1, 3, 4, 6, 7, 8]].any()  # nothing else written
    assert entries(clean_server, settle_to=0) == 0  # drop_select: the store forgot it
    worker.shutdown(), sched.shutdown()


def test_miss_is_zero_matched_and_nothing_loaded(clean_server):
    sched, worker, caches = make_connectors("kv_consumer", server=clean_server.address)
    req = request("d2", list(range(50, 61)))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert schedule(sched, worker, req, [1, 2, 3], 0) == set()
    assert not any(c.any() for c in caches.values())
    worker.shutdown(), sched.shutdown()


def test_dead_server_reports_load_errors_and_never_raises(server_factory):
    server = server_factory()
    prompt = list(range(7, 20))  # 13 tokens
    _, params = prefill(server, prompt, [0, 1, 2, 3])
    # (load_wait_s short: the first load below waits for the dead server's entries that
    # long, then one timeout_s; then the bound of 10 s has room on a loaded machine.)
    sched, worker, _ = make_connectors("kv_consumer", server=server.address, timeout_s=3.0,
                                       load_wait_s=0.5)
    req = request("d3", prompt, params)
    matched, _ = sched.get_num_new_matched_tokens(req, 0)
    assert matched == 12
    server.kill()  # between the scheduler's answer and the worker's load
    start = time.monotonic()
    errors = schedule(sched, worker, req, [4, 5, 6, 8], matched)
    assert errors == {4, 5, 6}  # every block the load was to fill: vLLM recomputes them
    assert time.monotonic() - start < 10
    # The next request naming it fails at once: the worker remembers the server is down
    # (trying it again would take the 3 s timeout; 2.5 s leaves a loaded machine room,
    # with two pytest workers beside each other).
    again = request("d4", prompt, params)
    matched, _ = sched.get_num_new_matched_tokens(again, 0)
    start = time.monotonic()
    assert schedule(sched, worker, again, [4, 5, 6, 8], matched) == {4, 5, 6}
    assert time.monotonic() - start < 2.5
    worker.shutdown(), sched.shutdown()


def test_kv_both_is_a_prefix_cache(clean_server):
    """Blocks saved by one request serve a later one that shares a prefix, and stay."""
    sched, worker, caches = make_connectors("kv_both", server=clean_server.address)
    fill_random(caches, seed=5)
    first = list(range(300, 310))  # 10 tokens
    req = request("a", first)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert schedule(sched, worker, req, [1, 2, 3], 0) == set()
    sched.request_finished(req, [1, 2, 3])
    saved = {n: c.clone() for n, c in caches.items()}

    second = first[:8] + [999, 998, 997]  # shares two full blocks
    req2 = request("b", second)
    matched, _ = sched.get_num_new_matched_tokens(req2, 0)
    assert matched == 8
    # vLLM already had the first block locally (prefix-cache hit of 4 tokens).
    assert sched.get_num_new_matched_tokens(req2, 4) == (4, False)
    caches[LAYERS[0]][11].zero_()
    assert schedule(sched, worker, req2, [1, 11, 12], 4, local=4) == set()
    for name in LAYERS:
        assert torch.equal(caches[name][11], saved[name][2])
        assert torch.equal(caches[name][12], saved[name][12])  # tokens 8.. are vLLM's to compute
    # Kept (a prefix cache, not a hand-off), and the second prompt's own partial
    # block was saved beside the first's: 2 shared full blocks + 2 partial ones.
    assert entries(clean_server) == 4
    worker.shutdown(), sched.shutdown()


def test_chunked_prefill_saves_once_the_last_chunk_is_computed(clean_server):
    """A prompt prefilled in two steps (vLLM's chunked prefill) is saved in the second,
    with the block the second step added; the first step saves nothing."""
    from vllm.v1.core.sched.output import CachedRequestData

    sched, worker, caches = make_connectors("kv_producer", server=clean_server.address)
    fill_random(caches, seed=9)
    prompt = list(range(400, 411))  # 11 tokens
    req = request("c1", prompt)
    sched.update_state_after_alloc(req, KVCacheBlocks(([],)), 0)
    step1 = SchedulerOutput.make_empty()
    step1.scheduled_new_reqs = [NewRequestData.from_request(req, ([6, 2],))]
    step1.num_scheduled_tokens = {"c1": 8}
    meta1 = sched.build_connector_meta(step1)
    assert meta1.saves == [] and meta1.loads == []

    step2 = SchedulerOutput.make_empty()
    step2.scheduled_cached_reqs = CachedRequestData(
        req_ids=["c1"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
        new_block_ids=[([13],)], num_computed_tokens=[8], num_output_tokens=[0])
    step2.num_scheduled_tokens = {"c1": 3}
    meta2 = sched.build_connector_meta(step2)
    assert [(s.req_id, s.block_ids) for s in meta2.saves] == [("c1", [6, 2, 13])]
    worker.bind_connector_metadata(meta2)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert worker.worker.drain(30)  # the save runs in the background
    assert entries(clean_server) == 3
    worker.shutdown(), sched.shutdown()

    # What was saved is those blocks' bytes: a keep-mode reader gets them back.
    reader, rworker, rcaches = make_connectors("kv_both", server=clean_server.address)
    req2 = request("c2", prompt)
    assert reader.get_num_new_matched_tokens(req2, 0) == (10, False)
    assert schedule(reader, rworker, req2, [0, 1, 3], 10) == set()
    for name in LAYERS:
        assert torch.equal(rcaches[name][0], caches[name][6])
        assert torch.equal(rcaches[name][1], caches[name][2])
        assert torch.equal(rcaches[name][3, :, :2], caches[name][13, :, :2])
    rworker.shutdown(), reader.shutdown()


def test_entry_lost_between_lookup_and_load_fails_only_the_blocks_from_there(clean_server):
    prompt = list(range(500, 511))  # 11 tokens: blocks of 4, 4, 3
    prefill(clean_server, prompt, [3, 7, 1])
    sched, worker, caches = make_connectors("kv_consumer", server=clean_server.address)
    req = request("e1", prompt)
    matched, _ = sched.get_num_new_matched_tokens(req, 0)
    assert matched == 10
    client = sched.stores.client(clean_server.address)
    client.evict(keys=[client.keys_for(prompt)[1]])  # the second block goes
    errors = schedule(sched, worker, req, [5, 9, 2], matched)
    assert errors == {9, 2}  # block 5 arrived; vLLM recomputes from block 9 on
    assert all(caches[n][5].any() for n in LAYERS)
    worker.shutdown(), sched.shutdown()


@pytest.mark.parametrize("layerwise", [True, False])
def test_no_save_in_the_step_of_a_failed_load_into_its_blocks(clean_server, layerwise):
    """kv_both: the lookup finds the prompt's first 10 tokens, the second block is
    evicted before the same-step load reaches it. The blocks from there hold no KV of
    this prompt (here: 7.0 everywhere, a previous request's), and what the forward
    computes on top of them is wrong too: vLLM recomputes them, and the step's save
    must not store them. Another prefix-cache engine then finds only the first block,
    never the junk."""
    prompt = list(range(520, 531))  # 11 tokens: 10 stored, blocks of 4, 4, 2
    prefill(clean_server, prompt, [3, 7, 1])
    sched, worker, caches = make_connectors("kv_both", server=clean_server.address,
                                            layerwise_saves=layerwise)
    for c in caches.values():
        c.fill_(7.0)
    req = request("j1", prompt)
    matched, is_async = sched.get_num_new_matched_tokens(req, 0)
    assert (matched, is_async) == (10, False)
    client = sched.stores.client(clean_server.address)
    client.evict(keys=[client.keys_for(prompt)[1]])
    stored = entries(clean_server)
    assert schedule(sched, worker, req, [5, 9, 2], matched) == {9, 2}
    sched.request_finished(req, [5, 9, 2])
    worker.shutdown(), sched.shutdown()
    assert entries(clean_server) == stored  # nothing was saved
    reader, r_worker, _ = make_connectors("kv_both", server=clean_server.address)
    assert reader.get_num_new_matched_tokens(request("j2", prompt), 0) == (4, False)
    r_worker.shutdown(), reader.shutdown()


def test_same_step_load_errors_are_reported_before_wait_for_save(clean_server):
    """With speculative decoding vLLM's model runner asks for the load errors right
    after the target model's forward and calls wait_for_save only after the drafter
    (``_get_kv_connector_output(defer_finalize=True)``): a same-step load's failed
    blocks must be in that answer, not the next step's, when the request may
    already have finished."""
    prompt = list(range(540, 551))
    prefill(clean_server, prompt, [3, 7, 1])
    sched, worker, _ = make_connectors("kv_both", server=clean_server.address)
    req = request("s1", prompt)
    matched, _ = sched.get_num_new_matched_tokens(req, 0)
    client = sched.stores.client(clean_server.address)
    client.evict(keys=[client.keys_for(prompt)[1]])
    sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in (5, 9, 2)],)),
                                   matched)
    req.num_computed_tokens = matched
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, ([5, 9, 2],))]
    out.num_scheduled_tokens = {"s1": 1}
    out.total_num_scheduled_tokens = 1
    worker.bind_connector_metadata(sched.build_connector_meta(out))
    worker.start_load_kv(None)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    worker.get_finished(set())
    assert worker.get_block_ids_with_load_errors() == {9, 2}
    worker.wait_for_save()  # after the drafter
    worker.clear_connector_metadata()
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    assert worker.worker.drain(30)
    worker.shutdown(), sched.shutdown()


def test_a_reset_gives_this_engines_requests_keys_of_their_own(clean_server):
    """vLLM's reset_prefix_cache(reset_connector=True), as after a weight update,
    calls the scheduler's reset_cache: from then on this engine finds nothing stored
    before, what it saves is found by it and not by an engine that was not reset
    (a lookup), and the store kept everything. A reset retried with no request
    between keeps the generation. A decode engine that was not reset loads what
    the reset engine saved through its kv_transfer_params, which carry the
    producer's generation."""
    old, new = list(range(560, 571)), list(range(580, 591))
    prefill(clean_server, old, [3, 7, 1])
    sched, worker, caches = make_connectors("kv_both", server=clean_server.address)
    other, o_worker, _ = make_connectors("kv_both", server=clean_server.address)
    assert sched.get_num_new_matched_tokens(request("r1", old), 0) == (10, False)
    stored = entries(clean_server)
    assert sched.reset_cache() is True and sched.reset_cache() is True  # (a retry)
    assert sched.get_num_new_matched_tokens(request("r2", old), 0) == (0, False)
    fill_random(caches, seed=11)
    req = request("r3", new)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert schedule(sched, worker, req, [5, 9, 2], 0) == set()
    _, params = sched.request_finished(req, [5, 9, 2])
    assert params[PARAM_GENERATION] == 1, params
    assert entries(clean_server) == stored + 3  # saved, and nothing dropped
    assert sched.get_num_new_matched_tokens(request("r4", new), 0) == (10, False)
    assert other.get_num_new_matched_tokens(request("r5", new), 0) == (0, False)
    assert other.get_num_new_matched_tokens(request("r6", old), 0) == (10, False)
    decode, d_worker, d_caches = make_connectors("kv_consumer", server=clean_server.address)
    claimed = request("d1", new, params)
    assert decode.get_num_new_matched_tokens(claimed, 0) == (10, True)
    assert schedule(decode, d_worker, claimed, [6, 8, 4], 10) == set()
    for name in LAYERS:
        assert torch.equal(d_caches[name][6], caches[name][5])
        assert torch.equal(d_caches[name][8], caches[name][9])
    for conn in (worker, sched, o_worker, other, d_worker, decode):
        conn.shutdown()


def test_full_cuda_graphs_give_way_to_piecewise_unless_loads_are_off():
    """A same-step load is waited for in wait_for_layer_load, which a full CUDA
    graph's replay skips; vLLM asks the connector class whether to run piecewise.
    (What vLLM does with the answer needs CUDA: on CPU it runs no graphs.)"""
    cls = vllm_v1.KVStoreConnectorV1
    assert cls.requires_piecewise_for_cudagraph({}) is True
    assert cls.requires_piecewise_for_cudagraph({"load": True}) is True
    assert cls.requires_piecewise_for_cudagraph({"load": "false"}) is False
    assert cls.requires_piecewise_for_cudagraph({"load": False}) is False


def test_a_load_moves_no_block_vllm_already_holds(clean_server):
    """vLLM's own prefix cache holds the first block: the load takes all three
    entries but moves only the other two. When vLLM takes nothing from the store
    (it keeps its own hit of both full blocks), the order still takes the entries
    and moves no byte."""
    prompt = list(range(600, 611))  # 11 tokens: 10 stored, blocks of 4, 4, 2
    caches_p, params = prefill(clean_server, prompt, [3, 7, 1])
    sched, worker, caches = make_connectors("kv_consumer", server=clean_server.address)
    req = request("h1", prompt, params)
    assert sched.get_num_new_matched_tokens(req, 4) == (6, True)
    assert schedule(sched, worker, req, [8, 5, 2], 6, local=4) == set()
    assert not caches[LAYERS[0]][8].any()  # vLLM's block: not written
    assert torch.equal(caches[LAYERS[0]][5], caches_p[LAYERS[0]][7])
    assert worker.get_kv_connector_stats().data["loaded_bytes"] == \
        sched.layout.nbytes(6)
    assert entries(clean_server, settle_to=0) == 0

    prefill(clean_server, prompt, [3, 7, 1], req_id="p2")
    req = request("h2", prompt)  # no params: a lookup, then nothing new to load
    assert sched.get_num_new_matched_tokens(req, 8) == (2, False)
    assert schedule(sched, worker, req, [8, 5], 0, local=8) == set()
    stats = worker.get_kv_connector_stats()
    assert stats is None or stats.data["loaded_bytes"] == 0
    assert entries(clean_server, settle_to=0) == 0
    worker.shutdown(), sched.shutdown()


def test_bad_extra_config_is_a_clear_error_at_start(clean_server):
    from kvstore.core.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config"):
        make_connectors("kv_consumer", server=clean_server.address, sevrer="typo")
    with pytest.raises(ConfigError, match="load_mode"):
        make_connectors("kv_both", server=clean_server.address, load_mode="sometimes")


def test_caches_of_another_shape_are_refused_at_registration(clean_server):
    from kvstore.core.errors import ConfigError

    sched, worker, _ = make_connectors("kv_both", server=clean_server.address)
    # e.g. vLLM split each 4-token block into two 2-token kernel blocks
    split = {n: torch.zeros(2 * NUM_BLOCKS, HEADS, BS // 2, 2 * HEAD, dtype=torch.float16)
             for n in LAYERS}
    with pytest.raises(ConfigError, match="block-size"):
        worker.register_kv_caches(split)
    worker.shutdown(), sched.shutdown()


def test_one_step_with_a_loading_and_a_saving_request(clean_server):
    """Orders are per request: in one step one request loads into its blocks while
    another is saved from its own."""
    sched, worker, caches = make_connectors("kv_both", server=clean_server.address)
    fill_random(caches, seed=11)
    stored = list(range(600, 609))  # 9 tokens, saved by an earlier request
    first = request("s0", stored)
    assert sched.get_num_new_matched_tokens(first, 0) == (0, False)
    assert schedule(sched, worker, first, [0, 1, 2], 0) == set()
    before = {n: c.clone() for n, c in caches.items()}

    again, fresh = request("s1", stored), request("s2", list(range(700, 706)))
    assert sched.get_num_new_matched_tokens(again, 0) == (8, False)
    assert sched.get_num_new_matched_tokens(fresh, 0) == (0, False)
    for req, blocks, ext in ((again, [3, 4, 5], 8), (fresh, [6, 7], 0)):
        sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in blocks],)), ext)
        req.num_computed_tokens = ext
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(again, ([3, 4, 5],)),
                              NewRequestData.from_request(fresh, ([6, 7],))]
    out.num_scheduled_tokens = {"s1": 1, "s2": 6}
    meta = sched.build_connector_meta(out)
    assert [(o.req_id, o.block_ids, o.ntokens) for o in meta.loads] == [("s1", [3, 4, 5], 8)]
    assert sorted(o.req_id for o in meta.saves) == ["s1", "s2"]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    worker.clear_connector_metadata()
    assert worker.worker.drain(30)  # the saves run in the background
    for name in LAYERS:
        assert torch.equal(caches[name][3], before[name][0])
        assert torch.equal(caches[name][4], before[name][1])
    # s0's 2 entries (its 8 stored tokens; s1's are the same keys) + s2's full block
    # and its 1-token partial block (6 tokens, the last never stored).
    assert entries(clean_server) == 4
    worker.shutdown(), sched.shutdown()


def test_etcd_server_address_places_saves_and_loads_through_the_cluster(server_factory):
    """``server: etcd://...``: producer and consumer name only the cluster's etcd; the
    prompt goes to (and comes back from) its rendezvous home among registered nodes."""
    from tools.etcd_proc import start_etcd

    prompt, src_blocks, dst_blocks = list(range(300, 311)), [3, 7, 1], [5, 9, 2]
    with start_etcd() as etcd:
        node = server_factory(extra=("--cluster", etcd.url, "--cluster-prefix", "/v1c/",
                                     "--node-id", "only"))
        opts = dict(server=etcd.url, cluster_prefix="/v1c/")
        sched, worker, p_caches = make_connectors("kv_producer", **opts)
        fill_random(p_caches, seed=5)
        req = request("p-etcd", prompt)
        assert schedule(sched, worker, req, src_blocks, 0) == set()
        _, params = sched.request_finished(req, src_blocks)
        worker.shutdown(), sched.shutdown()
        assert params[PARAM_SERVER] == etcd.url and entries(node) == 3

        sched, worker, caches = make_connectors("kv_consumer", **opts)
        req = request("d-etcd", prompt, params)
        matched, _ = sched.get_num_new_matched_tokens(req, 0)
        assert matched == len(prompt) - 1
        assert schedule(sched, worker, req, dst_blocks, matched) == set()
        for name in LAYERS:
            assert torch.equal(caches[name][5], p_caches[name][3])
            assert torch.equal(caches[name][2, :, :2], p_caches[name][1, :, :2])
        assert entries(node, settle_to=0) == 0  # drop_select through the cluster client
        worker.shutdown(), sched.shutdown()


def test_server_address_of_another_scheme_is_refused():
    from kvstore.core.errors import ConfigError

    with pytest.raises(ConfigError, match="tcp://host:port or etcd://host:port"):
        make_connectors("kv_both", server="http://127.0.0.1:2379")


def test_consumer_loading_from_two_servers_runs_one_te_engine(server_factory, transports_made):
    """The worker's clients (one per producer server) share one TE engine and staging
    buffer: an engine each would multiply registrations and busy-waiting threads."""
    made = transports_made
    servers = [server_factory(), server_factory()]
    prompts = [list(range(400, 409)), list(range(500, 509))]
    sources = [prefill(srv, p, [1, 2, 3], req_id=f"p{i}")
               for i, (srv, p) in enumerate(zip(servers, prompts))]
    made.clear()
    sched, worker, caches = make_connectors("kv_consumer", server=servers[0].address,
                                            allowed_servers=[servers[1].address],
                                            same_node="false")  # TE, not the shared arena
    for i, (prompt, (p_caches, params)) in enumerate(zip(prompts, sources)):
        req = request(f"d{i}", prompt, params)
        matched, _ = sched.get_num_new_matched_tokens(req, 0)
        blocks = [4 + 3 * i, 5 + 3 * i, 6 + 3 * i]
        assert schedule(sched, worker, req, blocks, matched) == set()
        assert all(torch.equal(caches[n][blocks[0]], p_caches[n][1]) for n in LAYERS)
    assert [entries(srv, settle_to=0) for srv in servers] == [0, 0]  # both loaded (drop) over TE
    assert len(made) == 1
    worker.shutdown(), sched.shutdown()


def test_request_named_server_nobody_configured_is_never_contacted(clean_server):
    """kv_transfer_params come from an HTTP request: an address that is not the
    connector's server, in allowed_servers or in its cluster is ignored (counted,
    warned) and the connector's own server is asked instead. A real listening
    socket at the named address proves no connection was ever attempted."""
    import socket

    prompt = list(range(800, 811))
    _, params = prefill(clean_server, prompt, [3, 7, 1])
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(0.5)
    evil = {PARAM_SERVER: f"tcp://127.0.0.1:{trap.getsockname()[1]}"}
    sched, worker, caches = make_connectors("kv_consumer", server=clean_server.address)
    try:
        req = request("x1", prompt, evil)
        matched, _ = sched.get_num_new_matched_tokens(req, 0)
        assert matched == len(prompt) - 1  # from its own server, which has the prompt
        assert sched.stores.rejected_sources == 1
        assert schedule(sched, worker, req, [5, 9, 2], matched) == set()
        with pytest.raises(socket.timeout):
            trap.accept()
        assert entries(clean_server, settle_to=0) == 0
        for bad in ("http://169.254.169.254/", 12345, ["tcp://a:1"]):
            sched.get_num_new_matched_tokens(request(f"x-{bad}", prompt, {PARAM_SERVER: bad}), 0)
        assert sched.stores.rejected_sources == 4
    finally:
        trap.close()
        worker.shutdown(), sched.shutdown()


def test_client_cache_is_bounded(server_factory, monkeypatch):
    """However many allowed servers requests name, at most _CLIENTS_KEPT clients live;
    the least recently used is closed."""
    from kvstore.connector import v1_stores

    monkeypatch.setattr(v1_stores, "_CLIENTS_KEPT", 2)
    servers = [server_factory() for _ in range(3)]
    sched, worker, _ = make_connectors("kv_consumer", server=servers[0].address,
                                       allowed_servers=[s.address for s in servers[1:]])
    for i, srv in enumerate(servers):
        req = request(f"b{i}", list(range(10)), {PARAM_SERVER: srv.address})
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert [key[0] for key in sched.stores._clients] == [servers[1].address,
                                                         servers[2].address]
    worker.shutdown(), sched.shutdown()


def test_scheduler_lookup_counts_only_what_every_tp_rank_holds(clean_server):
    """With TP = 2 each rank stores its own part of a block under its own keys: the
    scheduler's lookup is the least any rank holds, so a rank that lost (or never
    saved) its part makes a miss there, not a load that fails on that rank."""
    from kvstore.connector.v1_config import ConnectorSettings
    from kvstore.connector.v1_stores import StoreClients
    from tests.integration.conftest import make_kv

    sched, worker, _ = make_connectors("kv_consumer", server=clean_server.address)
    layout = sched.layout
    worker.shutdown(), sched.shutdown()
    settings = ConnectorSettings.from_extra("kv_consumer", {
        "server": clean_server.address, "model_id": "tiny-llama", "timeout_s": 3.0},
        "tiny-llama")
    stores = StoreClients(settings, layout, 0, 2, worker=False)
    prompt = list(range(100, 100 + 4 * BS + 1))  # 4 full blocks + 1 token
    ranks = [KVStoreClient(clean_server.address, layout=layout, model_id="tiny-llama",
                           tp_rank=r, tp_size=2, timeout_s=5.0) for r in (0, 1)]
    try:
        assert stores.lookup(clean_server.address, prompt) == 0
        ranks[0].insert(prompt, make_kv(len(prompt), layout=layout))
        assert stores.lookup(clean_server.address, prompt) == 0  # rank 1 has nothing
        ranks[1].insert(prompt[:2 * BS], make_kv(2 * BS, layout=layout))
        assert stores.lookup(clean_server.address, prompt) == 2 * BS
        ranks[1].insert(prompt, make_kv(len(prompt) - 2 * BS, layout=layout), skip_blocks=2)
        assert stores.lookup(clean_server.address, prompt) == len(prompt)
    finally:
        for c in ranks:
            c.close()
        stores.close()


def test_one_token_prompt_stores_nothing(clean_server):
    """A consumer can load at most prompt - 1 tokens: a 1-token prompt's producer
    must not leave entries no consumer can ever take."""
    sched, worker, caches = make_connectors("kv_producer", server=clean_server.address)
    fill_random(caches, seed=1)
    req = request("one", [42])
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert schedule(sched, worker, req, [3], 0) == set()
    sched.request_finished(req, [3])
    assert entries(clean_server) == 0
    worker.shutdown(), sched.shutdown()


def test_cache_salt_scopes_the_keys(clean_server):
    """Same tokens, different cache_salt: a miss; the same salt: a hit (vLLM's prefix
    cache draws the same line)."""
    prompt = list(range(900, 911))
    sched, worker, caches = make_connectors("kv_producer", server=clean_server.address)
    fill_random(caches, seed=3)
    req = Request("salted", prompt, SamplingParams(max_tokens=1), None, cache_salt="alice")
    sched.get_num_new_matched_tokens(req, 0)
    assert schedule(sched, worker, req, [3, 7, 1], 0) == set()
    sched.request_finished(req, [3, 7, 1])
    worker.shutdown(), sched.shutdown()

    sched, worker, _ = make_connectors("kv_consumer", server=clean_server.address)
    for salt, want in ((None, 0), ("bob", 0), ("alice", len(prompt) - 1)):
        other = Request(f"r-{salt}", prompt, SamplingParams(max_tokens=1), None, cache_salt=salt)
        assert sched.get_num_new_matched_tokens(other, 0) == (want, False)
    worker.shutdown(), sched.shutdown()


def test_a_claim_is_believed_once_then_only_the_store_counts(clean_server):
    """A decode whose claimed load failed comes back (vLLM resets it to WAITING):
    then only a lookup decides, so it recomputes instead of waiting for KV that is not
    coming, round after round."""
    prompt = list(range(1200, 1211))
    sched, worker, _ = make_connectors("kv_consumer", server=clean_server.address,
                                       load_wait_s=0.3)
    params = {PARAM_SERVER: clean_server.address, "kvstore_tokens": 10}  # nothing stored
    req = request("claim", prompt, params)
    assert sched.get_num_new_matched_tokens(req, 0) == (10, True)
    assert schedule(sched, worker, req, [1, 2, 3], 10) == {1, 2, 3}
    req.num_computed_tokens = 0  # what vLLM does after a fully failed async load
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    worker.shutdown(), sched.shutdown()


def test_a_load_waiting_for_its_producer_does_not_hold_up_the_others(clean_server):
    """While one background load waits (up to load_wait_s) for a producer's entries,
    the transfer thread serves the others: a prompt that is there loads at once."""
    waiting, there = list(range(1300, 1311)), list(range(1400, 1411))
    _, params = prefill(clean_server, there, [3, 7, 1])
    sched, worker, _ = make_connectors("kv_consumer", server=clean_server.address,
                                       load_wait_s=20.0)
    late = request("late", waiting, {PARAM_SERVER: clean_server.address,
                                     "kvstore_tokens": 10})
    assert sched.get_num_new_matched_tokens(late, 0) == (10, True)
    sched.update_state_after_alloc(late, KVCacheBlocks(([KVCacheBlock(b) for b in (0, 4, 8)],)),
                                   10)
    out = SchedulerOutput.make_empty()
    worker.bind_connector_metadata(sched.build_connector_meta(out))
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    start = time.monotonic()
    now = request("now", there, params)
    matched, _ = sched.get_num_new_matched_tokens(now, 0)
    sched.update_state_after_alloc(now, KVCacheBlocks(([KVCacheBlock(b) for b in (5, 9, 2)],)),
                                   matched)
    worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput.make_empty()))
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    done: set[str] = set()
    while "now" not in done and time.monotonic() - start < 15:
        done |= worker.get_finished(set())[1] or set()
        time.sleep(0.01)
    assert done == {"now"} and time.monotonic() - start < 5.0  # not behind the 20 s wait
    assert worker.get_block_ids_with_load_errors() == set()
    assert entries(clean_server, settle_to=0) == 0  # it took its entries
    worker.shutdown(), sched.shutdown()


def test_transfer_thread_runs_torch_on_one_thread_and_leaves_the_engines(clean_server):
    """On a CPU engine the transfer thread's ops must not start a second OpenMP team
    on the cores the forward uses (it made every later decode step 2.7x slower); the
    engine thread's own count and the process default stay as they were."""
    import threading

    before = torch.get_num_threads()
    sched, worker, _ = make_connectors("kv_consumer", server=clean_server.address)
    seen, done = [], threading.Event()
    worker.worker._submit(0, lambda: (seen.append(torch.get_num_threads()), done.set()))
    assert done.wait(10)
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start(), t.join()
    worker.shutdown(), sched.shutdown()
    assert seen == [1]
    assert torch.get_num_threads() == before
    assert fresh == [before]  # a thread that starts later gets the process default


def test_an_idle_step_waits_for_a_background_load_and_wakes_when_it_lands(clean_server,
                                                                        monkeypatch):
    """A step with nothing scheduled (every request waits for its KV) pauses in
    get_finished until a load finishes, so vLLM's empty steps do not spin against
    the transfer thread; the pause ends the moment the load does (with a 60 s
    bound here, a missed wake-up would hold the step for all of it)."""
    from kvstore.connector import v1_worker

    monkeypatch.setattr(v1_worker, "IDLE_STEP_WAIT_S", 60.0)
    prompt = list(range(2000, 2011))
    _, params = prefill(clean_server, prompt, [3, 7, 1])
    sched, worker, _ = make_connectors("kv_consumer", server=clean_server.address)
    req = request("i1", prompt, params)
    assert sched.get_num_new_matched_tokens(req, 0) == (len(prompt) - 1, True)
    sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in (5, 9, 2)],)),
                                   len(prompt) - 1)
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert meta.idle and meta.loads
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    start = time.monotonic()
    _, done = worker.get_finished(set())  # the first idle call: the load is in flight
    assert done == {"i1"} and time.monotonic() - start < 30
    worker.clear_connector_metadata()
    # Nothing in flight: an idle step does not wait at all.
    worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput.make_empty()))
    start = time.monotonic()
    assert worker.get_finished(set()) == (None, set())
    assert time.monotonic() - start < 30
    worker.shutdown(), sched.shutdown()


@pytest.mark.parametrize("layerwise", [True, False])
def test_saves_layer_by_layer_or_at_the_steps_end_store_the_same_bytes(clean_server,
                                                                       layerwise):
    """``layerwise_saves``: each layer is copied in its save_kv_layer hook, or none is
    until wait_for_save; either way the server gets exactly the caches' bytes."""
    prompt = list(range(3000, 3011))
    sched, worker, caches = make_connectors("kv_producer", server=clean_server.address,
                                            layerwise_saves=layerwise)
    fill_random(caches, seed=5)
    req = request("s1", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = [3, 7, 1]
    sched.update_state_after_alloc(req, KVCacheBlocks(([],)), 0)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (blocks,))]
    out.num_scheduled_tokens = {"s1": len(prompt)}
    out.total_num_scheduled_tokens = len(prompt)
    worker.bind_connector_metadata(sched.build_connector_meta(out))
    worker.start_load_kv(None)
    for name in LAYERS:
        worker.save_kv_layer(name, caches[name], None)
    (job,) = worker.worker._step_saves
    assert job.gathered == (set(range(len(LAYERS))) if layerwise else set())
    assert worker.worker.drain(30)  # the thread has had every layer handed to it
    if layerwise:  # reserved at the first layer, every layer in the arena already
        assert job.pending is not None and job.pending._written == set(range(len(LAYERS)))
        assert entries(clean_server) == 0  # not visible before the commit
    else:
        assert job.pending is None
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert worker.worker.drain(30)
    worker.shutdown(), sched.shutdown()
    with KVStoreClient(clean_server.address, layout=sched.layout, model_id="tiny-llama",
                       timeout_s=5.0) as reader:
        got = reader.get(prompt[:-1])
    assert got.matched_tokens == len(prompt) - 1
    want = gather_blocks(sched.layout, truthful(caches[LAYERS[0]], "test-view"),
                         [caches[n] for n in LAYERS], blocks, len(prompt) - 1)
    assert torch.equal(torch.as_tensor(got.kv).reshape(-1).view(torch.uint8), want)


def test_a_keep_mode_load_that_lands_after_its_abort_leaves_no_state_behind(clean_server):
    """kv_both with a producer's params: the load runs in the background, waiting for
    the producer's entries. The request is aborted meanwhile (vLLM's next step names
    it in finished_req_ids at once, and keeps its blocks until the load is reported);
    then the entries land and the load reads them. What it found stored is kept for
    a save that will never come: the worker must still let go of the request, as it
    does for one that finishes after its load."""
    prompt = list(range(3100, 3111))
    sched, worker, _ = make_connectors("kv_both", server=clean_server.address,
                                       load_wait_s=20.0)
    params = {PARAM_SERVER: clean_server.address, "kvstore_tokens": 10}
    req = request("ab1", prompt, params)
    assert sched.get_num_new_matched_tokens(req, 0) == (10, True)
    sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in (5, 9, 2)],)),
                                   10)
    worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput.make_empty()))
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.get_finished(set()) == (None, set())  # waiting for the producer
    worker.clear_connector_metadata()
    sched.request_finished(req, [5, 9, 2])  # aborted
    assert worker.get_finished({"ab1"}) == (None, set())  # the next step says so
    prefill(clean_server, prompt, [3, 7, 1])  # the entries land; the load reads them
    done: set[str] = set()
    deadline = time.monotonic() + 30
    while "ab1" not in done and time.monotonic() < deadline:
        done |= worker.get_finished(set())[1] or set()
        time.sleep(0.01)
    assert done == {"ab1"} and worker.get_block_ids_with_load_errors() == set()
    assert worker.worker.requests.tracked() == set()
    worker.worker.requests.check_integrity()

    # The same, finished after its load instead: nothing left either.
    req = request("ab2", prompt, params)
    assert sched.get_num_new_matched_tokens(req, 0) == (10, True)
    assert schedule(sched, worker, req, [4, 6, 8], 10) == set()
    sched.request_finished(req, [4, 6, 8])
    worker.get_finished({"ab2"})
    assert worker.worker.requests.tracked() == set()
    worker.shutdown(), sched.shutdown()
