"""The benchmark runner and the single-node walk-through run end to end (real store,
real LMDB, real files). Only behaviour is checked here, never speed."""

from __future__ import annotations

import importlib
import json

import pytest

from tools import bench
from tools.bench import BenchOptions, Section


def test_every_section_target_resolves():
    for section in bench.SECTIONS:
        module, _, func = section.target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), section


def test_a_failing_section_is_reported_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "SECTIONS", [
        Section("boom", "tools.bench:_no_such_function", "fails"),
        Section("fine", "tests.unit.test_tools_bench:_rows", "works"),
    ])
    results = bench.run_sections(None, BenchOptions(workdir=tmp_path))
    assert "error" in results["boom"]
    assert [r["op"] for r in results["fine"]] == ["x", "y"]
    out = capsys.readouterr().out
    assert "section boom failed" in out and "ratio" in out
    assert list(tmp_path.iterdir()) == []  # per-section work dirs are removed


def _rows(opts: BenchOptions) -> list[dict]:
    return [{"table": "t", "op": "x", "ratio": 0.5, "GB/s": 12345.678},
            {"table": "t", "op": "y", "ratio": float("nan")}]


def test_unknown_section_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--only", "nope"])


def test_pick_follows_the_size_flags():
    assert BenchOptions(quick=True, full=True).pick(1, 2, 3) == 1
    assert BenchOptions(full=True).pick(1, 2, 3) == 3
    assert BenchOptions(full=True).pick(1, 2) == 2
    assert BenchOptions().pick(1, 2, 3) == 2


@pytest.mark.timeout(120)
def test_quick_hashing_section_writes_json(tmp_path):
    path = tmp_path / "out.json"
    assert bench.main(["--only", "hashing", "--quick", "--repeat", "1", "--dir", str(tmp_path),
                       "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    rows = doc["sections"]["hashing"]
    assert {r["input"] for r in rows if "input" in r} == {"list[int]", "numpy int64",
                                                          "torch int64"}
    assert all(r["best ms"] > 0 for r in rows if "best ms" in r)
    assert doc["machine"]["cpus"] >= 1


@pytest.mark.timeout(120)
def test_walkthrough_tells_the_whole_story(tmp_path, capsys):
    from tools import walkthrough

    data_dir = tmp_path / "data"
    assert walkthrough.main(["--tokens", "40", "--data-dir", str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert "NVMe entries survived the restart" in out
    assert "MISMATCH" not in out
    assert not data_dir.exists()  # removed unless --keep


def test_plots_are_drawn_from_bench_json(tmp_path):
    from tools.bench import plot as bench_plot

    doc = {"sections": {
        "dram": [{"table": "t", "op": "put", "entry KiB": 64.0, "store GB/s": 1.0,
                  "store/memcpy": 0.4}],
        "index": [{"entries": n, "acquire+release /s": 5e4, "reserve+commit /s": 2e3,
                   "lmdb txn /s": 3e3, "RSS B/entry": 550.0, "LMDB B/entry": 260.0,
                   "store/lmdb": 0.6} for n in (10, 100)],
        "broken": {"error": "x"}}}
    src = tmp_path / "run.json"
    src.write_text(json.dumps(doc))
    assert bench_plot.main([str(src), "--out", str(tmp_path / "img")]) == 0
    assert {p.name for p in (tmp_path / "img").iterdir()} == {"bench-ratios.png",
                                                              "bench-index.png"}
    assert [b[1] for b in bench_plot.ratio_bars(bench_plot.load([src]))] == [0.4, 0.6, 0.6]


def test_gpu_without_cuda_stops_at_once_with_a_clear_message(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    monkeypatch.setattr(bench, "run_sections", lambda *a: ran.append(a) or {})
    assert bench.main(["--gpu", "--only", "limits"]) == 2
    assert ran == []  # no section ran before the refusal
    assert "--gpu: needs a CUDA GPU" in capsys.readouterr().err
