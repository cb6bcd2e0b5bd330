"""The load harness of tools/bench/load.py, smaller: 4 producer and 4 consumer
processes against one real kvstore-server for a few seconds, its DRAM tier a few
prompts big and its NVMe slab a little bigger, so demotion and eviction run all the
time. Asserts what must hold under load, never how fast: every drop_select exact, a
clean prefix or a miss; nothing left leased or reserved; memory that stays flat."""

from __future__ import annotations

import json

import pytest

from kvstore.core import errors
from tools.bench.load import MiB, LoadSpec, rss_growth, run_load
from tools.netns import make_cluster

pytestmark = [pytest.mark.timeout(240), pytest.mark.netns, pytest.mark.slow]

# 4 KiB per token (the bench's "small" layout): prompts of 32-128 tokens are
# 128-512 KiB, so DRAM holds ~12 of them and the slab ~36, while the producers
# insert dozens per second and a quarter of them are never read.
SPEC = LoadSpec(procs=4, seconds=6.0, min_tokens=32, max_tokens=128, dram_bytes=4 * MiB,
                nvme_bytes=12 * MiB, reservation_lease_s=2.0, read_lease_s=5.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with make_cluster(2) as cluster:
        return run_load(cluster, tmp_path_factory.mktemp("load"), SPEC, "kvstore")


def _sum(answers: list[dict], key: str) -> int:
    return sum(a[key] for a in answers)


def _error_classes(answers: list[dict]) -> set[str]:
    return {kind.split(":")[0] for a in answers for kind in a["errors"]}


def test_every_process_finished_its_run(run):
    assert not run.killed
    assert all(run.producers) and all(run.consumers)


def test_every_drop_select_is_exact_a_prefix_or_a_miss(run):
    selects = run.consumers
    assert _sum(selects, "hits") > 0, selects  # the load really read prompts back
    assert _sum(selects, "wrong_selects") == 0 and _sum(selects, "wrong_bytes") == 0
    # A select that raised must have raised a miss (recompute), never a bug.
    for name in _error_classes(selects):
        assert issubclass(getattr(errors, name, Exception), errors.MissError), name


def test_inserts_succeed_or_fail_as_misses(run):
    assert len([x for a in run.producers for x in a["lat"]]) > 0
    for name in _error_classes(run.producers):
        assert issubclass(getattr(errors, name, Exception), errors.MissError), name


def test_demotion_and_eviction_ran(run):
    assert run.stats["demotions"] > 0, json.dumps(run.stats)
    assert run.stats["evictions"] > 0, json.dumps(run.stats)


def test_nothing_leased_or_reserved_after_the_clients_stop(run):
    assert run.stats["leases"] == 0 and run.stats["reservations"] == 0, json.dumps(run.stats)


def test_server_memory_stays_flat(run):
    # What the server may hold more of as the run goes on is bounded by its tiers:
    # arena pages touched for the first time (at most the DRAM tier), a writeback
    # batch being copied to the slab (at most the DRAM tier again), and the index of
    # at most (DRAM + NVMe) / 64 KiB = 256 entries. 16 MiB more covers the allocator
    # and Python's free lists; growth past that comes per operation: a leak.
    first, last = rss_growth(run.rss_mib)
    assert last - first <= 2 * SPEC.dram_bytes / MiB + 16, run.rss_mib
