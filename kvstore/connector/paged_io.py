"""Entry bytes <-> vLLM 0.33 paged KV caches, one ``[B, H, N, C]`` view per layer.

vLLM 0.33 hands connectors (``register_kv_caches``) one view per attention layer,
``[num_blocks, kv_heads, block_size, C]`` with K in ``C[:C/2]`` and V in ``C[C/2:]``
(strides depend on the resolved KV cache layout; indexing handles any). An entry
is ``[layers, 2, tokens, kv_heads, C/2]`` (kvstore.layout), a prompt's entries
back to back: full blocks first, then the partial rest.

Both directions batch per layer, never per block: one gather (``index_select``)
or one scatter (``index_copy_``) of all the request's full blocks per layer, plus
one slice for a partial last block. Bytes cross to/from the host once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.errors import InvalidRequestError
from kvstore.layout import KVLayout


def _check(layout: KVLayout, caches: Sequence[torch.Tensor], block_ids: Sequence[int],
           first_block: int, ntokens: int) -> tuple[int, int]:
    if len(caches) != layout.num_layers:
        raise InvalidRequestError(f"{len(caches)} layer caches, layout has {layout.num_layers}")
    c0 = caches[0]
    want = (layout.kv_heads, layout.block_tokens, 2 * layout.head_dim)
    if c0.dim() != 4 or tuple(c0.shape[1:]) != want or c0.dtype != layout.torch_dtype:
        raise InvalidRequestError(f"cache view {tuple(c0.shape)} {c0.dtype} does not match "
                                  f"[B, {want[0]}, {want[1]}, {want[2]}] {layout.dtype}")
    full, rest = divmod(ntokens, layout.block_tokens)
    if len(block_ids) < full + bool(rest):
        raise InvalidRequestError(f"{ntokens} tokens need {full + bool(rest)} blocks, "
                                  f"got {len(block_ids)}")
    if not 0 <= first_block <= full + bool(rest):
        raise InvalidRequestError(f"first_block {first_block} outside the request's blocks")
    return full, rest


def _as_halves(x: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``[..., H, N, C]`` -> ``[..., H, N, 2, C/2]`` (a view)."""
    return x.unflatten(-1, (2, layout.head_dim))


def gather_blocks(layout: KVLayout, caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                  ntokens: int) -> torch.Tensor:
    """The entry bytes of a request's first ``ntokens`` tokens, as a flat uint8 CPU tensor."""
    full, rest = _check(layout, caches, block_ids, 0, ntokens)
    dev = caches[0].device
    parts = []
    if full:
        ids = torch.as_tensor(list(block_ids[:full]), dtype=torch.long, device=dev)
        # per layer [n, H, N, 2, D] -> stacked [n, L, 2, N, H, D]: entry order.
        g = torch.stack([_as_halves(c.index_select(0, ids), layout) for c in caches], dim=1)
        parts.append(g.permute(0, 1, 4, 3, 2, 5).contiguous().view(torch.uint8).reshape(-1))
    if rest:
        last = block_ids[full]
        # per layer [H, rest, 2, D] -> stacked [L, 2, rest, H, D].
        g = torch.stack([_as_halves(c[last, :, :rest], layout) for c in caches])
        parts.append(g.permute(0, 3, 2, 1, 4).contiguous().view(torch.uint8).reshape(-1))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.cpu()


def scatter_blocks(layout: KVLayout, data: torch.Tensor, caches: Sequence[torch.Tensor],
                   block_ids: Sequence[int], ntokens: int, first_block: int = 0,
                   data_tokens: int | None = None) -> None:
    """Write the first ``ntokens`` tokens of ``data`` into ``block_ids``, skipping the
    request's first ``first_block`` blocks (already present locally, e.g. vLLM
    prefix-cache hits shared with other requests). ``data`` holds the entries of
    ``data_tokens >= ntokens`` tokens (its last entry may be partial)."""
    full, rest = _check(layout, caches, block_ids, first_block, ntokens)
    data_tokens = ntokens if data_tokens is None else data_tokens
    flat = data.reshape(-1).view(torch.uint8)
    if data_tokens < ntokens or flat.numel() != layout.nbytes(data_tokens):
        raise InvalidRequestError(f"data of {flat.numel()} bytes does not hold the entries of "
                                  f"{data_tokens} >= {ntokens} tokens")
    dev, dt = caches[0].device, layout.torch_dtype
    L, H, N, D = layout.num_layers, layout.kv_heads, layout.block_tokens, layout.head_dim
    block_bytes = layout.block_nbytes
    if full > first_block:
        src = flat[first_block * block_bytes: full * block_bytes].to(dev).view(dt)
        src = src.view(full - first_block, L, 2, N, H, D)
        ids = torch.as_tensor(list(block_ids[first_block:full]), dtype=torch.long, device=dev)
        for layer, cache in enumerate(caches):
            # [n, 2, N, H, D] -> [n, H, N, 2, D] -> [n, H, N, C]
            cache.index_copy_(0, ids, src[:, layer].permute(0, 3, 2, 1, 4).reshape(-1, H, N, 2 * D))
    if rest and first_block <= full:
        # The entry holding these tokens may hold more of them (up to a block).
        held = min(N, data_tokens - full * N)
        tail = flat[full * block_bytes: full * block_bytes + layout.nbytes(held)]
        tail = tail.to(dev).view(dt).view(L, 2, held, H, D)[:, :, :rest]
        last = block_ids[full]
        for layer, cache in enumerate(caches):
            cache[last, :, :rest] = tail[layer].permute(2, 1, 0, 3).reshape(H, rest, 2 * D)
