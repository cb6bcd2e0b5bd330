"""The v0 lookup buffer against real kvstore-server processes (loopback ports).

In the spirit of vLLM's own lookup-buffer tests: the [1, 2, 3] round trip, the store
empty afterwards; a shuffled many-request stress test through a server too small to
hold them all at once; bounded misses; exact-key matching.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvstore.client.client import KVStoreClient
from kvstore.connector.lookup_buffer import KVStoreLookupBuffer
from kvstore.core.errors import InvalidRequestError

pytestmark = pytest.mark.timeout(120)


def _buffer(server, **opts) -> KVStoreLookupBuffer:
    opts.setdefault("block_tokens", 4)
    opts.setdefault("staging_bytes", 1 << 20)
    return KVStoreLookupBuffer(server.address, **opts)


def _entries(server) -> int:
    with KVStoreClient(server.address, timeout_s=10.0) as admin:
        return admin.stats()["entries"]


@pytest.mark.parametrize("same_node", ["auto", False], ids=["shm", "te"])
def test_vllm_round_trip_then_store_empty(clean_server, same_node):
    server = clean_server
    provider, consumer = _buffer(server), _buffer(server, same_node=same_node)
    assert _entries(server) == 0
    tokens = torch.tensor([1, 2, 3])
    roi = tokens > 0
    key, value = 2.0 * torch.ones([5, 6]), 3.0 * torch.ones([5, 6])
    provider.insert(tokens, roi, key, value, torch.tensor([1]))
    assert _entries(server) > 0

    tok, roi_, key_, value_, hidden = consumer.drop_select(tokens, roi)
    assert torch.equal(tok, tokens) and torch.equal(roi_, roi)
    assert torch.allclose(key_, 2.0 * torch.ones([5, 6]))
    assert torch.allclose(value_, 3.0 * torch.ones([5, 6]))
    assert torch.equal(hidden, torch.tensor([1]))
    assert _entries(server) == 0  # dropped: the buffer is empty again
    provider.close(), consumer.close()


def test_miss_returns_nones_within_timeout(clean_server):
    server = clean_server
    buf = _buffer(server, select_timeout_s=0.3)
    start = time.monotonic()
    assert buf.drop_select(torch.tensor([7, 8, 9]), None) == [None] * 5
    assert 0.3 <= time.monotonic() - start < 3.0
    buf.close()


def test_exact_tokens_only_never_a_neighbours_kv(clean_server):
    server = clean_server
    """A shorter, longer or differently masked prompt is a miss, not someone's prefix."""
    provider, consumer = _buffer(server), _buffer(server, select_timeout_s=0.2)
    tokens = torch.arange(100, 110)
    provider.insert(tokens, torch.ones(10, dtype=torch.bool), torch.zeros(3), torch.ones(3), None)
    assert consumer.drop_select(tokens[:9], None) == [None] * 5
    assert consumer.drop_select(torch.arange(100, 111), None) == [None] * 5
    half = torch.arange(10) < 5
    assert consumer.drop_select(tokens, half) == [None] * 5
    got = consumer.drop_select(tokens, torch.ones(10, dtype=torch.bool))
    assert torch.equal(got[3], torch.ones(3)) and got[4] is None
    assert _entries(server) == 0


def test_roi_selects_the_key_tokens(clean_server):
    server = clean_server
    provider, consumer = _buffer(server), _buffer(server, select_timeout_s=0.2)
    tokens, roi = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([False, True, True, True, False])
    provider.insert(tokens, roi, torch.full((2, 3), 4.0), torch.full((2, 3), 5.0), None)
    # Same masked tokens ([6, 7, 8]) under a different padding: the same entry.
    got = consumer.drop_select(torch.tensor([0, 6, 7, 8]), torch.tensor([False, True, True, True]))
    assert torch.equal(got[0], tokens) and torch.equal(got[2], torch.full((2, 3), 4.0))


