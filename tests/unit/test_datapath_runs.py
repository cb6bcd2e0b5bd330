"""kvstore.client.datapath._runs: copies contiguous on both sides merge into one run."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvstore.client.datapath import _runs


def test_back_to_back_entries_are_one_copy():
    assert _runs([0, 10, 20], [100, 110, 120], [10, 10, 10]) == [(0, 100, 30)]


def test_a_gap_on_either_side_splits_the_run():
    assert _runs([0, 10, 20, 40], [100, 110, 120, 130], [10, 10, 10, 5]) == [
        (0, 100, 30), (40, 130, 5)]
    assert _runs([0, 10], [0, 4106], [10, 10]) == [(0, 0, 10), (10, 4106, 10)]


@given(st.lists(st.tuples(st.integers(1, 50), st.integers(0, 3), st.integers(0, 3)),
                min_size=1, max_size=30))
def test_runs_copy_exactly_what_per_entry_copies_would(items):
    dst, src, sizes, d, s = [], [], [], 0, 0
    for n, dgap, sgap in items:
        d, s = d + dgap, s + sgap
        dst.append(d)
        src.append(s)
        sizes.append(n)
        d, s = d + n, s + n
    source = np.random.default_rng(0).integers(0, 256, s + 1, dtype=np.uint8)
    want, got = np.zeros(d + 1, np.uint8), np.zeros(d + 1, np.uint8)
    for a, b, n in zip(dst, src, sizes):
        want[a:a + n] = source[b:b + n]
    for a, b, n in _runs(dst, src, sizes):
        got[a:a + n] = source[b:b + n]
    assert np.array_equal(want, got)
