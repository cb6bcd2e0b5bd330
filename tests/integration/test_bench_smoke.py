"""The two-node benchmark runs end to end at a tiny size and writes what the docs
and plots read. Checks shapes and sanity only: speed is never asserted in tests."""

import json
import math

import pytest

from tools.bench import BenchOptions
from tools.bench.cluster import bench_entries, bench_limits, run_transfer
from tools.bench.profile import profile

pytestmark = [pytest.mark.timeout(180), pytest.mark.netns]

SYSTEMS = {"kvstore", "mooncake", "rawte-coalesced"}  # raw TE's default: one pattern
KEYS = {"GB/s", "p50 ms", "p99 ms", "max ms", "blocks/s", "CPU s/GB", "runs"}
# every kind of raw-TE pattern (tools/bench/rawte.py), and the TE entries each moves
# a 64-token small-layout prompt in (4 blocks of 64 KiB, back to back)
PATTERNS = {"coalesced": 1, "per-block": 4, "slices-4": 4, "threads-2": 2}


def _docs_img() -> dict[str, bytes]:
    from tools.bench.cluster_procs import REPO

    return {p.name: p.read_bytes() for p in (REPO / "docs" / "img").glob("*")}


def test_transfer_quick_writes_json_rows_and_plots(tmp_path, monkeypatch):
    out = tmp_path / "results"
    monkeypatch.setenv("KVSTORE_BENCH_OUT", str(out))
    work = tmp_path / "work"
    work.mkdir()
    docs_before = _docs_img()
    rows = run_transfer(BenchOptions(quick=True, workdir=work, repeat=1), {"small": [64]},
                        raw_patterns=tuple(PATTERNS))

    doc = json.loads((out / "transfer.json").read_text())
    assert doc["nodes"] in ("netns", "loopback") and doc["quick"] is True
    assert doc["raw_patterns"] == list(PATTERNS)
    prompts = [r for r in doc["rows"] if r["table"] == "prompts"]
    raw = {f"rawte-{p}" for p in PATTERNS}
    assert {r["system"] for r in prompts} == {"kvstore", "mooncake", *raw}
    assert {r["op"] for r in prompts} == {"put", "get", "put+get"}
    for r in prompts:
        assert KEYS <= r.keys(), r
        assert r["tokens"] == 64 and r["GB/s"] > 0 and r["max ms"] >= r["p50 ms"] > 0
        assert r["p99 ms"] is None  # a handful of runs: no honest p99, only the max
        assert r["runs"] == 3  # every pattern ran every prompt (quick: 3, cluster_run.reps)
    # kvstore's gets say where their time went: the acquire's round trip, the move
    get = next(r for r in prompts if r["system"] == "kvstore" and r["op"] == "get")
    assert 0 < get["acquire ms"] <= get["max ms"] and 0 < get["move ms"] <= get["max ms"]
    assert not any("acquire ms" in r for r in prompts if r is not get)
    # each pattern moved the prompt as it says (the bytes were checked by the consumer)
    assert {r["system"]: r["TE transfers"] for r in prompts if r["op"] == "get"
            and r["system"] in raw} == {f"rawte-{p}": n for p, n in PATTERNS.items()}
    ratios = [r for r in rows if r["table"] == "ratios"]
    assert {r["op"] for r in ratios} == {"put", "get", "put+get"}
    for r in ratios:  # against the fastest pattern at that point, named
        assert r["kv/rawte"] > 0 and not math.isnan(r["kv/mooncake"])
        assert r["rawte floor"] in PATTERNS
        assert r["rawte GB/s"] == max(p["GB/s"] for p in prompts
                                      if p["op"] == r["op"] and p["system"] in raw)
    memory = [r for r in rows if r["table"].startswith("peak memory")]
    assert {(r["system"], r["process"]) for r in memory} >= {
        ("kvstore", "server"), ("kvstore", "server-b"), ("mooncake", "master"),
        ("rawte", "consumer")}
    assert len([r for r in memory if r["system"] == "rawte"]) == 2  # one pair, all patterns
    # a run plots next to its JSON, never over the committed docs/img
    assert (out / "img" / "transfer-small.png").stat().st_size > 1000
    assert (out / "img" / "transfer-ratios.png").exists()
    assert _docs_img() == docs_before


