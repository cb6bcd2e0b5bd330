"""Prometheus metrics of one kvstore-server.

Two sources, one registry per ``Metrics`` (never the process-global one, so two
servers in one process - tests - do not collide):

* The store's own counters and gauges are *not* copied into prometheus objects.
  ``StoreCollector`` calls ``stats_fn()`` (the server passes ``store.stats``) at scrape
  time and turns every number in that dict into a sample, so ``kvstore stats`` and a
  scrape can never disagree and nothing has to be kept in sync.
* The server's request loop also hands each successful request and its result to
  ``on_result`` (kvstore/server/transfer_metrics.py): client-reported transfer times and
  bytes, and the server-side reserve->commit / acquire->release durations.
* Request latencies are observed by the server's request loop through the hook
  ``observe(op, seconds, ok)``: ``op`` is the wire op (``reserve``, ``commit``,
  ``acquire``, ``release``, ``lookup``, ...). A client process may own a ``Metrics``
  with no ``stats_fn`` and observe its Transfer Engine moves as ``te_write`` /
  ``te_read``; the server never sees those (TE is one-sided).

What each histogram measures is written out in docs/operations.md ("Reading the
metrics").
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from kvstore.core.errors import ConfigError
from kvstore.server.transfer_metrics import TransferMetrics

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger(__name__)

PREFIX = "kvstore"
# Control-plane ops take ~50 us .. ~100 ms; TE moves of many MiB take up to seconds.
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Which logical operation each wire op belongs to (the ``kind`` label), so a
# dashboard can sum reserve+commit into "insert" and acquire+release into "drop_select".
OP_KINDS = {
    "reserve": "insert", "commit": "insert", "put": "insert", "abort": "insert",
    "acquire": "drop_select", "release": "drop_select",
    "lookup": "lookup",
    "te_write": "transfer", "te_read": "transfer", "inline_read": "transfer",
}

# Store stats keys that only ever grow; every other number is exported as a gauge.
# (Store.stats() plus the server's request counters; a new counter the store adds
# shows up as a gauge until it is listed here - still correct values, wrong TYPE.)
COUNTER_KEYS = frozenset({
    "hits", "misses", "bytes_in", "bytes_out", "evictions", "demotions", "promotions",
    "stagings", "checksum_failures", "commit_checksum_failures", "collisions", "commits",
    "aborts", "dropped", "reservations_expired", "rooms_expired", "leases_expired", "requests",
    "errors", "storage_errors", "staging_shortfalls", "staging_spent", "transfer_checksum_failures",
    "unchecked_checksum_failures", "writebacks", "busy", "local_requests", "stream_requests",
    "late_writes", "late_reads", "inline_replies", "inline_bytes", "inline_views",
})
# Names this module's own metrics use; a stats key of the same name is skipped so
# one exposition never carries two families of one name.
OWN_FAMILIES = frozenset({"up", "request_duration_seconds", "after_reply_seconds",
                          "op_requests", "transfer_duration_seconds", "transfer_bytes",
                          "end_to_end_duration_seconds"})


# A client can put any string in ``op``; label values must stay a small set.
MAX_OPS = 64
_OP_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def op_kind(op: str) -> str:
    return OP_KINDS.get(op, "admin")


class StoreCollector(Collector):
    """Every number of ``stats_fn()`` as a sample, read at scrape time.

    Shape handled (what ``Store.stats()`` returns): top-level numbers become
    ``kvstore_<name>``; a ``tiers`` mapping of ``{tier: {name: number}}`` becomes
    ``kvstore_tier_<name>{tier="..."}``; other nested mappings become
    ``kvstore_<parent>_<name>``. Booleans and strings are skipped.
    """

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]]) -> None:
        self._stats_fn = stats_fn

    def describe(self) -> list[Metric]:
        # Families depend on what stats() returns; empty describe() keeps the
        # registry from calling collect() at registration time.
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats_fn()
        except Exception:  # noqa: BLE001 - a scrape must not kill the server
            log.exception("stats() failed during a metrics scrape")
            yield GaugeMetricFamily(f"{PREFIX}_up", "1 if the store answered stats()", 0)
            return
        yield GaugeMetricFamily(f"{PREFIX}_up", "1 if the store answered stats()", 1)
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for name, labels, value in flatten_stats(stats):
            if name in OWN_FAMILIES:
                continue
            family = families.get(name)
            if family is None:
                family = _family(name, sorted(labels))
                families[name] = family
            family.add_metric([labels[k] for k in sorted(labels)], value)
        yield from families.values()


def flatten_stats(stats: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(metric base name, labels, value)`` for every number in a stats dict."""
    for key, value in stats.items():
        if key == "tiers" and isinstance(value, Mapping):
            for tier, tier_stats in value.items():
                if isinstance(tier_stats, Mapping):
                    for name, number in _numbers(tier_stats):
                        yield f"tier_{name}", {"tier": str(tier)}, number
        elif isinstance(value, Mapping):
            for name, number in _numbers(value):
                yield f"{key}_{name}", {}, number
        elif _is_number(value):
            yield key, {}, float(value)


