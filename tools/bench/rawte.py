"""The raw-TE floor of the two-node benchmark: the same bytes moved by TE alone, in
several transfer patterns, so that kvstore is compared with the best use of TE and
not with one arbitrary use of it.

The producer copies the prompt into a TE-registered buffer (what the same-node path
does: a put is one memcpy in every pattern); the consumer reads it into its own
registered buffer in one of these patterns (``RawPattern.parse`` reads the names):

* ``coalesced``: one TE transfer of the whole prompt (its blocks are back to back,
  so ``Transport.read`` merges them into one entry);
* ``per-block``: one TE entry per block, submitted in batches of up to
  ``MAX_BATCH_ENTRIES`` (what Mooncake Store does with one object per block);
* ``slices-N``: the prompt cut into N equal, page-aligned slices, submitted as one
  batch of N entries: TE's TCP transport starts every entry of a batch before
  waiting for any, so all N are in flight at once, each on its own connection;
* ``threads-N``: the same N slices, each a one-entry sync transfer from its own
  thread through its own engine, all started together (TE's sync calls release
  the GIL);
* ``streamed``: the prompt in the pieces kvstore's client streams it in
  (``kvstore.transport.ranges.stream_piece``), each a one-entry async batch, all in
  flight at once, the wait yielding the CPU instead of spinning
  (``Transport.stream``): kvstore's default TE use, without its hashing.

Which patterns the ``transfer`` section runs is ``TRANSFER_PATTERNS`` in
tools/bench/cluster.py; docs/benchmarks.md gives the measurement that chose them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

PAGE = 4096
KINDS = ("coalesced", "per-block", "slices", "threads", "streamed")


class RawPattern(NamedTuple):
    kind: str  # one of KINDS
    n: int  # slices for "slices" / "threads"; 0 otherwise

    @classmethod
    def parse(cls, name: str) -> RawPattern:
        kind, _, count = name.rpartition("-") if name[-1:].isdigit() else (name, "", "")
        if kind not in KINDS or (kind in ("slices", "threads")) != bool(count):
            raise ValueError(f"unknown raw-TE pattern {name!r}: one of coalesced, per-block, "
                             "slices-N, threads-N, streamed")
        n = int(count) if count else 0
        if count and n < 1:
            raise ValueError(f"raw-TE pattern {name!r}: N must be >= 1")
        return cls(kind, n)


class Ranges(NamedTuple):
    """Byte ranges of one transfer, as offsets from the start of both buffers."""

    offsets: np.ndarray  # int64
    lengths: np.ndarray  # int64


def block_ranges(sizes: list[int]) -> Ranges:
    lengths = np.asarray(sizes, dtype=np.int64)
    return Ranges(np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64), lengths)


def slice_ranges(nbytes: int, n: int, align: int = PAGE) -> Ranges:
    """``nbytes`` cut into at most ``n`` contiguous slices of near-equal length, every
    cut on a multiple of ``align``; covers every byte exactly once, in order. Fewer
    slices than ``n`` when the bytes do not fill ``n`` aligned pieces."""
    if nbytes <= 0 or n < 1:
        raise ValueError(f"need nbytes > 0 and n >= 1, got {nbytes}, {n}")
    units = -(-nbytes // align)  # aligned pieces, the last one maybe short
    cuts = np.unique(np.linspace(0, units, min(n, units) + 1).round().astype(np.int64)) * align
    cuts[-1] = nbytes
    return Ranges(cuts[:-1], np.diff(cuts))


def plan(pattern: RawPattern, sizes: list[int]) -> Ranges:
    """The ranges one get of a prompt with these block ``sizes`` moves."""
    if pattern.kind in ("coalesced", "per-block"):
        return block_ranges(sizes)
    if pattern.kind == "streamed":
        from kvstore.transport.ranges import stream_piece

        nbytes = int(sum(sizes))
        return slice_ranges(nbytes, -(-nbytes // stream_piece(nbytes)))
    return slice_ranges(int(sum(sizes)), pattern.n)


class RawTESide:
    """Producer or consumer of the raw-TE system (see the module doc)."""

    def __init__(self, cfg: dict) -> None:
        from kvstore.transport.te import Transport

        self.te = Transport(cfg["host"])
        self.device = cfg.get("device", "cpu")
        if self.device == "cpu":
            buf = self.te.allocate_buffer(cfg["max_bytes"])
            self.array, self.address = buf.array, buf.address
        else:  # --gpu: TE straight from/to VRAM (needs the CUDA build of TE)
            import torch

            self.array = torch.empty(cfg["max_bytes"], dtype=torch.uint8, device=self.device)
            self.address = self.array.data_ptr()
            self.te.register(self.address, cfg["max_bytes"], f"cuda:{self.array.device.index}")
        self.peer = cfg.get("peer")  # consumer: the producer's {"segment", "address"}
        self._host, self._nbytes = cfg["host"], cfg["max_bytes"]
        self._extra: list = []  # threads-N: more engines, one per extra thread
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self.last_transfers = 0  # TE entries the last get submitted

    def info(self) -> dict:
        return {"segment": self.te.segment, "address": self.address}

    def put(self, name: str, pid: int, ntokens: int, data: Any) -> None:
        if self.device == "cpu":
            np.copyto(self.array[:data.size], data)
        else:
            self.array[:data.numel()].copy_(data)

    def get(self, name: str, pid: int, ntokens: int, pattern: str = "coalesced") -> Any:
        from tools.bench.cluster_worker import LAYOUTS, entry_sizes

        how = RawPattern.parse(pattern)
        sizes = entry_sizes(LAYOUTS[name], ntokens)
        ranges = plan(how, sizes)
        local = self.address + ranges.offsets
        remote = self.peer["address"] + ranges.offsets
        seg = self.peer["segment"]
        if how.kind == "threads":
            self.last_transfers = self._threads(seg, local, remote, ranges.lengths)
        elif how.kind == "streamed":
            self.last_transfers = self.te.stream("read", seg, local, remote,
                                                 ranges.lengths).transfers
        else:
            # coalesced: Transport merges the back-to-back blocks into one entry
            stats = self.te.read(seg, local, remote, ranges.lengths,
                                 merge=how.kind == "coalesced")
            self.last_transfers = stats.transfers
        return self.array[:int(sum(sizes))]

    def _threads(self, seg: str, local: np.ndarray, remote: np.ndarray,
                 lengths: np.ndarray) -> int:
        """One single-entry sync read per slice, each from its own thread through its
        own engine (one Transport serialises its calls under a lock), all started
        together."""
        engines = self._engines(len(lengths))
        if self._pool_size < len(engines):
            if self._pool is not None:
                self._pool.shutdown()
            self._pool, self._pool_size = ThreadPoolExecutor(len(engines)), len(engines)
        futures = [self._pool.submit(te.read, seg, [int(lo)], [int(rem)], [int(ln)],
                                     merge=False)
                   for te, lo, rem, ln in zip(engines, local, remote, lengths)]
        for f in futures:
            f.result()
        return len(futures)

    def _engines(self, n: int) -> list:
        """This side's engine and ``n - 1`` more, each with the buffer registered."""
        from kvstore.transport.te import Transport

        while len(self._extra) < n - 1:
            te = Transport(self._host)
            location = "cpu:0" if self.device == "cpu" else f"cuda:{self.array.device.index}"
            te.register((self.address, int(self._nbytes), location))
            self._extra.append(te)
        return [self.te, *self._extra[:n - 1]]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        for te in self._extra:
            te.close()
        self.te.close()
