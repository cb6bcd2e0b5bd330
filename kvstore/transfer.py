"""The node's Mooncake Transfer Engine (TE): the only module that imports ``mooncake``.

TE reports failures as return codes, crashes on misuse and can block for long;
``Transport`` turns it into typed errors and bounded waits (measured facts in
``shared/TRANSFER_ENGINE.md``):

* Every return code is checked. ``TransferError`` (peer alive, transfer refused,
  e.g. a remote range outside its registrations) and ``PeerUnavailableError``
  (segment unknown, closed, dead or stalled) carry segment and byte counts.
* Waits are bounded by ``timeout_s``: before each engine starts, TE's
  ``MC_TRANSFER_TIMEOUT`` (>= 5 s, TE's minimum) and ``MC_TCP_PROGRESS_TIMEOUT_SEC``
  / ``MC_TCP_STATUS_TIMEOUT_SEC`` are set from it; TE reads them at initialize().
  A stalled peer fails a sync call after about that bound. Not bounded by us: a
  port that accepts TCP but is no TE peer blocks the first handshake ~62 s, so
  callers verify a peer over the control plane before the first transfer.
* Only the sync batch calls are used: the async API segfaults on a reused batch
  id and misreports multi-entry batches. A batch carries at most
  ``MAX_BATCH_ENTRIES`` entries (TE's TCP transport fails batches of ~2050+).
* One lock serialises TE calls: sync calls busy-wait a core (GIL released), and on
  2 cores one transfer thread per process is fastest.
* Local ranges must lie inside regions registered here: TE on TCP would read any
  pointer (a bad one segfaults the process), and RDMA requires registration.
* A segment that failed as unavailable is remembered as dead; later calls fail
  fast instead of paying ~1 s each, until ``mark_alive`` (the control plane saw
  the peer again).

Segments: in P2P-handshake mode (no metadata server) a segment is
``"host:rpc_port"``. With a metadata server (``etcd://host:port``, ``http://...``)
the segment is the engine's ``name``; it must be unique in the cluster, and a
crashed process's key lingers (the HTTP server refuses a duplicate), so a
restarted process takes a fresh name (the default picks one).
"""

from __future__ import annotations

import itertools
import logging
import math
import mmap
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from kvstore.errors import (
    ConfigError,
    InvalidRequestError,
    KVStoreError,
    PeerUnavailableError,
    TransferError,
)

log = logging.getLogger(__name__)

# TE logs at INFO to stderr unless told otherwise before the import.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

P2P = "P2PHANDSHAKE"
DEFAULT_TIMEOUT_S = 10.0
MAX_BATCH_ENTRIES = 1024
_TE_MIN_TIMEOUT_S = 5
_METADATA_SCHEMES = ("etcd://", "http://", "https://", "redis://")
_PAGE = mmap.PAGESIZE

Addrs = Sequence[int] | np.ndarray


class TransferStats(NamedTuple):
    nbytes: int
    transfers: int  # TE entries submitted, after coalescing
    seconds: float


class Region(NamedTuple):
    address: int
    nbytes: int
    location: str


class StagingBuffer(NamedTuple):
    """A page-aligned anonymous mapping registered with the engine."""

    address: int
    array: np.ndarray  # uint8 view of the whole buffer


