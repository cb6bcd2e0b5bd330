"""GPU-only paths of the tiers: a real VRAM arena, pinned DRAM, async copies + sync.
Skipped without CUDA (tests/conftest.py); on a CUDA machine every test checks bytes."""

import numpy as np
import pytest
import torch

from kvstore.core.errors import ConfigError, IntegrityError, TierFullError
from tiers.dram import DramTier
from tiers.gpu import GpuTier

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

CAP = 16 << 20
SIZES = [1, 4095, 4096, 4097, 3 << 20, 12_345]


def _rand(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def gpu():
    t = GpuTier(CAP, device="cuda:0")
    yield t
    t.check_integrity()
    t.close()


def test_arena_lives_in_vram(gpu):
    ext = gpu.allocate(5000)
    tensor = gpu.tensor(ext)
    assert tensor.is_cuda and tensor.device.index == 0
    assert tensor.data_ptr() == gpu.address(ext)
    (region,) = gpu.regions()
    assert region.location == "cuda:0" and region.nbytes == CAP
    assert region.address <= gpu.address(ext) < gpu.address(ext) + 5000 <= region.address + CAP
    assert gpu.view(ext) is None  # device memory has no host view


def test_round_trip_random_bytes_through_vram(gpu):
    extents = gpu.allocate_many(SIZES)
    payloads = [_rand(n, i) for i, n in enumerate(SIZES)]
    for ext, data in zip(extents, payloads):
        gpu.write(ext, memoryview(data))  # read-only source
    for ext, data in zip(extents, payloads):
        assert gpu.tensor(ext).cpu().numpy().tobytes() == data  # bytes really on device
        out = bytearray(ext.nbytes)
        gpu.read_into(ext, memoryview(out))
        assert bytes(out) == data


def test_pinned_dram_stages_to_and_from_vram(gpu):
    dram = DramTier(CAP)
    try:
        assert dram.pinned
        n = 8 << 20  # large enough that a missing stream sync would show stale bytes
        src, dst, gext = dram.allocate(n), dram.allocate(n), gpu.allocate(n)
        assert torch.frombuffer(dram.view(src), dtype=torch.uint8).is_pinned()
        data = _rand(n, 9)
        dram.write(src, memoryview(data))
        gpu.write(gext, dram.view(src))
        gpu.read_into(gext, dram.view(dst))
        assert bytes(dram.view(dst)) == data
        gpu.tensor(gext).fill_(0xAB)  # overwrite on device, then read straight back
        gpu.read_into(gext, dram.view(dst))
        assert np.all(np.frombuffer(dram.view(dst), dtype=np.uint8) == 0xAB)
    finally:
        dram.close()
    assert not dram.pinned


def test_full_and_double_free_on_device(gpu):
    ext = gpu.allocate(CAP // 2)
    before = gpu.stats()
    with pytest.raises(TierFullError):
        gpu.allocate_many([CAP // 4, CAP // 4, 1])
    assert gpu.stats() == before
    gpu.free(ext)
    with pytest.raises(IntegrityError):
        gpu.free(ext)


def test_missing_device_index_is_a_config_error():
    with pytest.raises(ConfigError):
        GpuTier(CAP, device=f"cuda:{torch.cuda.device_count()}")


def test_close_returns_vram():
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved(0)
    t = GpuTier(64 << 20, device="cuda:0")
    assert torch.cuda.memory_reserved(0) >= base + (64 << 20)
    t.close()
    assert torch.cuda.memory_reserved(0) <= base
