"""tools/bench/parts.py runs on both data paths and reports every part; levers and prefault
time every variant; put_split times every part of every case, room_run both copies in
both cases, writeback_idle every case, wake_place both placements (no speeds
asserted)."""

import pytest

from tools.bench.parts import run

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("path", ["shm", "te", "inline"])
def test_bench_parts_reports_each_part_of_insert_and_get(path):
    result = run("small", 64, path, reps=2)
    for op in ("insert", "get"):
        parts = result[op]
        assert set(parts) == {"total", "keys", "move", "round trips", "server"}
        assert all(ms > 0 for ms in parts.values())
        assert parts["keys"] + parts["move"] + parts["round trips"] <= parts["total"]
        # the server's own time (its /metrics) is part of the round trips it answered
        assert parts["server"] < parts["round trips"]


def test_bench_levers_times_every_variant_and_moves_the_whole_prompt():
    from tools.bench.levers import GETS, PUTS
    from tools.bench.levers import run as levers

    result = levers("small", 64, reps=1)  # raises if a get came back short
    assert list(result["put"]) == list(PUTS) and list(result["get"]) == list(GETS)
    assert all(ms > 0 for op in result.values() for ms in op.values())


def test_bench_prefault_times_both_variants_on_fresh_pages():
    from tools.bench.prefault import VARIANTS
    from tools.bench.prefault import run as prefault

    result = prefault("small", 256, reps=3, arena=64 << 20)  # raises if a get came back short
    for op in ("insert", "get"):
        assert list(result[op]) == list(VARIANTS)
        assert all(len(ms) == 3 and min(ms) > 0 for ms in result[op].values())


def test_bench_put_split_times_every_part_of_both_cases():
    from tools.bench.put_split import CASES, PARTS
    from tools.bench.put_split import run as put_split

    result = put_split("small", 64, reps=2, idle_s=0.001)  # raises if an insert fell short
    assert list(result) == list(CASES)
    for parts in result.values():
        assert set(parts) == set(PARTS)
        assert all(len(ms) == 2 for ms in parts.values())
        for rep in range(2):
            keys, copy, put, insert = (parts[p][rep] for p in ("keys", "copy", "put", "insert"))
            assert min(keys, copy, put) > 0 and keys + copy + put <= insert


def test_bench_room_run_times_both_copies_in_both_cases():
    from tools.bench.room_run import CASES, VARIANTS
    from tools.bench.room_run import run as room_run

    from kvstore.client import shm

    if shm.SCATTER_RUN is None:
        pytest.skip("kvstore.client._ntcopy built without xxhash.h")
    one_call = shm.SCATTER_RUN
    # Raises if an insert fell short, or was not one put through the copy it names.
    result = room_run("small", 64, reps=2, idle_s=0.001)
    assert shm.SCATTER_RUN is one_call  # given back, whatever the rounds did
    assert list(result) == list(CASES)
    for times in result.values():
        assert list(times) == list(VARIANTS)
        assert all(len(ms) == 2 and min(ms) > 0 for ms in times.values())


def test_bench_writeback_idle_times_lookups_in_every_case():
    from tools.bench.writeback_idle import CASES
    from tools.bench.writeback_idle import run as writeback_idle

    result = writeback_idle(2000, 0.3)  # raises if the writeback copied nothing
    assert list(result) == list(CASES)
    assert all(0 < r["p50"] <= r["p99"] <= r["max"] for r in result.values())
    assert result["off"]["rounds"] == 0
    assert result["under lock"]["rounds"] > 0 and result["shipped"]["rounds"] > 0


def test_bench_wake_place_times_both_placements():
    import os

    from tools.bench.wake_place import MODES
    from tools.bench.wake_place import run as wake_place

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    before = os.sched_getaffinity(0)
    result = wake_place([1], reps=3, idle_s=0.001)  # every reply read whole, or it raises
    assert os.sched_getaffinity(0) == before  # the reader's placement given back
    assert list(result) == [1] and list(result[1]) == list(MODES)
    for head, whole in result[1].values():
        assert 0 < head <= whole
