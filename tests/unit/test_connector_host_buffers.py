"""The worker's reused host buffers: any mix of sizes taken and given back."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kvstore.connector.v1_worker import _KEEP_BUFFERS, HostBuffers  # noqa: E402


def test_buffers_of_different_sizes_are_reused_smallest_fit_first():
    bufs = HostBuffers(pinned=False)
    small, large = bufs.take(100), bufs.take(1000)
    bufs.give(large)
    bufs.give(small)  # two free buffers of different sizes, the larger first
    got = bufs.take(50)  # was: RuntimeError from list.remove comparing tensors
    assert got.numel() == 50 and got._base is small._base
    assert bufs.take(500)._base is large._base
    assert bufs.take(10)._base is not None  # none free: a fresh one


def test_at_most_keep_buffers_stay_free_and_the_smallest_go():
    bufs = HostBuffers(pinned=False)
    taken = [bufs.take(n) for n in range(10, 10 + 10 * (_KEEP_BUFFERS + 2), 10)]
    for buf in taken:
        bufs.give(buf)
    sizes = sorted(b.numel() for b in bufs._free)
    assert sizes == [b.numel() for b in taken][-_KEEP_BUFFERS:]


def test_free_buffers_stay_within_keep_bytes():
    """Free buffers are memory outside the save cap (pinned on a GPU engine): at most
    keep_bytes of them stay, the smallest going first, and one larger than that on
    its own is not kept at all."""
    bufs = HostBuffers(pinned=False, keep_bytes=100)
    a, b, c = bufs.take(60), bufs.take(50), bufs.take(30)
    bufs.give(a)
    bufs.give(b)  # 110 free: the smallest (b) goes
    assert sorted(x.numel() for x in bufs._free) == [60]
    bufs.give(c)
    assert sorted(x.numel() for x in bufs._free) == [30, 60] and bufs.free_bytes == 90
    huge = bufs.take(1000)
    bufs.give(huge)  # alone over the bound: dropped, the others kept
    assert sorted(x.numel() for x in bufs._free) == [30, 60]
    assert bufs.take(55)._base is a._base  # still reused
