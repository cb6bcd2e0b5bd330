"""The ``connector`` bench section (tools/bench/connector.py) at its smallest size.

Six real engines on a 2-layer model and one 96-token prompt: the rows are
well-formed, every table is there, and the tokens the decode engines produce from
loaded KV (kvstore's and vLLM's example connector's) are the plain engine's. No
timing is asserted: speeds are only reported by ``make bench``.
"""

from __future__ import annotations

import math

import pytest

from tools.bench.connector import EXPOSED, ITL, TTFT, Workload, run

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SYSTEMS = {"recompute", "kvstore", "example"}


def test_connector_section_smallest(tmp_path):
    rows = run(Workload(lengths=(96,), repeat=1, itl_tokens=4, layers=2), tmp_path)

    by_table: dict[str, list[dict]] = {}
    for row in rows:
        by_table.setdefault(row["table"], []).append(row)
    assert set(by_table) == {TTFT, EXPOSED, ITL}
    assert {r["system"] for r in by_table[TTFT]} == SYSTEMS
    assert {r["system"] for r in by_table[ITL]} == SYSTEMS
    assert [r["tokens"] for r in by_table[EXPOSED]] == [96]

    signed = {"exposed_s", "exposed_share", "whole_exposed_s", "whole_share"}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value) and (value >= 0 or key in signed), (key, row)
    for row in [*by_table[TTFT], *by_table[ITL]]:
        assert row["tokens_match"] is True, row
    # The decode engines loaded the prompt's full blocks rather than recomputing them.
    for row in by_table[TTFT]:
        if row["system"] != "recompute":
            assert row["loaded_tokens"] >= 96 // 32 * 32 - 32, row
    # Asked at once, the decode waited for each producer's save and loaded all of it.
    for row in by_table[EXPOSED]:
        assert row["at_once_loaded"] == row["whole_loaded"] == 95, row
    assert not list(tmp_path.glob("bench-connector-*")), "the run left its work dir"
