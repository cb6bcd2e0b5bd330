"""tools/bench/parts.py runs on both data paths and reports every part (no speeds asserted)."""

import pytest

from tools.bench.parts import run

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("path", ["shm", "te"])
def test_bench_parts_reports_each_part_of_insert_and_get(path):
    result = run("small", 64, path, reps=2)
    for op in ("insert", "get"):
        assert set(result[op]) == {"total", "move", "round trips"}
        assert all(ms > 0 for ms in result[op].values())
        assert result[op]["move"] + result[op]["round trips"] <= result[op]["total"]
