"""kvstore-server copies the entries its next demotions would take to NVMe in the
background, so a demotion under pressure is an index flip: real server process,
real NVMe slab file, real LMDB, bytes checked end to end."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.integration.client_worker import prompt_kv, prompt_tokens

pytestmark = pytest.mark.timeout(120)


def _until(client, pred, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if pred(stats):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


@pytest.mark.parametrize("same_node", [True, False], ids=["shm", "te"])
def test_copies_are_written_ahead_and_demotion_flips_to_them(server_factory, client_factory,
                                                             same_node):
    # DRAM 64 pages of 4 KiB (one 512 B block each); copying starts above 75 %.
    srv = server_factory(dram="256KiB", nvme="8MiB")
    client = client_factory(srv, same_node=same_node)
    client.insert(prompt_tokens(1, 200), prompt_kv(1, 200))  # 50 blocks: 78 %
    stats = _until(client, lambda s: s["nvme_copies"] >= 1)
    assert stats["writebacks"] >= 1 and stats["demotions"] == 0
    assert stats["tiers"]["nvme"]["entries"] == 0  # copies, not moved entries
    client.insert(prompt_tokens(2, 48), prompt_kv(2, 48))  # past 95 %: demote to 85 %
    stats = client.stats()
    assert stats["demotions"] >= 1 and stats["tiers"]["nvme"]["entries"] >= 1
    for pid, n in ((1, 200), (2, 48)):
        got = client.drop_select(prompt_tokens(pid, n))
        assert got.matched_tokens == n
        assert np.array_equal(got.kv.numpy(), prompt_kv(pid, n))
    assert client.stats()["entries"] == 0


def test_writeback_off_copies_nothing_and_demotion_still_works(server_factory, client_factory):
    srv = server_factory(dram="256KiB", nvme="8MiB",
                         env={"KVSTORE_POLICY_BACKGROUND_WRITEBACK": "false"})
    client = client_factory(srv)
    client.insert(prompt_tokens(3, 200), prompt_kv(3, 200))
    time.sleep(0.5)  # several rounds' worth of the writeback thread's idle wait
    assert client.stats()["nvme_copies"] == 0 and client.stats()["writebacks"] == 0
    client.insert(prompt_tokens(4, 48), prompt_kv(4, 48))
    assert client.stats()["demotions"] >= 1  # written inline, as before
    got = client.drop_select(prompt_tokens(3, 200))
    assert got.matched_tokens == 200 and np.array_equal(got.kv.numpy(), prompt_kv(3, 200))
