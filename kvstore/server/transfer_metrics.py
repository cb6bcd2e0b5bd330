"""Server-side timings of whole inserts and drop_selects, and of the client's data moves.

Transfer Engine moves are one-sided: the client writes into (or reads from) the
server's memory and the server's CPU never sees them. So the client reports what it
measured with the op that ends the move (``xfer_s`` / ``xfer_bytes`` on ``commit``
and ``release``, see docs/protocol.md) and ``TransferMetrics`` turns those into:

* ``kvstore_transfer_duration_seconds{direction}``: the client's data move (TE, or
  memcpy through the shared arena for a same-node client), ``write`` for inserts,
  ``read`` for selects (for a lease the server ends itself once its reply's bytes
  are out over the stream door, ``Acquire.release_sent``, no release comes: the
  server's own send, from the reply made to the last byte in its kernel);
* ``kvstore_transfer_bytes_total{direction}``: the bytes those moves carried;
* ``kvstore_end_to_end_duration_seconds{kind}``: from the server answering
  ``reserve`` to it receiving the matching ``commit`` (``kind="insert"``), and from
  ``acquire`` to ``release`` (``kind="drop_select"``; a plain ``get`` too): what
  the server sees of one whole operation, the client's transfer and checksums
  included, the client's hashing before the first message not (for a lease ended
  once sent: to the last byte in the server's socket).

``on_result`` is called by the server after each successful op: by its request
thread, and for an acquire that staged NVMe entries by its staging thread; the
open-op maps are touched only there, under one lock. They are bounded: a
reservation or lease that expires without commit/release is forgotten once
``MAX_OPEN`` newer ones have been opened.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvstore.core import protocol as p
PREFIX = "kvstore"
MAX_OPEN = 1 << 16
# A small insert's whole round trip is ~1 ms; a large TE move takes seconds.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._xfer = Histogram(
            f"{PREFIX}_transfer_duration_seconds",
            "Client-measured data move of one insert (write) or select (read), reported "
            "with commit / release (a read whose lease the server ended once sent over "
            "the stream door: the server's send)", ["direction"], buckets=BUCKETS,
            registry=registry)
        self._xfer_bytes = Counter(
            f"{PREFIX}_transfer_bytes", "Bytes clients reported moving, by direction",
            ["direction"], registry=registry)
        self._e2e = Histogram(
            f"{PREFIX}_end_to_end_duration_seconds",
            "Server-side time from reserve to commit (insert) or acquire to release "
            "(drop_select), the client's transfer included", ["kind"], buckets=BUCKETS,
            registry=registry)
        self._open: dict[str, collections.OrderedDict[int, float]] = {
            "insert": collections.OrderedDict(), "drop_select": collections.OrderedDict()}
        self._lock = threading.Lock()

    def on_result(self, req: p.Request, result: dict[str, Any]) -> None:
        """Account one successful request (the server calls this after replying)."""
        with self._lock:
            self._account(req, result, time.monotonic())

    def _account(self, req: p.Request, result: dict[str, Any], now: float) -> None:
        if isinstance(req, p.Reserve):
            self._begin("insert", result.get("rid"), now)
        elif isinstance(req, p.Acquire):
            self._begin("drop_select", result.get("aid"), now)  # aid 0: nothing leased
        elif isinstance(req, p.Commit):
            self._end("insert", req.rid, now)
            self._transfer("write", req.xfer_s, req.xfer_bytes)
        elif isinstance(req, p.Put):  # one step: no reserve-to-commit time to measure
            self._transfer("write", req.xfer_s, req.xfer_bytes)
        elif isinstance(req, p.Release):
            self._end("drop_select", req.aid, now)
            self._transfer("read", req.xfer_s, req.xfer_bytes)
        elif isinstance(req, p.Abort):
            self._open["insert"].pop(req.rid, None)

    def _begin(self, kind: str, ident: Any, now: float) -> None:
        if not ident:
            return
        pending = self._open[kind]
        pending[ident] = now
        while len(pending) > MAX_OPEN:
            pending.popitem(last=False)

    def _end(self, kind: str, ident: int, now: float) -> None:
        started = self._open[kind].pop(ident, None)
        if started is not None:
            self._e2e.labels(kind).observe(now - started)

    def _transfer(self, direction: str, seconds: float | None, nbytes: int | None) -> None:
        if seconds is not None:
            self._xfer.labels(direction).observe(seconds)
        if nbytes is not None:
            self._xfer_bytes.labels(direction).inc(nbytes)
