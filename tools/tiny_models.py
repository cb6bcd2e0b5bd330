"""Small models built on this machine, for real vLLM engines in tests and ``make run``.

Nothing can be downloaded here, so a model is a transformers config with weights
drawn from a fixed seed, saved with ``save_pretrained`` beside a word-level
tokenizer (token ``i`` is the word ``w<i>``), so vLLM loads it like any hub model,
OpenAI-compatible server included. The same (arch, dtype, seed, layers) always
gives the same bytes on disk.

Weights are drawn wider than transformers' default (std 0.08): greedy decoding then
has clear winners, so a token that differs means the KV differed, not a near-tie.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

import torch

# "gemma2": Gemma 2's attention, alternating a 64-token sliding window and full
# attention layer by layer (a hybrid model: two KV cache groups where vLLM's hybrid
# allocator runs).
# "deepseek2": DeepSeek-V2 attention (MLA: one 576-wide latent per token and layer,
# the only width vLLM's CPU MLA kernel takes), dense MLPs, no MoE.
ARCHS = ("llama", "qwen2", "gemma2", "deepseek2")
SLIDING_WINDOW = 64
DTYPES = ("float32", "bfloat16")
VOCAB = 1024
_STAMP = "kvstore-tiny-model.json"


class ModelSpec(NamedTuple):
    arch: str = "llama"  # one of ARCHS
    dtype: str = "float32"  # "float32" | "bfloat16"
    layers: int = 2
    seed: int = 0
    hidden: int = 128  # 4 heads of 32 (CPU attention supports head_dim 32)
    kv_heads: int = 2
    max_len: int = 4096

    @property
    def name(self) -> str:
        return f"tiny-{self.arch}-{self.dtype}-l{self.layers}-s{self.seed}"


def _config(spec: ModelSpec):
    common = dict(vocab_size=VOCAB, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
                  num_hidden_layers=spec.layers, num_attention_heads=4,
                  num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_len,
                  tie_word_embeddings=False, torch_dtype=spec.dtype,
                  # No special tokens: greedy runs never stop early or mask a token.
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if spec.arch == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(head_dim=spec.hidden // 4, **common)
    if spec.arch == "qwen2":
        from transformers import Qwen2Config
        return Qwen2Config(**common)
    if spec.arch == "gemma2":
        from transformers import Gemma2Config
        common["tie_word_embeddings"] = True  # vLLM's Gemma 2 has no lm_head of its own
        return Gemma2Config(head_dim=spec.hidden // 4, sliding_window=SLIDING_WINDOW,
                            layer_types=["sliding_attention", "full_attention"]
                            * (spec.layers // 2) + ["sliding_attention"] * (spec.layers % 2),
                            **common)
    if spec.arch == "deepseek2":
        from transformers import DeepseekV2Config
        common.pop("num_key_value_heads")
        return DeepseekV2Config(num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                                qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                                first_k_dense_replace=spec.layers, n_routed_experts=4,
                                moe_intermediate_size=spec.hidden, num_experts_per_tok=2,
                                **common)
    raise ValueError(f"arch must be one of {ARCHS}, got {spec.arch!r}")


def _save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.save_pretrained(str(path))


def build(spec: ModelSpec, root: str | Path) -> Path:
    """The model directory for ``spec`` under ``root``, built once (reused if present)."""
    path = Path(root) / spec.name
    stamp = path / _STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == spec._asdict():
        return path
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(_config(spec))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model = model.to(getattr(torch, spec.dtype))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    _save_tokenizer(path)
    stamp.write_text(json.dumps(spec._asdict()))
    return path


def prompt_text(tokens: list[int]) -> str:
    """The text the tokenizer turns back into exactly ``tokens``."""
    return " ".join(f"w{t}" for t in tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(build(ModelSpec(args.arch, args.dtype, args.layers, args.seed), args.root))


if __name__ == "__main__":
    main()