def test_bad_input_is_a_typed_error(clean_server):
    server = clean_server
    buf = _buffer(server)
    with pytest.raises(InvalidRequestError):
        buf.insert(torch.tensor([1, 2]), torch.tensor([True]), torch.ones(1), torch.ones(1), None)
    with pytest.raises(InvalidRequestError):
        buf.drop_select(torch.tensor([1, 2]), torch.tensor([False, False]))
    with pytest.raises(InvalidRequestError):
        buf.drop_select(torch.tensor([-1, 2]), None)
    assert _entries(server) == 0


def _stress_requests(n: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(100)
    reqs = []
    for i in range(n):
        ntok = int(torch.randint(3, 40, (1,), generator=g))
        tokens = torch.randint(0, 50_000, (ntok,), generator=g)
        tokens[0] = i  # distinct prompts
        reqs.append((tokens, torch.ones(ntok, dtype=torch.bool),
                     torch.rand(2, ntok, 4, 8, generator=g), torch.rand(2, ntok, 4, 8, generator=g),
                     torch.rand(ntok, 16, generator=g)))
    return reqs


@pytest.mark.timeout(180)
def test_shuffled_stress_through_a_small_server(server_factory):
    """200 requests (~2.5 MiB of records) through a 1 MiB DRAM tier and no NVMe.

    As in vLLM's stress test, provider and consumer walk the requests in different
    shuffled orders. The provider must wait while the server is full of unconsumed
    entries (never evicting one); the consumer answers misses quickly and comes back
    to them later. Nothing deadlocks, nothing is lost, each request gets its own KV.
    """
    server = server_factory(dram="1MiB", nvme="0")
    reqs = _stress_requests(200)
    produce_order, consume_order = list(range(len(reqs))), list(range(len(reqs)))
    random.Random(0).shuffle(produce_order)
    random.Random(1).shuffle(consume_order)
    provider = _buffer(server, block_tokens=16, insert_timeout_s=60.0)
    consumer = _buffer(server, block_tokens=16, select_timeout_s=0.02)
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for i in produce_order:
                provider.insert(*reqs[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    pending, misses, deadline = consume_order, 0, time.monotonic() + 150
    while pending and time.monotonic() < deadline and not errors:
        left = []
        for i in pending:
            out = consumer.drop_select(reqs[i][0], reqs[i][1])
            if out[0] is None:
                assert out == [None] * 5
                left.append(i)
                continue
            for want, have in zip(reqs[i], out):
                assert torch.equal(want, have), f"request {i} got wrong tensors"
        misses += len(left)
        pending = left
    thread.join(30)
    assert not errors and not thread.is_alive()
    assert not pending, f"{len(pending)} requests never arrived"
    assert misses > 0  # the orders differ: the consumer did have to come back
    assert provider.full_waits > 0  # and the provider did have to wait for room
    assert _entries(server) == 0
    provider.close(), consumer.close()


def test_two_inserts_of_one_prompt_serve_two_consumers(clean_server):
    """Like two prefills of one prompt for two decodes: each drop_select takes one."""
    server = clean_server
    provider = _buffer(server)
    consumers = [_buffer(server, select_timeout_s=0.2) for _ in range(3)]
    tokens = torch.arange(40, 53)
    for _ in range(2):
        provider.insert(tokens, None, torch.full((4,), 7.0), torch.full((4,), 8.0), None)
    for consumer in consumers[:2]:
        got = consumer.drop_select(tokens, None)
        assert got[0] is not None and torch.equal(got[2], torch.full((4,), 7.0))
    assert consumers[2].drop_select(tokens, None) == [None] * 5
    assert _entries(server) == 0
    for buf in (provider, *consumers):
        buf.close()


def test_etcd_address_round_trip_through_a_registered_server(server_factory):
    """Both sides name only the cluster's etcd; the entry lives on the registered node
    and is gone from it after the consumer's drop_select."""
    from tools.etcd_proc import start_etcd

    with start_etcd() as etcd:
        node = server_factory(extra=("--cluster", etcd.url, "--cluster-prefix", "/v0c/",
                                     "--node-id", "only"))
        opts = dict(block_tokens=4, staging_bytes=1 << 20, cluster_prefix="/v0c/")
        with KVStoreLookupBuffer(etcd.url, **opts) as provider, \
                KVStoreLookupBuffer(etcd.url, same_node=False, **opts) as consumer:
            tokens = torch.arange(40, 50)
            roi = torch.ones(10, dtype=torch.bool)
            provider.insert(tokens, roi, torch.full((2, 3), 4.0), torch.zeros(1), None)
            assert _entries(node) == 4  # 3 blocks and the record
            tok, roi_, key, value, hidden = consumer.drop_select(tokens, roi)
            assert torch.equal(tok, tokens) and torch.equal(key, torch.full((2, 3), 4.0))
            assert hidden is None
            assert _entries(node) == 0  # consumed: unpinned and dropped on the node
            # A record of several staging buffers: its parts are placed like prompts.
            big = torch.rand(3 << 18)  # 3 MiB
            provider.insert(tokens, roi, big, None, None)
            assert torch.equal(consumer.drop_select(tokens, roi)[2], big)
            assert _entries(node) == 0


def _stats(server) -> dict:
    with KVStoreClient(server.address, timeout_s=10.0) as admin:
        return admin.stats()


def test_select_any_is_an_immediate_miss_with_one_warning(clean_server, caplog):
    """vLLM's base class lets drop_select(None, None) pop any entry; an exact-key
    store has none to offer: a miss at once (not after select_timeout_s), a warning
    once, and the stored entry left for the consumer that names its tokens."""
    server = clean_server
    provider, consumer = _buffer(server), _buffer(server, select_timeout_s=5.0)
    tokens = torch.arange(60, 70)
    provider.insert(tokens, None, torch.ones(4), torch.zeros(4), None)
    stored = _entries(server)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="kvstore.connector.lookup_buffer"):
        assert consumer.drop_select(None, None) == [None] * 5
        assert consumer.drop_select(None, torch.ones(10, dtype=torch.bool)) == [None] * 5
    assert time.monotonic() - start < 4.0  # (not select_timeout_s, 5 s, even once)
    assert consumer.select_any_calls == 2
    assert sum("select any" in r.getMessage() for r in caplog.records) == 1
    assert _entries(server) == stored  # nothing was taken
    assert torch.equal(consumer.drop_select(tokens, None)[2], torch.ones(4))
    assert _entries(server) == 0
    provider.close(), consumer.close()


@pytest.mark.parametrize("record_mib", [3, 10], ids=["3MiB", "10MiB"])
def test_record_larger_than_the_staging_buffer_crosses_nodes(server_factory, record_mib):
    """Over TE every entry is staged through the client's registered buffer (1 MiB
    here, as 256 MiB is for a ~2k-token prompt of an 8B model). A record of several
    buffers (it used to be an InvalidRequestError) travels as parts: the consumer
    gets it whole, and nothing stays behind."""
    server = server_factory(dram="64MiB", nvme="0")
    provider = _buffer(server, same_node=False)
    consumer = _buffer(server, same_node=False, select_timeout_s=2.0)
    g = torch.Generator().manual_seed(3)
    n = (record_mib << 20) // 8  # two fp32 tensors of record_mib / 2 each
    tokens, roi = torch.arange(500, 537), torch.ones(37, dtype=torch.bool)
    key, value = torch.rand(n, generator=g), torch.rand(n, generator=g)
    hidden = torch.rand(37, 8, generator=g)
    provider.insert(tokens, roi, key, value, hidden)
    assert provider.insert_misses == 0
    assert _entries(server) > 2 * record_mib  # the prompt's entries and 512 KiB parts

    got = consumer.drop_select(tokens, roi)
    for want, have in zip((tokens, roi, key, value, hidden), got):
        assert torch.equal(want, have)
    stats = _stats(server)
    assert stats["entries"] == 0 and stats["pinned_entries"] == 0
    provider.close(), consumer.close()


def test_consumer_too_small_for_the_producers_parts_misses_and_leaves_no_pin(
        server_factory, caplog):
    """Parts are half the producer's staging buffer; a consumer with a smaller one
    cannot read them over TE: a miss with a warning, and the parts unpinned. (Asking
    for them in the acquire's reply, ``client.inline_max_bytes``, it would get these
    3 MiB parts: that consumer reads over TE only.)"""
    from kvstore.core.config import ClientConfig

    server = server_factory(dram="64MiB", nvme="0")
    provider = _buffer(server, staging_bytes=4 << 20, same_node=False)
    consumer = _buffer(server, staging_bytes=1 << 20, same_node=False, select_timeout_s=2.0,
                       config=ClientConfig(inline_max_bytes=0))
    tokens = torch.arange(10, 30)
    provider.insert(tokens, None, torch.ones(3 << 18), torch.zeros(3 << 18), None)  # 6 MiB
    assert _stats(server)["pinned_entries"] > 0
    with caplog.at_level("WARNING", logger="kvstore.connector.lookup_buffer"):
        assert consumer.drop_select(tokens, None) == [None] * 5
    assert any("same staging_bytes" in r.getMessage() for r in caplog.records)
    assert _stats(server)["pinned_entries"] == 0
    provider.close(), consumer.close()


@pytest.mark.parametrize("record_kib, occupant_kib, next_kib", [(400, 700, 200), (1536, 300, 600)],
                         ids=["one-record", "in-parts"])
def test_insert_into_a_server_that_stays_full_is_skipped(server_factory, record_kib,
                                                         occupant_kib, next_kib):
    """vLLM's v0 insert cannot fail: a server still full (of an unconsumed entry)
    after insert_timeout_s skips the insert (counted; its consumer misses and
    recomputes). Parts already stored for it are unpinned: the next insert, which
    fits only without them, goes in."""
    server = server_factory(dram="1MiB", nvme="0")
    provider = _buffer(server, insert_timeout_s=0.3)
    consumer = _buffer(server, select_timeout_s=0.2)
    occupant = torch.arange(1, 9)
    provider.insert(occupant, None, torch.zeros(occupant_kib << 10, dtype=torch.uint8), None, None)
    pinned = _stats(server)["pinned_entries"]
    tokens = torch.arange(100, 120)
    start = time.monotonic()
    provider.insert(tokens, None, torch.ones(record_kib << 10, dtype=torch.uint8), None, None)
    assert 0.3 <= time.monotonic() - start < 5.0  # waited for room, then gave up
    assert provider.insert_misses == 1 and provider.full_waits > 0
    assert _stats(server)["pinned_entries"] == pinned  # no part of it stays pinned
    assert consumer.drop_select(tokens, None) == [None] * 5
    following = torch.arange(200, 210)
    provider.insert(following, None, torch.ones(next_kib << 10, dtype=torch.uint8), None, None)
    assert provider.insert_misses == 1
    assert consumer.drop_select(following, None)[0] is not None
    assert consumer.drop_select(occupant, None)[0] is not None
    assert _stats(server)["pinned_entries"] == 0
    provider.close(), consumer.close()


def test_insert_to_an_unreachable_server_is_skipped(server_factory):
    """A provider whose server is gone: insert returns (a miss for the writer)."""
    server = server_factory()
    provider = _buffer(server, timeout_s=1.0)
    provider.insert(torch.arange(5), None, torch.ones(2), None, None)
    server.stop()
    start = time.monotonic()
    provider.insert(torch.arange(5, 10), None, torch.ones(2), None, None)
    assert time.monotonic() - start < 10.0
    assert provider.insert_misses == 1
    provider.close()
