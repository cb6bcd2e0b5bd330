"""Disaggregated serving through the OpenAI-compatible HTTP servers and the proxy.

As docs/vllm.md deploys it, on three emulated nodes (tools/pd_cluster.py; network
namespaces where allowed, else loopback): node A runs a kvstore-server and a vLLM
server whose connector is a ``kv_producer``; node B a kvstore-server and a vLLM
server whose connector is a ``kv_consumer`` (A's server in its ``allowed_servers``);
node C the proxy (tools/pd_proxy.py), a plain vLLM server (no connector) and the
clients. All prompts go through the proxy at once, one of them streamed; each answer
must be token for token the plain engine's, the decode engine must report the
prompt's first n-1 tokens as not computed, and A's server must have served exactly
those blocks and be empty afterwards.
"""

from __future__ import annotations

import math
import random

import pytest

from tools.netns import netns_available
from tools.pd_cluster import BLOCK_SIZE, SERVED_NAME, PDCluster
from tools.tiny_models import VOCAB, ModelSpec, build

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.netns,
              pytest.mark.timeout(420)]

# Under a block, around one block, partial last blocks, several blocks, >= 2000 tokens.
PROMPT_LENS = (1, 7, 31, 32, 33, 37, 300, 2000)
STREAMED = 37  # this one goes through the proxy as a stream
DECODE_TOKENS = 24
SPEC = ModelSpec("llama", "float32")


def _prompts() -> dict[int, list[int]]:
    rng = random.Random(10)
    return {n: [rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENS}


def _body(prompt: list[int], stream: bool = False) -> dict:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": DECODE_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Everything the tests look at, gathered with the cluster up, then the cluster
    closed (so the last test can check that nothing is left)."""
    tmp = tmp_path_factory.mktemp("pd_http")
    model = build(SPEC, tmp / "models")
    prompts = _prompts()
    with PDCluster(model, tmp / "run", dtype=SPEC.dtype) as pd:
        completions = pd.plain.url + "/v1/completions"
        via_proxy = pd.proxy.url + "/v1/completions"
        before = pd.store_stats()
        results = pd.run_plan([
            {"parallel": [{"id": f"plain-{n}", "post": completions, "body": _body(p)}
                          for n, p in prompts.items()]},
            {"parallel": [{"id": f"pd-{n}", "post": via_proxy, "body": _body(p, n == STREAMED)}
                          for n, p in prompts.items()]},
            {"id": "proxy", "get": pd.proxy.url + "/proxy/stats"},
        ])
        after = pd.store_stats()
        kind = pd.kind
        logs = {s.name: s.log_tail(20000) for s in pd.services}
    by_id = {r["id"]: r for r in results}
    failed = {i: r for i, r in by_id.items() if r.get("status") != 200}
    assert not failed, f"requests failed: {failed}\n" + "\n".join(
        f"--- {name}\n{tail[-3000:]}" for name, tail in logs.items())
    return {"kind": kind, "by_id": by_id, "before": before, "after": after,
            "leftover_pids": pd.leftover_pids(), "leftover_ns": pd.leftover_namespaces()}


def _answer(result: dict) -> tuple[list[int], int]:
    """(generated token ids, prompt tokens the engine did not compute)."""
    if "stream_tokens" in result:
        usage = result["stream_usage"] or {}
        return result["stream_tokens"], (usage.get("prompt_tokens_details") or {}).get(
            "cached_tokens", -1)
    body = result["json"]
    return (body["choices"][0]["token_ids"],
            body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_nodes_are_what_this_machine_allows(served, record_property):
    record_property("node_emulation", served["kind"])
    print(f"node emulation: {served['kind']}")
    assert served["kind"] == ("netns" if netns_available() else "loopback")


def test_decode_through_the_proxy_gives_the_plain_engines_tokens(served):
    differ = {}
    for n in PROMPT_LENS:
        want, _ = _answer(served["by_id"][f"plain-{n}"])
        got, _ = _answer(served["by_id"][f"pd-{n}"])
        assert len(want) == DECODE_TOKENS
        if got != want:
            first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                         min(len(got), len(want)))
            differ[n] = f"from token {first}: {got} != {want}"
    assert not differ, f"prompt lengths whose decode differs from one plain engine: {differ}"


def test_the_decode_engine_computed_only_the_last_prompt_token(served):
    cached = {n: _answer(served["by_id"][f"pd-{n}"])[1] for n in PROMPT_LENS}
    assert cached == {n: n - 1 for n in PROMPT_LENS}
    plain = {n: _answer(served["by_id"][f"plain-{n}"])[1] for n in PROMPT_LENS}
    assert plain == dict.fromkeys(PROMPT_LENS, 0)  # the prompts share no prefix


def test_the_kv_came_from_the_prefill_nodes_store(served):
    a0, a, b = served["before"]["A"], served["after"]["A"], served["after"]["B"]
    loaded_blocks = sum(math.ceil((n - 1) / BLOCK_SIZE) for n in PROMPT_LENS)
    assert a["hits"] - a0["hits"] == loaded_blocks
    assert a["misses"] == a0["misses"]
    assert a["bytes_out"] - a0["bytes_out"] == a["bytes_in"] - a0["bytes_in"] > 0
    # drop_select took everything; a 1-token prompt left nothing no consumer can take
    assert a["entries"] == 0
    assert (b["entries"], b["hits"], b["bytes_in"]) == (0, 0, 0)
    proxy = served["by_id"]["proxy"]["json"]
    # Every prompt with KV to hand off was handed off (a 1-token prompt has none).
    loadable = sum(n > 1 for n in PROMPT_LENS)
    assert proxy["requests"] == proxy["handoffs"] + proxy["without_params"] == len(PROMPT_LENS)
    assert proxy["handoffs"] >= loadable and proxy["prefill_failures"] == 0


def test_the_requests_were_in_flight_together(served):
    runs = [served["by_id"][f"pd-{n}"] for n in PROMPT_LENS]
    assert max(r["t0"] for r in runs) < min(r["t1"] for r in runs)


def test_nothing_is_left_behind(served):
    assert served["leftover_pids"] == []
    assert served["leftover_ns"] == []
