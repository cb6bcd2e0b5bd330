"""The demo's model driver: a small Llama built locally, prefill and greedy decode.

The model is a real Hugging Face ``LlamaForCausalLM`` made from a ``LlamaConfig``
with weights drawn from a fixed seed, so every process that calls
``build_model(seed)`` holds the same weights without any download. Prompts are
token ids drawn from a seeded generator; no tokenizer is involved.

KV crosses process boundaries as per-layer ``(k, v)`` tensors of shape
``[1, kv_heads, seq, head_dim]`` — the form ``kvstore.layout.pack_hf`` takes —
and is turned back into a transformers ``DynamicCache`` here.

Determinism: greedy decoding compares argmaxes, so the same KV bytes and weights
give the same tokens only if the kernels are deterministic; ``configure_torch``
pins the thread count so every process runs the same reductions.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvstore.layout import KVLayout

MODEL_ID = "kvstore-demo/llama-tiny"
DEFAULT_SEED = 1234

PerLayerKV = list[tuple[torch.Tensor, torch.Tensor]]


class PrefillResult(NamedTuple):
    past: PerLayerKV  # per layer (k, v), each [1, kv_heads, seq, head_dim]
    next_token: int  # greedy token after the prompt
    hidden: torch.Tensor  # final-norm hidden state of the last prompt token, [1, hidden]


def configure_torch(threads: int = 1) -> None:
    """Same intra-op thread count everywhere, so float reductions agree bit for bit."""
    torch.set_num_threads(threads)


def demo_config(dtype: torch.dtype = torch.float32) -> LlamaConfig:
    # Small enough to prefill 300 tokens in well under a second on one core; GQA
    # (2 KV heads for 4 query heads) like the models kvstore serves. A wider init
    # than the default 0.02 gives peaked logits, so greedy tokens depend on the KV.
    return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, initializer_range=0.2,
                       tie_word_embeddings=False, dtype=dtype,
                       # No special tokens: greedy runs never stop early or mask a token.
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_model(seed: int = DEFAULT_SEED, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The demo model, its weights a pure function of ``seed`` (no hub download)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(demo_config(dtype)).to(dtype)
    return model.eval()


def kv_layout(model: LlamaForCausalLM, block_tokens: int = 16) -> KVLayout:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVLayout(num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                    head_dim=head_dim, dtype=model.dtype, block_tokens=block_tokens)


def make_prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    """A deterministic pseudo-random prompt: the same (length, seed) gives the same ids."""
    if length <= 0:
        raise ValueError(f"prompt length must be positive, got {length}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + length)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


# ----------------------------------------------------------- cache conversion
def to_per_layer(cache) -> PerLayerKV:
    """A transformers cache (``DynamicCache`` or legacy tuples) -> per-layer (k, v)."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]


def to_cache(past: Sequence[tuple[torch.Tensor, torch.Tensor]], config: LlamaConfig) -> DynamicCache:
    """Per-layer (k, v) -> a ``DynamicCache`` the model can continue from."""
    params = inspect.signature(DynamicCache.__init__).parameters
    if "config" in params:
        return DynamicCache(ddp_cache_data=list(past), config=config)
    cache = DynamicCache()
    for i, (k, v) in enumerate(past):
        cache.update(k, v, i)
    return cache


# transformers 5 renamed forward's ``past_key_values`` to ``cache`` (and the output field).
_CACHE_ARG = ("cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
              else "past_key_values")


def _forward(model: LlamaForCausalLM, ids: torch.Tensor, cache=None, hidden: bool = False):
    kwargs = {_CACHE_ARG: cache} if cache is not None else {}
    return model(input_ids=ids, use_cache=True, logits_to_keep=1,
                 output_hidden_states=hidden, **kwargs)


def _out_cache(out):
    return out.cache if _CACHE_ARG == "cache" else out.past_key_values


def _argmax_last(logits: torch.Tensor) -> int:
    return int(logits[0, -1].argmax())


# ------------------------------------------------------------ prefill, decode
@torch.inference_mode()
def prefill(model: LlamaForCausalLM, tokens: Sequence[int]) -> PrefillResult:
    """Run the prompt; its KV as per-layer (k, v), the first greedy token, last hidden."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    out = _forward(model, ids, hidden=True)
    past = [(k.contiguous(), v.contiguous()) for k, v in to_per_layer(_out_cache(out))]
    return PrefillResult(past, _argmax_last(out.logits), out.hidden_states[-1][:, -1].clone())


@torch.inference_mode()
def token_from_hidden(model: LlamaForCausalLM, hidden: torch.Tensor) -> int:
    """The greedy token from a last-position hidden state (what ``prefill`` returns)."""
    logits = model.lm_head(hidden.to(model.dtype).reshape(1, 1, -1))
    return _argmax_last(logits)


class DecodeResult(NamedTuple):
    tokens: list[int]  # the n greedy tokens after first_token
    past: PerLayerKV  # KV of the prompt, first_token and every token but the last


@torch.inference_mode()
def decode_with_past(model: LlamaForCausalLM, past: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     first_token: int, n: int) -> DecodeResult:
    """Feed ``first_token`` after the KV in ``past``, take ``n`` greedy steps.

    ``past`` is not modified (the cache works on copies). The returned KV covers
    ``seq + n`` tokens: the last produced token has not been fed yet.
    """
    cache = to_cache([(k.clone(), v.clone()) for k, v in past], model.config)
    token, produced = first_token, []
    for _ in range(n):
        out = _forward(model, torch.tensor([[token]], dtype=torch.long), cache)
        cache = _out_cache(out)
        token = _argmax_last(out.logits)
        produced.append(token)
    return DecodeResult(produced, to_per_layer(cache))


def decode_greedy(model: LlamaForCausalLM, past: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  first_token: int, n: int) -> list[int]:
    """The ``n`` greedy tokens that follow ``first_token`` after the KV in ``past``."""
    return decode_with_past(model, past, first_token, n).tokens


@torch.inference_mode()
def reference_tokens(model: LlamaForCausalLM, tokens: Sequence[int], n: int) -> list[int]:
    """The single-process answer from Hugging Face's own greedy ``generate``, nothing moved.

    Returns ``[first_token, *n decoded tokens]``, the same shape the demo's decode
    node reports. Independent of ``prefill``/``decode_greedy``, so it checks them too.
    """
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n + 1, min_new_tokens=n + 1)
    return out[0, ids.shape[1]:].tolist()