def _numbers(mapping: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    for name, value in mapping.items():
        if _is_number(value):
            yield str(name), float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def _family(name: str, label_names: list[str]) -> CounterMetricFamily | GaugeMetricFamily:
    name = _BAD_CHARS.sub("_", name)
    leaf = name.removeprefix("tier_")
    if leaf in COUNTER_KEYS:
        return CounterMetricFamily(f"{PREFIX}_{name}", f"store counter {name}",
                                   labels=label_names)
    return GaugeMetricFamily(f"{PREFIX}_{name}", f"store gauge {name}", labels=label_names)


class Metrics:
    """A server's (or client's) metrics: the store collector plus request histograms.

    ``observe`` is thread-safe (prometheus_client locks per child) and cheap: one
    histogram observation and one counter increment.
    """

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        if stats_fn is not None:
            self.registry.register(StoreCollector(stats_fn))
        # python_gc_*: this process's garbage collections by generation (server.gc_young)
        GCCollector(registry=self.registry)
        self._latency = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Time the server spent handling one control-plane request, by wire op "
            "(te_write/te_read: a client's Transfer Engine move)",
            ["op", "kind"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self._after = Histogram(
            f"{PREFIX}_after_reply_seconds",
            "In-memory book-keeping the server did after answering a commit or put "
            "(store.answer_first), before serving its next request", ["op"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self._requests = Counter(
            f"{PREFIX}_op_requests", "Requests handled, by wire op and outcome",
            ["op", "kind", "outcome"], registry=self.registry)
        # Client-reported transfers and reserve->commit / acquire->release timings.
        self._sessions = TransferMetrics(self.registry)
        self.on_result = self._sessions.on_result
        self._ops: set[str] = set(OP_KINDS)
        self._ops_lock = threading.Lock()
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def observe(self, op: str, seconds: float, ok: bool) -> None:
        """Record one request of ``op`` that took ``seconds``; ``ok`` False if it failed."""
        op = self._bounded(op)
        kind = op_kind(op)
        self._latency.labels(op, kind).observe(max(0.0, seconds))
        self._requests.labels(op, kind, "ok" if ok else "error").inc()

    def observe_after(self, op: str, seconds: float) -> None:
        """Record ``seconds`` of book-keeping done after answering an ``op`` request."""
        self._after.labels(self._bounded(op)).observe(max(0.0, seconds))

    def _bounded(self, op: str) -> str:
        if not isinstance(op, str):
            return "unknown"
        if op in self._ops:
            return op
        if not _OP_RE.match(op) or len(self._ops) >= MAX_OPS:
            return "unknown"
        with self._ops_lock:
            self._ops.add(op)
        return op

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` in a daemon thread; returns the port.

        ``port`` 0 in the config means "off": the server does not call this then.
        """
        if self._http is not None:
            raise ConfigError("metrics endpoint already started")
        try:
            self._http, self._thread = start_http_server(port, addr=host,
                                                         registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"metrics port {host}:{port} unavailable: {exc}") from exc
        bound = self._http.server_port
        log.info("metrics on http://%s:%s/metrics", host, bound)
        return bound

    @property
    def port(self) -> int | None:
        return None if self._http is None else self._http.server_port

    def close(self) -> None:
        """Stop the HTTP endpoint (idempotent); in-flight scrapes finish first."""
        if self._http is None:
            return
        self._http.shutdown()
        self._http.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._http = self._thread = None
