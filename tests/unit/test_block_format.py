"""Block placement against the backends' own cache writes, not caches a test filled.

CPU attention: vLLM's ``cpu_attn_reshape_and_cache`` kernel (the op its forward uses,
for the ISA it would pick for that dtype) writes K/V for a prompt into a paged cache;
``gather_blocks`` must give exactly the logical entry bytes (``pack_hf`` of the same
K/V), and ``scatter_blocks`` of those bytes into other blocks must leave exactly the
bytes the kernel leaves when it writes the same K/V there. MLA: the CPU MLA backend's
own ``do_kv_cache_update``. A "backend" that quantizes, pads or writes outside its
block is refused at start.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
ops = pytest.importorskip("vllm._custom_ops")

from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from kvstore.connector.block_format import probe, truthful  # noqa: E402
from kvstore.connector.paged_io import gather_blocks, scatter_blocks  # noqa: E402
from kvstore.core.errors import ConfigError  # noqa: E402
from kvstore.core.layout import KVLayout, dtype_name, pack_hf  # noqa: E402


def cpu_attn_writer(heads: int, block: int, dim: int, dtype: torch.dtype):
    """What CPUAttentionBackendImpl.do_kv_cache_update does: split the view into its
    K and V halves and call the kernel with the ISA the backend picks."""
    isa = _get_attn_isa(dtype, block, dim)

    def write(key, value, cache, slots):
        kc, vc = cache.view(cache.shape[0], heads, 2 * block, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    return write


def slots_of(blocks: list[int], ntokens: int, block: int) -> torch.Tensor:
    return torch.tensor([blocks[t // block] * block + t % block for t in range(ntokens)])


CASES = [(torch.float32, 2, 32, 32), (torch.float32, 4, 64, 64), (torch.bfloat16, 2, 32, 32),
         (torch.bfloat16, 1, 32, 128), (torch.float16, 2, 32, 64)]


@pytest.mark.parametrize("dtype,heads,block,dim", CASES)
@pytest.mark.parametrize("ntokens", [1, 31, 32, 33, 70])
def test_cpu_attention_round_trip_matches_the_kernel(dtype, heads, block, dim, ntokens):
    layers = 2
    layout = KVLayout(layers, heads, dim, dtype_name(dtype), block)
    write = cpu_attn_writer(heads, block, dim, dtype)
    fmt = probe(torch.zeros(8, heads, block, 2 * dim, dtype=dtype), write, "CPU_ATTN")
    assert not fmt.identity  # K is kept transposed: the view is not the truth
    g = torch.Generator().manual_seed(ntokens)
    k = torch.randn(layers, ntokens, heads, dim, generator=g).to(dtype)
    v = torch.randn(layers, ntokens, heads, dim, generator=g).to(dtype)
    nblocks = -(-ntokens // block)
    src_blocks, dst_blocks = [6, 1, 4][:nblocks], [2, 7, 0][:nblocks]
    src = [torch.zeros(8, heads, block, 2 * dim, dtype=dtype) for _ in range(layers)]
    for layer in range(layers):
        write(k[layer], v[layer], src[layer], slots_of(src_blocks, ntokens, block))

    entries = gather_blocks(layout, fmt, src, src_blocks, ntokens)
    hf = [(k[layer].transpose(0, 1)[None], v[layer].transpose(0, 1)[None])
          for layer in range(layers)]
    assert torch.equal(entries, pack_hf(layout, hf))

    dst = [torch.zeros_like(c) for c in src]
    scatter_blocks(layout, fmt, entries, dst, dst_blocks, ntokens)
    want = [torch.zeros_like(c) for c in src]
    for layer in range(layers):
        write(k[layer], v[layer], want[layer], slots_of(dst_blocks, ntokens, block))
    for got, exp in zip(dst, want):
        assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))


def test_scatter_skips_local_blocks_and_leaves_the_rest_of_a_partial_block():
    dtype, heads, block, dim, ntokens = torch.float32, 2, 32, 32, 45
    layout = KVLayout(1, heads, dim, "float32", block)
    write = cpu_attn_writer(heads, block, dim, dtype)
    fmt = probe(torch.zeros(4, heads, block, 2 * dim, dtype=dtype), write, "CPU_ATTN")
    k, v = torch.randn(ntokens, heads, dim), torch.randn(ntokens, heads, dim)
    src = torch.zeros(4, heads, block, 2 * dim)
    write(k, v, src, slots_of([0, 1], ntokens, block))
    entries = gather_blocks(layout, fmt, [src], [0, 1], ntokens)
    dst = torch.full((4, heads, block, 2 * dim), 7.0)
    scatter_blocks(layout, fmt, entries, [dst], [2, 3], 40, first_block=1, data_tokens=ntokens)
    assert bool((dst[2] == 7.0).all())  # a local prefix-cache block: untouched
    want = torch.full_like(dst, 7.0)
    write(k[32:40], v[32:40], want, slots_of([3], 8, block))  # tokens 32..39 into block 3
    assert torch.equal(dst[3], want[3])  # tokens 40.. keep what was there


def test_mla_latent_placement_from_the_cpu_mla_backend():
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    rank, rope, block, layers, ntokens = 64, 16, 32, 2, 40
    channels = rank + rope

    def write(latent, _none, cache, slots):  # the backend's own update (uses no state)
        CPUMLAImpl.do_kv_cache_update(None, latent[:, :rank], latent[:, rank:].unsqueeze(1),
                                      cache, slots, "auto", torch.tensor(1.0))
    fmt = probe(torch.zeros(4, block, channels), write, "CPU_MLA")
    assert fmt.mla and fmt.identity
    layout = KVLayout(layers, 1, channels // 2, "float32", block)
    latents = torch.randn(layers, ntokens, channels)
    src = [torch.zeros(4, block, channels) for _ in range(layers)]
    for layer in range(layers):
        write(latents[layer], None, src[layer], slots_of([3, 0], ntokens, block))
    entries = gather_blocks(layout, fmt, src, [3, 0], ntokens)
    # logical: per layer [2, tokens, 1, C/2]: the latent's two halves
    hf = [(latents[i, :, : channels // 2][None, None], latents[i, :, channels // 2:][None, None])
          for i in range(layers)]
    assert torch.equal(entries, pack_hf(layout, hf))
    dst = [torch.zeros_like(c) for c in src]
    scatter_blocks(layout, fmt, entries, dst, [1, 2], ntokens)
    assert torch.equal(dst[1][1], src[1][3]) and torch.equal(dst[0][2, :8], src[0][0, :8])


def test_truthful_view_is_the_identity_and_agrees_with_the_general_path():
    dtype, heads, block, dim = torch.bfloat16, 2, 16, 8
    cache = torch.randn(5, heads, block, 2 * dim).to(dtype)

    def view_write(key, value, c, slots):  # flash-attention's semantics: [b, h, n, K|V]
        b, n = slots // block, slots % block
        c[b, :, n, :dim] = key
        c[b, :, n, dim:] = value
    probed = probe(cache, view_write, "view")
    assert probed.identity and probed.coords_key() == truthful(cache, "view").coords_key()


def refuse(write, match: str, cache=None):
    cache = torch.zeros(4, 2, 32, 64) if cache is None else cache
    with pytest.raises(ConfigError, match=match):
        probe(cache, write, "odd")


def test_backends_the_connector_cannot_place_are_refused_at_start():
    def scaled(key, value, c, slots):  # quantizes / scales what it stores
        b, n = slots // 32, slots % 32
        c[b, :, n, :32] = key * 0.5
        c[b, :, n, 32:] = value * 0.5

    def spills(key, value, c, slots):  # writes beside the block it was given
        b, n = slots // 32, slots % 32
        c[b, :, n, :32], c[b, :, n, 32:] = key, value
        c[b + 1, 0, 0, 0] = 1.0

    def drops_v(key, value, c, slots):  # keeps K twice, V nowhere
        b, n = slots // 32, slots % 32
        c[b, :, n, :32], c[b, :, n, 32:] = key, key

    def raises(*_):
        raise RuntimeError("needs a GPU")

    refuse(scaled, "one-to-one")
    refuse(spills, "not given")
    refuse(drops_v, "one-to-one")
    with pytest.raises(RuntimeError, match="needs a GPU"):  # v1_backend makes it a ConfigError
        probe(torch.zeros(4, 2, 32, 64), raises, "odd")
    refuse(lambda *a: None, "one-to-one")  # writes nothing at all
    refuse(lambda *a: None, "dtype", torch.zeros(4, 2, 32, 64, dtype=torch.int32))
