"""The benchmark runner and the single-node walk-through run end to end (real store,
real LMDB, real files). Only behaviour is checked here, never speed."""

from __future__ import annotations

import importlib
import json
import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

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


# ------------------------------------------------------------ raw-TE patterns
def test_raw_pattern_names_parse_and_bad_ones_are_refused():
    from tools.bench.rawte import RawPattern

    assert RawPattern.parse("coalesced") == ("coalesced", 0)
    assert RawPattern.parse("per-block") == ("per-block", 0)
    assert RawPattern.parse("slices-8") == ("slices", 8)
    assert RawPattern.parse("threads-2") == ("threads", 2)
    for bad in ("slices", "slices-0", "coalesced-2", "per-block-4", "merged", ""):
        with pytest.raises(ValueError):
            RawPattern.parse(bad)


@given(nbytes=st.integers(1, 1 << 26), n=st.integers(1, 64),
       align=st.sampled_from([1, 512, 4096]))
def test_slices_cover_every_byte_once_in_at_most_n_aligned_pieces(nbytes, n, align):
    from tools.bench.rawte import slice_ranges

    offsets, lengths = slice_ranges(nbytes, n, align)
    assert 1 <= len(offsets) <= n and (lengths > 0).all()
    assert offsets[0] == 0 and (offsets[1:] == offsets[:-1] + lengths[:-1]).all()
    assert int(lengths.sum()) == nbytes
    assert (offsets % align == 0).all()
    if nbytes >= n * align:  # room for n aligned pieces: all n are used, near-equal
        assert len(offsets) == n and lengths.max() - lengths.min() <= 2 * align


def test_each_pattern_plans_the_ranges_it_names():
    from tools.bench.rawte import RawPattern, plan

    sizes = [65536] * 5 + [4096]  # a prompt with a short last block
    whole = plan(RawPattern.parse("coalesced"), sizes)  # Transport merges these into one
    per_block = plan(RawPattern.parse("per-block"), sizes)
    assert list(whole.lengths) == list(per_block.lengths) == sizes
    assert list(per_block.offsets) == [0, 65536, 131072, 196608, 262144, 327680]
    for name in ("slices-4", "threads-4"):
        ranges = plan(RawPattern.parse(name), sizes)
        assert len(ranges.lengths) == 4 and int(ranges.lengths.sum()) == sum(sizes)


def _prompt(system: str, op: str, gbps: float, tokens: int = 512) -> dict:
    return {"table": "prompts", "layout": "small", "tokens": tokens, "MiB": 2.0,
            "system": system, "op": op, "mode": "interleaved", "GB/s": gbps,
            "p50 ms": 2.0, "max ms": 3.0, "CPU s/GB": 1.0, "runs": 3}


def test_ratios_are_against_the_fastest_raw_pattern_and_name_it():
    from tools.bench.cluster_run import ratios

    rows = [_prompt("kvstore", "get", 0.6), _prompt("mooncake", "get", 0.5),
            _prompt("rawte-coalesced", "get", 0.8), _prompt("rawte-per-block", "get", 0.6),
            _prompt("rawte-slices-4", "get", 1.2),
            _prompt("kvstore", "put", 2.0), _prompt("rawte-coalesced", "put", 10.0),
            _prompt("rawte-slices-4", "put", 8.0)]
    by_op = {r["op"]: r for r in ratios(rows, ("layout", "tokens"))}
    assert by_op["get"]["rawte floor"] == "slices-4" and by_op["get"]["rawte GB/s"] == 1.2
    assert by_op["get"]["kv/rawte"] == pytest.approx(0.5)
    assert by_op["get"]["kv/mooncake"] == pytest.approx(1.2)  # Mooncake's ratio as before
    assert by_op["put"]["rawte floor"] == "coalesced"
    assert by_op["put"]["kv/rawte"] == pytest.approx(0.2)
    assert math.isnan(by_op["put"]["kv/mooncake"])  # no Mooncake row at that point
    assert all(r["table"] == "ratios" and r["tokens"] == 512 for r in by_op.values())


