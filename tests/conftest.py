"""Shared test set-up: quiet TE logging, GPU tests skipped without CUDA."""

import os

# Must be set before mooncake is imported anywhere in this process or its children.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import pytest  # noqa: E402


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
