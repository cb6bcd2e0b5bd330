"""Batched NVMe I/O (tiers/nvme_runs.py): adjacent extents in one vectored call,
the same bytes on disk as one extent at a time. Real slab files (ext4, O_DIRECT on
and off), aligned and unaligned buffers."""

import mmap

import numpy as np
import pytest

from kvstore.core.errors import IntegrityError, InvalidRequestError
from tiers.base import Extent
from tiers.nvme import NvmeTier
from tiers.nvme_runs import RunIO

PAGE = 4096
CAP = 256 * PAGE


def _rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _aligned(n):
    return memoryview(mmap.mmap(-1, -(-n // PAGE) * PAGE))[:n]


def _raw(path, offset, n):
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


@pytest.mark.parametrize("direct", ["on", "off"])
@pytest.mark.parametrize("aligned", [True, False])
def test_many_moves_the_same_bytes_as_one_at_a_time(tmp_path, direct, aligned):
    t = NvmeTier(str(tmp_path / "slab"), CAP, direct=direct, fsync="commit")
    sizes = [5000, PAGE, 123, 3 * PAGE + 7, 2 * PAGE]
    run = t.allocate_many(sizes)  # back to back: one run
    exts = run + [t.allocate(PAGE), t.allocate(100)]  # allocated one by one, still adjacent
    payloads = [_rand(e.nbytes, i) for i, e in enumerate(exts)]
    srcs = []
    for p in payloads:
        buf = _aligned(len(p)) if aligned else memoryview(bytearray(len(p)))
        buf[:] = p
        srcs.append(buf)
    order = [3, 0, 6, 1, 4, 2, 5]  # any order: the tier sorts by offset
    t.write_many([exts[i] for i in order], [srcs[i] for i in order])
    t.flush()
    assert t.calls == 1  # all seven extents are adjacent on disk
    outs = [_aligned(e.nbytes) if aligned else memoryview(bytearray(e.nbytes)) for e in exts]
    t.read_many(exts, outs)
    assert [bytes(o) for o in outs] == payloads
    one = [bytearray(e.nbytes) for e in exts]
    for e, o in zip(exts, one):
        t.read_into(e, memoryview(o))
    assert [bytes(o) for o in one] == payloads
    pad = -(-123 // PAGE) * PAGE - 123
    assert _raw(t.path, run[2].offset + 123, pad) == bytes(pad)  # padding is zeros
    t.close()


def test_runs_split_at_gaps_and_reads_check_every_extent(tmp_path):
    t = NvmeTier(str(tmp_path / "slab"), CAP, direct="auto", fsync="commit")
    a, gap, b = t.allocate(PAGE), t.allocate(PAGE), t.allocate(2 * PAGE)
    t.free(gap)
    t.write_many([a, b], [memoryview(_rand(PAGE, 1)), memoryview(_rand(2 * PAGE, 2))])
    assert t.calls == 2
    with pytest.raises(InvalidRequestError):
        t.read_many([a, b], [memoryview(bytearray(PAGE))])
    with pytest.raises(IntegrityError):  # gap is not live: nothing is read
        t.read_many([a, gap], [memoryview(bytearray(PAGE)), memoryview(bytearray(PAGE))])
    assert t.calls == 2
    t.close()


@pytest.mark.parametrize("write", [True, False])
def test_small_bounce_and_iov_limits_split_calls(write):
    """RunIO alone over a memory "disk": limits end a call, an extent too big for
    the bounce buffer goes alone, and the bytes are the same."""
    disk = bytearray(64 * PAGE)
    calls = []

    def io(iov, offset, w):
        calls.append(len(iov))
        pos = offset
        for v in iov:
            if w:
                disk[pos:pos + v.nbytes] = v
            else:
                v[:] = disk[pos:pos + v.nbytes]
            pos += v.nbytes

    def single(ext, buf, w):
        calls.append(0)
        if w:
            disk[ext.offset:ext.end] = buf
        else:
            buf[:] = disk[ext.offset:ext.end]

    bounce = _aligned(2 * PAGE)
    # bounce pages needed: 1, 1, 1 (full: new call), 6 (unaligned: alone), 1, 1
    sizes = [PAGE + 10, PAGE + 10, PAGE + 10, 5 * PAGE + 1, 100, 100]
    offs = np.cumsum([0] + [-(-n // PAGE) * PAGE for n in sizes])[:-1]
    exts = [Extent("nvme", int(o), n) for o, n in zip(offs, sizes)]
    payloads = [_rand(n, i) for i, n in enumerate(sizes)]
    if not write:
        for e, p in zip(exts, payloads):
            disk[e.offset:e.end] = p
    bufs = [_aligned(n) for n in sizes]
    bufs[3] = memoryview(bytearray(sizes[3] + 1))[1:]  # not page-aligned
    if write:
        for b, p in zip(bufs, payloads):
            b[:] = p
    n = RunIO(PAGE, True, bounce, io, single).run(exts, bufs, write)
    assert calls == [4, 2, 0, 2]  # iovecs per call; 0: the extent that went alone
    assert n == len(calls)
    if write:
        assert [bytes(disk[e.offset:e.end]) for e in exts] == payloads
        assert bytes(disk[exts[4].end:exts[5].offset]) == bytes(PAGE - 100)
    else:
        assert [bytes(b) for b in bufs] == payloads


def test_concurrent_writes_and_reads_through_the_bounce_buffer_keep_their_bytes(tmp_path):
    """The store's writeback writes NVMe copies without the store lock while a request
    stages entries in: with O_DIRECT, both pass unaligned buffers through the tier's
    one bounce buffer. Each call holds the tier's own lock, so neither sees the
    other's bytes (without it this test mixed them)."""
    import threading

    t = NvmeTier(str(tmp_path / "slab"), CAP, direct="on", fsync="never")
    n = 3 * PAGE + 123  # not a page multiple, and an unaligned buffer: bounce buffer
    a, b = t.allocate(n), t.allocate(n)
    want_a, want_b = _rand(n, 1), _rand(n, 2)
    t.write(a, memoryview(want_a))
    errors: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        src = memoryview(bytearray(b"\0" + want_b))[1:]  # unaligned on purpose
        while not stop.is_set():
            t.write_many([b], [src])

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        out = memoryview(bytearray(n + 1))[1:]
        for _ in range(300):
            t.read_many([a], [out])
            if bytes(out) != want_a:
                errors.append("read of a came back with other bytes")
                break
    finally:
        stop.set()
        thread.join()
    assert not errors
    back = memoryview(bytearray(n))
    t.read_into(b, back)
    assert bytes(back) == want_b
    t.close()
