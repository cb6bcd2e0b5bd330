"""Prefaulting the DRAM arena (tiers/prefault.py): real /dev/shm files, real mappings,
and this process's page tables read back from /proc/self/smaps."""

import gc
import mmap
import os
import tempfile
import time

import numpy as np
import pytest

from kvstore.client.shm import map_shared
from tiers.dram import DramTier
from tiers.prefault import CHUNK_BYTES, Prefault, populate

MiB = 1 << 20
WAIT_S = 60


def mapped_kib(path: str, pid: int | str = "self") -> int | None:
    """KiB of ``path``'s mappings present in ``pid``'s page tables (smaps ``Rss``);
    None when ``path`` is not mapped there."""
    total, current = None, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                current = len(fields) >= 6 and fields[5] == path
            elif current and fields[0] == "Rss:":
                total = (total or 0) + int(fields[1])
    return total


def wait_mapped(path: str, pid: int | str, kib: int, within_s: float = 60.0) -> int | None:
    """``mapped_kib`` once it reaches ``kib``, or what it is after ``within_s``."""
    deadline = time.monotonic() + within_s
    while (got := mapped_kib(path, pid)) != kib and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


@pytest.fixture
def shm_file():
    """A 64 MiB file in /dev/shm, its pages reserved (as the server's arena is) and
    every 4 KiB page stamped with its number through a first mapping."""
    fd, path = tempfile.mkstemp(prefix="kvprefault-", dir="/dev/shm")
    try:
        nbytes = 64 * MiB
        os.posix_fallocate(fd, 0, nbytes)
        with mmap.mmap(fd, nbytes, mmap.MAP_SHARED) as mm:
            pages = np.frombuffer(mm, dtype=np.uint32).reshape(-1, 1024)
            pages[:, 0] = np.arange(len(pages), dtype=np.uint32)
            del pages
        yield path, nbytes
    finally:
        os.close(fd)
        os.unlink(path)


def test_populate_maps_every_page_and_changes_no_byte(shm_file):
    path, nbytes = shm_file
    arena = map_shared(path, nbytes)  # as a client maps it, no prefault
    assert mapped_kib(path) == 0
    assert populate(int(arena.ctypes.data), nbytes)
    assert mapped_kib(path) == nbytes // 1024
    stamps = arena.view(np.uint32).reshape(-1, 1024)[:, 0]
    assert np.array_equal(stamps, np.arange(nbytes // 4096, dtype=np.uint32))


def test_a_client_mapping_is_prefaulted_in_the_background(shm_file):
    path, nbytes = shm_file
    assert nbytes > CHUNK_BYTES  # several steps
    arena = map_shared(path, nbytes)
    job = Prefault(arena, "test")
    assert job.done.wait(WAIT_S)
    assert job.nbytes_done == nbytes
    assert mapped_kib(path) == nbytes // 1024
    assert arena.view(np.uint32)[1024 * 7] == 7  # page 7 still says 7
    assert job.covers(arena) and not job.covers(arena[:])


def test_a_mapping_let_go_of_is_unmapped_and_its_prefault_stops(shm_file):
    path, nbytes = shm_file
    arena = map_shared(path, nbytes)
    job = Prefault(arena, "test")
    del arena
    gc.collect()
    assert job.done.wait(WAIT_S)
    # Whether it got through or not, the thread kept no reference to the mapping.
    assert mapped_kib(path) is None


def test_stop_ends_the_job_between_steps(shm_file):
    path, nbytes = shm_file
    arena = map_shared(path, nbytes)
    job = Prefault(arena, "test")
    job.stop()  # waits for the step in progress
    assert job.done.is_set()
    assert job.nbytes_done % CHUNK_BYTES == 0 or job.nbytes_done == nbytes
    assert (mapped_kib(path) or 0) <= job.nbytes_done // 1024 + 4


@pytest.fixture
def arena_path():
    """A /dev/shm name nobody uses (the tier creates the file and removes it)."""
    d = tempfile.mkdtemp(prefix="kvprefault-", dir="/dev/shm")
    yield os.path.join(d, "arena")
    leftovers = os.listdir(d)
    os.rmdir(d)
    assert not leftovers, f"the tier left {leftovers} behind"


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "anonymous"])
def test_the_dram_tier_prefaults_its_arena_only_when_asked(arena_path, shared):
    path = arena_path if shared else None
    tier = DramTier(48 * MiB, shared_path=path, prefault=True)
    try:
        assert tier.prefault is not None and tier.prefault.done.wait(WAIT_S)
        assert tier.prefault.nbytes_done == tier.capacity
        if shared:
            assert mapped_kib(path) == tier.capacity // 1024
        data = np.arange(4096, dtype=np.uint8)
        extent = tier.allocate(4096)
        tier.write(extent, memoryview(data))
        out = np.zeros(4096, dtype=np.uint8)
        tier.read_into(extent, memoryview(out))
        assert np.array_equal(out, data)
    finally:
        tier.close()
    plain = DramTier(48 * MiB, shared_path=path, prefault=False)
    try:
        assert plain.prefault is None
        if shared:
            assert mapped_kib(path) == 0
    finally:
        plain.close()


def test_closing_the_tier_while_it_prefaults_stops_the_job_first(arena_path):
    path = arena_path
    tier = DramTier(256 * MiB, shared_path=path, prefault=True)
    job = tier.prefault
    tier.close()  # no "views are alive" warning: the job let go first
    assert job.done.is_set()
    assert not os.path.exists(path)
    assert mapped_kib(path) is None
