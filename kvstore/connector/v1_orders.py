"""What the connector's scheduler side tells its workers each step, and the key rules
both sides share.

What is stored for a prompt of ``n`` tokens is the KV of its first ``n - 1``: a decode
engine computes the last prompt token itself (it needs its logits), so it can never use
more, and a 1-token prompt stores nothing that no consumer could ever take.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

PARAM_SERVER = "kvstore_server"  # kv_transfer_params: the server holding the prompt's KV
PARAM_TOKENS = "kvstore_tokens"  # kv_transfer_params: how many tokens the producer stores
# kv_transfer_params: the producer's key generation (SchedulerSide.reset), when not 0
PARAM_GENERATION = "kvstore_generation"


@dataclass(frozen=True)
class LoadOrder:
    """Load ``ntokens`` tokens of a request into its blocks.

    ``wait``: the producer named this prompt (kv_transfer_params), so its entries may
    still be on their way: the worker waits for them (bounded) before taking them.
    ``background``: the request waits in vLLM's WAITING_FOR_REMOTE_KVS and is told
    through ``get_finished``; otherwise the load feeds this step's forward, layer by
    layer (``wait_for_layer_load``)."""

    req_id: str
    token_ids: list[int]  # the stored part of the prompt: all but its last token
    block_ids: list[int]  # the request's blocks, in token order
    ntokens: int  # tokens whose KV must be present after the load
    first_block: int  # blocks before this one are vLLM's local prefix-cache hits
    server: str
    scope: str = ""  # request_scope(): part of the keys
    wait: bool = False
    background: bool = False
    # Per KV cache group, when vLLM keeps several (its hybrid allocator): the
    # request's blocks of each, ``block_ids`` being the first's. Empty: one group.
    groups: tuple[list[int], ...] = ()


@dataclass(frozen=True)
class SaveOrder:
    """Save a request's stored part. ``first_block``: the blocks before it were on
    the server when the scheduler looked (a prefix-cache hit, keep mode) or were
    saved by the request's earlier chunk orders: they are neither copied off the
    device nor sent, and the save fails whole (a later miss) if the server lost one
    of them since."""

    req_id: str
    token_ids: list[int]  # the stored part of the prompt (or of it so far): see ``last``
    block_ids: list[int]
    scope: str = ""
    first_block: int = 0
    groups: tuple[list[int], ...] = ()  # as LoadOrder.groups
    # False: a chunk's save, of the full blocks one step of a chunked prefill computed
    # (where vLLM frees a sliding window's blocks before the last chunk, each chunk
    # is saved in its own step); the prompt's stored part is complete only with the
    # order whose ``last`` is True.
    last: bool = True
    # The blocks before first_block were stored, and counted as waiting for a
    # consumer, by this request's own earlier chunk orders: only the new ones are
    # reserved (a whole insert would count those again, and a decode that takes
    # the prompt once would leave them behind).
    continues: bool = False


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    # The step computes nothing (vLLM's no-forward step: every request is waiting,
    # e.g. for its remote KV): the worker may pause in it for a load to finish.
    idle: bool = False


def stored_part(prompt: list[int]) -> list[int]:
    """The prompt tokens whose KV is stored: all but the last (see the module doc)."""
    return prompt[:-1]


def request_scope(request: Any) -> str:
    """What a request's KV depends on besides its tokens, as vLLM's prefix-cache block
    hashes see it: its cache_salt, LoRA adapter and multimodal inputs (by content
    hash and position). Requests with prompt embeddings get a scope no other
    request has (their KV depends on the embeddings), so they never share."""
    parts = []
    if getattr(request, "prompt_embeds", None) is not None:
        parts.append(f"embeds={request.request_id}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}@{getattr(lora, 'lora_path', '')}")
    for feature in getattr(request, "mm_features", None) or []:
        pos = feature.mm_position
        parts.append(f"mm={feature.identifier}@{pos.offset}+{pos.length}")
    return "\n".join(parts)


def claimed_tokens(params: Any, stored: int) -> int | None:
    """The token count a producer's kv_transfer_params claim, clamped to what this
    prompt can have stored; None when they claim nothing (untrusted input: only an
    int is taken)."""
    if not isinstance(params, dict):
        return None
    value = params.get(PARAM_TOKENS)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return min(value, stored)
