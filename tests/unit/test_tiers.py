"""Every tier keeps the same contract: real mmaps, real files, real CPU tensors."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.core.errors import ConfigError, IntegrityError, InvalidRequestError, TierFullError
from tiers.base import Extent
from kvstore.client.shm import map_shared
from tiers.dram import DramTier
from tiers.gpu import GpuTier
from tiers.nvme import NvmeTier

REPO = Path(__file__).resolve().parents[2]
CAP = 64 * 4096
SIZES = [1, 4095, 4096, 4097, 3 * 4096, 10_000, 33]  # page multiples and not


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="kvtiers-", dir="/dev/shm")
    yield d
    leftovers = os.listdir(d)
    os.rmdir(d)
    assert not leftovers, f"tier left files behind: {leftovers}"


def _dram(tmp_path, shm_dir):
    return DramTier(CAP)


def _dram_shared(tmp_path, shm_dir):
    return DramTier(CAP, shared_path=os.path.join(shm_dir, "arena"))


def _nvme_direct(tmp_path, shm_dir):
    t = NvmeTier(str(tmp_path / "slab"), CAP, direct="on")  # tmp_path is on ext4 here
    assert t.direct
    return t


def _nvme_buffered(tmp_path, shm_dir):
    return NvmeTier(str(tmp_path / "slab"), CAP, direct="off", fsync="always")


def _gpu_on_cpu(tmp_path, shm_dir):
    return GpuTier(CAP, device="cpu")  # the same code as on CUDA, on a CPU tensor


FACTORIES = {"dram": _dram, "dram-shared": _dram_shared, "nvme-direct": _nvme_direct,
             "nvme-buffered": _nvme_buffered, "gpu-cpu": _gpu_on_cpu}


@pytest.fixture(params=sorted(FACTORIES))
def tier(request, tmp_path, shm_dir):
    t = FACTORIES[request.param](tmp_path, shm_dir)
    yield t
    t.check_integrity()
    t.close()


def _random_bytes(rng, n):
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def test_round_trip_random_bytes(tier):
    rng = np.random.default_rng(1)
    extents = tier.allocate_many(SIZES)
    payloads = [_random_bytes(rng, n) for n in SIZES]
    for ext, data in zip(extents, payloads):
        tier.write(ext, memoryview(data))
    tier.flush()
    for ext, data in zip(extents, payloads):
        out = bytearray(ext.nbytes)
        tier.read_into(ext, memoryview(out))
        assert bytes(out) == data
    page = tier.page_size
    assert tier.used == sum(-(-n // page) * page for n in SIZES)
    stats = tier.stats()
    assert (stats.name, stats.used, stats.extents) == (tier.name, tier.used, len(SIZES))
    for ext in extents:
        tier.free(ext)
    assert tier.used == 0 and tier.stats().largest_free == tier.capacity


def test_batch_is_back_to_back_and_inside_regions(tier):
    extents = tier.allocate_many([5000, 100, 8192])
    assert [e.offset for e in extents] == [0, 8192, 12288]
    regions = tier.regions()
    for ext in extents:
        addr = tier.address(ext)
        if addr is None:
            assert not regions
            continue
        assert any(r.address <= addr and addr + ext.nbytes <= r.address + r.nbytes
                   for r in regions)


def test_full_tier_changes_nothing(tier):
    ext = tier.allocate(CAP // 2)
    before = tier.stats()
    with pytest.raises(TierFullError):
        tier.allocate_many([CAP // 4, CAP // 4, 1])
    assert tier.stats() == before
    tier.free(ext)


def test_double_free_and_dead_extents_raise(tier):
    ext = tier.allocate(100)
    tier.free(ext)
    with pytest.raises(IntegrityError):
        tier.free(ext)
    with pytest.raises(IntegrityError):
        tier.write(ext, memoryview(bytes(100)))
    with pytest.raises(IntegrityError):
        tier.read_into(ext, memoryview(bytearray(100)))
    assert tier.used == 0


def test_bad_buffers_raise_and_change_nothing(tier):
    ext = tier.allocate(100)
    tier.write(ext, memoryview(b"\x07" * 100))
    with pytest.raises(InvalidRequestError):
        tier.write(ext, memoryview(bytes(99)))
    with pytest.raises(InvalidRequestError):
        tier.read_into(ext, memoryview(bytearray(101)))
    with pytest.raises(InvalidRequestError):
        tier.read_into(ext, memoryview(bytes(100)))  # read-only destination
    with pytest.raises(InvalidRequestError):
        tier.free(Extent("elsewhere", ext.offset, ext.nbytes))
    out = np.zeros(100, dtype=np.uint8)
    tier.read_into(ext, memoryview(out))
    assert (out == 7).all()
    tier.free(ext)


def test_dram_view_is_zero_copy():
    t = DramTier(CAP)
    try:
        ext = t.allocate(10)
        t.view(ext)[:] = b"0123456789"
        out = bytearray(10)
        t.read_into(ext, memoryview(out))
        assert out == b"0123456789"
        assert t.address(ext) == t.regions()[0].address + ext.offset
        assert t.regions()[0].location == "cpu:0"
    finally:
        t.close()


def test_a_closed_dram_tier_refuses_a_span_whatever_the_extents():
    t = DramTier(CAP)
    a, b = t.allocate_many([4096, 4096])
    t.close()
    for extents in ([a, b], [b, a], []):  # a view, no view, nothing asked
        with pytest.raises(InvalidRequestError, match="closed"):
            t.span(extents)


def test_dram_span_is_one_view_over_neighbouring_live_extents():
    t = DramTier(CAP)
    try:
        a, b, c = t.allocate_many([4096, 8192, 4096])  # one batch: back to back
        for i, ext in enumerate((a, b, c)):
            t.view(ext)[:] = bytes([i + 1]) * ext.nbytes
        span = t.span([a, b, c])
        assert span is not None and span.nbytes == 16384
        assert bytes(span) == b"\x01" * 4096 + b"\x02" * 8192 + b"\x03" * 4096
        t.view(b)[:1] = b"\x09"
        assert span[4096] == 9  # a view, not a copy
        assert t.span([a, c]) is None  # a gap between them
        assert t.span([b, a]) is None  # out of order
        assert t.span([a, Extent("nvme", b.offset, b.nbytes)]) is None  # another tier's
        assert t.span([a, Extent("dram", b.offset, 0)]) is None  # an empty one
        assert t.span([a, Extent("dram", b.offset, 4096)]) is None  # b is not 4096 long
        assert t.span_of([a.offset, b.offset], [a.nbytes, b.nbytes]).nbytes == 12288
        odd = t.allocate_many([100, 100])  # each rounded up to a page: not back to back
        assert t.span(odd) is None
        t.free(c)
        assert t.span([a, b, c]) is None  # c is no longer live
        assert t.span([]) is None
    finally:
        t.close()


def test_dram_runs_are_views_of_each_run_of_neighbouring_live_extents():
    t = DramTier(CAP)
    try:
        a, b, c = t.allocate_many([4096, 8192, 4096])  # one batch: back to back
        odd, d = t.allocate_many([100, 4096])  # a page's gap after the 100 bytes
        for i, ext in enumerate((a, b, c, odd, d)):
            t.view(ext)[:] = bytes([i + 1]) * ext.nbytes
        whole = t.runs_of([a.offset, b.offset, c.offset], [a.nbytes, b.nbytes, c.nbytes])
        assert [v.nbytes for v in whole] == [16384]  # one run: span_of's view
        runs = t.runs_of([b.offset, a.offset, c.offset, odd.offset, d.offset],
                         [b.nbytes, a.nbytes, c.nbytes, 100, d.nbytes])
        # In the order asked: b, then a (before b in the arena), then c, odd and d
        # (c and odd lie back to back; odd's page is not all of it).
        assert [v.nbytes for v in runs] == [8192, 4096, 4096 + 100, 4096]
        assert b"".join(runs) == (b"\x02" * 8192 + b"\x01" * 4096 + b"\x03" * 4096
                                  + b"\x04" * 100 + b"\x05" * 4096)
        t.view(a)[:1] = b"\x09"
        assert runs[1][0] == 9  # views, not copies
        assert t.runs_of([], []) is None
        t.free(c)
        assert t.runs_of([a.offset, c.offset], [a.nbytes, c.nbytes]) is None  # c is gone
        assert t.runs_of([a.offset], [a.nbytes + 1]) is None  # not a's length
        t.close()
        with pytest.raises(InvalidRequestError, match="closed"):
            t.runs_of([a.offset], [a.nbytes])
    finally:
        t.close()


_CLIENT = """
import sys
from kvstore.client.shm import map_shared
arena = map_shared(sys.argv[1], int(sys.argv[2]))
off = int(sys.argv[3])
assert bytes(arena[off:off + 5]) == b"hello", bytes(arena[off:off + 5])
arena[off:off + 5] = memoryview(b"world")
"""


@pytest.mark.timeout(60)
def test_shared_arena_is_visible_to_another_process(shm_dir):
    path = os.path.join(shm_dir, "arena")
    t = DramTier(CAP, shared_path=path)
    try:
        ext = t.allocate(5)
        t.write(ext, memoryview(b"hello"))
        env = dict(os.environ, PYTHONPATH=str(REPO))
        subprocess.run([sys.executable, "-c", _CLIENT, path, str(CAP), str(ext.offset)],
                       check=True, timeout=30, env=env, cwd=REPO)
        out = bytearray(5)
        t.read_into(ext, memoryview(out))
        assert out == b"world"
    finally:
        t.close()
    assert not os.path.exists(path)


def test_an_arena_at_a_path_an_earlier_process_left_is_a_new_file(shm_dir):
    """A server restarted under the same pid (a container) gets the same arena path.
    A client of the old process may still map the old file and write into it (a
    room it was granted): that must never reach the new server's memory."""
    path = os.path.join(shm_dir, "arena")
    old = DramTier(CAP, shared_path=path)  # as a SIGKILLed server leaves it
    client = map_shared(path, CAP)
    new = DramTier(CAP, shared_path=path)
    try:
        ext = new.allocate(5)
        new.write(ext, memoryview(b"fresh"))
        client[ext.offset:ext.offset + 5] = memoryview(b"stale")
        out = bytearray(5)
        new.read_into(ext, memoryview(out))
        assert out == b"fresh"
    finally:
        del client
        new.close()
        old.shared_path = None  # its file is gone already: a dead process's is
        old.close()


