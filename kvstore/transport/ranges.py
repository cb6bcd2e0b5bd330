"""Address ranges of a transfer: validation and coalescing (pure numpy, no TE).

Kept apart from kvstore/transport/te.py so the batching rule can be property-tested
without an engine. Invariant: whatever these return moves exactly the bytes the
caller asked for, zero-length entries aside.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.core.errors import InvalidRequestError

Addrs = Sequence[int] | np.ndarray


def coalesce(local: Addrs, remote: Addrs, lengths: Addrs
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge transfers whose ranges are contiguous on both sides.

    Entries are ordered by remote then local address (a TE batch has no order), and
    each one that starts where the previous ends on both sides joins it.
    Zero-length entries are dropped. Moves exactly the same bytes.
    """
    loc, rem, ln = nonempty_ranges(local, remote, lengths)
    if len(ln) < 2:
        return loc, rem, ln
    order = np.lexsort((loc, rem))
    loc, rem, ln = loc[order], rem[order], ln[order]
    joins = (loc[:-1] + ln[:-1] == loc[1:]) & (rem[:-1] + ln[:-1] == rem[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return loc[starts], rem[starts], np.add.reduceat(ln, starts)


def nonempty_ranges(local: Addrs, remote: Addrs, lengths: Addrs
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranges as given, one TE entry each (benchmarks), less zero-length ones."""
    loc, rem, ln = as_arrays(local, remote, lengths)
    keep = ln > 0
    return loc[keep], rem[keep], ln[keep]


def as_arrays(local: Addrs, remote: Addrs, lengths: Addrs
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    try:
        raw = [np.asarray(a).reshape(-1) for a in (local, remote, lengths)]
        if any(a.size and a.dtype.kind not in "iu" for a in raw):
            raise TypeError(f"got dtypes {[a.dtype.name for a in raw]}")
        arrays = [a.astype(np.int64, copy=False) for a in raw]
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequestError(f"addresses and lengths must be integers: {exc}") from exc
    if not len(arrays[0]) == len(arrays[1]) == len(arrays[2]):
        raise InvalidRequestError(
            f"local/remote/lengths differ in size: {[len(a) for a in arrays]}")
    if any(len(a) and a.min() < 0 for a in arrays):
        raise InvalidRequestError("addresses and lengths must be >= 0")
    return arrays[0], arrays[1], arrays[2]


def split(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, piece: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every range longer than ``piece`` bytes into pieces of ``piece`` bytes (the
    last one shorter), so that TE keeps several of them in flight; 0: as given.
    Moves exactly the same bytes."""
    if piece <= 0 or not len(lengths) or int(lengths.max()) <= piece:
        return local, remote, lengths
    counts = -(-lengths // piece)  # pieces per range
    first = np.repeat(np.cumsum(counts) - counts, counts)  # index of each range's first piece
    within = (np.arange(int(counts.sum())) - first) * piece  # offset inside its range
    owner = np.repeat(np.arange(len(lengths)), counts)
    return (local[owner] + within, remote[owner] + within,
            np.minimum(lengths[owner] - within, piece))


STREAM_PIECE_BYTES = 4 << 20  # a large move's pieces (``Transport.stream``)
STREAM_MIN_PIECES = 4  # a small move is still cut in this many, so its hashing overlaps
STREAM_MIN_PIECE_BYTES = 256 << 10
# How long ``stream`` sleeps between polls of a piece not landed yet, unless told
# otherwise: ~80 us in all (the kernel's 50 us timer slack comes on top). Long enough
# to leave both cores to the TE threads and the kernel's TCP copies that move the
# bytes, short against a piece (>= 256 KiB: ~150 us at 1.7 GB/s). Measured against
# yielding and spinning in docs/benchmarks.md ("Sleeping between polls").
STREAM_NAP_S = 30e-6
# ... but only once a move has taken this long: a short move (2 MiB: ~1.3 ms here)
# lands within a nap or two, and sleeping through its last piece lost it time
# (docs/benchmarks.md, "Sleeping between polls").
STREAM_YIELD_S = 1e-3
_PAGE = 4096


def stream_piece(nbytes: int) -> int:
    """The piece size ``Transport.stream`` moves ``nbytes`` in when the caller chose
    none: 4 MiB, or for a move under 16 MiB a quarter of it (page-rounded, at least
    256 KiB), so that the first pieces land, and get hashed, while the rest are on the
    wire. Measured in docs/benchmarks.md ("Streamed transfers")."""
    if nbytes >= STREAM_MIN_PIECES * STREAM_PIECE_BYTES:
        return STREAM_PIECE_BYTES
    quarter = -(-nbytes // STREAM_MIN_PIECES)
    return max(STREAM_MIN_PIECE_BYTES, -(-quarter // _PAGE) * _PAGE)