def coalesce(local: Addrs, remote: Addrs, lengths: Addrs
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge transfers whose ranges are contiguous on both sides.

    Entries are ordered by remote then local address (a TE batch has no order), and
    each one that starts where the previous ends on both sides joins it.
    Zero-length entries are dropped. Moves exactly the same bytes.
    """
    loc, rem, ln = _as_arrays(local, remote, lengths)
    keep = ln > 0
    loc, rem, ln = loc[keep], rem[keep], ln[keep]
    if len(ln) < 2:
        return loc, rem, ln
    order = np.lexsort((loc, rem))
    loc, rem, ln = loc[order], rem[order], ln[order]
    joins = (loc[:-1] + ln[:-1] == loc[1:]) & (rem[:-1] + ln[:-1] == rem[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return loc[starts], rem[starts], np.add.reduceat(ln, starts)


def _as_arrays(local: Addrs, remote: Addrs, lengths: Addrs
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


def _import_engine():
    if os.environ.get("MC_LOG_DIR"):  # glog double init: SIGABRT inside the import
        raise ConfigError("unset MC_LOG_DIR: the TE import aborts the process when it is set")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ConfigError(
            "mooncake Transfer Engine is not importable (install the "
            "mooncake-transfer-engine[-non-cuda] wheel and libibverbs1/librdmacm1): "
            f"{exc}") from exc
    return TransferEngine


def _check_host(host: str) -> None:
    """TE accepts any string as its host and then is unreachable: bind to prove it."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except OSError as exc:
        raise ConfigError(f"TE host {host!r} is not an address of this machine: {exc}") from exc


def _set_timeouts(timeout_s: float) -> None:
    """TE reads these at initialize(): they bound every sync call of that engine."""
    seconds = max(1, math.ceil(timeout_s))
    os.environ["MC_TRANSFER_TIMEOUT"] = str(max(_TE_MIN_TIMEOUT_S, seconds))
    os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(seconds)
    os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = str(seconds)


def _bound_from_env() -> float:
    """A stall fails a sync call after the first of TE's two bounds to expire."""
    try:
        return float(min(int(os.environ["MC_TRANSFER_TIMEOUT"]),
                         int(os.environ.get("MC_TCP_PROGRESS_TIMEOUT_SEC", "30"))))
    except ValueError as exc:
        raise ConfigError(f"MC_TRANSFER_TIMEOUT / MC_TCP_PROGRESS_TIMEOUT_SEC: {exc}") from exc


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _port_open(segment: str, timeout_s: float = 0.5) -> bool | None:
    """Whether a P2P segment's handshake port accepts TCP; None if not host:port."""
    host, _, port = segment.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


class Transport:
    """One TE engine with its registered regions. Thread-safe.

    Who calls it: the server (registers the tier arenas once) and each client
    (registers its staging buffers); both then ``write``/``read`` to peers'
    registered addresses that the control plane handed them.
    """

    def __init__(self, host: str = "127.0.0.1", metadata: str = P2P,
                 protocol: str = "tcp", timeout_s: float | None = None,
                 name: str | None = None) -> None:
        if metadata != P2P and not metadata.startswith(_METADATA_SCHEMES):
            raise ConfigError(f"TE metadata must be {P2P!r} or a URL starting with one of "
                              f"{_METADATA_SCHEMES}, got {metadata!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        _check_host(host)
        if timeout_s is not None or "MC_TRANSFER_TIMEOUT" not in os.environ:
            _set_timeouts(timeout_s or DEFAULT_TIMEOUT_S)
        self.timeout_s = _bound_from_env()
        self.p2p = metadata == P2P
        self.metadata = metadata  # peers must resolve segments the same way
        local_name = host if self.p2p else (name or f"{host}:{_free_port(host)}")
        self._te = _import_engine()()
        rc = self._te.initialize(local_name, metadata, protocol, "")
        if rc != 0:
            cls = ConfigError if self.p2p else PeerUnavailableError
            raise cls(f"TE initialize({local_name!r}, {metadata!r}, {protocol!r}) "
                      f"returned {rc}: metadata server unreachable or name already taken")
        self.segment = f"{host}:{self._te.get_rpc_port()}" if self.p2p else local_name
        self._lock = threading.RLock()  # every TE call and the region books
        self._regions: dict[int, Region] = {}
        self._starts = np.zeros(0, dtype=np.int64)  # sorted region addresses
        self._ends = np.zeros(0, dtype=np.int64)  # their ends, same order
        self._buffers: dict[int, mmap.mmap] = {}
        self._dead: dict[str, str] = {}  # segment -> why; own lock: checks never wait on TE
        self._dead_lock = threading.Lock()
        self._closed = False
        log.info("TE engine %s up (metadata %s, timeout %ss)", self.segment, metadata,
                 self.timeout_s)

    # ------------------------------------------------------------ registration
    def register(self, address: int | tuple, nbytes: int | None = None,
                 location: str = "cpu:0") -> Region:
        """Register ``[address, address + nbytes)``; ``register(region)`` also takes an
        ``(address, nbytes, location)`` tuple such as ``tiers.base.MemoryRegion``."""
        if nbytes is None:
            return self.register_many([address])[0]  # type: ignore[list-item]
        return self.register_many([(address, nbytes, location)])[0]

    def register_many(self, regions: Iterable[tuple[int, int, str] | tuple[int, int]]
                      ) -> list[Region]:
        """Register regions once, in one TE call. All or nothing: an overlap with an
        existing region or with each other raises ``InvalidRequestError``."""
        try:
            new = [Region(int(r[0]), int(r[1]), str(r[2]) if len(r) > 2 else "cpu:0")
                   for r in regions]
        except (TypeError, ValueError, IndexError) as exc:
            raise InvalidRequestError(
                f"regions must be (address, nbytes[, location]): {exc}") from exc
        with self._lock:
            self._check_open()
            self._check_free(new)
            if not new:
                return []
            if len({r.location for r in new}) == 1:
                rc = self._te.batch_register_memory([r.address for r in new],
                                                    [r.nbytes for r in new], new[0].location)
            else:
                rc = min(self._te.register_memory(r.address, r.nbytes, r.location)
                         for r in new)
            if rc != 0:
                for r in new:  # undo whatever part TE took; unknown ones just return < 0
                    self._te.unregister_memory(r.address)
                raise TransferError(f"TE refused to register {len(new)} region(s) "
                                    f"({sum(r.nbytes for r in new)} bytes): rc {rc}")
            for r in new:
                self._regions[r.address] = r
            self._reindex()
        log.debug("registered %s region(s)", len(new))
        return new

    def unregister(self, address: int) -> None:
        with self._lock:
            if address not in self._regions:
                raise InvalidRequestError(f"no region registered at {address:#x}")
            rc = self._te.unregister_memory(address) if not self._closed else 0
            del self._regions[address]
            self._reindex()
            buf = self._buffers.pop(address, None)
        if rc != 0:
            log.warning("TE unregister_memory(%#x) returned %s", address, rc)
        if buf is not None:
            _close_mapping(buf)

    def regions(self) -> list[Region]:
        with self._lock:
            return sorted(self._regions.values())

    def allocate_buffer(self, nbytes: int, location: str = "cpu:0") -> StagingBuffer:
        """A page-aligned anonymous mapping, registered once; ``unregister(address)``
        or ``close()`` frees it (once no numpy view of it is left)."""
        if nbytes <= 0:
            raise InvalidRequestError(f"buffer size must be > 0, got {nbytes}")
        size = -(-nbytes // _PAGE) * _PAGE
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        array = np.frombuffer(buf, dtype=np.uint8)
        address = array.ctypes.data
        try:
            self.register(address, size, location)
        except KVStoreError:
            del array
            buf.close()
            raise
        with self._lock:
            self._buffers[address] = buf
        return StagingBuffer(address, array[:nbytes])

    def _check_free(self, new: list[Region]) -> None:
        spans = sorted([(r.address, r.address + r.nbytes) for r in new]
                       + [(r.address, r.address + r.nbytes) for r in self._regions.values()])
        for r in new:
            if r.address <= 0 or r.nbytes <= 0:
                raise InvalidRequestError(f"bad region {r}: address and size must be > 0")
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise InvalidRequestError(
                    f"region at {start:#x} overlaps one already registered (or in this "
                    "call); TE does not support overlapping registrations")

    def _reindex(self) -> None:
        starts = sorted(self._regions)
        self._starts = np.array(starts, dtype=np.int64)
        self._ends = np.array([a + self._regions[a].nbytes for a in starts], dtype=np.int64)

    def _check_local(self, loc: np.ndarray, ln: np.ndarray) -> None:
        """Every local range inside one registered region (vectorised)."""
        idx = np.searchsorted(self._starts, loc, side="right") - 1
        ok = idx >= 0
        ok[ok] &= loc[ok] + ln[ok] <= self._ends[idx[ok]]
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise InvalidRequestError(
                f"local range {int(loc[bad]):#x}+{int(ln[bad])} is not inside a region "
                f"registered with this transport ({len(self._starts)} registered)")

    # -------------------------------------------------------------- transfers
    def write(self, segment: str, local_addrs: Addrs, remote_addrs: Addrs, lengths: Addrs,
              *, merge: bool = True) -> TransferStats:
        """Copy local registered bytes to ``segment``'s registered addresses."""
        return self._transfer("write", segment, local_addrs, remote_addrs, lengths, merge)

    def read(self, segment: str, local_addrs: Addrs, remote_addrs: Addrs, lengths: Addrs,
             *, merge: bool = True) -> TransferStats:
        """Copy ``segment``'s registered bytes into local registered memory."""
        return self._transfer("read", segment, local_addrs, remote_addrs, lengths, merge)

    def _transfer(self, op: str, segment: str, local: Addrs, remote: Addrs, lengths: Addrs,
                  merge: bool) -> TransferStats:
        if not isinstance(segment, str) or not segment:
            raise InvalidRequestError(f"segment must be a non-empty str, got {segment!r}")
        if merge:
            loc, rem, ln = coalesce(local, remote, lengths)
        else:  # raw: one TE entry per given range (benchmarks)
            loc, rem, ln = _as_arrays(local, remote, lengths)
            keep = ln > 0
            loc, rem, ln = loc[keep], rem[keep], ln[keep]
        nbytes = int(ln.sum())
        self._check_dead(segment, op, nbytes)
        start = time.perf_counter()
        done, rc, elapsed = 0, 0, 0.0
        with self._lock:
            self._check_open()
            self._check_local(loc, ln)
            call = (self._te.batch_transfer_sync_write if op == "write"
                    else self._te.batch_transfer_sync_read)
            for lo in range(0, len(ln), MAX_BATCH_ENTRIES):
                hi = lo + MAX_BATCH_ENTRIES
                batch_start = time.perf_counter()
                rc = call(segment, loc[lo:hi].tolist(), rem[lo:hi].tolist(), ln[lo:hi].tolist())
                if rc != 0:
                    elapsed = time.perf_counter() - batch_start
                    break
                done += int(ln[lo:hi].sum())
            del call  # a traceback keeps this frame: it must not keep the engine alive
        if rc != 0:  # classified outside the lock: a probe must not hold up other transfers
            self._fail(f"TE {op} of {nbytes} bytes in {len(ln)} transfer(s) to {segment} "
                       f"failed (rc {rc} after {elapsed:.2f}s; {done} bytes had landed "
                       "in earlier batches)", segment, elapsed)
        return TransferStats(nbytes, len(ln), time.perf_counter() - start)

    def _fail(self, what: str, segment: str, elapsed: float) -> None:
        """Raise TransferError if the peer is up, else mark it dead and raise
        PeerUnavailableError. TE's -1 does not say which, so ask the peer cheaply."""
        if elapsed >= 0.9 * self.timeout_s:
            why = "not answering within the transfer timeout"
        elif self.p2p:
            # A TCP connect, not TE's probe: that blocks ~60 s on a stalled peer.
            up = _port_open(segment)
            why = "" if up else "segment unknown, closed or dead (its handshake port is closed)"
        else:
            # The endpoint comes from the metadata server, so it is a TE port: TE's
            # probe answers in ~1 ms (0 alive, -200 unknown name, -102 gone).
            probe = self._probe(segment)
            why = "" if probe == 0 else f"segment unknown or dead (TE probe returned {probe})"
        if not why:
            raise TransferError(f"{what}: the peer is up but refused the transfer "
                                "(a remote range outside its registered memory?)")
        self.mark_dead(segment, why)
        raise PeerUnavailableError(f"{what}: {why}")

    def _probe(self, segment: str) -> int:
        # Its own frame: a traceback through _fail must not keep the engine alive.
        engine = self._te  # None once closed
        return engine.send_probe(segment) if engine is not None else -1

    # -------------------------------------------------------------- dead peers
    def mark_dead(self, segment: str, why: str = "marked dead") -> None:
        with self._dead_lock:
            self._dead[segment] = why
        log.warning("TE segment %s marked dead: %s", segment, why)

    def mark_alive(self, segment: str) -> None:
        """Forget a failure, e.g. once the control plane has seen the peer again."""
        with self._dead_lock:
            self._dead.pop(segment, None)

    def is_dead(self, segment: str) -> bool:
        with self._dead_lock:
            return segment in self._dead

    def _check_dead(self, segment: str, op: str, nbytes: int) -> None:
        with self._dead_lock:
            why = self._dead.get(segment)
        if why is not None:
            raise PeerUnavailableError(f"TE {op} of {nbytes} bytes to {segment} not tried: "
                                       f"segment failed earlier ({why})")

    # ------------------------------------------------------------------ close
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequestError(f"transport {self.segment} is closed")

    def close(self) -> None:
        """Unregister everything and free staging buffers. Safe to call twice.

        With a metadata server the engine is destroyed now (~1 s, holding the GIL), so
        its segment leaves the shared metadata at once. In P2P mode it is left to the
        garbage collector: nothing outside this process names it, and the second is
        not worth paying in every close.
        """
        with self._lock:
            if self._closed:
                return
            for address in list(self._regions):
                self.unregister(address)
            self._closed = True
            if not self.p2p:
                self._te = None
        log.info("TE engine %s closed", self.segment)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_mapping(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # a numpy view still uses it: unmapped when that view dies
        log.debug("staging buffer still viewed; left to the garbage collector")
