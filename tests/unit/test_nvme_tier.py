"""NVMe tier specifics: persistence across reopen, O_DIRECT on and refused, fsync policy,
aligned and unaligned buffers. Real slab files on this machine's disk (ext4)."""

import errno
import fcntl
import logging
import os
import shutil
import subprocess

import numpy as np
import pytest

from kvstore.core.errors import ConfigError, IntegrityError
from tiers import nvme as nvme_mod
from tiers.dram import DramTier
from tiers.nvme import NvmeTier

PAGE = 4096
CAP = 64 * PAGE


def _rand(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _read(tier, ext):
    out = bytearray(ext.nbytes)
    tier.read_into(ext, memoryview(out))
    return bytes(out)


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("direct", ["on", "off"])
def test_contents_survive_close_and_reopen_when_claimed(tmp_path, direct):
    path = str(tmp_path / "slab")
    t = NvmeTier(path, CAP, direct=direct)
    extents = t.allocate_many([5000, PAGE, 123])
    payloads = [_rand(e.nbytes, i) for i, e in enumerate(extents)]
    for ext, data in zip(extents, payloads):
        t.write(ext, memoryview(data))
    t.flush()
    t.close()

    t = NvmeTier(path, CAP, direct=direct)
    assert t.used == 0
    with pytest.raises(IntegrityError):
        _read(t, extents[0])  # not live until the index claims it
    for ext in extents:
        t.claim(ext)
    assert [_read(t, e) for e in extents] == payloads
    with pytest.raises(IntegrityError):
        t.claim(extents[1])  # already live
    assert t.allocate(PAGE).offset == 4 * PAGE  # claimed space is not handed out again
    t.check_integrity()
    t.close()


def test_direct_on_really_uses_o_direct(tmp_path):
    t = NvmeTier(str(tmp_path / "slab"), CAP, direct="on")
    try:
        assert fcntl.fcntl(t._fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        t.close()


@pytest.fixture
def refuse_o_direct(monkeypatch):
    """This kernel's tmpfs and ext4 both take O_DIRECT, so a refusing file system
    (old tmpfs, some FUSE mounts) is played by failing ``open`` as they do: EINVAL."""
    real_open = os.open

    def open_without_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_without_direct)


def test_auto_falls_back_to_buffered_with_one_log_line(tmp_path, refuse_o_direct, caplog):
    caplog.set_level(logging.WARNING, logger="tiers.nvme")
    t = NvmeTier(str(tmp_path / "slab"), CAP, direct="auto")
    try:
        assert not t.direct
        assert not fcntl.fcntl(t._fd, fcntl.F_GETFL) & os.O_DIRECT
        assert len([r for r in caplog.records if "O_DIRECT refused" in r.message]) == 1
        ext = t.allocate(777)
        t.write(ext, memoryview(_rand(777)))
        assert _read(t, ext) == _rand(777)
    finally:
        t.close()


def test_direct_on_refused_is_a_config_error(tmp_path, refuse_o_direct):
    fds = _open_fds()
    with pytest.raises(ConfigError, match="O_DIRECT"):
        NvmeTier(str(tmp_path / "slab"), CAP, direct="on")
    assert _open_fds() == fds


def test_auto_on_tmpfs_round_trips(tmp_path):
    path = f"/dev/shm/kvtiers-nvme-{os.getpid()}"
    try:
        t = NvmeTier(path, CAP, direct="auto")
        ext = t.allocate(4099)
        t.write(ext, memoryview(_rand(4099)))
        assert _read(t, ext) == _rand(4099)
        t.close()
    finally:
        os.unlink(path)


def test_aligned_and_unaligned_buffers_and_large_extents(tmp_path):
    """Page-aligned buffers (a DRAM view: the staging path) go straight to the disk;
    unaligned ones and tails ride the bounce buffer, in chunks when large."""
    big = nvme_mod.BOUNCE_BYTES + 3 * PAGE + 5
    t = NvmeTier(str(tmp_path / "slab"), 2 * big + 8 * PAGE, direct="on")
    dram = DramTier(4 * big)
    try:
        for n in (3 * PAGE, 3 * PAGE + 17, big):
            ext, dext = t.allocate(n), dram.allocate(n)
            data = _rand(n, n)
            unaligned = memoryview(bytearray(n + 1))[1:]
            unaligned[:] = data
            t.write(ext, unaligned)
            dram.view(dext)[:] = bytes(n)
            t.read_into(ext, dram.view(dext))  # aligned destination
            assert bytes(dram.view(dext)) == data
            t.write(ext, dram.view(dext))  # aligned source
            back = memoryview(bytearray(n + 3))[3:]
            t.read_into(ext, back)
            assert bytes(back) == data
            t.free(ext)
            dram.free(dext)
    finally:
        t.close()
        dram.close()


@pytest.mark.parametrize("policy, after_writes, after_flush",
                         [("always", 3, 3), ("commit", 0, 1), ("never", 0, 0)])
def test_fsync_policy(tmp_path, monkeypatch, policy, after_writes, after_flush):
    calls = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), real(fd)))
    t = NvmeTier(str(tmp_path / "slab"), CAP, fsync=policy)
    for ext in t.allocate_many([10, 20, 30]):
        t.write(ext, memoryview(bytes(ext.nbytes)))
    assert len(calls) == after_writes
    t.flush()
    assert len(calls) == after_flush
    t.close()


