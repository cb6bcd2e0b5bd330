"""Several KV cache groups (vLLM's hybrid allocator, ``SupportsHMA``): full and
sliding-window layers with block tables of their own, against vLLM's CPU attention
kernel's own cache writes and a real kvstore-server.

tests/engine/test_model_shapes.py runs a real hybrid model (Gemma 2, two groups);
these tests take its paths one at a time, with the bytes checked exactly. They build
the groups as vLLM's scheduler would, through its own objects (KVCacheConfig with a FullAttentionSpec and
a SlidingWindowSpec group, SchedulerOutput, KVCacheBlocks), and fill the caches with
``cpu_attn_reshape_and_cache``, the kernel the CPU backend's forward writes with. What
the hybrid allocator does that matters here is reproduced: a sliding-window group's
blocks behind the window are freed (and reused by other requests) while a chunked
prefill goes on, and a loading request gets the null block (id 0) for them.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks a platform
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")
ops = pytest.importorskip("vllm._custom_ops")

from vllm.config import CacheConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
    supports_hma,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from kvstore.connector import vllm_v1  # noqa: E402
from kvstore.connector.block_format import probe  # noqa: E402
from kvstore.connector.v1_config import kv_groups_of  # noqa: E402
from kvstore.connector.vllm_v1 import KVStoreConnectorV1  # noqa: E402
from kvstore.core.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.timeout(120)

HEADS, HEAD, BS, NUM_BLOCKS, WINDOW = 2, 32, 32, 24, 40
DTYPE = torch.float32
# Model order interleaves the kinds (as Gemma's layers do); vLLM lists them by group.
FULL = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
SLIDING = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
LAYERS = [FULL[0], SLIDING[0], FULL[1], SLIDING[1]]


def hybrid_config() -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                                dtype=DTYPE, sliding_window=WINDOW)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(FULL, full),
                                          KVCacheGroupSpec(SLIDING, sliding)])


def cpu_write(key, value, cache, slots):
    """What CPUAttentionBackendImpl.do_kv_cache_update does with one layer's K/V."""
    kc, vc = cache.view(cache.shape[0], HEADS, 2 * BS, HEAD).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, _get_attn_isa(DTYPE, BS, HEAD))


@pytest.fixture(autouse=True)
def cpu_attention_placement(monkeypatch):
    """No model runs: the placement is probed from the CPU kernel's own writes."""
    monkeypatch.setattr(vllm_v1, "block_format_of",
                        lambda _cfg, names, caches: probe(caches[names[0]], cpu_write,
                                                          "CPU_ATTN"))


@pytest.fixture
def server(server_factory):
    return server_factory(block_tokens=BS, dram="64MiB")


def connectors(role: str, server, **extra):
    kvt = KVTransferConfig(kv_connector="KVStoreConnectorV1",
                           kv_connector_module_path="kvstore.connector.vllm_v1",
                           kv_role=role, kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"server": server.address,
                                                      "model_id": "hybrid", "timeout_s": 5.0,
                                                      "staging_bytes": "4MiB",
                                                      # (what a lookup finds, not its budget)
                                                      "lookup_timeout_s": 5.0, **extra})
    cfg = VllmConfig(kv_transfer_config=kvt, cache_config=CacheConfig(block_size=BS))
    kcc = hybrid_config()
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kcc)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    caches = {n: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD, dtype=DTYPE) for n in LAYERS}
    worker.register_kv_caches(caches)
    return sched, worker, caches


def slots(blocks: list[int], start: int, stop: int) -> torch.Tensor:
    return torch.tensor([blocks[t // BS] * BS + t % BS for t in range(start, stop)])


def kv_of(ntokens: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(ntokens, HEADS, HEAD, generator=g),
                torch.randn(ntokens, HEADS, HEAD, generator=g)) for n in LAYERS}


def compute(caches, kv, groups: dict[str, list[int]], start: int, stop: int) -> None:
    """The forward of tokens [start, stop): each layer's K/V into its group's blocks."""
    for name in LAYERS:
        k, v = kv[name]
        cpu_write(k[start:stop], v[start:stop], caches[name], slots(groups[name], start, stop))


def step(sched, worker, out: SchedulerOutput) -> None:
    meta = sched.build_connector_meta(out)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, None, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert worker.worker.drain(30)


def wait_loaded(worker, rid: str) -> set[str]:
    """Step vLLM's way until ``rid``'s background load is reported; the requests
    reported failed meanwhile. Block-level errors never come with several groups
    (vLLM refuses them there)."""
    done: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + 30
    while rid not in done and time.monotonic() < deadline:
        results = worker.get_transfer_results(set())
        done |= results.finished_recving
        failed |= results.failed_recving
        assert worker.get_block_ids_with_load_errors() == set()
        time.sleep(0.01)
    assert rid in done, "the load was never reported"
    return failed


def test_groups_follow_the_model_order_and_odd_specs_are_refused():
    groups = kv_groups_of(hybrid_config())
    assert groups.layer_names == LAYERS
    assert groups.layer_group == [0, 1, 0, 1]
    assert groups.windowed == (False, True)
    assert groups.layout.num_layers == 4 and groups.layout.block_tokens == BS
    assert supports_hma(KVStoreConnectorV1)

    other = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=2 * HEAD,
                              dtype=DTYPE)
    cfg = hybrid_config()
    cfg.kv_cache_groups[1] = KVCacheGroupSpec(SLIDING, other)
    with pytest.raises(ConfigError, match="differ"):
        kv_groups_of(cfg)
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(DTYPE,))
    cfg.kv_cache_groups[1] = KVCacheGroupSpec(SLIDING, mamba)
    with pytest.raises(ConfigError, match="not an attention spec"):
        kv_groups_of(cfg)
    cross = CrossAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                               dtype=DTYPE)
    cfg.kv_cache_groups[1] = KVCacheGroupSpec(SLIDING, cross)
    with pytest.raises(ConfigError, match="do not map tokens in order"):
        kv_groups_of(cfg)


