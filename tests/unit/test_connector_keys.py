"""Which requests may share stored KV: the connector's request scope, on vLLM's own
Request objects, and the namespace parts (pipeline stage) that keep shards apart."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm.v1.request")

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvstore.connector.v1_orders import claimed_tokens, request_scope, stored_part  # noqa: E402
from kvstore.core.hashing import block_keys, namespace_of  # noqa: E402
from kvstore.core.layout import KVLayout  # noqa: E402

PROMPT = list(range(100, 170))
LAYOUT = KVLayout(2, 2, 32, "float32", 32)


def req(rid: str = "r", **kw) -> Request:
    return Request(rid, PROMPT, SamplingParams(max_tokens=1), None, **kw)


def keys(scope: str, **ns) -> list[bytes]:
    return block_keys(namespace_of("m", LAYOUT, scope=scope, **ns), PROMPT, 32).keys


def test_plain_requests_share_whatever_their_ids():
    assert request_scope(req("a")) == request_scope(req("b")) == ""
    assert keys("") == block_keys(namespace_of("m", LAYOUT), PROMPT, 32).keys  # unchanged


def test_cache_salt_lora_and_multimodal_inputs_separate_keys():
    lora = LoRARequest("sql-adapter", 1, "/adapters/sql")
    other_lora = LoRARequest("chat-adapter", 2, "/adapters/chat")
    image = MultiModalFeatureSpec(data=None, modality="image", identifier="img-hash-1",
                                  mm_position=PlaceholderRange(offset=5, length=10))
    moved = MultiModalFeatureSpec(data=None, modality="image", identifier="img-hash-1",
                                  mm_position=PlaceholderRange(offset=6, length=10))
    scopes = {
        "plain": request_scope(req()),
        "salt-a": request_scope(req(cache_salt="a")),
        "salt-b": request_scope(req(cache_salt="b")),
        "lora": request_scope(req(lora_request=lora)),
        "other-lora": request_scope(req(lora_request=other_lora)),
        "image": request_scope(req(mm_features=[image])),
        "image-moved": request_scope(req(mm_features=[moved])),
    }
    assert len(set(scopes.values())) == len(scopes)
    all_keys = [keys(s)[0] for s in scopes.values()]
    assert len(set(all_keys)) == len(all_keys)  # even the first block differs
    # The same inputs again: the same scope (so the same keys, on another engine too).
    assert request_scope(req("x", cache_salt="a", lora_request=lora)) == \
        request_scope(req("y", cache_salt="a", lora_request=LoRARequest("sql-adapter", 7,
                                                                        "/adapters/sql")))


def test_prompt_embeddings_never_share():
    import torch

    a = Request("e1", None, SamplingParams(max_tokens=1), None,
                prompt_embeds=torch.zeros(4, 8))
    b = Request("e2", None, SamplingParams(max_tokens=1), None,
                prompt_embeds=torch.zeros(4, 8))
    assert request_scope(a) != request_scope(b)


def test_pipeline_stage_is_part_of_the_namespace():
    stages = [keys("", pp_rank=r, pp_size=2)[0] for r in range(2)]
    assert stages[0] != stages[1] and keys("")[0] not in stages


def test_what_is_stored_and_what_params_may_claim():
    assert stored_part([7]) == [] and stored_part([1, 2, 3]) == [1, 2]
    assert claimed_tokens({"kvstore_tokens": 69}, 69) == 69
    assert claimed_tokens({"kvstore_tokens": 10**9}, 69) == 69  # clamped to the prompt
    for bad in (None, [], {"kvstore_tokens": "69"}, {"kvstore_tokens": True},
                {"kvstore_tokens": -3}, {"kvstore_tokens": 0}, {}):
        assert claimed_tokens(bad, 69) is None