def test_the_docs_table_shows_every_pattern_and_the_one_that_won():
    from tools.bench.plots import markdown

    rows = [_prompt("kvstore", "get", 0.6), _prompt("mooncake", "get", 0.5),
            _prompt("rawte-coalesced", "get", 0.8), _prompt("rawte-slices-4", "get", 1.2),
            {"table": "peak memory", "system": "rawte", "process": "consumer"},
            {"table": "ratios", "layout": "small", "tokens": 512, "op": "get"}]
    head, rule, line = markdown(rows).splitlines()
    assert "raw TE GB/s: coalesced / slices-4" in head and "best raw TE" in head
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert len(cells) == len(rule.strip("|").split("|")) == 15
    assert cells[6:10] == ["0.80 / 1.20", "slices-4", "1.20", "0.50"]


def test_memory_rows_report_the_shared_raw_workers_once():
    from types import SimpleNamespace

    from tools.bench.cluster_procs import SystemProcs
    from tools.bench.cluster_run import memory_rows

    me = os.getpid()
    producer = SimpleNamespace(name="rawte-producer", pid=me)
    systems = {f"rawte-{p}": SystemProcs(f"rawte-{p}", producer, None,
                                         get_options={"pattern": p})
               for p in ("coalesced", "per-block")}
    rows = memory_rows(systems, "peak memory")
    assert [(r["system"], r["process"]) for r in rows] == [("rawte", "producer")]
    assert rows[0]["peak MiB"] > 0


# ------------------------------------------------------------ where results go
def _transfer_rows(systems: tuple[str, ...]) -> list[dict]:
    from tools.bench.cluster_run import ratios

    rows = [_prompt(s, op, 1.0) for s in systems for op in ("put", "get", "put+get")]
    return rows + ratios(rows, ("layout", "tokens"))


def _docs_img() -> dict[str, bytes]:
    from tools.bench.cluster_procs import REPO

    return {p.name: p.read_bytes() for p in sorted((REPO / "docs" / "img").glob("*"))}


@pytest.mark.parametrize("quick", [True, False])
def test_a_plain_run_writes_json_and_plots_in_its_results_dir_only(tmp_path, quick):
    from tools.bench.cluster import save

    before = _docs_img()
    rows = _transfer_rows(("kvstore", "mooncake", "rawte-coalesced"))
    save("transfer", rows, BenchOptions(quick=quick, out=tmp_path / "results"))
    assert {p.name for p in (tmp_path / "results").iterdir()} == {"transfer.json", "img"}
    assert {p.name for p in (tmp_path / "results" / "img").iterdir()} == {
        "transfer-small.png", "transfer-ratios.png"}
    assert _docs_img() == before  # the committed plots are left alone, normal size too


def test_plots_flag_copies_the_plots_where_it_says(tmp_path):
    from tools.bench.cluster import save

    rows = _transfer_rows(("kvstore", "rawte-coalesced", "rawte-slices-2"))
    docs = tmp_path / "docs" / "img"
    save("transfer", rows, BenchOptions(out=tmp_path / "results", plots=docs))
    drawn = {p.name: p.read_bytes() for p in (tmp_path / "results" / "img").iterdir()}
    assert {p.name: p.read_bytes() for p in docs.iterdir()} == drawn
    assert set(drawn) == {"transfer-small.png", "transfer-ratios.png"}


