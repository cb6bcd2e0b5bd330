"""paged_io through a truthful-view placement (flash-attention's [B, H, N, K|V] caches)
<-> entry bytes, against kvstore.core.layout. Backend-specific placements (CPU attention,
MLA) are tested against vLLM's own cache writes in test_block_format.py."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.connector.block_format import truthful
from kvstore.connector.paged_io import _rows, gather_blocks, gather_layer, scatter_blocks
from kvstore.core.layout import KVLayout, pack_hf

# Three heads: with two, the truthful view's permutation of a block is its own inverse,
# and moving whole blocks could mix up the two directions unseen.
HEADS = 3
LAYOUT = KVLayout(num_layers=3, kv_heads=HEADS, head_dim=4, dtype="float16", block_tokens=4)
PER_BLOCK = 2 * 4 * HEADS * 4  # elements of one layer's block


def _caches(seed: int, nblocks: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(nblocks, HEADS, 4, 8, generator=g).half() for _ in range(3)]


FMT = truthful(_caches(0)[0], "view")


@settings(max_examples=40, deadline=None)
@given(ntokens=st.integers(1, 16), extra=st.integers(0, 3), seed=st.integers(0, 99),
       perm=st.permutations(range(12)))
def test_gather_matches_layout_and_scatter_inverts_it(ntokens, extra, seed, perm):
    held = min(16, ntokens + extra)  # the store may hold more of the last block
    src_ids, dst_ids = list(perm[:4]), list(perm[4:8])
    src = _caches(seed)
    data = gather_blocks(LAYOUT, FMT, src, src_ids, held)
    # Same bytes as the HF layout of the same KV: per layer K and V [1, H, T, D].
    past = []
    for c in src:  # [B, H, N, K|V] -> the prompt's tokens [T, H, 2, D] -> K, V [1, H, T, D]
        kv = c[src_ids].transpose(1, 2).flatten(0, 1)[:held].unflatten(-1, (2, 4))
        past.append((kv[:, :, 0].transpose(0, 1)[None], kv[:, :, 1].transpose(0, 1)[None]))
    assert torch.equal(data, pack_hf(LAYOUT, past))
    dst = [torch.zeros_like(c) for c in src]
    scatter_blocks(LAYOUT, FMT, data, dst, dst_ids, ntokens, data_tokens=held)
    full, rest = divmod(ntokens, 4)
    for s, d in zip(src, dst):
        for i in range(full):
            assert torch.equal(d[dst_ids[i]], s[src_ids[i]])
        if rest:
            assert torch.equal(d[dst_ids[full], :, :rest], s[src_ids[full], :, :rest])
            assert not d[dst_ids[full], :, rest:].any()
        untouched = [b for b in range(12) if b not in dst_ids[:full + bool(rest)]]
        assert not d[untouched].any()


@settings(max_examples=20, deadline=None)
@given(ntokens=st.integers(1, 16), seed=st.integers(0, 99), perm=st.permutations(range(12)))
def test_blocks_moved_whole_and_element_by_element_agree(ntokens, seed, perm):
    """A cache whose blocks are each one run of memory, with gaps between them, moves
    whole blocks (``_rows``); one whose blocks are not (a view permuted over its
    storage, as an NHD layout gives) places every element by its coordinates. Both
    hold the same values as the plain cache, so both give the same entry bytes, and a
    scatter writes the same values into them and nothing into the gaps."""
    src_ids, dst_ids = list(perm[:4]), list(perm[4:8])
    plain = _caches(seed)
    storage = [torch.zeros(12, PER_BLOCK + 5).half() for _ in plain]
    gapped = [g[:, :PER_BLOCK].view(12, HEADS, 4, 8) for g in storage]
    nhd = [c.transpose(1, 2).contiguous().transpose(1, 2) for c in plain]
    for g, c in zip(gapped, plain):
        g.copy_(c)
    assert _rows(gapped[0], PER_BLOCK) is not None and _rows(nhd[0], PER_BLOCK) is None
    data = gather_blocks(LAYOUT, FMT, plain, src_ids, ntokens)
    assert torch.equal(gather_blocks(LAYOUT, FMT, gapped, src_ids, ntokens), data)
    assert torch.equal(gather_blocks(LAYOUT, FMT, nhd, src_ids, ntokens), data)
    wants = [torch.zeros_like(c) for c in plain]
    permuted = [torch.zeros_like(c).transpose(1, 2).contiguous().transpose(1, 2)
                for c in plain]
    for g in storage:
        g.fill_(3)
    for caches in (wants, gapped, permuted):
        scatter_blocks(LAYOUT, FMT, data, caches, dst_ids, ntokens)
    full, rest = divmod(ntokens, 4)
    for want, gap, perm_cache in zip(wants, gapped, permuted):
        assert torch.equal(perm_cache, want)
        for b in dst_ids[:full]:
            assert torch.equal(gap[b], want[b])
        if rest:
            assert torch.equal(gap[dst_ids[full], :, :rest], want[dst_ids[full], :, :rest])
    for g in storage:
        assert bool((g[:, PER_BLOCK:] == 3).all())


def test_first_block_skips_local_prefix_blocks():
    src = _caches(1)
    data = gather_blocks(LAYOUT, FMT, src, [5, 6, 7], 10)
    dst = [torch.zeros_like(c) for c in src]
    scatter_blocks(LAYOUT, FMT, data, dst, [0, 1, 2], 10, first_block=1)
    for s, d in zip(src, dst):
        assert not d[0].any() and torch.equal(d[1], s[6])


@settings(max_examples=30, deadline=None)
@given(ntokens=st.integers(1, 16), first=st.integers(0, 4), seed=st.integers(0, 99))
def test_gather_from_first_block_copies_only_the_rest(ntokens, first, seed):
    """A save whose first blocks the server holds copies only the others; their
    bytes sit where a whole gather puts them, the rest of the buffer is untouched."""
    first = min(first, -(-ntokens // 4))
    src = _caches(seed)
    whole = gather_blocks(LAYOUT, FMT, src, [3, 1, 4, 0], ntokens)
    host = torch.full_like(whole, 0xAB)
    for layer, cache in enumerate(src):
        gather_layer(LAYOUT, FMT, cache, layer, [3, 1, 4, 0], ntokens, host, first)
    skipped = LAYOUT.nbytes(min(ntokens, first * 4))
    assert torch.equal(host[skipped:], whole[skipped:])
    assert (host[:skipped] == 0xAB).all()


def test_kvstore_and_its_connector_helpers_import_without_vllm():
    """Only vllm_v1 (which vLLM itself imports) may need vLLM."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None\n"
            "import kvstore, kvstore.client.client, kvstore.connector.lookup_buffer\n"
            "import kvstore.connector.paged_io, kvstore.connector.v1_config\n"
            "import kvstore.connector.v1_stores, kvstore.connector.block_format\n"
            "import kvstore.connector.v1_backend\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