def test_bad_configuration(tmp_path):
    path = str(tmp_path / "slab")
    NvmeTier(path, CAP).close()
    with pytest.raises(ConfigError, match="has 262144 bytes"):
        NvmeTier(path, 2 * CAP)
    NvmeTier(path, CAP + 100).close()  # same size once rounded to pages
    with pytest.raises(ConfigError):
        NvmeTier(path, CAP, direct="maybe")
    with pytest.raises(ConfigError):
        NvmeTier(path, CAP, fsync="sometimes")
    with pytest.raises(ConfigError):
        NvmeTier(str(tmp_path), CAP)  # a directory
    with pytest.raises(ConfigError):
        NvmeTier(str(tmp_path / "absent-dir" / "slab"), CAP)


def test_nvme_is_not_memory(tmp_path):
    t = NvmeTier(str(tmp_path / "slab"), CAP)
    ext = t.allocate(10)
    assert (t.address(ext), t.view(ext), t.regions()) == (None, None, [])
    assert (t.name, t.volatile, t.page_size) == ("nvme", False, PAGE)
    t.close()


@pytest.fixture
def loop_device(tmp_path):
    """A real block device: a loop device over a 1 MiB file (root and losetup needed)."""
    image = tmp_path / "disk.img"
    image.write_bytes(bytes(1 << 20))
    if shutil.which("losetup") is None or os.geteuid() != 0:
        pytest.skip("needs root and losetup for a loop block device")
    made = subprocess.run(["losetup", "--find", "--show", str(image)], check=False,
                          capture_output=True, text=True, timeout=20)
    if made.returncode != 0:
        pytest.skip(f"losetup refused: {made.stderr.strip()}")
    dev = made.stdout.strip()
    yield dev
    subprocess.run(["losetup", "-d", dev], check=True, timeout=20)


@pytest.mark.timeout(60)
def test_block_device_size_comes_from_the_device(loop_device):
    t = NvmeTier(loop_device, 1 << 30, direct="on")  # asks for more than the device has
    assert (t.block_device, t.capacity, t.direct) == (True, 1 << 20, True)
    ext = t.allocate(5000)
    t.write(ext, memoryview(_rand(5000)))
    t.close()
    t = NvmeTier(loop_device, 1 << 30)
    t.claim(ext)
    assert _read(t, ext) == _rand(5000)
    t.close()