def test_map_shared_refuses_missing_or_short_files(shm_dir):
    with pytest.raises(ConfigError):
        map_shared(os.path.join(shm_dir, "absent"), 4096)
    path = os.path.join(shm_dir, "short")
    Path(path).write_bytes(bytes(100))
    try:
        with pytest.raises(ConfigError):
            map_shared(path, 4096)
    finally:
        os.unlink(path)


def test_gpu_tier_on_cpu_tensor():
    t = GpuTier(CAP, device="cpu")
    try:
        (a, b) = t.allocate_many([100, 5000])
        t.write(b, memoryview(bytes(range(250)) * 20))
        assert bytes(t.tensor(b)[:250].numpy()) == bytes(range(250))
        assert t.tensor(b).data_ptr() == t.address(b)
        t.view(a)[:] = b"x" * 100  # CPU arena: the view is zero-copy
        out = bytearray(100)
        t.read_into(a, memoryview(out))
        assert out == b"x" * 100
        assert t.regions()[0].location == "cpu:0" and t.regions()[0].nbytes == CAP
        t.free(a)
        with pytest.raises(IntegrityError):
            t.tensor(a)
    finally:
        t.close()


def test_gpu_tier_refuses_missing_or_bad_devices():
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            GpuTier(CAP, device="cuda:0")
    for bad in ("bogus", "meta"):
        with pytest.raises(ConfigError):
            GpuTier(CAP, device=bad)
