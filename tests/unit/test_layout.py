"""Entry bytes <-> HF and vLLM paged KV tensors (kvstore/core/layout.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.core.errors import ConfigError, InvalidRequestError
from kvstore.core.layout import KVLayout, pack_hf, unpack_hf

DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "int8", "uint8"]


@st.composite
def layouts(draw) -> KVLayout:
    return KVLayout(num_layers=draw(st.integers(1, 3)), kv_heads=draw(st.integers(1, 3)),
                    head_dim=draw(st.sampled_from([1, 2, 8])),
                    dtype=draw(st.sampled_from(DTYPES)),
                    block_tokens=draw(st.sampled_from([1, 3, 4, 16])))


def random_tensor(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: every bit pattern is exercised,
    and byte-level comparison makes NaN payloads compare equal."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(*shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def hf_past(layout: KVLayout, seq: int, seed: int = 0):
    shape = (1, layout.kv_heads, seq, layout.head_dim)
    return [(random_tensor(shape, layout.torch_dtype, seed + 2 * i),
             random_tensor(shape, layout.torch_dtype, seed + 2 * i + 1))
            for i in range(layout.num_layers)]


# ------------------------------------------------------------------ sizes
@given(layouts(), st.integers(1, 100))
def test_entry_sizes_sum_to_nbytes(layout, ntokens):
    sizes = layout.entry_sizes(ntokens)
    assert sum(sizes) == layout.nbytes(ntokens)
    assert sizes[:-1] == [layout.block_nbytes] * (len(sizes) - 1)
    assert len(sizes) == -(-ntokens // layout.block_tokens)
    assert layout.block_nbytes == (layout.num_layers * 2 * layout.block_tokens * layout.kv_heads
                                   * layout.head_dim * layout.itemsize)


@pytest.mark.parametrize("kwargs", [
    {"num_layers": 0, "kv_heads": 1, "head_dim": 1},
    {"num_layers": 1, "kv_heads": -1, "head_dim": 1},
    {"num_layers": 1, "kv_heads": 1, "head_dim": 1.5},
    {"num_layers": 1, "kv_heads": 1, "head_dim": 1, "dtype": "float64"},
    {"num_layers": 1, "kv_heads": 1, "head_dim": 1, "block_tokens": 0},
])
def test_bad_layouts_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        KVLayout(**kwargs)


def test_dtype_accepts_torch_dtypes():
    assert KVLayout(1, 1, 1, torch.float16).dtype == "float16"
    assert KVLayout(1, 1, 1, "torch.bfloat16").torch_dtype is torch.bfloat16


# ------------------------------------------------------------------ HF round trip
@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(1, 40), st.data())
def test_hf_round_trip(layout, seq, data):
    ntokens = data.draw(st.integers(1, seq))
    past = hf_past(layout, seq, seed=seq)
    packed = pack_hf(layout, past, ntokens)
    assert packed.dtype == torch.uint8 and packed.is_contiguous()
    assert packed.numel() == layout.nbytes(ntokens)
    back = unpack_hf(layout, packed, ntokens)
    assert len(back) == layout.num_layers
    for (k, v), (k2, v2) in zip(past, back):
        assert k2.shape == (1, layout.kv_heads, ntokens, layout.head_dim)
        assert k2.dtype == layout.torch_dtype
        assert torch.equal(as_bytes(k[:, :, :ntokens]), as_bytes(k2))
        assert torch.equal(as_bytes(v[:, :, :ntokens]), as_bytes(v2))


@given(layouts(), st.integers(1, 40))
def test_entries_are_independent_slices(layout, seq):
    """Packing a prefix gives the same bytes as the prefix of the packed whole."""
    past = hf_past(layout, seq)
    whole = pack_hf(layout, past)
    full = (seq // layout.block_tokens) * layout.block_tokens
    if full:
        assert torch.equal(pack_hf(layout, past, full), whole[:layout.nbytes(full)])


def test_entry_byte_order_is_layers_kv_tokens_heads_dim():
    """One element's byte offset, computed by hand from the documented order."""
    layout = KVLayout(num_layers=3, kv_heads=2, head_dim=5, dtype="float32", block_tokens=4)
    seq = 10  # two full blocks and a partial block of 2
    past = [(torch.zeros(1, 2, seq, 5), torch.zeros(1, 2, seq, 5)) for _ in range(3)]
    layer, kv, token, head, dim = 2, 1, 9, 1, 3
    past[layer][kv][0, head, token, dim] = 42.0
    flat = pack_hf(layout, past).view(torch.float32)
    block, t_in_block = divmod(token, layout.block_tokens)
    ntok = 2  # the element sits in the partial last block
    entry_start = block * layout.block_nbytes // 4
    index = (entry_start + (((layer * 2 + kv) * ntok + t_in_block) * 2 + head) * 5 + dim)
    assert flat[index] == 42.0
    assert int(torch.count_nonzero(flat)) == 1
    # Same for an element in a full block.
    past[layer][kv].zero_()
    past[0][0][0, 1, 5, 4] = 7.0
    flat = pack_hf(layout, past).view(torch.float32)
    index = layout.block_nbytes // 4 + ((((0 * 2 + 0) * 4 + 1) * 2 + 1) * 5 + 4)
    assert flat[index] == 7.0 and int(torch.count_nonzero(flat)) == 1


# ------------------------------------------------------------------ bad input
LAY = KVLayout(num_layers=2, kv_heads=3, head_dim=4, dtype="float32", block_tokens=4)


def _kv(shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


def _good_past(seq=5):
    return [(_kv((1, 3, seq, 4)), _kv((1, 3, seq, 4))) for _ in range(2)]


@pytest.mark.parametrize("past,ntokens", [
    ([(_kv((1, 3, 5, 4), torch.float16), _kv((1, 3, 5, 4), torch.float16))] * 2, None),
    ([(_kv((1, 3, 5, 4)), _kv((1, 3, 5, 4)))] * 3, None),  # 3 layers, layout has 2
    ([(_kv((2, 3, 5, 4)), _kv((2, 3, 5, 4)))] * 2, None),  # batch 2
    ([(_kv((3, 5, 4)), _kv((3, 5, 4)))] * 2, None),  # 3-D
    ([(_kv((1, 2, 5, 4)), _kv((1, 2, 5, 4)))] * 2, None),  # wrong heads
    ([(_kv((1, 3, 5, 8)), _kv((1, 3, 5, 8)))] * 2, None),  # wrong head_dim
    ([(_kv((1, 3, 5, 4)), _kv((1, 3, 6, 4)))] * 2, None),  # k/v disagree
    (_good_past()[:1] + [(_kv((1, 3, 6, 4)), _kv((1, 3, 6, 4)))], None),  # layers disagree
    (_good_past(), 0), (_good_past(), 6), (_good_past(), -1),
])
def test_pack_hf_rejects_bad_input(past, ntokens):
    with pytest.raises(InvalidRequestError):
        pack_hf(LAY, past, ntokens)


@pytest.mark.parametrize("nbytes,ntokens", [(LAY.nbytes(5) - 1, 5), (LAY.nbytes(5), 4),
                                            (0, 0), (7, 1)])
def test_unpack_hf_rejects_wrong_sizes(nbytes, ntokens):
    with pytest.raises(InvalidRequestError):
        unpack_hf(LAY, torch.zeros(nbytes, dtype=torch.uint8), ntokens)
