"""GPU tier: one device arena allocated through torch, sub-allocated by extents.

``device="cuda:N"`` puts the arena in VRAM; ``device="cpu"`` runs the very same code
on a CPU tensor, which is how machines without CUDA test it. Copies go through torch
(``copy_``); on CUDA they are issued non-blocking and the stream is synchronized
before returning, so a caller may reuse its buffer as soon as a call returns.
"""

from __future__ import annotations

import logging
import warnings

import torch

from tiers.errors import ConfigError, InvalidRequestError
from tiers.arena import ArenaTier
from tiers.base import Extent, MemoryRegion

log = logging.getLogger(__name__)

PAGE_SIZE = 4096


def _resolve_device(device: str) -> torch.device:
    """A concrete ``torch.device`` (cuda index filled in), or ``ConfigError``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"gpu tier: bad device {device!r}: {exc}") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"gpu tier: device must be cuda:N or cpu, got {device!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"gpu tier: {device} asked for but CUDA is not available")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ConfigError(f"gpu tier: {device} but only {torch.cuda.device_count()} devices")
    return torch.device("cuda", index)


def _host_tensor(buf: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``buf`` without copying. torch warns on read-only buffers
    because it cannot mark the tensor read-only; we only ever copy from those."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


class GpuTier(ArenaTier):
    name = "gpu"
    volatile = True

    def __init__(self, capacity: int, device: str = "cuda:0") -> None:
        self.device = _resolve_device(device)
        super().__init__(capacity, PAGE_SIZE)
        self._cuda = self.device.type == "cuda"
        try:
            self._arena: torch.Tensor | None = torch.empty(
                self.capacity, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise ConfigError(f"gpu tier: cannot allocate {self.capacity} bytes on "
                              f"{self.device}: {exc}") from exc
        self.location = f"cuda:{self.device.index}" if self._cuda else "cpu:0"
        log.info("gpu tier: %s bytes on %s at %#x", self.capacity, self.location,
                 self._arena.data_ptr())

    def write(self, extent: Extent, data: memoryview) -> None:
        src = self._checked(extent, data)
        self._slice(extent).copy_(_host_tensor(src), non_blocking=self._cuda)
        self._sync()

    def read_into(self, extent: Extent, out: memoryview) -> None:
        dst = self._checked(extent, out, writable=True)
        _host_tensor(dst).copy_(self._slice(extent), non_blocking=self._cuda)
        self._sync()

    def tensor(self, extent: Extent) -> torch.Tensor:
        """The extent as a uint8 tensor on the arena's device (no copy)."""
        self._own(extent)
        self._require_live(extent)
        return self._slice(extent)

    def view(self, extent: Extent) -> memoryview | None:
        if self._cuda:
            return None
        return self.tensor(extent).numpy().data

    def address(self, extent: Extent) -> int:
        self._own(extent)
        return self._live_arena().data_ptr() + extent.offset

    def regions(self) -> list[MemoryRegion]:
        return [MemoryRegion(self._live_arena().data_ptr(), self.capacity, self.location)]

    def close(self) -> None:
        if self._arena is None:
            return
        self._arena = None
        if self._cuda:
            torch.cuda.empty_cache()  # hand the arena back to the driver, not the cache

    def _slice(self, extent: Extent) -> torch.Tensor:
        return self._live_arena()[extent.offset:extent.end]

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _live_arena(self) -> torch.Tensor:
        if self._arena is None:
            raise InvalidRequestError("gpu tier is closed")
        return self._arena
