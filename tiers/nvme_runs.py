"""Batched NVMe I/O: adjacent extents move in one ``pwritev`` / ``preadv``.

The allocator places a batch back to back, so the extents of one prompt (or one
demotion pass) usually form runs of adjacent page-rounded ranges on disk. One
vectored call per run replaces one call per extent: fewer syscalls and, for reads,
one large request the device can stream instead of many small synchronous ones.

Each extent contributes at most two iovecs, in disk order:
* the page-aligned, page-multiple head of its buffer, straight from/to the caller
  (O_DIRECT needs aligned addresses and lengths; buffered I/O takes any buffer);
* the rest through a slice of the tier's bounce buffer: the buffer's tail plus the
  extent's zero padding up to its page boundary (or, with O_DIRECT and an unaligned
  caller buffer, the whole extent).
A call ends where the next extent is not adjacent, the bounce buffer is used up,
or ``IOV_MAX`` / ``MAX_CALL_BYTES`` would be passed. An extent that needs more
bounce than there is goes through ``single`` (the tier's one-extent path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from tiers.base import Extent

IOV_MAX = 1024  # Linux UIO_MAXIOV
MAX_CALL_BYTES = 256 << 20  # well under the 2 GiB a single read/write may move


class Part(NamedTuple):
    """One extent's share of a call: its direct head and its bounce slice."""

    head: memoryview | None  # caller bytes moved in place
    bounce: memoryview | None  # bounce slice: tail + padding (or the whole extent)
    tail: memoryview | None  # caller bytes copied through ``bounce[:len(tail)]``


def address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if buf.nbytes else 0


class RunIO:
    """Plans and issues the vectored calls for one ``write_many`` / ``read_many``.

    ``io(iovecs, offset, write)`` does one exact vectored call; ``single(ext, buf,
    write)`` moves one extent alone. ``bounce`` is page-aligned and owned by the
    tier (one thread at a time).
    """

    def __init__(self, page: int, direct: bool, bounce: memoryview,
                 io: Callable[[list[memoryview], int, bool], None],
                 single: Callable[[Extent, memoryview, bool], None]) -> None:
        self.page, self.direct, self.bounce = page, direct, bounce
        self._io, self._single = io, single

    def run(self, exts: list[Extent], bufs: list[memoryview], write: bool) -> int:
        """Move every extent; returns the number of vectored calls made."""
        order = sorted(range(len(exts)), key=lambda i: exts[i].offset)
        parts: list[Part] = []
        start = end = used = calls = 0
        for i in order:
            ext, buf = exts[i], bufs[i]
            span = -(-ext.nbytes // self.page) * self.page
            head = self._head(buf)
            need = span - head
            if need > self.bounce.nbytes:  # too big for the bounce: alone, the slow way
                calls += self._flush(parts, start, write)
                parts, used = [], 0
                self._single(ext, buf, write)
                calls += 1
                continue
            if parts and (ext.offset != end or used + need > self.bounce.nbytes
                          or 2 * len(parts) + 2 > IOV_MAX
                          or end - start + span > MAX_CALL_BYTES):
                calls += self._flush(parts, start, write)
                parts, used = [], 0
            if not parts:
                start = ext.offset
            slot = self.bounce[used:used + need] if need else None
            parts.append(Part(buf[:head] if head else None, slot,
                              buf[head:] if head < buf.nbytes else None))
            if write and slot is not None:
                tail = buf.nbytes - head
                slot[:tail] = buf[head:]
                slot[tail:] = bytes(need - tail)  # the extent's padding is zeros
            used += need
            end = ext.offset + span
        return calls + self._flush(parts, start, write)

    def _head(self, buf: memoryview) -> int:
        """Bytes of ``buf`` that can go to the kernel in place."""
        if not self.direct:
            return buf.nbytes
        if address(buf) % self.page:
            return 0
        return buf.nbytes // self.page * self.page

    def _flush(self, parts: list[Part], offset: int, write: bool) -> int:
        if not parts:
            return 0
        iov = [v for p in parts for v in (p.head, p.bounce) if v is not None]
        self._io(iov, offset, write)
        if not write:
            for p in parts:
                if p.tail is not None:
                    assert p.bounce is not None  # run() gives every tail a bounce slice
                    p.tail[:] = p.bounce[:p.tail.nbytes]
        return 1
