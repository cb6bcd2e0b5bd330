"""The client's data plane: moving entry bytes to and from a server's tier arenas.

Two ways, chosen per entry:
* same node: the server's DRAM arena is a shared-memory file this process maps
  (``tiers.dram.map_shared``); a DRAM entry is one memcpy at its arena offset;
* otherwise TE: bytes go through this client's registered, page-aligned staging
  buffer in as few one-sided batches as it takes (one when they fit), and the
  Transport coalesces runs that are contiguous on both sides into single transfers.

The server has told us, in ``hello``, its TE segment and its arena file; the
control plane therefore verified the peer before the first TE transfer (a port
that is not a TE peer would otherwise stall TE's handshake for about a minute).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from kvstore.errors import ConfigError, InvalidRequestError
from kvstore.nodeid import host_id

log = logging.getLogger(__name__)

# Wire layout of placements / entries (kvstore.handlers): tier, offset, nbytes, address.
_TIER, _OFFSET, _NBYTES, _ADDRESS = 0, 1, 2, 3


class Segment(NamedTuple):
    name: str  # the server's TE segment, "host:rpc_port"
    shm: np.ndarray | None  # the server's DRAM arena mapped here, when on the same node


class DataPath:
    """``observer(op, seconds, ok)`` (e.g. ``kvstore.metrics.Metrics.observe``) is told
    how long each TE move took, as ``te_write`` / ``te_read``: staging copy plus the
    batched transfers (the first one also starts the TE engine). Same-node memcpys
    are not reported."""

    def __init__(self, te_host: str, staging_bytes: int, same_node: bool | str = "auto",
                 observer: Callable[[str, float, bool], None] | None = None) -> None:
        if same_node not in (True, False, "auto"):
            raise ConfigError(f"same_node must be True, False or 'auto', got {same_node!r}")
        self.te_host = te_host
        self.staging_bytes = staging_bytes
        self.same_node = same_node
        self.observer = observer
        self.segment: Segment | None = None
        self._transport = None
        self._stage: np.ndarray | None = None
        self._stage_address = 0
        self._lock = threading.Lock()

    def connect(self, hello: dict[str, Any]) -> None:
        """Adopt a server's hello: its TE segment, and its DRAM arena if on this node."""
        shm = None
        dram = hello.get("dram")
        local = hello.get("host_id") == host_id() and dram is not None \
            and os.path.exists(dram["path"])
        if self.same_node is True and not local:
            raise ConfigError("same_node=True but the server's DRAM arena is not shared "
                              "with this process (other node, or no shared arena)")
        if self.same_node and local:
            from tiers.dram import map_shared

            shm = map_shared(dram["path"], int(dram["nbytes"]))
            log.info("same-node fast path: mapped %s (%s bytes)", dram["path"], dram["nbytes"])
        self.segment = Segment(hello["segment"], shm)
        if self._transport is not None:
            # The control plane just saw this peer: let TE try it again.
            self._transport.mark_alive(hello["segment"])

    @property
    def uses_shared_memory(self) -> bool:
        return self.segment is not None and self.segment.shm is not None

    # ------------------------------------------------------------------ moves
    def write(self, seg: Segment, buffers: list[np.ndarray], placements: list[list]) -> None:
        """Copy each buffer into its placement (same-node memcpy or TE write)."""
        remote = []
        for buf, pl in zip(buffers, placements):
            if seg.shm is not None and pl[_TIER] == "dram":
                seg.shm[pl[_OFFSET]:pl[_OFFSET] + pl[_NBYTES]] = buf
            else:
                remote.append((buf, pl))
        if remote:
            with self._lock, self._timed("te_write"):
                for group in self._groups([pl[_NBYTES] for _, pl in remote]):
                    self._te_write(seg.name, [remote[i] for i in group])

    def read(self, seg: Segment, entries: list[list]) -> np.ndarray:
        """All entries' bytes back to back, in entry order."""
        sizes = [e[_NBYTES] for e in entries]
        out = np.empty(sum(sizes), dtype=np.uint8)
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        remote = []
        for e, start in zip(entries, starts):
            if seg.shm is not None and e[_TIER] == "dram":
                out[start:start + e[_NBYTES]] = seg.shm[e[_OFFSET]:e[_OFFSET] + e[_NBYTES]]
            else:
                remote.append((start, e))
        if remote:
            with self._lock, self._timed("te_read"):
                for group in self._groups([e[_NBYTES] for _, e in remote]):
                    self._te_read(seg.name, out, [remote[i] for i in group])
        return out

    @contextlib.contextmanager
    def _timed(self, op: str) -> Iterator[None]:
        start, ok = time.perf_counter(), False
        try:
            yield
            ok = True
        finally:
            if self.observer is not None:
                self.observer(op, time.perf_counter() - start, ok)

    def _groups(self, sizes: list[int]) -> list[list[int]]:
        """Consecutive runs of entries that fit the staging buffer together."""
        groups: list[list[int]] = [[]]
        used = 0
        for i, n in enumerate(sizes):
            if n > self.staging_bytes:
                raise InvalidRequestError(f"entry of {n} bytes exceeds the client's staging "
                                          f"buffer ({self.staging_bytes}); raise staging_bytes")
            if used + n > self.staging_bytes:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += n
        return [g for g in groups if g]

    def _te_write(self, segment: str, items: list[tuple[np.ndarray, list]]) -> None:
        stage, base = self._staging_buffer()
        local, remote, lengths = [], [], []
        pos = 0
        for buf, pl in items:
            n = pl[_NBYTES]
            stage[pos:pos + n] = buf
            local.append(base + pos)
            remote.append(_address(pl))
            lengths.append(n)
            pos += n
        self._te().write(segment, local, remote, lengths)

    def _te_read(self, segment: str, out: np.ndarray, items: list[tuple[int, list]]) -> None:
        stage, base = self._staging_buffer()
        local, remote, lengths = [], [], []
        pos = 0
        for _, e in items:
            local.append(base + pos)
            remote.append(_address(e))
            lengths.append(e[_NBYTES])
            pos += e[_NBYTES]
        self._te().read(segment, local, remote, lengths)
        pos = 0
        for start, e in items:
            n = e[_NBYTES]
            out[start:start + n] = stage[pos:pos + n]
            pos += n

    # -------------------------------------------------------------- resources
    def _te(self):
        if self._transport is None:
            from kvstore.transfer import Transport

            self._transport = Transport(self.te_host)
        return self._transport

    def _staging_buffer(self) -> tuple[np.ndarray, int]:
        if self._stage is None:
            # Page-aligned and registered with TE once, for the client's life.
            buf = self._te().allocate_buffer(self.staging_bytes)
            self._stage, self._stage_address = buf.array, buf.address
        return self._stage, self._stage_address

    def close(self) -> None:
        with self._lock:
            self._stage = None
            if self._transport is not None:
                self._transport.close()  # frees the staging buffer too
                self._transport = None
            self.segment = None  # drops the shared mapping with the last view of it


def _address(item: list) -> int:
    addr = item[_ADDRESS]
    if addr is None:
        raise InvalidRequestError(f"server gave no TE address for a {item[_TIER]} entry")
    return addr