def test_chunked_prefill_of_a_hybrid_model_round_trips_every_layer(server):
    """Prefill 4 blocks + 5 tokens in two chunks; between them the sliding group's
    first blocks fall out of the window and are reused by another request (their
    bytes overwritten). The decode side, whose sliding group gets null blocks behind
    the window, must get exactly the kernel's bytes: every block of the full layers,
    the window's blocks of the sliding ones; the null block is never written."""
    n = 4 * BS + 5
    prompt = list(range(500, 500 + n))
    stored = n - 1
    kv = kv_of(n, seed=3)
    sched, worker, caches = connectors("kv_producer", server)
    full_ids, slide_ids = [3, 5, 7, 9, 11], [4, 6, 8, 10, 12]
    per_layer = {name: (full_ids if name in FULL else slide_ids) for name in LAYERS}
    req = Request("h1", prompt, SamplingParams(max_tokens=1), None)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, KVCacheBlocks(([], [])), 0)

    first = 2 * BS  # chunk 1: blocks 0-1
    compute(caches, kv, {k: v for k, v in per_layer.items()}, 0, first)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (full_ids[:2], slide_ids[:2]))]
    out.num_scheduled_tokens = {"h1": first}
    out.total_num_scheduled_tokens = first
    step(sched, worker, out)
    req.num_computed_tokens = first

    # The window (40 tokens) has left block 0 behind: vLLM frees it, another request
    # writes into it. Chunk 2 computes the rest.
    for name in SLIDING:
        caches[name][slide_ids[0]].fill_(-7.0)
    compute(caches, kv, per_layer, first, n)
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=["h1"], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
        new_block_ids=[(full_ids[2:], slide_ids[2:])], num_computed_tokens=[first],
        num_output_tokens=[0])
    out.num_scheduled_tokens = {"h1": n - first}
    out.total_num_scheduled_tokens = n - first
    step(sched, worker, out)
    free_now, params = sched.request_finished_all_groups(req, (full_ids, slide_ids))
    assert free_now is False and params["kvstore_tokens"] == stored
    worker.shutdown(), sched.shutdown()

    # A prompt sharing the first two blocks finds them by lookup (keep mode: the
    # entries stay). Its window reaches back into block 0, so its sliding layers
    # need block 0 as the prefill computed it, before that block was reused.
    other = prompt[:2 * BS] + list(range(9000, 9010))
    sched, worker, near = connectors("kv_consumer", server, load_mode="keep")
    req_b = Request("h3", other, SamplingParams(max_tokens=1), None)
    # A lookup hit loads in the background too: with several groups vLLM can only
    # recover a failed load per request.
    assert sched.get_num_new_matched_tokens(req_b, 0) == (2 * BS, True)
    b_full, b_slide = [1, 2, 3], [21, 22, 23]
    sched.update_state_after_alloc(
        req_b, KVCacheBlocks(([KVCacheBlock(b) for b in b_full[:2]],
                              [KVCacheBlock(b) for b in b_slide[:2]])), 2 * BS)
    step(sched, worker, SchedulerOutput.make_empty())
    assert wait_loaded(worker, "h3") == set()
    worker.shutdown(), sched.shutdown()
    for name in LAYERS:
        k, v = kv[name]
        ids = b_full if name in FULL else b_slide
        want_b = torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD, dtype=DTYPE)
        cpu_write(k[:2 * BS], v[:2 * BS], want_b, slots(ids, 0, 2 * BS))
        assert torch.equal(near[name][ids[:2]], want_b[ids[:2]]), name

    # The decode side: its sliding group has the null block for blocks 0-1 (behind
    # the window of token 132), real blocks for 2-4.
    sched, worker, dst = connectors("kv_consumer", server)
    dec = Request("h2", prompt, SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": params}), None)
    assert sched.get_num_new_matched_tokens(dec, 0) == (stored, True)
    d_full, d_slide = [13, 14, 15, 16, 17], [0, 0, 18, 19, 20]
    sched.update_state_after_alloc(
        dec, KVCacheBlocks(([KVCacheBlock(b) for b in d_full],
                            [KVCacheBlock(b) for b in d_slide])), stored)
    step(sched, worker, SchedulerOutput.make_empty())
    assert wait_loaded(worker, "h2") == set()
    worker.shutdown(), sched.shutdown()

    want = {n_: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD, dtype=DTYPE) for n_ in LAYERS}
    for name in FULL:
        k, v = kv[name]
        cpu_write(k[:stored], v[:stored], want[name], slots(d_full, 0, stored))
    for name in SLIDING:
        k, v = kv[name]
        cpu_write(k[2 * BS:stored], v[2 * BS:stored], want[name],
                  slots(d_slide, 2 * BS, stored))
    for name in LAYERS:
        assert torch.equal(dst[name], want[name]), name
    assert all(bool((dst[name][0] == 0).all()) for name in SLIDING)  # null block untouched


