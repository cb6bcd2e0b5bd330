"""kvstore.client.checks: landed entries hashed by a nice-19 thread or by the reader
(with the C extension's ``hashes``, entries of any size, in claims of up to
``BATCH_BYTES``; without it, large ones only, small ones by the reader at once); the
first corrupt one reported; the reader never waits for the thread; a finished or
cancelled read lets its memory go."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.client import checks
from kvstore.client.checks import LandedChecks, use_background
from kvstore.core.errors import ChecksumError
from kvstore.core.hashing import checksum

ENTRY = checks.BACKGROUND_MIN_ENTRY_BYTES
SMALL = 64 << 10
needs_hashes = pytest.mark.skipif(checks.HASHES is None,
                                  reason="the C extension was built without xxhash.h")


@pytest.fixture
def without_hashes(monkeypatch):
    """As where the C extension has no ``hashes``: the xxhash binding, entry by entry."""
    monkeypatch.setattr(checks, "HASHES", None)


def _entries(out: np.ndarray, sizes: list[int], bad: set[int] = frozenset()
             ) -> list[tuple[int, list]]:
    items, start = [], 0
    for i, n in enumerate(sizes):
        good = checksum(out[start:start + n])
        items.append((start, ["dram", start, n, None, good + 1 if i in bad else good]))
        start += n
    return items


def _corrupt(entry: list) -> ChecksumError:
    return ChecksumError(f"entry at {entry[1]} arrived corrupt")


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_every_entry_matches():
    out = _data(8 * ENTRY)
    items = _entries(out, [ENTRY] * 8)
    job = LandedChecks(out, _corrupt)
    job.landed(items[:3])
    job.landed(items[3:])
    assert job.finish() is None


def test_a_corrupt_large_entry_is_found_whoever_hashes_it():
    out = _data(8 * ENTRY, 1)
    items = _entries(out, [ENTRY] * 8, bad={5})
    job = LandedChecks(out, _corrupt)
    job.landed(items)
    assert job.finish() == items[5]
    job = LandedChecks(out, _corrupt)  # the reader alone (nothing handed to the thread)
    job._items.extend(items)
    assert job.finish() == items[5]


def test_the_reader_hashes_an_entry_the_thread_holds_instead_of_waiting():
    out = _data(2 * ENTRY, 2)
    items = _entries(out, [ENTRY, ENTRY], bad={1})
    job = LandedChecks(out, _corrupt)
    job._items.extend(items)
    job._next, job._held = 2, (0, 2)  # as if the (starved) thread held both
    assert job.finish() == items[1]  # returns without the thread


def test_without_hashes_small_entries_are_checked_by_the_reader_as_they_land(
        without_hashes):
    small = SMALL
    out = _data(ENTRY + 2 * small, 3)
    items = _entries(out, [ENTRY, small, small], bad={2})
    job = LandedChecks(out, _corrupt)
    job.landed(items[:2])  # the small one hashed here, the large one handed on
    with pytest.raises(ChecksumError, match=f"at {items[2][0]}"):
        job.landed(items[2:])
    assert job._items == [items[0]]


def test_a_finished_or_cancelled_read_lets_go_and_takes_no_more():
    out = _data(4 * ENTRY, 4)
    items = _entries(out, [ENTRY] * 4)
    job = LandedChecks(out, _corrupt)
    job.landed(items[:2])
    assert job.finish() is None and job._out is None and job._items == []
    with pytest.raises(RuntimeError, match="after their read was finished"):
        job.landed(items[2:])
    job = LandedChecks(out, _corrupt)
    job._items.extend(items)
    job.cancel()
    job.work()  # claims nothing after a cancel
    assert job._next == 0 and job._out is None


def test_the_thread_runs_at_the_lowest_priority():
    out = np.zeros(ENTRY, np.uint8)
    job = LandedChecks(out, _corrupt)
    job.landed(_entries(out, [ENTRY]))
    assert job.finish() is None
    thread = next(t for t in threading.enumerate() if t.name == "kvstore-verify")
    stat = open(f"/proc/self/task/{thread.native_id}/stat").read()
    nice = int(stat.rsplit(")", 1)[1].split()[16])  # field 19 of stat
    assert nice == checks.HASHER_NICE


@needs_hashes
def test_small_entries_go_to_the_thread_in_claims_of_batch_bytes():
    per = checks.BATCH_BYTES // SMALL
    n = 3 * per + 1
    out = _data(n * SMALL, 5)
    items = _entries(out, [SMALL] * n, bad={2 * per + 3})
    job = LandedChecks(out, _corrupt)
    job.landed(items[:per])  # nothing hashed on the reader's thread, nothing raised
    job.landed(items[per:])
    assert job.finish() == items[2 * per + 3]
    job = LandedChecks(out, _corrupt)
    job._items.extend(items)
    job.work(thread=False)  # one claim after another, each of BATCH_BYTES
    assert job._next == 2 * per + per and job._bad == items[2 * per + 3]
    good = _entries(out, [SMALL] * n)
    job = LandedChecks(out, _corrupt)
    job._items.extend(good)
    job.work(thread=False)
    assert job._next == n and job.finish() is None
    assert use_background([SMALL])


@needs_hashes
def test_hashes_matches_the_binding_and_refuses_what_is_outside():
    out = _data(3 * SMALL + 17, 6)
    starts, sizes = [0, 5, SMALL, 3 * SMALL], [0, 100, 2 * SMALL, 17]
    assert checks.HASHES(out, starts, sizes) == [checksum(out[a:a + n])
                                                for a, n in zip(starts, sizes)]
    with pytest.raises(ValueError, match="outside"):
        checks.HASHES(out, [3 * SMALL + 1], [17])
    # An entry past the end is bad even where the bytes that are there match, and
    # one that is in a batch with it is not blamed for it.
    there = checksum(out[3 * SMALL + 1:])
    assert checks.first_bad(out, [(3 * SMALL + 1, ["dram", 0, 17, None, there])]) == 0
    good = (0, ["dram", 0, SMALL, None, checksum(out[:SMALL])])
    assert checks.first_bad(out, [good, (3 * SMALL + 1, ["dram", 0, 17, None, there])]) == 1
    assert checks.first_bad(out, [good]) is None


def test_without_hashes_only_reads_with_large_entries_use_it(without_hashes):
    assert use_background([ENTRY, 4096])
    assert not use_background([64 << 10] * 4)
    assert not use_background([])
