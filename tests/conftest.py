"""Shared test set-up: quiet TE logging, no Hypothesis deadline, GPU tests skipped
without CUDA, and how ``make test`` shares the tests out between its pytest-xdist workers."""

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


# ``make test`` runs the suite in two pytest-xdist workers (``-n 2 --dist loadscope``):
# most tests wait on servers, sockets and timeouts, and a serial run left the 2 cores
# idle over half its time. Each test module is one unit of work (its module-scoped
# servers start once, on one worker), and all of tests/engine, where every test that
# runs real vLLM engines lives, is one unit: its session fixtures (the node cluster,
# the plain engines' tokens) are made once, its engines never compete with another
# worker's for the cores, and its checks that no vLLM file is left in /dev/shm see no
# other test's (the tests that make such files on purpose live there too). Units go
# out in collection order (xdist 3.8's ``loadscopereorder`` off), so tests/engine
# starts first. A test marked ``engine`` outside tests/engine fails at its setup.
# (xdist's own ``loadgroup`` would do it with marks, but with pytest 9 it groups
# nothing: it renames the items' ``_nodeid``, which pytest no longer reads.)
ENGINE_DIR = "tests/engine/"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EngineTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return ENGINE_DIR if module.startswith(ENGINE_DIR) else module

    config.option.loadscopereorder = False  # (by size, tests/engine would start late)
    return EngineTogether(config, log)


def pytest_runtest_setup(item):
    # (Failed here, not refused at collection: an error a worker raises while it
    # collects reaches xdist's controller as "no active workers", without its words.)
    if item.get_closest_marker("engine") is not None and not item.nodeid.startswith(ENGINE_DIR):
        pytest.fail(f"{item.nodeid} runs vLLM engines (marked engine): it belongs in "
                    f"{ENGINE_DIR}, which runs as one unit, never beside another worker's "
                    "tests", pytrace=False)


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