def test_a_failed_load_is_reported_by_request_never_by_block_id(server):
    """vLLM raises if a connector names failed block ids with several groups: a load
    whose entries are not there is reported in failed_recving (vLLM then recomputes
    the request whole), and its cache is left alone."""
    sched, worker, dst = connectors("kv_consumer", server, load_wait_s=0.2)
    prompt = list(range(700, 700 + 3 * BS))
    params = {"kvstore_server": server.address, "kvstore_tokens": len(prompt) - 1}
    req = Request("m1", prompt, SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": params}), None)
    assert sched.get_num_new_matched_tokens(req, 0) == (len(prompt) - 1, True)
    sched.update_state_after_alloc(req, KVCacheBlocks(
        ([KVCacheBlock(b) for b in (1, 2, 3)], [KVCacheBlock(b) for b in (0, 4, 5)])),
        len(prompt) - 1)
    step(sched, worker, SchedulerOutput.make_empty())
    assert wait_loaded(worker, "m1") == {"m1"}
    worker.shutdown(), sched.shutdown()
    assert all(bool((c == 0).all()) for c in dst.values())


def test_a_prompt_whose_window_blocks_vllm_freed_is_not_saved(server):
    """A request that came with a local prefix-cache hit longer than the window gets
    null blocks for the window's past in its sliding group: that KV is gone, so the
    prompt is not saved and no params claim it (a decode would wait for nothing)."""
    sched, worker, caches = connectors("kv_producer", server)
    n = 4 * BS + 3
    req = Request("w1", list(range(300, 300 + n)), SamplingParams(max_tokens=1), None)
    sched.get_num_new_matched_tokens(req, 2 * BS)
    sched.update_state_after_alloc(req, KVCacheBlocks(([], [])), 0)
    full_ids, slide_ids = [1, 2, 3, 4, 5], [0, 0, 6, 7, 8]
    req.num_computed_tokens = 2 * BS
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (full_ids, slide_ids))]
    out.num_scheduled_tokens = {"w1": n - 2 * BS}
    out.total_num_scheduled_tokens = n - 2 * BS
    before = entries(server)
    meta = sched.build_connector_meta(out)
    assert meta.saves == []
    assert sched.request_finished_all_groups(req, (full_ids, slide_ids)) == (False, None)
    worker.shutdown(), sched.shutdown()
    assert entries(server) == before


def test_a_chunk_save_that_fails_after_its_abort_leaves_no_state_behind(server):
    """The first chunk of a sliding-window model's prompt is saved in its own step;
    the server is frozen, so that save hangs on the transfer thread, and the request
    is aborted meanwhile (the next step names it in finished_req_ids). The save then
    fails (timeout_s): the failure, which would drop the request's later chunk
    orders, comes after vLLM is done with the request, and must not stay behind."""
    sched, worker, _ = connectors("kv_producer", server, timeout_s=1.0)
    n = 4 * BS + 5
    req = Request("c1", list(range(800, 800 + n)), SamplingParams(max_tokens=1), None)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, KVCacheBlocks(([], [])), 0)
    full_ids, slide_ids = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (full_ids[:2], slide_ids[:2]))]
    out.num_scheduled_tokens = {"c1": 2 * BS}
    out.total_num_scheduled_tokens = 2 * BS
    os.kill(server.pid, signal.SIGSTOP)
    try:
        meta = sched.build_connector_meta(out)
        assert [o.last for o in meta.saves] == [False]  # a chunk's save
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for name in LAYERS:
            worker.save_kv_layer(name, None, None)
        worker.wait_for_save()
        worker.get_transfer_results(set())
        worker.clear_connector_metadata()
        sched.request_finished_all_groups(req, (full_ids[:2], slide_ids[:2]))  # aborted
        worker.get_transfer_results({"c1"})  # the next step says so
        assert worker.worker.drain(30)  # the save failed meanwhile
    finally:
        os.kill(server.pid, signal.SIGCONT)
    stats = worker.get_kv_connector_stats()
    assert stats is not None and stats.data["save_failures"] == 1, stats
    assert worker.worker.requests.tracked() == set()
    worker.worker.requests.check_integrity()
    worker.shutdown(), sched.shutdown()


def entries(server) -> int:
    from kvstore.client.client import KVStoreClient

    with KVStoreClient(server.address, timeout_s=5.0) as admin:
        return admin.stats()["entries"]
