"""Entry bytes <-> a vLLM engine's paged KV caches, through each layer's ``BlockFormat``.

vLLM hands connectors one view per attention layer (``[blocks, kv_heads, block_size,
2*D]``; MLA ``[blocks, block_size, C]``); where each K/V element really sits inside a
block is the backend's business, found by ``block_format.probe``. An entry is
``[layers, 2, tokens, kv_heads, D]`` (kvstore.layout), a prompt's entries back to
back: full blocks first, then the partial rest.

Both directions batch per layer, never per block: one gather (``index_select`` plus
one indexed read in logical order) or one scatter (one indexed write) of all the
request's full blocks per layer, plus one indexed access for a partial last block.
Elements move as same-width integers, so every dtype (float8 included) is copied
bit for bit. Bytes cross to/from the host once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.connector.block_format import BlockFormat, bits
from kvstore.errors import InvalidRequestError
from kvstore.layout import KVLayout


def _check(layout: KVLayout, fmt: BlockFormat, caches: Sequence[torch.Tensor],
           block_ids: Sequence[int], first_block: int, ntokens: int) -> tuple[int, int]:
    if len(caches) != layout.num_layers:
        raise InvalidRequestError(f"{len(caches)} layer caches, layout has {layout.num_layers}")
    c0 = caches[0]
    if tuple(c0.shape[1:]) != fmt.view_shape or c0.dtype != layout.torch_dtype:
        raise InvalidRequestError(f"cache view {tuple(c0.shape)} {c0.dtype} does not match "
                                  f"[B, {fmt.view_shape}] {layout.dtype}")
    full, rest = divmod(ntokens, layout.block_tokens)
    if len(block_ids) < full + bool(rest):
        raise InvalidRequestError(f"{ntokens} tokens need {full + bool(rest)} blocks, "
                                  f"got {len(block_ids)}")
    if not 0 <= first_block <= full + bool(rest):
        raise InvalidRequestError(f"first_block {first_block} outside the request's blocks")
    return full, rest


def _logical_shape(layout: KVLayout) -> tuple[int, int, int, int]:
    return (2, layout.block_tokens, layout.kv_heads, layout.head_dim)


def _rest_coords(fmt: BlockFormat, layout: KVLayout, rest: int) -> tuple[torch.Tensor, ...]:
    """View coordinates of the logical elements of a block's first ``rest`` tokens,
    in logical order ``[2, rest, H, D]``."""
    return tuple(c.view(_logical_shape(layout))[:, :rest].reshape(-1) for c in fmt.coords)


def gather_blocks(layout: KVLayout, fmt: BlockFormat, caches: Sequence[torch.Tensor],
                  block_ids: Sequence[int], ntokens: int) -> torch.Tensor:
    """The entry bytes of a request's first ``ntokens`` tokens, as a flat uint8 CPU tensor."""
    full, rest = _check(layout, fmt, caches, block_ids, 0, ntokens)
    dev = caches[0].device
    shape = _logical_shape(layout)
    parts = []
    if full:
        ids = torch.as_tensor(list(block_ids[:full]), dtype=torch.long, device=dev)
        per_layer = []
        for cache in caches:
            blocks = bits(cache.index_select(0, ids))  # [n, *view]
            per_layer.append(blocks[(slice(None), *fmt.coords)].view(full, *shape))
        # [n, L, 2, N, H, D]: entry order.
        parts.append(torch.stack(per_layer, dim=1).view(torch.uint8).reshape(-1))
    if rest:
        last = int(block_ids[full])
        coords = _rest_coords(fmt, layout, rest)
        g = torch.stack([bits(c[last])[coords].view(2, rest, *shape[2:]) for c in caches])
        parts.append(g.view(torch.uint8).reshape(-1))  # [L, 2, rest, H, D]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.cpu()


def scatter_blocks(layout: KVLayout, fmt: BlockFormat, data: torch.Tensor,
                   caches: Sequence[torch.Tensor], block_ids: Sequence[int], ntokens: int,
                   first_block: int = 0, data_tokens: int | None = None) -> None:
    """Write the first ``ntokens`` tokens of ``data`` into ``block_ids``, skipping the
    request's first ``first_block`` blocks (already present locally, e.g. vLLM
    prefix-cache hits shared with other requests). ``data`` holds the entries of
    ``data_tokens >= ntokens`` tokens (its last entry may be partial). Only the
    elements of the ``ntokens`` tokens are written: the rest of a partial last block
    is left as it is (vLLM writes the tokens it computes there itself)."""
    full, rest = _check(layout, fmt, caches, block_ids, first_block, ntokens)
    data_tokens = ntokens if data_tokens is None else data_tokens
    flat = data.reshape(-1).view(torch.uint8)
    if data_tokens < ntokens or flat.numel() != layout.nbytes(data_tokens):
        raise InvalidRequestError(f"data of {flat.numel()} bytes does not hold the entries of "
                                  f"{data_tokens} >= {ntokens} tokens")
    dev = caches[0].device
    L = layout.num_layers
    shape = _logical_shape(layout)
    per_block = 2 * layout.block_tokens * layout.kv_heads * layout.head_dim
    block_bytes = layout.block_nbytes
    if full > first_block:
        n = full - first_block
        src = bits(flat[first_block * block_bytes: full * block_bytes].to(dev)
                   .view(layout.torch_dtype)).view(n, L, per_block)
        ids = torch.as_tensor(list(block_ids[first_block:full]), dtype=torch.long,
                              device=dev).view(-1, 1)
        index = (ids, *(c.view(1, -1) for c in fmt.coords))
        for layer, cache in enumerate(caches):
            bits(cache)[index] = src[:, layer]
    if rest and first_block <= full:
        # The entry holding these tokens may hold more of them (up to a block).
        held = min(layout.block_tokens, data_tokens - full * layout.block_tokens)
        tail = flat[full * block_bytes: full * block_bytes + layout.nbytes(held)]
        tail = bits(tail.to(dev).view(layout.torch_dtype)).view(L, 2, held, *shape[2:])
        tail = tail[:, :, :rest].reshape(L, -1)
        last = int(block_ids[full])
        coords = _rest_coords(fmt, layout, rest)
        for layer, cache in enumerate(caches):
            bits(cache[last])[coords] = tail[layer]