def test_limits_quick_measures_memcpy_and_file_io(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_BENCH_OUT", str(tmp_path / "results"))
    rows = bench_limits(BenchOptions(quick=True, workdir=tmp_path, repeat=1))
    assert [r["op"] for r in rows] == ["memcpy (numpy copyto)", "file write + fsync",
                                       "file read, cold"]
    assert all(r["MiB"] == 64 and r["GB/s"] >= r["median GB/s"] > 0 for r in rows)
    doc = json.loads((tmp_path / "results" / "limits.json").read_text())
    assert doc["section"] == "limits" and len(doc["rows"]) == 3


def test_entries_quick_measures_at_each_level_of_entries_held(tmp_path, monkeypatch):
    out = tmp_path / "results"
    monkeypatch.setenv("KVSTORE_BENCH_OUT", str(out))
    work = tmp_path / "work"
    work.mkdir()
    rows = bench_entries(BenchOptions(quick=True, workdir=work, repeat=1))

    entries = [r for r in rows if r["table"] == "entries"]
    assert {(r["entries"], r["system"], r["op"]) for r in entries} == {
        (n, s, op) for n in (0, 1024) for s in SYSTEMS for op in ("put", "get")}
    assert all(r["runs"] == 3 and r["GB/s"] > 0 and r["store RSS MiB"] > 0 for r in entries)
    fills = [r for r in rows if r["table"] == "fill"]
    assert {(r["system"], r["entries"]) for r in fills} == {("kvstore", 1024),
                                                            ("mooncake", 1024)}
    assert {r["entries"] for r in rows if r["table"] == "ratios"} == {0, 1024}
    assert json.loads((out / "entries.json").read_text())["tokens"] == 512
    assert (out / "img" / "entries.png").stat().st_size > 1000


def test_profile_writes_the_workers_profiles(tmp_path, capsys):
    profile("small", 64, 2, tmp_path)
    for worker in ("kvstore-producer", "kvstore-consumer", "rawte-consumer"):
        assert (tmp_path / f"{worker}.txt").stat().st_size > 0
        assert (tmp_path / f"{worker}.html").exists()
    text = (tmp_path / "kvstore-consumer.txt").read_text()
    assert "Samples:" in text and "cluster_worker.py" in text  # pyinstrument's report
    # py-spy on the server needs ptrace, and a server busy at some sample (tiny
    # prompts may give none): either its report or the tool says why there is none
    spy = tmp_path / "kvstore-server.pyspy.txt"
    said = capsys.readouterr().out
    assert (spy.exists() and spy.stat().st_size > 0) or "py-spy on the server failed" in said \
        or "py-spy caught the server busy in none" in said
    assert (tmp_path / "py-spy.log").exists()


def test_rtt_times_both_doors():
    from tools.bench import rtt

    out = rtt.run(calls=20, gaps=[0.0, 0.001])
    assert set(out) == {0.0, 0.001}
    for doors in out.values():
        assert set(doors) == {"router", "local"}
        assert all(0 < ms < 1000 for ms in doors.values()), doors


def test_inline_times_both_reads_of_the_same_prompts():
    from tools.bench import inline

    kind, rows = inline.run([64, 4096], reps=2, layout="small", part=64 << 10)
    assert kind in ("netns", "loopback")
    assert [r["tokens"] for r in rows] == [64, 4096]
    for r in rows:
        assert r["te"] > 0 and r["inline"] > 0 and r["parts"] > 0
    # 0.25 MiB and 16 MiB went in the replies of both inline consumers every round
    # (warm-ups too: 4 rounds), within the server's default limit (4 GiB).
    assert [r["inline_replies"] for r in rows] == [8, 8]


def test_verify_cost_times_both_reads_and_the_hash():
    from tools.bench import verify_cost

    res = verify_cost.run("small", 256, reps=2)
    assert set(res) == {"verified", "as landed", "unverified", "verified after",
                        "low priority", "hash alone"}
    assert all(len(v) == 2 and all(ms > 0 for ms in v) for v in res.values()), res


@pytest.mark.parametrize("door", [True, False], ids=["stream door", "ZeroMQ port"])
def test_timeline_stamps_the_consumer_and_the_server_of_every_get(tmp_path, monkeypatch, door):
    from tools.bench import timeline

    monkeypatch.setenv("KVSTORE_CLIENT_STREAM_SOCKET", str(door).lower())  # (the workers')
    res = timeline.run("small", 512, reps=3, raw=False, out=tmp_path)
    # 2 MiB in 64 KiB blocks: after the reply over the stream door (the default), in
    # the reply in parts of 512 KiB over the ZeroMQ port
    assert (res["gets"], res["left out"], res["parts"]) == (3, 0, 1 if door else 4)
    phases = res["phases ms"]
    # (no release over the stream door: the server ends the lease once it has sent)
    assert list(phases) == [name for name, start, _ in (*timeline.PHASES, *timeline.INSIDE,
                                                        timeline.TOTAL)
                            if not (door and start == "C:ows0")]
    assert all(median >= 0 and mean >= 0 for median, mean in phases.values()), res
    # every get cut into consecutive phases: their means add up to the mean get
    assert sum(phases[name][1] for name, _, _ in timeline.PHASES) == \
        pytest.approx(phases["drop_select"][1])
    assert json.loads((tmp_path / "timeline.json").read_text())["gets"] == 3
    assert len(list(tmp_path.glob("stamps-*.txt"))) >= 2  # the consumer's, the server's
