"""The record that carries the v0 lookup buffer's five tensors as one byte buffer.

``[u32 header length][msgpack header][tensor bytes back to back]``; the header lists
each tensor's dtype and shape (``None`` for an absent tensor). No pickle: a record
read from a server is data, never code.

A record too large for one staged transfer travels as parts (``split_record``), each
stored on its own; a *manifest* (a record whose header lists the parts' sizes instead
of tensors) takes its place in the prompt's entry. ``manifest_parts`` tells the two
apart, ``decode_record`` reads the whole record once the parts are joined.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from kvstore.core.errors import ChecksumError, InvalidRequestError

_LEN = struct.Struct("<I")
_VERSION = 1


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ChecksumError(f"record names unknown dtype {name!r}")
    return dtype


def _with_header(header: dict[str, Any], parts: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    packed = msgpack.packb({"v": _VERSION, **header})
    head = torch.frombuffer(bytearray(_LEN.pack(len(packed)) + packed), dtype=torch.uint8)
    return torch.cat([head, *parts])


def _read_header(raw: torch.Tensor) -> tuple[dict[str, Any], int]:
    """The header and where the bytes after it start; unreadable: ``ChecksumError``."""
    try:
        (hlen,) = _LEN.unpack(raw[:_LEN.size].numpy().tobytes())
        header = msgpack.unpackb(raw[_LEN.size:_LEN.size + hlen].numpy().tobytes(), raw=False)
        if not isinstance(header, dict) or header.get("v") != _VERSION:
            raise ValueError(f"not a version {_VERSION} header")
    except Exception as exc:  # noqa: BLE001 - any decoding problem: unusable record
        raise ChecksumError(f"unreadable v0 record: {exc}") from None
    return header, _LEN.size + hlen


def _flat(record: torch.Tensor) -> torch.Tensor:
    return record.detach().cpu().reshape(-1).view(torch.uint8)


def encode_record(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Tensors (or None) -> one flat uint8 CPU tensor."""
    specs: list[list[Any] | None] = []  # [dtype, shape] per tensor
    parts: list[torch.Tensor] = []
    for t in tensors:
        if t is None:
            specs.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            raise InvalidRequestError(f"expected a tensor or None, got {type(t).__name__}")
        t = t.detach().cpu().contiguous()
        specs.append([str(t.dtype).removeprefix("torch."), list(t.shape)])
        parts.append(t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8))
    return _with_header({"tensors": specs}, parts)


def decode_record(record: torch.Tensor) -> list[torch.Tensor | None]:
    """Inverse of ``encode_record``; a malformed record is a ``ChecksumError`` (a miss)."""
    raw = _flat(record)
    header, pos = _read_header(raw)
    specs = header.get("tensors")
    if not isinstance(specs, list):
        raise ChecksumError("v0 record has no tensor list")
    out: list[torch.Tensor | None] = []
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


# ------------------------------------------------------------------- parts
def split_record(record: torch.Tensor, part_bytes: int) -> list[torch.Tensor]:
    """``record`` as consecutive views of at most ``part_bytes`` each."""
    if part_bytes <= 0:
        raise InvalidRequestError(f"part_bytes must be > 0, got {part_bytes}")
    return list(_flat(record).split(part_bytes))


def encode_manifest(part_sizes: Sequence[int]) -> torch.Tensor:
    """The small record that stands for a record stored as parts of these sizes."""
    return _with_header({"parts": [int(n) for n in part_sizes]})


def manifest_parts(record: torch.Tensor) -> list[int] | None:
    """The part sizes if ``record`` is a manifest; None if it is a whole record."""
    header, pos = _read_header(_flat(record))
    sizes = header.get("parts")
    if sizes is None:
        return None
    if (not isinstance(sizes, list) or not sizes or pos != _flat(record).numel()
            or not all(isinstance(n, int) and n > 0 for n in sizes)):
        raise ChecksumError("v0 record manifest is malformed")
    return sizes
