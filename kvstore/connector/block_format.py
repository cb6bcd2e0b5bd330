"""Where an attention backend keeps each K/V element inside one paged block.

vLLM hands a connector one cache view per layer — ``[blocks, kv_heads, block_size, 2*D]``
for attention, ``[blocks, block_size, C]`` for MLA's latent — but the view is only a
promise about the block's *size*. CPU attention, for one, keeps each head's K
transposed (``[D, block_size]``) followed by V (``[block_size, D]``) in the same
bytes, so element ``[b, h, t, c]`` of the view is not token ``t``'s channel ``c``.

An entry is always the logical layout of kvstore.core.layout, whatever the backend:
per layer and block ``[2, tokens, kv_heads, D]`` (MLA: kv_heads 1 and the latent's C
channels split in two halves of D). So KV written by a CPU engine can be read by a
GPU engine and the other way round.

The map from logical element to view position is not written down per backend:
``probe`` asks the backend itself. It writes probe tensors through the layer's own
cache-update op (``impl.do_kv_cache_update``, the reshape-and-cache kernel the
forward uses) into a scratch block, and reads back where each (kv, token, head,
channel) landed, one base-``B`` digit of each coordinate per write (``B`` small
enough that every digit is exact in the cache dtype). A backend whose writes are not
a one-to-one placement of the logical elements in the block (padding, scales, a
write that touches other blocks) is refused at start-up with a ``ConfigError``:
never wrong KV.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.core.errors import ConfigError

# Largest base whose digits 1..B are exact in each cache dtype.
_BASE = {torch.float32: 4096, torch.float16: 1024, torch.bfloat16: 128,
         torch.float8_e4m3fn: 8, torch.float8_e5m2: 4}
# Same-width integer views: copies through them move bits, never values.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PROBE_BLOCKS = 3  # the probe writes block 1; blocks 0 and 2 must stay untouched

# writer(key [T, H, D], value [T, H, D], cache, slot_mapping [T]) for attention;
# writer(latent [T, C], None, cache, slot_mapping) for MLA.
Writer = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class BlockFormat:
    """Where logical element ``i`` of a block (``[2, N, H, D]`` flattened) sits in the
    layer's per-block view: ``coords[k][i]`` along each view dim after the block dim.
    ``identity``: the view is truthful (``[H, N, 2D]`` with K then V; said in the
    connector's start-up log)."""

    view_shape: tuple[int, ...]  # per-block view shape: (H, N, 2D) or MLA (N, C)
    coords: tuple[torch.Tensor, ...]
    identity: bool
    backend: str

    @property
    def mla(self) -> bool:
        return len(self.view_shape) == 2

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """Where logical element ``i`` sits as a flat (row-major) position in the
        block's view; a permutation of ``range(2 * N * H * D)`` (``probe`` checked)."""
        flat = torch.zeros_like(self.coords[0])
        for coord, size in zip(self.coords, self.view_shape):
            flat = flat * size + coord
        return flat

    @functools.cached_property
    def elements(self) -> torch.Tensor:
        """Which logical element sits at each flat position of the block's view
        (``positions`` inverted)."""
        return torch.argsort(self.positions)

    def coords_key(self) -> tuple:
        """Equal for two formats that place every element alike."""
        return (self.view_shape, tuple(c.cpu().numpy().tobytes() for c in self.coords))


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the same-width integer type."""
    return t.view(_BITS[t.element_size()])


def _digits(limit: int, base: int) -> int:
    return max(1, math.ceil(math.log(limit, base))) if limit > 1 else 1


def _logical_grid(n: int, h: int, d: int, device: torch.device):
    """Coordinates (kv, t, h, d) of every logical element, each shaped [2, N, H, D]."""
    shape = (2, n, h, d)
    grids = torch.meshgrid(*(torch.arange(s, device=device) for s in shape), indexing="ij")
    return [g.expand(shape) for g in grids]


def probe(cache: torch.Tensor, writer: Writer, backend: str) -> BlockFormat:
    """Ask ``writer`` (the backend's own cache write) where each element of a block
    goes, using a scratch cache shaped and strided like ``cache`` (one layer's view).
    Raises ``ConfigError`` if the placement is not one-to-one within the block."""
    if cache.dim() not in (3, 4):
        raise ConfigError(f"{backend}: KV cache view {tuple(cache.shape)} is neither "
                          "[blocks, heads, block_size, 2*D] nor MLA's [blocks, block_size, C]")
    if cache.dtype not in _BASE:
        raise ConfigError(f"{backend}: KV cache dtype {cache.dtype} is not supported "
                          f"(one of {sorted(str(d) for d in _BASE)})")
    mla = cache.dim() == 3
    view_shape = tuple(int(s) for s in cache.shape[1:])
    n = view_shape[0] if mla else view_shape[1]
    h = 1 if mla else view_shape[0]
    channels = view_shape[-1]
    if channels % 2:
        raise ConfigError(f"{backend}: {channels} channels per token cannot split into halves")
    d = channels // 2
    dev, dtype, base = cache.device, cache.dtype, _BASE[cache.dtype]
    scratch = torch.empty_strided((_PROBE_BLOCKS, *view_shape), cache.stride(), dtype=dtype,
                                  device=dev)
    slots = torch.arange(n, device=dev, dtype=torch.long) + n  # every slot of block 1
    kv, t, hh, dd = _logical_grid(n, h, d, dev)
    decoded = []
    unwritten = torch.zeros(view_shape, dtype=torch.bool, device=dev)
    for coord, limit in ((kv, 2), (t, n), (hh, h), (dd, d)):
        value = torch.zeros(view_shape, dtype=torch.long, device=dev)
        for digit in range(_digits(limit, base)):
            probe_vals = (coord // base ** digit) % base + 1  # 1..base: 0 means unwritten
            got = _write_probe(scratch, writer, probe_vals, slots, mla, backend)
            unwritten |= got == 0
            value += (got - 1) * base ** digit
        decoded.append(value.reshape(-1))
    return _format_from(decoded, unwritten.reshape(-1), view_shape, n, h, d, backend)


def _write_probe(scratch: torch.Tensor, writer: Writer, vals: torch.Tensor,
                 slots: torch.Tensor, mla: bool, backend: str) -> torch.Tensor:
    """One probe write of ``vals`` ([2, N, H, D] logical) into block 1; returns what
    block 1 holds afterwards, per view position, as longs (0: nothing written)."""
    scratch.zero_()
    x = vals.to(scratch.dtype)
    if mla:  # latent [T, C] = the two halves side by side
        writer(torch.cat((x[0, :, 0], x[1, :, 0]), dim=-1).contiguous(), None, scratch, slots)
    else:  # key, value [T, H, D]
        writer(x[0].contiguous(), x[1].contiguous(), scratch, slots)
    others = torch.cat((scratch[0].reshape(-1), scratch[2].reshape(-1)))
    if bool((others != 0).any()):
        raise ConfigError(f"{backend}: its cache write touched blocks it was not given; "
                          "the connector cannot place KV for it")
    got = scratch[1].float().round().long()
    if bool(((got < 0) | (got > _BASE[scratch.dtype])).any()):
        raise ConfigError(f"{backend}: its cache write does not store values as given "
                          "(quantized or scaled?); the connector cannot move its KV")
    return got


def _format_from(decoded: list[torch.Tensor], unwritten: torch.Tensor,
                 view_shape: tuple[int, ...], n: int, h: int, d: int,
                 backend: str) -> BlockFormat:
    kv, t, hh, dd = decoded
    total = 2 * n * h * d
    if kv.numel() != total:
        raise ConfigError(f"{backend}: a block view of {kv.numel()} elements holds {total} "
                          "K/V values plus something else (padding?); not supported")
    logical = ((kv * n + t) * h + hh) * d + dd
    in_range = (kv < 2) & (t < n) & (hh < h) & (dd < d)
    if bool(unwritten.any()) or not bool(in_range.all()) or \
            torch.unique(logical).numel() != total:
        raise ConfigError(f"{backend}: its cache write is not a one-to-one placement of a "
                          "block's K/V elements; the connector cannot move its KV")
    position = torch.empty(total, dtype=torch.long, device=logical.device)
    position[logical] = torch.arange(total, device=logical.device)
    coords = tuple(torch.unravel_index(position, view_shape))
    identity = bool((position == _truthful_positions(view_shape, n, h, d,
                                                     logical.device)).all())
    return BlockFormat(view_shape, coords, identity, backend)


def _truthful_positions(view_shape: tuple[int, ...], n: int, h: int, d: int,
                        device: torch.device) -> torch.Tensor:
    """View positions of logical elements when the view means what it says."""
    kv, t, hh, dd = _logical_grid(n, h, d, device)
    idx: tuple[torch.Tensor, ...]
    if len(view_shape) == 2:  # MLA [N, C]: halves side by side
        idx = (t, kv * d + dd)
    else:  # [H, N, 2D]: K then V along the channels
        idx = (hh, t, kv * d + dd)
    flat = torch.zeros_like(kv)
    for i, size in zip(idx, view_shape):
        flat = flat * size + i
    return flat.reshape(-1)


def truthful(cache: torch.Tensor, backend: str) -> BlockFormat:
    """The format of a backend whose view is the truth (flash-attention's caches)."""
    view_shape = tuple(int(s) for s in cache.shape[1:])
    mla = len(view_shape) == 2
    n = view_shape[0] if mla else view_shape[1]
    h = 1 if mla else view_shape[0]
    d = view_shape[-1] // 2
    position = _truthful_positions(view_shape, n, h, d, cache.device)
    return BlockFormat(view_shape, tuple(torch.unravel_index(position, view_shape)), True,
                       backend)
