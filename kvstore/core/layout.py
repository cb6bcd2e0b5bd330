"""The bytes of one entry, and conversions to and from engine KV tensors.

An entry is one block of one TP rank: every layer's K and V for up to
``block_tokens`` tokens, contiguous as ``[layers, 2, ntokens, kv_heads, head_dim]``.
A prompt's entries are laid back to back in token order, so a whole prompt is one
contiguous buffer that can move in a single transfer.

Pure functions of torch tensors; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvstore.core.errors import ConfigError, InvalidRequestError

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


# A hidden-state tensor travels as its bytes beside the KV: the KV dtypes, and what a
# caller naturally hands over with them (the first token as torch.tensor([tok]): int64).
_HIDDEN_DTYPES = frozenset(_DTYPES) | {"float64", "int16", "int32", "int64", "bool"}


def dtype_name(dtype: torch.dtype | str, hidden: bool = False) -> str:
    """The name of a KV dtype (a ``ConfigError`` if unsupported: layouts are config);
    ``hidden``: of a hidden-state tensor's dtype (an ``InvalidRequestError``: input)."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    else:
        name = str(dtype).removeprefix("torch.")
    if hidden:
        if name not in _HIDDEN_DTYPES:
            raise InvalidRequestError(f"unsupported dtype {dtype!r} of the hidden tensor; "
                                      f"one of {sorted(_HIDDEN_DTYPES)}")
        return name
    if name not in _DTYPES:
        raise ConfigError(f"unsupported KV dtype {dtype!r}; one of {sorted(_DTYPES)}")
    return name


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_tokens: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("num_layers", "kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def token_nbytes(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * self.itemsize

    @property
    def block_nbytes(self) -> int:
        return self.token_nbytes * self.block_tokens

    def nbytes(self, ntokens: int) -> int:
        return self.token_nbytes * ntokens

    def block_token_counts(self, ntokens: int) -> list[int]:
        """Tokens per entry for a prompt of ``ntokens``: full blocks, then the partial rest."""
        full, rest = divmod(ntokens, self.block_tokens)
        return [self.block_tokens] * full + ([rest] if rest else [])

    def entry_sizes(self, ntokens: int) -> list[int]:
        return [self.nbytes(n) for n in self.block_token_counts(ntokens)]

    def describe(self) -> tuple:
        """The fields that make KV bytes interchangeable; part of the key namespace."""
        return (self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.block_tokens)


# ------------------------------------------------------------------ HF layout
def pack_hf(layout: KVLayout, past: Sequence[tuple[torch.Tensor, torch.Tensor]],
            ntokens: int | None = None) -> torch.Tensor:
    """Per-layer ``(k, v)`` of shape ``[1, kv_heads, seq, head_dim]`` -> entry bytes.

    Returns a contiguous uint8 tensor holding every entry of the first ``ntokens``
    tokens back to back (full blocks, then the partial rest).
    """
    seq = _check_hf(layout, past)
    ntokens = seq if ntokens is None else ntokens
    if not 0 < ntokens <= seq:
        raise InvalidRequestError(f"ntokens {ntokens} outside 1..{seq}")
    # [L, 2, H, T, D] -> [L, 2, T, H, D]
    kv = torch.stack([torch.stack((k[0, :, :ntokens], v[0, :, :ntokens])) for k, v in past])
    return _pack_token_major(layout, kv.permute(0, 1, 3, 2, 4))


def unpack_hf(layout: KVLayout, data: torch.Tensor, ntokens: int,
              device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Entry bytes of ``ntokens`` tokens -> per-layer ``(k, v)`` ``[1, H, T, D]``."""
    kv = _unpack_token_major(layout, data, ntokens).to(device)  # [L, 2, T, H, D]
    kv = kv.permute(0, 1, 3, 2, 4)  # [L, 2, H, T, D]
    return [(kv[l, 0].unsqueeze(0).contiguous(), kv[l, 1].unsqueeze(0).contiguous())
            for l in range(layout.num_layers)]


# ------------------------------------------------------------------ helpers
def _pack_token_major(layout: KVLayout, kv: torch.Tensor) -> torch.Tensor:
    """``[L, 2, T, H, D]`` -> flat uint8 bytes of all entries in token order."""
    if kv.dtype != layout.torch_dtype:
        raise InvalidRequestError(f"KV dtype {kv.dtype} does not match layout {layout.dtype}")
    ntokens = kv.shape[2]
    full, rest = divmod(ntokens, layout.block_tokens)
    bt = layout.block_tokens
    parts = []
    if full:
        blocks = kv[:, :, : full * bt].unflatten(2, (full, bt))  # [L, 2, n, bt, H, D]
        parts.append(blocks.permute(2, 0, 1, 3, 4, 5).contiguous().view(torch.uint8).flatten())
    if rest:
        parts.append(kv[:, :, full * bt:].contiguous().view(torch.uint8).flatten())
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _unpack_token_major(layout: KVLayout, data: torch.Tensor, ntokens: int) -> torch.Tensor:
    """Inverse of ``_pack_token_major``: flat bytes -> ``[L, 2, T, H, D]``."""
    if ntokens <= 0:
        raise InvalidRequestError(f"ntokens must be > 0, got {ntokens}")
    expected = layout.nbytes(ntokens)
    flat = data.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    if flat.numel() != expected:
        raise InvalidRequestError(f"{ntokens} tokens need {expected} bytes, got {flat.numel()}")
    full, rest = divmod(ntokens, layout.block_tokens)
    bt, L, H, D = layout.block_tokens, layout.num_layers, layout.kv_heads, layout.head_dim
    vals = flat.view(layout.torch_dtype)
    parts = []
    split = full * bt * L * 2 * H * D
    if full:
        blocks = vals[:split].view(full, L, 2, bt, H, D).permute(1, 2, 0, 3, 4, 5)
        parts.append(blocks.reshape(L, 2, full * bt, H, D))
    if rest:
        parts.append(vals[split:].view(L, 2, rest, H, D))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _check_layers(layout: KVLayout, n: int) -> None:
    if n != layout.num_layers:
        raise InvalidRequestError(f"got {n} layers, layout has {layout.num_layers}")


def _check_hf(layout: KVLayout, past: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Every layer's k and v is ``[1, H, seq, D]`` of the layout's dtype, one ``seq``
    for all; returns ``seq``. Checked up front so bad input never half-packs."""
    _check_layers(layout, len(past))
    expected = None
    for layer, pair in enumerate(past):
        if len(pair) != 2:
            raise InvalidRequestError(f"layer {layer}: expected a (k, v) pair")
        for t in pair:
            if t.dim() != 4 or t.shape[0] != 1:
                raise InvalidRequestError(
                    f"layer {layer}: HF KV must be [1, heads, seq, dim], got {tuple(t.shape)}")
            _check_tensor(layout, t.shape[1], t.shape[3], t.dtype, heads_dim=True)
            expected = expected or tuple(t.shape)
            if tuple(t.shape) != expected:
                raise InvalidRequestError(
                    f"layer {layer}: shape {tuple(t.shape)} differs from {expected}")
    # KVLayout keeps num_layers > 0 and _check_layers matched it: past had a layer.
    assert expected is not None
    return expected[2]


def _check_tensor(layout: KVLayout, heads: int, dim: int, dtype: torch.dtype,
                  heads_dim: bool = False) -> None:
    if dtype != layout.torch_dtype:
        raise InvalidRequestError(f"KV dtype {dtype} does not match layout {layout.dtype}")
    if heads_dim and (heads, dim) != (layout.kv_heads, layout.head_dim):
        raise InvalidRequestError(
            f"KV heads/dim {(heads, dim)} do not match layout {(layout.kv_heads, layout.head_dim)}")
