"""A real kvstore-server's Prometheus endpoint, scraped over HTTP before and after
real client traffic (insert, lookup, drop_select through TE / the shared arena)."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import LAYOUT, free_port, make_kv

pytestmark = pytest.mark.timeout(120)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def op_count(samples: dict, op: str) -> float:
    return sum(v for (name, labels), v in samples.items()
               if name == "kvstore_request_duration_seconds_count" and ("op", op) in labels)


def test_metrics_move_with_traffic(server_factory, client_factory):
    mport = free_port()
    srv = server_factory(extra=("--metrics-port", str(mport)))
    before = scrape(mport)
    assert before[("kvstore_up", ())] == 1
    assert before[("kvstore_tier_capacity", (("tier", "dram"),))] == 4 << 20
    assert before[("kvstore_entries", ())] == 0
    assert before[("kvstore_bytes_in_total", ())] == 0

    client = client_factory(srv)
    tokens = list(range(1, 11))  # 2 full blocks + a partial one
    kv = make_kv(len(tokens), seed=3)
    assert client.insert(tokens, kv).new_blocks == 3
    after_insert = scrape(mport)
    assert after_insert[("kvstore_entries", ())] == 3
    assert after_insert[("kvstore_tier_entries", (("tier", "dram"),))] == 3
    assert after_insert[("kvstore_bytes_in_total", ())] == LAYOUT.nbytes(len(tokens))
    assert op_count(after_insert, "reserve") == 1 and op_count(after_insert, "commit") == 1

    assert client.lookup(tokens).matched_tokens == len(tokens)
    got = client.drop_select(tokens)
    assert got.matched_tokens == len(tokens)
    assert bytes(got.kv.numpy()) == kv.tobytes()
    assert client.drop_select(list(range(900, 908))).matched_tokens == 0  # a miss

    after = scrape(mport)
    assert after[("kvstore_entries", ())] == 0  # dropped after its one consumer
    assert after[("kvstore_hits_total", ())] > before[("kvstore_hits_total", ())]
    assert after[("kvstore_misses_total", ())] > before[("kvstore_misses_total", ())]
    assert after[("kvstore_bytes_out_total", ())] >= LAYOUT.nbytes(len(tokens))
    for op in ("lookup", "acquire", "release"):
        assert op_count(after, op) >= 1, op
    ok = after[("kvstore_op_requests_total",
                (("kind", "drop_select"), ("op", "acquire"), ("outcome", "ok")))]
    assert ok == 2
    assert after[("kvstore_request_duration_seconds_sum",
                  (("kind", "insert"), ("op", "reserve")))] > 0
    # The server's own request counter (from stats()) counts the scrape-independent ops.
    assert after[("kvstore_requests_total", ())] >= 6


def test_metrics_port_taken_refuses_to_start(server_factory):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        srv = server_factory(extra=("--metrics-port", str(port)), wait=False)
        code = srv.proc.wait(timeout=60)
    assert code != 0
    assert f"metrics port 127.0.0.1:{port} unavailable" in srv.log()


def test_client_side_te_transfer_histogram(server_factory, client_factory):
    """TE moves are one-sided, so only the client can time them: a client process
    exposes its own Metrics, fed through KVStoreClient(observer=...)."""
    from kvstore.server.metrics import Metrics

    srv = server_factory()
    metrics = Metrics()  # no stats_fn: a client has no store
    port = metrics.serve("127.0.0.1", 0)
    try:
        client = client_factory(srv, same_node=False, observer=metrics.observe)
        tokens = list(range(40, 52))
        kv = make_kv(len(tokens), seed=4)
        client.insert(tokens, kv)
        got = client.drop_select(tokens)
        assert bytes(got.kv.numpy()) == kv.tobytes()
        samples = scrape(port)
    finally:
        metrics.close()
    assert op_count(samples, "te_write") == 1 and op_count(samples, "te_read") == 1
    assert samples[("kvstore_request_duration_seconds_sum",
                    (("kind", "transfer"), ("op", "te_read")))] > 0
    assert ("kvstore_up", ()) not in samples


def test_hidden_key_probe_is_not_a_miss(server_factory, client_factory):
    """Every select appends the hidden-state key; a prompt stored without hidden state
    must not add a miss (nor its hidden entry a hit): hits and misses count blocks."""
    import torch

    mport = free_port()
    srv = server_factory(extra=("--metrics-port", str(mport)))
    client = client_factory(srv)
    plain, with_hidden = list(range(1, 11)), list(range(21, 31))  # 3 blocks each
    client.insert(plain, make_kv(len(plain), seed=1))
    client.insert(with_hidden, make_kv(len(with_hidden), seed=2), hidden=torch.ones(2, 4))
    before = scrape(mport)

    assert client.drop_select(plain).hidden is None
    assert client.get(with_hidden).hidden is not None
    assert client.drop_select(list(range(900, 908))).matched_tokens == 0  # 2 blocks missed

    after = scrape(mport)
    assert after[("kvstore_hits_total", ())] - before[("kvstore_hits_total", ())] == 6
    assert after[("kvstore_misses_total", ())] - before[("kvstore_misses_total", ())] == 2
    stats = client.stats()
    assert (stats["hits"], stats["misses"]) == (6, 2)


def _sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_transfer_and_end_to_end_histograms_move_with_traffic(server_factory, client_factory):
    """The client reports its TE moves with commit / release; the server exposes them
    and its own reserve->commit / acquire->release durations (a real scrape)."""
    mport = free_port()
    srv = server_factory(extra=("--metrics-port", str(mport)))
    before = scrape(mport)
    client = client_factory(srv)
    tokens = list(range(40, 52))  # 3 blocks
    kv = make_kv(len(tokens), seed=5)
    client.insert(tokens, kv)
    assert client.drop_select(tokens).matched_tokens == len(tokens)
    # drop_select's release is one-way: any reply on the same channel comes after it
    # is applied (the scrape is another channel).
    client.stats()
    after = scrape(mport)
    nbytes = LAYOUT.nbytes(len(tokens))
    for direction in ("write", "read"):
        count = "kvstore_transfer_duration_seconds_count"
        assert _sample(after, count, direction=direction) == \
            _sample(before, count, direction=direction) + 1, direction
        assert _sample(after, "kvstore_transfer_duration_seconds_sum", direction=direction) > 0
        assert _sample(after, "kvstore_transfer_bytes_total", direction=direction) == nbytes
    for kind in ("insert", "drop_select"):
        assert _sample(after, "kvstore_end_to_end_duration_seconds_count", kind=kind) == 1
        e2e = _sample(after, "kvstore_end_to_end_duration_seconds_sum", kind=kind)
        direction = "write" if kind == "insert" else "read"
        # The end-to-end span contains the client's transfer.
        assert e2e >= _sample(after, "kvstore_transfer_duration_seconds_sum",
                              direction=direction) > 0
    assert _sample(after, "kvstore_tier_bytes_in_total", tier="dram") == nbytes
    assert _sample(after, "kvstore_tier_bytes_out_total", tier="dram") == nbytes


def _collections(port: int) -> float:
    return sum(v for (name, _), v in scrape(port).items() if name == "python_gc_collections_total")


@pytest.mark.parametrize("young", [None, "0"], ids=["default", "python"])
def test_the_server_keeps_its_garbage_collector_off_the_request_path(
        server_factory, client_factory, young):
    """``server.gc_young`` (default 50 000, start-up frozen): the objects a 2 048-entry
    insert and drop_select make die before any collection (python_gc_* on /metrics).
    With Python's own settings (``--gc-young 0``; 700 on CPython 3.11, where this
    traffic sets off ~80) there are many."""
    mport = free_port()
    extra = ("--metrics-port", str(mport)) + (() if young is None else ("--gc-young", young))
    srv = server_factory(dram="64MiB", extra=extra)
    client = client_factory(srv)
    ntokens = 2048 * LAYOUT.block_tokens
    kv = make_kv(ntokens, seed=5)
    before = _collections(mport)
    for i in range(3):
        tokens = list(range(i * ntokens + 1, (i + 1) * ntokens + 1))
        assert client.insert(tokens, kv).new_blocks == 2048
        got = client.drop_select(tokens)
        assert got.matched_tokens == ntokens and bytes(got.kv.numpy()) == kv.tobytes()
    collected = _collections(mport) - before
    if young is None:
        assert collected <= 2, collected
    else:
        assert collected >= 10, collected
