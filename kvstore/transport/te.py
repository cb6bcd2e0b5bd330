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
* Sync batch calls (``read``/``write``) carry at most ``MAX_BATCH_ENTRIES`` entries
  (TE's TCP transport fails batches of ~2050+). ``stream`` uses the async API only
  the way it is safe: one entry per batch (a multi-entry batch's status is its
  first entry's), each id polled until done or failed and never again (a second
  look at a freed id segfaults).
* One lock serialises TE calls: sync calls busy-wait a core (GIL released), and on
  2 cores one transfer thread per process is fastest.
* Local ranges must lie inside regions registered here: TE on TCP would read any
  pointer (a bad one segfaults the process), and RDMA requires registration.
* A segment that failed as unavailable is remembered as dead; later calls fail
  fast instead of paying ~1 s each, until ``mark_alive`` (the control plane saw
  the peer again).
* The protocol is chosen, not discovered: TE's initialize() takes RDMA whenever it
  finds a NIC (its protocol argument does not decide) and TCP otherwise, silently.
  "tcp" therefore runs with ``MC_FORCE_TCP`` set for the call, and "rdma" is
  refused at once where there is no usable RDMA device (``env.check_protocol``).
  ``devices`` ("mlx5_0,mlx5_1") is TE's filter of the NICs it may use; empty: all.

Segments: in P2P-handshake mode (no metadata server) a segment is
``"host:rpc_port"``. With a metadata server (``etcd://host:port``, ``http://...``)
the segment is the engine's ``name``; it must be unique in the cluster, and a
crashed process's key lingers (the HTTP server refuses a duplicate), so a
restarted process takes a fresh name (the default picks one).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

import numpy as np

from kvstore.core.errors import (
    ConfigError,
    InvalidRequestError,
    PeerUnavailableError,
    TransferError,
)
from kvstore.transport.env import (
    bound_from_env,
    check_host,
    check_protocol,
    free_port,
    port_open,
    protocol_env,
    set_timeouts,
)
from kvstore.transport.ranges import STREAM_NAP_S, STREAM_YIELD_S, Addrs, coalesce, nonempty_ranges
from kvstore.transport.regions import Region, RegionsMixin, StagingBuffer

# Re-exported: callers import these names from here.
__all__ = ["DEFAULT_TIMEOUT_S", "MAX_BATCH_ENTRIES", "P2P", "Addrs", "Region", "StagingBuffer",
           "TeInit", "TransferStats", "Transport", "coalesce"]

log = logging.getLogger(__name__)

# TE logs at INFO to stderr unless told otherwise before the import.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

P2P = "P2PHANDSHAKE"
DEFAULT_TIMEOUT_S = 10.0
MAX_BATCH_ENTRIES = 1024
_BAD_BATCH = (1 << 64) - 1  # an async submission TE refused after opening no segment
# Async batches one stream keeps in flight: TE's TCP transport stalls past ~2 000
# outstanding ones (pieces that never finish, then a wedged peer), as it fails sync
# batches of ~2 050+ entries.
STREAM_WINDOW = 256
_METADATA_SCHEMES = ("etcd://", "http://", "https://", "redis://")


class TransferStats(NamedTuple):
    nbytes: int
    transfers: int  # TE entries submitted, after coalescing
    seconds: float


class TeInit(NamedTuple):
    """The arguments TE's ``initialize()`` was called with, as passed."""

    local_name: str
    metadata: str
    protocol: str  # "tcp" | "rdma"
    devices: str  # comma-separated NIC filter; "": every NIC TE discovers


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


class Transport(RegionsMixin):
    """One TE engine with its registered regions. Thread-safe.

    Who calls it: the server (registers the tier arenas once) and each client
    (registers its staging buffers); both then ``write``/``read`` to peers'
    registered addresses that the control plane handed them.
    """

    def __init__(self, host: str = "127.0.0.1", metadata: str = P2P,
                 protocol: str = "tcp", timeout_s: float | None = None,
                 name: str | None = None, devices: str | Sequence[str] = "") -> None:
        device_names = _check_args(host, metadata, timeout_s, protocol, devices)
        if timeout_s is not None or "MC_TRANSFER_TIMEOUT" not in os.environ:
            set_timeouts(timeout_s or DEFAULT_TIMEOUT_S)
        self.timeout_s = bound_from_env()
        self.p2p = metadata == P2P
        self.metadata = metadata  # peers must resolve segments the same way
        self.protocol = protocol
        self._start_engine(host, metadata, protocol, ",".join(device_names), name)
        self._lock = threading.RLock()  # every TE call and the region books
        self._regions: dict[int, Region] = {}
        self._starts = np.zeros(0, dtype=np.int64)  # sorted region addresses
        self._ends = np.zeros(0, dtype=np.int64)  # their ends, same order
        self._buffers: dict[int, mmap.mmap] = {}
        self._dead: dict[str, str] = {}  # segment -> why; own lock: checks never wait on TE
        self._dead_lock = threading.Lock()
        self._closed = False
        log.info("TE engine %s up: initialize(%s), timeout %ss", self.segment,
                 ", ".join(map(repr, self.init_args)), self.timeout_s)

    def _start_engine(self, host: str, metadata: str, protocol: str, devices: str,
                      name: str | None) -> None:
        local_name = host if self.p2p else (name or f"{host}:{free_port(host)}")
        self._te = _import_engine()()
        self.init_args = TeInit(local_name, metadata, protocol, devices)
        with protocol_env(protocol):
            rc = self._te.initialize(*self.init_args)
        if rc != 0:
            cls = ConfigError if self.p2p else PeerUnavailableError
            raise cls(f"TE initialize({', '.join(map(repr, self.init_args))}) returned {rc}: "
                      "metadata server unreachable, name already taken or no usable NIC")
        self.segment = f"{host}:{self._te.get_rpc_port()}" if self.p2p else local_name

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
        loc, rem, ln = (coalesce if merge else nonempty_ranges)(local, remote, lengths)
        nbytes = int(ln.sum())
        self._check_dead(segment, op, nbytes)
        start = time.perf_counter()
        done, rc, elapsed = self._submit(op, segment, loc, rem, ln)
        if rc != 0:  # classified outside the lock: a probe must not hold up other transfers
            self._fail(f"TE {op} of {nbytes} bytes in {len(ln)} transfer(s) to {segment} "
                       f"failed (rc {rc} after {elapsed:.2f}s; {done} bytes had landed "
                       "in earlier batches)", segment, elapsed)
        return TransferStats(nbytes, len(ln), time.perf_counter() - start)

    def _submit(self, op: str, segment: str, loc: np.ndarray, rem: np.ndarray,
                ln: np.ndarray) -> tuple[int, int, float]:
        """Hand the ranges to TE in batches of at most ``MAX_BATCH_ENTRIES``, stopping
        at the first failure; returns (bytes landed, TE's rc, the failed batch's
        seconds)."""
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
        return done, rc, elapsed

    def stream(self, op: str, segment: str, local: Addrs, remote: Addrs, lengths: Addrs, *,
               overlap: Callable[[], None] | None = None,
               on_landed: Callable[[int], None] | None = None,
               nap_s: float = STREAM_NAP_S) -> TransferStats:
        """The ranges, in the order given, each as its own one-entry async TE batch, all
        in flight at once; between polls the wait only yields the CPU (``sched_yield``)
        for the first ``STREAM_YIELD_S`` after its first poll, and sleeps ``nap_s``
        after that (0: it always yields) instead of spinning.

        TE's sync calls busy-wait a core for the whole transfer; on a machine whose
        cores also run TE's own worker threads (both ends, on 2 cores here) that spin
        slows the transfer it waits for. Here the caller's thread works instead:
        ``overlap()`` runs once every range is submitted (a write hashes its sources
        then), and ``on_landed(n)`` each time the first ``n`` ranges have all landed
        (a read hashes what arrived while the rest is still on the wire). Both run
        under this transport's lock; an exception from them still waits for every
        range to finish before it propagates, as does a failed range: nothing is left
        writing into the caller's memory when this returns (a wait bounded by
        progress: ``timeout_s``, plus 1 s per GiB of the piece, without one landing;
        past it the ranges are given up and their ids leak, as a stalled sync call's
        would). At most ``STREAM_WINDOW`` batches are in flight at once.

        Only one-entry batches: TE's status of a multi-entry async batch is its first
        entry's. Every batch id is polled until TE reports it done or failed (which
        frees it) and never again."""
        if op not in ("read", "write"):
            raise InvalidRequestError(f"op must be 'read' or 'write', got {op!r}")
        if not isinstance(segment, str) or not segment:
            raise InvalidRequestError(f"segment must be a non-empty str, got {segment!r}")
        loc, rem, ln = nonempty_ranges(local, remote, lengths)
        nbytes = int(ln.sum())
        self._check_dead(segment, op, nbytes)
        start = time.perf_counter()
        with self._lock:
            self._check_open()
            self._check_local(loc, ln)
            failed, elapsed, error = self._stream(op, segment, loc.tolist(), rem.tolist(),
                                                  ln.tolist(), overlap, on_landed, nap_s)
        if failed:
            self._fail(f"TE {op} of {nbytes} bytes in {len(ln)} transfer(s) to {segment} "
                       f"failed ({failed} after {elapsed:.2f}s)", segment, elapsed)
        if error is not None:
            raise error
        return TransferStats(nbytes, len(ln), time.perf_counter() - start)

    def _stream(self, op: str, segment: str, loc: list[int], rem: list[int], ln: list[int],
                overlap: Callable[[], None] | None, on_landed: Callable[[int], None] | None,
                nap_s: float) -> tuple[str, float, BaseException | None]:
        """Submit (at most ``STREAM_WINDOW`` in flight), poll in order. Returns (what
        failed or "", the failed part's seconds, the first exception a callback
        raised). Callers hold the lock."""
        te = self._te
        submit = te.batch_transfer_async_write if op == "write" else \
            te.batch_transfer_async_read
        check = te.transfer_check_status
        ids: list[int] = []  # submitted, in order; ids[:done] are finished (freed)
        failed, error = "", None
        last = time.perf_counter()  # the latest progress

        def submit_upto(upto: int) -> None:
            nonlocal failed
            while not failed and len(ids) < min(upto, len(ln)):
                i = len(ids)
                batch = submit(segment, [loc[i]], [rem[i]], [ln[i]])
                if batch <= 0 or batch >= _BAD_BATCH:  # 0 or (uint64)-1: not submitted
                    failed = f"submission {i} refused"
                    return
                ids.append(batch)

        done = 0
        try:
            submit_upto(STREAM_WINDOW)
            if overlap is not None and not failed:
                error = _call(overlap)
            yield_until = time.perf_counter() + STREAM_YIELD_S  # from the first poll
            while done < len(ids):
                status = check(ids[done])
                now = time.perf_counter()
                if status in (0, -2):  # pending, or TE's own timeout (id kept, still live)
                    # Bounded by progress: the peer must land a piece every so often.
                    if now - last > self.timeout_s + ln[done] / (1 << 30) + 1.0:
                        # TE never finished them: their ids leak, as a sync call's would.
                        return (failed or f"{len(ids) - done} transfer(s) unfinished, no "
                                "progress within the timeout"), now - last, error
                    if nap_s > 0 and now > yield_until:
                        time.sleep(nap_s)
                    else:
                        os.sched_yield()
                    continue
                done += 1
                last = now
                if status != 1:  # -1: failed (freed)
                    failed = failed or f"transfer {done - 1} reported {status}"
                elif not failed and error is None and on_landed is not None:
                    error = _call(on_landed, done)
                if not failed:
                    submit_upto(done + STREAM_WINDOW)
        except BaseException as exc:  # TE raised, or an interrupt between polls
            # Nothing may write into the caller's memory once this returns.
            _drain(check, ids[done:], time.perf_counter() + self.timeout_s)
            raise exc
        return failed, time.perf_counter() - last if failed else 0.0, error

    def _fail(self, what: str, segment: str, elapsed: float) -> None:
        """Raise TransferError if the peer is up, else mark it dead and raise
        PeerUnavailableError. TE's -1 does not say which, so ask the peer cheaply."""
        if elapsed >= 0.9 * self.timeout_s:
            why = "not answering within the transfer timeout"
        elif self.p2p:
            # A TCP connect, not TE's probe: that blocks ~60 s on a stalled peer.
            up = port_open(segment)
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


def _drain(check: Callable[[int], int], ids: list[int], deadline: float) -> None:
    """Poll ``ids`` until TE has finished each (or ``deadline``): after an error the
    caller's memory must not be written any more."""
    for batch in ids:
        while check(batch) in (0, -2) and time.perf_counter() < deadline:
            os.sched_yield()


def _call(fn: Callable[..., Any], *args: Any) -> BaseException | None:
    """``fn(*args)``; what it raised, instead of raising it (the transfers in flight
    are waited for first)."""
    try:
        fn(*args)
    except BaseException as exc:  # re-raised by the caller once TE is done with the memory
        return exc
    return None


def _check_args(host: str, metadata: str, timeout_s: float | None, protocol: str,
                devices: str | Sequence[str]) -> tuple[str, ...]:
    """Everything TE would misread or hang on, refused before it is imported; the
    device names to pass it."""
    if metadata != P2P and not metadata.startswith(_METADATA_SCHEMES):
        raise ConfigError(f"TE metadata must be {P2P!r} or a URL starting with one of "
                          f"{_METADATA_SCHEMES}, got {metadata!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
    device_names = check_protocol(protocol, devices)
    check_host(host)
    return device_names
