"""CUDA flash-attention's cache write, probed: its view is the truth, and entries
gathered from it are the same logical bytes a CPU engine's are (so the two can share).
Needs CUDA and the CUDA build of vLLM (skipped elsewhere, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kvstore.connector.block_format import probe
from kvstore.connector.paged_io import gather_blocks, scatter_blocks
from kvstore.core.layout import KVLayout, dtype_name, pack_hf

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def flash_writer(dim: int):
    from vllm._custom_ops import reshape_and_cache_flash

    one = torch.tensor(1.0, device="cuda")

    def write(key, value, cache, slots):  # as FlashAttentionImpl.do_kv_cache_update
        kc, vc = cache.transpose(1, 2).split(dim, dim=-1)
        reshape_and_cache_flash(key, value, kc, vc, slots, "auto", one, one)
    return write


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attention_view_is_truthful_and_round_trips(dtype):
    heads, block, dim, ntokens, layers = 4, 16, 128, 45, 2
    write = flash_writer(dim)
    caches = [torch.zeros(8, heads, block, 2 * dim, dtype=dtype, device="cuda")
              for _ in range(layers)]
    fmt = probe(caches[0], write, "FLASH_ATTN")
    assert fmt.identity
    layout = KVLayout(layers, heads, dim, dtype_name(dtype), block)
    k = torch.randn(layers, ntokens, heads, dim, device="cuda").to(dtype)
    v = torch.randn(layers, ntokens, heads, dim, device="cuda").to(dtype)
    slots = torch.tensor([[5, 2, 7][t // block] * block + t % block for t in range(ntokens)],
                         device="cuda")
    for layer in range(layers):
        write(k[layer], v[layer], caches[layer], slots)
    entries = gather_blocks(layout, fmt, caches, [5, 2, 7], ntokens)
    hf = [(k[i].transpose(0, 1)[None].cpu(), v[i].transpose(0, 1)[None].cpu())
          for i in range(layers)]
    assert torch.equal(entries, pack_hf(layout, hf))
    dst = [torch.zeros_like(c) for c in caches]
    scatter_blocks(layout, fmt, entries, dst, [1, 3, 4], ntokens)
    assert torch.equal(dst[0][1], caches[0][5]) and torch.equal(dst[1][3], caches[1][2])
