"""kvstore.client.checks: landed entries hashed by a nice-19 thread or by the reader,
each once; the first corrupt one reported; a cancelled read claims nothing more."""

from __future__ import annotations

import threading
import time

import numpy as np

from kvstore.client import checks
from kvstore.client.checks import LandedChecks, use_background
from kvstore.core.hashing import checksum

ENTRY = 256 << 10


def _entries(out: np.ndarray, n: int, bad: set[int] = frozenset()) -> list[tuple[int, list]]:
    items = []
    for i in range(n):
        start = i * ENTRY
        good = checksum(out[start:start + ENTRY])
        items.append((start, ["dram", start, ENTRY, None, good + 1 if i in bad else good]))
    return items


def test_every_entry_is_hashed_once_and_all_match():
    out = np.random.default_rng(0).integers(0, 256, 8 * ENTRY, dtype=np.uint8)
    items = _entries(out, 8)
    job = LandedChecks(out)
    job.landed(items[:3])
    job.landed(items[3:])
    assert job.finish() is None


def test_a_corrupt_entry_is_found_whoever_hashes_it():
    out = np.random.default_rng(1).integers(0, 256, 8 * ENTRY, dtype=np.uint8)
    items = _entries(out, 8, bad={5})
    job = LandedChecks(out)
    job.landed(items)
    assert job.finish() == items[5]
    job = LandedChecks(out)  # the reader alone (nothing handed to the thread)
    job._items.extend(items)
    assert job.finish() == items[5]


def test_the_thread_runs_at_the_lowest_priority():
    out = np.zeros(ENTRY, np.uint8)
    job = LandedChecks(out)
    job.landed(_entries(out, 1))
    assert job.finish() is None
    thread = next(t for t in threading.enumerate() if t.name == "kvstore-verify")
    stat = open(f"/proc/self/task/{thread.native_id}/stat").read()
    nice = int(stat.rsplit(")", 1)[1].split()[16])  # field 19 of stat
    assert nice == checks.HASHER_NICE


def test_a_cancelled_read_claims_nothing_more():
    out = np.random.default_rng(2).integers(0, 256, 64 * ENTRY, dtype=np.uint8)
    job = LandedChecks(out)
    job._items.extend(_entries(out, 64))
    job.cancel()
    start = time.perf_counter()
    job.work()  # returns at once: nothing is claimed after a cancel
    assert job._next == 0 and time.perf_counter() - start < 0.5


def test_only_large_entries_go_to_the_thread():
    assert use_background([ENTRY, ENTRY])
    assert not use_background([64 << 10] * 4)
    assert not use_background([])
