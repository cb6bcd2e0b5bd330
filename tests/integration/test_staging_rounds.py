"""A prompt whose NVMe entries do not fit the server's DRAM at once is served whole,
in rounds; when no room can be made at all the caller is told why (``short``)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.core.errors import TierFullError
from tests.integration.client_worker import prompt_kv, prompt_tokens

pytestmark = pytest.mark.timeout(120)

BIG = 400  # tokens: 100 blocks of 512 B, a 4 KiB DRAM page each; DRAM has 64 pages


def _on_nvme(client, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while client.stats()["tiers"]["nvme"]["entries"] < n:
        assert time.monotonic() < deadline, client.stats()
        time.sleep(0.1)


def _server(server_factory):
    # Low watermarks: the reaper demotes everything unleased down to NVMe.
    return server_factory(dram="256KiB", nvme="8MiB",
                          extra=("--high-watermark", "0.2", "--low-watermark", "0.05"))


def _insert_big(client, pid: int) -> None:
    # 100 blocks cannot be reserved in 64 pages at once: the first half goes first
    # (and down to NVMe), then the whole prompt dedups onto it.
    client.insert(prompt_tokens(pid, BIG // 2), prompt_kv(pid, BIG)[:BIG // 2 * 128])
    _on_nvme(client, 40)
    client.insert(prompt_tokens(pid, BIG), prompt_kv(pid, BIG))


@pytest.mark.parametrize("drop", [True, False], ids=["drop_select", "get"])
def test_prompt_bigger_than_dram_is_staged_in_rounds(server_factory, client_factory, drop):
    srv = _server(server_factory)
    client = client_factory(srv)
    _insert_big(client, 1)
    _on_nvme(client, 90)
    got = (client.drop_select if drop else client.get)(prompt_tokens(1, BIG))
    assert got.matched_tokens == BIG and got.short == ""
    assert np.array_equal(got.kv.numpy(), prompt_kv(1, BIG))
    stats = client.stats()
    assert stats["staging_shortfalls"] >= 1 and stats["leases"] == 0
    if drop:  # nothing stranded: the half prompt's own insert has one consumer left
        half = client.drop_select(prompt_tokens(1, BIG // 2))
        assert half.matched_tokens == BIG // 2
        assert client.stats()["entries"] == 0 and client.ls() == []
    else:
        assert client.get(prompt_tokens(1, BIG)).matched_tokens == BIG


def test_rounds_land_in_the_callers_buffer(server_factory, client_factory):
    srv = _server(server_factory)
    client = client_factory(srv, same_node=False)
    _insert_big(client, 2)
    _on_nvme(client, 90)
    out = np.zeros(prompt_kv(2, BIG).nbytes + 4096, dtype=np.uint8)
    got = client.drop_select(prompt_tokens(2, BIG), into=out)
    assert got.matched_tokens == BIG
    assert np.array_equal(out[:prompt_kv(2, BIG).nbytes], prompt_kv(2, BIG))


def test_dram_full_of_pinned_entries_says_why_nvme_hits_are_not_served(server_factory,
                                                                       client_factory):
    srv = _server(server_factory)
    client = client_factory(srv)
    client.insert(prompt_tokens(3, 64), prompt_kv(3, 64))
    _on_nvme(client, 13)  # the low watermark leaves 3 of its 16 blocks in DRAM
    client.pin(client.keys_for(prompt_tokens(3, 64)))
    fillers = []
    for pid in range(100, 200):  # one-block prompts, pinned, until DRAM is full of them
        try:
            client.insert(prompt_tokens(pid, 4), prompt_kv(pid, 4), pin=True)
        except TierFullError:
            break
        fillers.append(pid)
    got = client.drop_select(prompt_tokens(3, 64))
    assert got.matched_tokens < 64 and got.short == "no_room_to_stage"
    assert client.stats()["staging_shortfalls"] >= 1
    assert client.lookup(prompt_tokens(3, 64)).matched_tokens == 64  # still stored
    for pid in fillers:  # room again: served whole
        client.unpin(client.keys_for(prompt_tokens(pid, 4)))
    got = client.drop_select(prompt_tokens(3, 64))
    assert got.matched_tokens == 64 and got.short == ""
    assert np.array_equal(got.kv.numpy(), prompt_kv(3, 64))


def test_rest_with_no_room_after_the_first_round_is_spent_not_stranded(server_factory,
                                                                        client_factory):
    """Round one stages what DRAM holds and takes it; before round two, another
    client pins DRAM full. The rest can never be read whole again (its head is
    gone): the server spends it, the caller hears it got part, and the half
    prompt's own insert is still served whole once there is room."""
    from kvstore.client.client import KVStoreClient

    srv = _server(server_factory)
    other = client_factory(srv)
    fillers: list[int] = []

    class FillAfterFirstRound(KVStoreClient):
        def _read_round(self, *args, **kwargs):
            out = super()._read_round(*args, **kwargs)
            for pid in range(100, 300) if not fillers else ():
                try:
                    other.insert(prompt_tokens(pid, 4), prompt_kv(pid, 4), pin=True)
                except TierFullError:
                    fillers.append(-1)
                    break
                fillers.append(pid)
            return out

    client = client_factory(srv)
    _insert_big(client, 4)
    _on_nvme(client, 90)
    reader = FillAfterFirstRound(srv.address, layout=client.layout, timeout_s=10.0)
    try:
        got = reader.drop_select(prompt_tokens(4, BIG))
    finally:
        reader.close()
    assert 0 < got.matched_tokens < BIG and got.short == "no_room_to_stage", (fillers, client.stats())
    assert np.array_equal(got.kv.numpy(), prompt_kv(4, BIG)[:got.matched_tokens * 128])
    stats = client.stats()
    assert stats["staging_spent"] > 0 and stats["leases"] == 0
    # Nothing of the whole prompt is left that only it could reach.
    assert client.lookup(prompt_tokens(4, BIG)).matched_tokens <= BIG // 2
    for pid in fillers:
        if pid > 0:
            other.unpin(other.keys_for(prompt_tokens(pid, 4)))
    half = client.drop_select(prompt_tokens(4, BIG // 2))
    assert half.matched_tokens == BIG // 2 and half.short == ""
    assert np.array_equal(half.kv.numpy(), prompt_kv(4, BIG // 2 * 2)[:BIG // 2 * 128])
    assert client.stats()["entries"] == sum(1 for pid in fillers if pid > 0)
