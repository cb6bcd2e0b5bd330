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
