"""Shared test set-up: quiet TE logging, no Hypothesis deadline, GPU tests skipped
without CUDA."""

import os

# Must be set before mooncake is imported anywhere in this process or its children.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# No per-example deadline (Hypothesis's default is 200 ms): on a loaded CI machine one
# example held up by a preemption or a GC pause fails with DeadlineExceeded or
# "Unreliable test timings", which says nothing about the code under test.
settings.register_profile("kvstore", deadline=None)
settings.load_profile("kvstore")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - any import problem means no GPU
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
