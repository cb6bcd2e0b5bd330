"""Metrics without a server: the collector reads stats() at scrape time, observe()
fills histograms, the HTTP endpoint serves both and stops cleanly."""

import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.core.errors import ConfigError
from kvstore.server.metrics import MAX_OPS, Metrics, flatten_stats


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


class FakeStore:
    """Stands in for Store.stats(): a dict that changes between scrapes."""

    def __init__(self):
        self.hits = 0

    def stats(self):
        return {"tiers": {"dram": {"capacity": 1000, "used": 100 + self.hits, "entries": 2,
                                   "hits": self.hits},
                          "nvme": {"capacity": 5000, "used": 0, "entries": 0, "hits": 0}},
                "hits": self.hits, "misses": 3, "leases": 1, "node": "n1", "flag": True}


def test_collector_reads_stats_at_scrape_time():
    store = FakeStore()
    m = Metrics(store.stats)
    first = samples(m)
    assert first[("kvstore_hits_total", ())] == 0
    assert first[("kvstore_tier_capacity", (("tier", "dram"),))] == 1000
    assert first[("kvstore_leases", ())] == 1
    assert first[("kvstore_up", ())] == 1
    store.hits = 7
    second = samples(m)
    assert second[("kvstore_hits_total", ())] == 7
    assert second[("kvstore_tier_used", (("tier", "dram"),))] == 107
    assert second[("kvstore_tier_hits_total", (("tier", "dram"),))] == 7
    # strings and booleans are not numbers to export
    assert not any(name.startswith(("kvstore_node", "kvstore_flag")) for name, _ in second)


def test_failing_stats_reports_down_instead_of_raising():
    def broken():
        raise RuntimeError("store closed")

    assert samples(Metrics(broken))[("kvstore_up", ())] == 0


def test_flatten_nested_sections():
    rows = list(flatten_stats({"reservations": {"open": 2, "bytes": 10}, "x": 1.5}))
    assert ("reservations_open", {}, 2.0) in rows and ("x", {}, 1.5) in rows


def test_observe_fills_histogram_and_counter():
    m = Metrics()
    m.observe("reserve", 0.002, True)
    m.observe("reserve", 0.004, True)
    m.observe("acquire", 0.001, False)
    s = samples(m)
    reserve = (("kind", "insert"), ("op", "reserve"))
    assert s[("kvstore_request_duration_seconds_count", reserve)] == 2
    assert s[("kvstore_request_duration_seconds_sum", reserve)] == pytest.approx(0.006)
    assert s[("kvstore_op_requests_total", reserve + (("outcome", "ok"),))] == 2
    acquire = (("kind", "drop_select"), ("op", "acquire"), ("outcome", "error"))
    assert s[("kvstore_op_requests_total", acquire)] == 1


def test_op_labels_stay_bounded():
    m = Metrics()
    for i in range(MAX_OPS * 2):
        m.observe(f"op{i}", 0.001, False)
    m.observe("Bad Op!", 0.001, False)
    m.observe(["not", "a", "str"], 0.001, False)  # type: ignore[arg-type]
    ops = {dict(labels).get("op") for name, labels in samples(m)
           if name == "kvstore_op_requests_total"}
    assert len(ops) <= MAX_OPS + 1 and "unknown" in ops and "Bad Op!" not in ops


@pytest.mark.timeout(30)
def test_http_endpoint_serves_and_closes():
    store = FakeStore()
    m = Metrics(store.stats)
    port = m.serve("127.0.0.1", 0)
    try:
        m.observe("lookup", 0.01, True)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        text = body.decode()
        assert 'kvstore_tier_capacity{tier="dram"} 1000.0' in text
        assert 'kvstore_request_duration_seconds_count{kind="lookup",op="lookup"} 1.0' in text
        with pytest.raises(ConfigError):
            m.serve("127.0.0.1", 0)
    finally:
        m.close()
    m.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_port_in_use_is_a_config_error():
    a, b = Metrics(), Metrics()
    port = a.serve("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match="unavailable"):
            b.serve("127.0.0.1", port)
    finally:
        a.close()


def test_server_counters_do_not_clash_with_own_families():
    # kvstore-server adds "requests"/"errors" to the store's stats.
    m = Metrics(lambda: {"requests": 5, "errors": 1, "up": 7, "uptime_s": 3.0})
    m.observe("stats", 0.001, True)
    text = generate_latest(m.registry).decode()
    names = [fam.name for fam in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))
    s = samples(m)
    assert s[("kvstore_requests_total", ())] == 5 and s[("kvstore_up", ())] == 1
    assert s[("kvstore_uptime_s", ())] == 3.0
