"""The two-node benchmark runs end to end at a tiny size and writes what the docs
and plots read. Checks shapes and sanity only: speed is never asserted in tests."""

import json
import math

import pytest

from tools.bench import BenchOptions
from tools.bench_cluster import run_transfer

pytestmark = [pytest.mark.timeout(180), pytest.mark.netns]

SYSTEMS = {"kvstore", "mooncake", "rawte"}
KEYS = {"GB/s", "p50 ms", "p99 ms", "blocks/s", "CPU s/GB", "runs"}


def test_transfer_quick_writes_json_rows_and_plots(tmp_path, monkeypatch):
    out = tmp_path / "results"
    monkeypatch.setenv("KVSTORE_BENCH_OUT", str(out))
    work = tmp_path / "work"
    work.mkdir()
    rows = run_transfer(BenchOptions(quick=True, workdir=work, repeat=1), {"small": [64]})

    doc = json.loads((out / "transfer.json").read_text())
    assert doc["nodes"] in ("netns", "loopback") and doc["quick"] is True
    prompts = [r for r in doc["rows"] if r["table"] == "prompts"]
    assert {r["system"] for r in prompts} == SYSTEMS
    assert {r["op"] for r in prompts} == {"put", "get", "put+get"}
    for r in prompts:
        assert KEYS <= r.keys(), r
        assert r["tokens"] == 64 and r["GB/s"] > 0 and r["p99 ms"] >= r["p50 ms"] > 0
    ratios = [r for r in rows if r["table"] == "ratios"]
    assert {r["op"] for r in ratios} == {"put", "get", "put+get"}
    assert all(r["kv/rawte"] > 0 and not math.isnan(r["kv/mooncake"]) for r in ratios)
    memory = [r for r in rows if r["table"].startswith("peak memory")]
    assert {(r["system"], r["process"]) for r in memory} >= {
        ("kvstore", "server"), ("mooncake", "master"), ("rawte", "consumer")}
    # quick runs plot next to the JSON, never over the committed docs/img
    assert (out / "img" / "transfer-small.png").stat().st_size > 1000
    assert (out / "img" / "transfer-ratios.png").exists()
