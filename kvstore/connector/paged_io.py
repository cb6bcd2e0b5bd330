"""Entry bytes <-> a vLLM engine's paged KV caches, through each layer's ``BlockFormat``.

vLLM hands connectors one view per attention layer (``[blocks, kv_heads, block_size,
2*D]``; MLA ``[blocks, block_size, C]``); where each K/V element really sits inside a
block is the backend's business, found by ``block_format.probe``. An entry is
``[layers, 2, tokens, kv_heads, D]`` (kvstore.core.layout), a prompt's entries back to
back: full blocks first, then the partial rest.

The unit of work is one layer (``gather_layer`` / ``scatter_layer``), so a save can
copy layer i off the device as soon as layer i is computed and a load can hand layer i
to the forward before layer i+1 has landed. Within a layer, blocks move in chunks of
``CHUNK_BLOCKS``: device memory beyond the caches stays bounded by one chunk, however
long the prompt. Elements move as same-width integers, so every dtype (float8
included) is copied bit for bit. The host side is one flat uint8 buffer of the
prompt's entries, which the caller owns and reuses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.connector.block_format import BlockFormat, bits
from kvstore.core.errors import InvalidRequestError
from kvstore.core.layout import KVLayout

CHUNK_BLOCKS = 128  # blocks per device-side gather/scatter


def check(layout: KVLayout, fmt: BlockFormat, cache: torch.Tensor, block_ids: Sequence[int],
          first_block: int, ntokens: int) -> tuple[int, int]:
    """(full blocks, tokens of the partial rest) of ``ntokens``; InvalidRequestError
    when the cache, ids or range do not fit (nothing is touched then)."""
    if tuple(cache.shape[1:]) != fmt.view_shape or cache.dtype != layout.torch_dtype:
        raise InvalidRequestError(f"cache view {tuple(cache.shape)} {cache.dtype} does not match "
                                  f"[B, {fmt.view_shape}] {layout.dtype}")
    full, rest = divmod(ntokens, layout.block_tokens)
    if len(block_ids) < full + bool(rest):
        raise InvalidRequestError(f"{ntokens} tokens need {full + bool(rest)} blocks, "
                                  f"got {len(block_ids)}")
    if not 0 <= first_block <= full + bool(rest):
        raise InvalidRequestError(f"first_block {first_block} outside the request's blocks")
    return full, rest


def _rows(cache: torch.Tensor, per_block: int) -> torch.Tensor | None:
    """The layer's cache as ``[blocks, per_block]`` same-width integers, where each
    block's view is one contiguous run of its ``per_block`` elements (so a flat view
    position is a memory offset); None where it is not (such caches take the
    per-element path). Moving whole blocks and permuting within them is 2-3x faster
    than placing every element by its coordinates (docs/benchmarks.md, "Connector
    inside vLLM")."""
    if cache.shape[0] < 1 or cache[0].numel() != per_block or not cache[0].is_contiguous():
        return None
    return bits(cache).as_strided((cache.shape[0], per_block), (cache.stride(0), 1))


def _per_layer_block(layout: KVLayout) -> int:
    """Elements of one layer in one full block: ``2 * N * H * D``."""
    return 2 * layout.block_tokens * layout.kv_heads * layout.head_dim


def _rest_coords(fmt: BlockFormat, layout: KVLayout, rest: int) -> tuple[torch.Tensor, ...]:
    """View coordinates of the logical elements of a block's first ``rest`` tokens,
    in logical order ``[2, rest, H, D]``."""
    shape = (2, layout.block_tokens, layout.kv_heads, layout.head_dim)
    return tuple(c.view(shape)[:, :rest].reshape(-1) for c in fmt.coords)


def _host_views(layout: KVLayout, host: torch.Tensor, ntokens: int, held: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Typed views of a host buffer holding the entries of ``held >= ntokens`` tokens:
    full blocks ``[n, L, per_block]`` and the partial entry ``[L, 2, held_rest, H, D]``."""
    flat = host.reshape(-1).view(torch.uint8)
    if held < ntokens or flat.numel() < layout.nbytes(held):
        raise InvalidRequestError(f"buffer of {flat.numel()} bytes does not hold the entries "
                                  f"of {held} >= {ntokens} tokens")
    vals = bits(flat[: layout.nbytes(held)].view(layout.torch_dtype))
    full = ntokens // layout.block_tokens
    split = full * layout.num_layers * _per_layer_block(layout)
    blocks = vals[:split].view(full, layout.num_layers, _per_layer_block(layout))
    held_rest = min(layout.block_tokens, held - full * layout.block_tokens)
    if ntokens % layout.block_tokens == 0 or held_rest <= 0:
        return blocks, None
    tail = vals[split: split + layout.num_layers * 2 * held_rest * layout.kv_heads
                * layout.head_dim]
    return blocks, tail.view(layout.num_layers, 2, held_rest, layout.kv_heads, layout.head_dim)


def gather_layer(layout: KVLayout, fmt: BlockFormat, cache: torch.Tensor, layer: int,
                 block_ids: Sequence[int], ntokens: int, host: torch.Tensor,
                 first_block: int = 0) -> None:
    """Copy layer ``layer`` of a request's first ``ntokens`` tokens into ``host`` (the
    prompt's entry bytes, ``layout.nbytes(ntokens)``), in entry order, from block
    ``first_block`` on (the bytes of the blocks before it are left as they are)."""
    full, rest = check(layout, fmt, cache, block_ids, first_block, ntokens)
    blocks, tail = _host_views(layout, host, ntokens, ntokens)
    dev = cache.device
    rows = _rows(cache, blocks.shape[-1])
    every_block: tuple[slice | torch.Tensor, ...] = (slice(None), *fmt.coords)
    for start in range(first_block, full, CHUNK_BLOCKS):
        stop = min(full, start + CHUNK_BLOCKS)
        ids = torch.as_tensor(list(block_ids[start:stop]), dtype=torch.long, device=dev)
        out = blocks[start:stop, layer]
        if rows is not None:  # whole blocks, then each one's elements in logical order
            picked = rows.index_select(0, ids)
            where = fmt.positions.expand(picked.shape)
            if out.device == dev:  # straight into the host buffer
                torch.gather(picked, 1, where, out=out)
                continue
            picked = torch.gather(picked, 1, where)
        else:
            picked = bits(cache.index_select(0, ids))[every_block]
        out.copy_(picked, non_blocking=True)
    if rest and first_block <= full:
        assert tail is not None
        coords = _rest_coords(fmt, layout, rest)
        tail[layer].reshape(-1).copy_(bits(cache[int(block_ids[full])])[coords],
                                      non_blocking=True)


def scatter_layer(layout: KVLayout, fmt: BlockFormat, host: torch.Tensor, cache: torch.Tensor,
                  layer: int, block_ids: Sequence[int], ntokens: int, first_block: int = 0,
                  data_tokens: int | None = None) -> None:
    """Write layer ``layer`` of the first ``ntokens`` tokens held in ``host`` (entries of
    ``data_tokens >= ntokens`` tokens; its last entry may be partial) into
    ``block_ids``, skipping the request's first ``first_block`` blocks (vLLM's own
    prefix-cache hits). Of a partial last block only the ``ntokens`` tokens' elements
    are written: vLLM writes the tokens it computes there itself."""
    full, rest = check(layout, fmt, cache, block_ids, first_block, ntokens)
    data_tokens = ntokens if data_tokens is None else data_tokens
    blocks, tail = _host_views(layout, host, ntokens, data_tokens)
    dev = cache.device
    target = bits(cache)
    rows = _rows(cache, blocks.shape[-1])
    for start in range(first_block, full, CHUNK_BLOCKS):
        stop = min(full, start + CHUNK_BLOCKS)
        ids = torch.as_tensor(list(block_ids[start:stop]), dtype=torch.long, device=dev)
        src = blocks[start:stop, layer].to(dev, non_blocking=True)
        if rows is not None:  # each block's elements in view order, then whole blocks
            rows.index_copy_(0, ids, torch.gather(src, 1, fmt.elements.expand(src.shape)))
        else:
            target[(ids.view(-1, 1), *(c.view(1, -1) for c in fmt.coords))] = src
    if rest and first_block <= full:
        assert tail is not None
        coords = _rest_coords(fmt, layout, rest)
        src = tail[layer, :, :rest].reshape(-1).to(dev, non_blocking=True)
        bits(cache[int(block_ids[full])])[coords] = src


def gather_blocks(layout: KVLayout, fmt: BlockFormat, caches: Sequence[torch.Tensor],
                  block_ids: Sequence[int], ntokens: int) -> torch.Tensor:
    """The entry bytes of a request's first ``ntokens`` tokens, as a flat uint8 CPU tensor."""
    _check_layers(layout, caches)
    host = torch.empty(layout.nbytes(ntokens), dtype=torch.uint8)
    for layer, cache in enumerate(caches):
        gather_layer(layout, fmt, cache, layer, block_ids, ntokens, host)
    _sync(caches[0])
    return host


def scatter_blocks(layout: KVLayout, fmt: BlockFormat, data: torch.Tensor,
                   caches: Sequence[torch.Tensor], block_ids: Sequence[int], ntokens: int,
                   first_block: int = 0, data_tokens: int | None = None) -> None:
    """``scatter_layer`` for every layer (see there)."""
    _check_layers(layout, caches)
    data_tokens = ntokens if data_tokens is None else data_tokens
    flat = data.reshape(-1).view(torch.uint8)
    if data_tokens < ntokens or flat.numel() != layout.nbytes(data_tokens):
        raise InvalidRequestError(f"data of {flat.numel()} bytes does not hold the entries of "
                                  f"{data_tokens} >= {ntokens} tokens")
    for layer, cache in enumerate(caches):
        scatter_layer(layout, fmt, flat, cache, layer, block_ids, ntokens, first_block,
                      data_tokens)
    _sync(caches[0])


def _check_layers(layout: KVLayout, caches: Sequence[torch.Tensor]) -> None:
    if len(caches) != layout.num_layers:
        raise InvalidRequestError(f"{len(caches)} layer caches, layout has {layout.num_layers}")


def _sync(cache: torch.Tensor) -> None:
    """Wait for non-blocking copies on the cache's device (none on CPU)."""
    if cache.device.type == "cuda":
        torch.cuda.current_stream(cache.device).synchronize()