def test_out_and_plots_flags_reach_every_section(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run_sections", lambda names, opts: seen.append(opts) or {})
    assert bench.main(["--only", "limits", "--dir", str(tmp_path)]) == 0
    assert seen[-1].out is None and seen[-1].plots is None  # default: bench-results/, no docs
    assert bench.main(["--only", "limits", "--dir", str(tmp_path), "--out", str(tmp_path / "r"),
                       "--plots", str(tmp_path / "img")]) == 0
    assert seen[-1].out == tmp_path / "r" and seen[-1].plots == tmp_path / "img"
    assert bench._with_workdir(seen[-1], tmp_path / "w").plots == tmp_path / "img"


def test_replotting_from_json_defaults_to_the_results_dir(tmp_path):
    from tools.bench import plots as bench_plots

    before = _docs_img()
    rows = _transfer_rows(("kvstore", "rawte-coalesced"))
    (tmp_path / "transfer.json").write_text(json.dumps({"section": "transfer", "rows": rows}))
    assert bench_plots.main([str(tmp_path)]) == 0
    assert (tmp_path / "img" / "transfer-small.png").exists()
    assert _docs_img() == before


def test_the_pattern_sweep_names_the_winner_per_point_and_scores_each_pattern():
    from tools.bench.rawte_sweep import summarize

    rows = [_prompt("rawte-coalesced", "get", 1.0), _prompt("rawte-slices-2", "get", 2.0),
            _prompt("rawte-coalesced", "get", 1.0, tokens=4096),
            _prompt("rawte-slices-2", "get", 0.5, tokens=4096),
            _prompt("rawte-coalesced", "put", 9.0), _prompt("kvstore", "get", 5.0)]
    head, lines = summarize(rows)
    assert head == ["layout", "tokens", "coalesced", "slices-2", "won"]
    assert lines[0] == ["small", "512", "1.00", "2.00", "slices-2"]
    assert lines[1] == ["small", "4096", "1.00", "0.50", "coalesced"]
    assert lines[2] == ["geomean / best", "", "0.71", "0.71", ""]  # sqrt(0.5 * 1)


def test_writeback_section_rows_compare_both_modes_on_the_same_puts(tmp_path):
    from tools.bench.writeback import bench_writeback

    rows = bench_writeback(bench.BenchOptions(quick=True, workdir=tmp_path))
    assert [r["NVMe"].split(",")[0] for r in rows] == ["NVMe with room"] * 2 + \
        ["NVMe full (evicting)"] * 2
    for off, on in (rows[:2], rows[2:]):
        assert off["writeback"].startswith("off") and on["writeback"] == "on"
        assert off["copies written ahead"] == 0 and on["copies written ahead"] > 0
        # Off, every demotion is a put's; on, the thread demotes ahead of the high
        # watermark (quick: a prompt is more than the tier's distance from that mark
        # to high, so the puts still make theirs; tests/unit/test_store_writeback.py
        # has the case where they make none).
        assert off["demotions"] == off["demotions by the puts"] > 0 and on["demotions"] > 0
        assert off["median x off"] == 1.0 and on["median x off"] > 0
    room, full = rows[1], rows[2:]
    assert room["evictions"] == 0
    # A full NVMe tier evicts: off, on the puts; on, ahead of them, in the thread.
    assert full[0]["evictions"] == full[0]["evictions by the puts"] > 0
    assert full[1]["evictions"] > 0 and full[1]["evictions by the puts"] == 0


def test_store_ab_runs_two_checkouts_in_turn():
    """``tools.bench.store_ab`` against this very checkout: both workers store,
    acquire and release every entry (a worker that acquired fewer, or whose acquire
    did not come with its bytes, or whose put through a server stored fewer, stops
    the run)."""
    from pathlib import Path

    from tools.bench import store_ab

    root = Path(__file__).resolve().parents[2]
    for claim, server in ((False, False), (True, False), (True, True)):  # 3 workers a side
        # a get's acquire, a drop_select's, then a drop_select's through a real
        # server's handle (its bytes in the reply; the worker stops unless its
        # release leaves nothing stored)
        result = store_ab.run(root, entries=8, reps=3, claim=claim, server=server, procs=3)
        assert set(result) == {"base", "this"}
        for steps in result.values():
            want = store_ab.SERVER_STEPS if server else store_ab.STEPS
            assert list(steps) == list(want) and all(v > 0 for v in steps.values())


def _stamp_files(where, **by_pid):
    for pid, stamps in by_pid.items():
        (where / f"{pid[1:]}.txt").write_text(
            "".join(f"{tag} {1000 + ms / 1e3:.7f}\n" for tag, ms in stamps))


# pid 1: the consumer; pid 2: the server (a producer's put served first, then the
# acquire, then the one-way release); times in ms from 1000 s.
_CONSUMER = [("sel0", 0.0), ("key0", 0.01), ("key1", 0.06), ("ex0", 0.1),
             ("msg0", 0.12), ("msg1", 0.14),  # the last release's reply, stale
             ("msg0", 0.15), ("msg1", 0.9), ("rp0", 0.92), ("cp0", 0.95), ("cp1", 1.0),
             ("msg0", 1.0), ("msg1", 1.6), ("cp0", 1.61), ("cp1", 1.66), ("rp1", 1.67),
             ("ex1", 1.7), ("ex0", 1.72), ("ex1", 1.75), ("sel1", 1.8)]
_PUT = [("arr", -0.8), ("srv0", -0.79), ("rsp0", -0.78), ("rsp1", -0.5), ("snd0", -0.5),
        ("snd1", -0.45), ("srv1", -0.44)]
_ACQUIRE = [("arr", 0.3), ("srv0", 0.31), ("rsp0", 0.32), ("rsp1", 0.5), ("snd0", 0.51),
            ("snd1", 0.6), ("srv1", 0.61)]
_RELEASE = [("arr", 1.9), ("srv0", 1.91), ("rsp0", 1.92), ("rsp1", 2.0), ("snd0", 2.0),
            ("snd1", 2.01), ("srv1", 2.02)]


def test_the_timeline_splits_a_get_into_its_phases_across_processes(tmp_path):
    from tools.bench import timeline

    _stamp_files(tmp_path, p1=_CONSUMER, p2=_PUT + _ACQUIRE + _RELEASE)
    found = timeline.windows(timeline.load(tmp_path))
    assert found.missed == 0 and [g.parts for g in found.gets] == [2]
    got = timeline.phases(found.gets)
    want = {"client: keys and the request, until the acquire's call": 0.1,
            "request until the serving thread has it": 0.2,
            "server: queue, store lock, until the handling": 0.02,
            "server: decode, acquire, encode": 0.18,
            "reply (and first part): sent, in transit": 0.4,
            "the bytes after it, until the last is in": 0.7,
            "after the last byte: the last copy and checks": 0.1,
            "the release (one-way; none over the door) and the result": 0.1,
            "client: keys (hashing the tokens)": 0.05,
            "server: reply and bytes handed to the socket": 0.09,
            "drop_select": 1.8}
    assert set(got) == set(want)
    for name, ms in want.items():
        assert got[name] == (pytest.approx(ms, abs=1e-3), pytest.approx(ms, abs=1e-3)), name
    # the consecutive phases add up to the whole get
    assert sum(got[name][1] for name, _, _ in timeline.PHASES) == pytest.approx(1.8, abs=1e-3)
    # gets that began before ``since`` (a warm-up) are not counted at all
    assert timeline.windows(timeline.load(tmp_path), since=1000.5) == ([], 0)


def test_the_timeline_leaves_out_a_get_whose_acquire_the_server_did_not_stamp(tmp_path):
    from tools.bench import timeline

    # the release's serving, after the reply, is not taken for the acquire's
    _stamp_files(tmp_path, p1=_CONSUMER, p2=_PUT + _RELEASE)
    assert timeline.windows(timeline.load(tmp_path)) == ([], 1)


def test_the_timeline_takes_the_reply_not_a_stale_message_read_late(tmp_path):
    from tools.bench import timeline

    # the stale reply read after the server sent the acquire's reply, one part
    consumer = [("sel0", 0.0), ("ex0", 0.1), ("msg0", 0.12), ("msg1", 0.55),
                ("msg0", 0.56), ("msg1", 0.9), ("cp0", 0.95), ("cp1", 1.0), ("ex1", 1.01),
                ("ex0", 1.02), ("ex1", 1.05), ("sel1", 1.1)]
    _stamp_files(tmp_path, p1=consumer, p2=_ACQUIRE, p3=[("arr", 0.2), ("srv0", 0.21)])
    found = timeline.windows(timeline.load(tmp_path))
    assert found.missed == 0 and [g.parts for g in found.gets] == [1]
    get = found.gets[0].at
    assert get["reply"] == get["last part"] == pytest.approx(0.9)
    assert get["S:arr"] == pytest.approx(0.3)  # (p3 never sent a reply: not the server)


def test_the_timeline_ends_a_stream_doors_bytes_where_their_reading_ends(tmp_path):
    from tools.bench import timeline

    # over the stream door: the reply frame (msg), then the bytes after it (rp), read
    # in no message of their own
    consumer = [("sel0", 0.0), ("ex0", 0.1), ("msg0", 0.12), ("msg1", 0.8),
                ("rp0", 0.81), ("rp1", 1.5), ("ex1", 1.52), ("sel1", 1.7)]
    _stamp_files(tmp_path, p1=consumer, p2=_ACQUIRE)
    found = timeline.windows(timeline.load(tmp_path))
    assert found.missed == 0 and [g.parts for g in found.gets] == [1]
    get = found.gets[0].at
    assert get["reply"] == pytest.approx(0.8) and get["last part"] == pytest.approx(1.5)


def test_the_timeline_refuses_to_time_a_function_that_is_gone(tmp_path):
    import types

    from tools.bench import timeline

    module = types.ModuleType("kvstore.client.rpc")  # no Channel
    with pytest.raises(AttributeError):
        timeline.patch(module, timeline._Stamps(str(tmp_path)))
