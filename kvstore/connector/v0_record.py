"""The record that carries the v0 lookup buffer's five tensors as one byte buffer.

``[u32 header length][msgpack header][tensor bytes back to back]``; the header lists
each tensor's dtype and shape (``None`` for an absent tensor). No pickle: a record
read from a server is data, never code.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import msgpack
import torch

from kvstore.errors import ChecksumError, InvalidRequestError

_LEN = struct.Struct("<I")
_VERSION = 1


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ChecksumError(f"record names unknown dtype {name!r}")
    return dtype


def encode_record(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Tensors (or None) -> one flat uint8 CPU tensor."""
    specs, parts = [], []
    for t in tensors:
        if t is None:
            specs.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            raise InvalidRequestError(f"expected a tensor or None, got {type(t).__name__}")
        t = t.detach().cpu().contiguous()
        specs.append([str(t.dtype).removeprefix("torch."), list(t.shape)])
        parts.append(t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8))
    header = msgpack.packb({"v": _VERSION, "tensors": specs})
    head = torch.frombuffer(bytearray(_LEN.pack(len(header)) + header), dtype=torch.uint8)
    return torch.cat([head, *parts])


def decode_record(record: torch.Tensor) -> list[torch.Tensor | None]:
    """Inverse of ``encode_record``; a malformed record is a ``ChecksumError`` (a miss)."""
    raw = record.detach().cpu().reshape(-1).view(torch.uint8)
    try:
        (hlen,) = _LEN.unpack(raw[:_LEN.size].numpy().tobytes())
        header = msgpack.unpackb(raw[_LEN.size:_LEN.size + hlen].numpy().tobytes(), raw=False)
        specs = header["tensors"]
    except Exception as exc:  # noqa: BLE001 - any decoding problem: unusable record
        raise ChecksumError(f"unreadable v0 record: {exc}") from None
    pos, out = _LEN.size + hlen, []
    for spec in specs:
        if spec is None:
            out.append(None)
            continue
        dtype, shape = _dtype_of(spec[0]), [int(d) for d in spec[1]]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if pos + nbytes > raw.numel():
            raise ChecksumError("v0 record is shorter than its header says")
        out.append(raw[pos:pos + nbytes].clone().view(dtype).reshape(shape))
        pos += nbytes
    if pos != raw.numel():
        raise ChecksumError("v0 record is longer than its header says")
    return out
