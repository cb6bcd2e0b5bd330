"""KVStoreClient against a real server: exact bytes both ways, on both data paths.

``same_node="auto"`` memcpys through the server's shared DRAM arena (the server is on
this node); ``same_node=False`` forces real TE transfers over loopback TCP.
"""

import time

import numpy as np
import pytest
import torch

from kvstore.core import protocol as p
from kvstore.core.errors import (ChecksumError, InvalidRequestError, KVTimeoutError,
                                 NotFoundError, PeerUnavailableError, TierFullError)
from kvstore.core.layout import unpack_hf
from tests.integration.conftest import LAYOUT, damage_at_rest, free_port, make_kv

pytestmark = pytest.mark.timeout(120)
PATHS = pytest.mark.parametrize("same_node", ["auto", False], ids=["shm", "te"])


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(1000 + seed).integers(0, 50_000, n).tolist()


@PATHS
def test_raw_bytes_round_trip_any_length(clean_server, client_factory, same_node):
    client = client_factory(clean_server, same_node=same_node)
    assert client.hello() and client._data.uses_shared_memory is (same_node == "auto")
    # shorter than a block, one block, not a multiple of the block
    for seed, n in enumerate([1, 3, 4, 5, 16, 37]):
        kv = make_kv(n, seed)
        res = client.insert(prompt(n, seed), kv)
        assert res == (len(LAYOUT.entry_sizes(n)), 0, n, kv.size)
        got = client.drop_select(prompt(n, seed))
        assert got.matched_tokens == n and got.hidden is None
        assert np.array_equal(got.kv.numpy(), kv)
    assert client.stats()["entries"] == 0
    # The same-node path never even started a TE engine; the TE path did.
    assert (client._data.engine.transport is None) is (same_node == "auto")


def test_the_client_hashes_a_prompt_with_the_extensions_loop(clean_server, client_factory,
                                                              monkeypatch):
    """Every insert, lookup and drop_select takes its keys from ``prompt_keys`` (the C
    loop), and they name the same entries as Python's path: a prompt inserted with it
    is found and taken with the Python path, and the other way round."""
    import kvstore.client.client as client_mod
    from kvstore.client.shm import PROMPT_KEYS

    calls = []

    def counted(*args):
        calls.append(args[2])
        return PROMPT_KEYS(*args)

    client = client_factory(clean_server)
    for seed, (insert_c, select_c) in enumerate([(True, False), (False, True)]):
        tokens, kv = prompt(37, seed), make_kv(37, seed)
        monkeypatch.setattr(client_mod, "PROMPT_KEYS", counted if insert_c else None)
        client.insert(tokens, kv)
        monkeypatch.setattr(client_mod, "PROMPT_KEYS", counted if select_c else None)
        assert client.lookup(tokens).matched_tokens == 37
        got = client.drop_select(tokens)
        assert got.matched_tokens == 37 and np.array_equal(got.kv.numpy(), kv)
    assert calls == [LAYOUT.block_tokens] * 3  # the first insert, the second lookup and select
    assert client.stats()["entries"] == 0


@PATHS
def test_hf_tensors_and_hidden_round_trip(clean_server, client_factory, same_node):
    client = client_factory(clean_server, same_node=same_node)
    n = 11
    g = torch.Generator().manual_seed(3)
    past = [tuple(torch.randn(1, 2, n, 8, generator=g).half() for _ in "kv")
            for _ in range(LAYOUT.num_layers)]
    hidden = torch.randn(n, 32, generator=g).bfloat16()
    client.insert(prompt(n), past, hidden=hidden)
    got = client.drop_select(prompt(n))
    assert got.matched_tokens == n
    for (k, v), (k2, v2) in zip(past, unpack_hf(LAYOUT, got.kv, n)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert got.hidden.dtype == torch.bfloat16 and torch.equal(got.hidden, hidden)
    assert client.stats()["entries"] == 0


def test_two_consumers_of_one_prefix_both_get_it(clean_server, client_factory):
    producer, c1, c2 = (client_factory(clean_server, same_node=s) for s in ("auto", False, "auto"))
    kv = make_kv(9, 1)
    assert producer.insert(prompt(9), kv).new_blocks == 3
    # dedup: nothing stored twice (the bytes went into the producer's room, same-node
    # memcpy, before the server said they were stored already)
    assert producer.insert(prompt(9), kv)[:3] == (0, 3, 9)
    for consumer in (c1, c2):
        got = consumer.drop_select(prompt(9))
        assert got.matched_tokens == 9 and np.array_equal(got.kv.numpy(), kv)
    assert c1.drop_select(prompt(9)).matched_tokens == 0
    c2.stats()  # c2's release was one-way: its next reply comes after it is applied
    assert producer.stats()["entries"] == 0


@PATHS
def test_get_is_non_destructive_and_lookup_reports_prefix(clean_server, client_factory, same_node):
    client = client_factory(clean_server, same_node=same_node)
    kv = make_kv(10, 2)
    client.insert(prompt(10), kv)
    assert client.lookup(prompt(10)).matched_tokens == 10
    longer = prompt(10) + [7] * 6  # same first 8 tokens (2 full blocks), then differs
    assert client.lookup(longer) == (8, 2, ["dram", "dram"])
    for _ in range(2):
        got = client.get(prompt(10))
        assert np.array_equal(got.kv.numpy(), kv)
    got = client.drop_select(longer)
    assert got.matched_tokens == 8 and np.array_equal(got.kv.numpy(), kv[:LAYOUT.nbytes(8)])
    # ``longer`` was never inserted: it read prompt(10)'s shared blocks and took nothing
    # (docs/architecture.md, "Who a drop_select takes from"); prompt(10)'s own takes it.
    assert client.lookup(prompt(10)).matched_tokens == 10
    assert client.drop_select(prompt(10)).matched_tokens == 10
    assert client.lookup(prompt(10)).matched_tokens == 0


def test_miss_returns_zero_quickly(clean_server, client_factory):
    client = client_factory(clean_server)
    start = time.monotonic()
    got = client.drop_select(prompt(40, 9), timeout=2.0)
    assert got == (0, None, None, "") and time.monotonic() - start < 2.0


def test_prompt_larger_than_staging_buffer(clean_server, client_factory):
    client = client_factory(clean_server, same_node=False, staging_bytes=16 << 10)  # 32 blocks fit
    kv = make_kv(400, 4)  # 50 KiB: four staging rounds each way
    client.insert(prompt(400, 4), kv)
    got = client.drop_select(prompt(400, 4))
    assert got.matched_tokens == 400 and np.array_equal(got.kv.numpy(), kv)


@pytest.mark.parametrize("same_node", ["auto", False], ids=["shm", "te"])
def test_corrupt_bytes_are_a_checksum_miss_reported_and_dropped(clean_server, client_factory,
                                                                 same_node):
    client = client_factory(clean_server, same_node=same_node)
    client.insert(prompt(12, 5), make_kv(12, 5))
    keys = client.keys_for(prompt(12, 5))
    damage_at_rest(client, keys[1:])  # a stray writer hit blocks 1 and 2
    before = client.stats()["checksum_failures"]
    with pytest.raises(ChecksumError):
        client.drop_select(prompt(12, 5))
    # The reader reported it; the server re-checked the lease, counted both bad
    # entries and dropped them (the alert fires); the good block 0 stays, undropped.
    stats = client.stats()
    assert stats["checksum_failures"] - before == 2 and stats["leases"] == 0
    assert {e["key"] for e in client.ls()} == {keys[0]}
    assert client.lookup(prompt(12, 5)).matched_tokens == 4


def test_bad_input_is_refused_and_reserves_nothing(clean_server, client_factory):
    client = client_factory(clean_server)
    with pytest.raises(InvalidRequestError, match="bytes of KV"):
        client.insert(prompt(5), make_kv(4))
    with pytest.raises(InvalidRequestError, match="empty"):
        client.insert([], make_kv(1))
    with pytest.raises(TierFullError):
        client.insert(prompt(1 << 16), make_kv(1 << 16))  # 8 MiB > the 4 MiB DRAM tier
    stats = client.stats()
    assert stats["reservations"] == 0 and stats["entries"] == 0
    client.insert(prompt(4), make_kv(4))
    assert client.lookup(prompt(4)).matched_tokens == 4


BAD_TIMEOUTS = [-1, 0, float("nan"), float("inf"), "3", True]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
def test_a_bad_timeout_is_refused_before_anything_is_sent(clean_server, client_factory, bad):
    """NaN and infinity used to end in a ValueError or OverflowError deep in the
    socket wait, a negative timeout in a late acquire; now each is refused at the
    call, and the prompt stays stored for the next reader."""
    from kvstore.client.client import KVStoreClient
    from kvstore.core.errors import ConfigError

    from kvstore.cluster.client import ClusterClient

    with pytest.raises(ConfigError, match="timeout_s must be a finite number"):
        KVStoreClient(clean_server.address, layout=LAYOUT, timeout_s=bad)
    with pytest.raises(ConfigError, match="timeout_s must be a finite number"):
        ClusterClient("http://127.0.0.1:9", LAYOUT, timeout_s=bad)  # before etcd is asked
    client = client_factory(clean_server, same_node=False)
    client.insert(prompt(8, 9), make_kv(8, 9))
    before = client.stats()
    for call in (lambda: client.drop_select(prompt(8, 9), timeout=bad),
                 lambda: client.get(prompt(8, 9), timeout=bad),
                 lambda: client.lookup(prompt(8, 9), timeout_s=bad)):
        with pytest.raises(InvalidRequestError, match="timeout must be a finite number"):
            call()
    after = client.stats()
    assert (after["leases"], after["late_reads"]) == (0, before["late_reads"])
    got = client.drop_select(prompt(8, 9), timeout=5)
    assert got.matched_tokens == 8 and np.array_equal(got.kv.numpy(), make_kv(8, 9))


def test_wait_s_is_always_one_the_server_takes(clean_server, client_factory):
    """A call with no time left, or with hours of it, still sends a wait_s within the
    protocol's (0, MAX_LEASE_S]: the call ends as a miss or succeeds, never with the
    server refusing the request as invalid."""
    from kvstore.core.errors import MissError

    client = client_factory(clean_server, same_node=False)
    client.insert(prompt(8, 3), make_kv(8, 3))
    client.hello()
    assert (client._wait_s(-1.0), client._wait_s(0.0), client._wait_s(1e6)) == \
        (0.001, 0.001, p.MAX_LEASE_S)
    with pytest.raises(MissError):
        client.drop_select(prompt(8, 3), timeout=1e-7)
    patient = client_factory(clean_server, same_node=False, timeout_s=5000.0)
    assert patient.hello()["wait_s"]
    assert patient.lookup(prompt(8, 3), timeout_s=4000).matched_tokens == 8
    got = patient.drop_select(prompt(8, 3))
    assert got.matched_tokens == 8 and np.array_equal(got.kv.numpy(), make_kv(8, 3))


def test_admin_calls(clean_server, client_factory):
    client = client_factory(clean_server)
    client.insert(prompt(12, 6), make_kv(12, 6))
    keys = client.keys_for(prompt(12, 6))
    entries = client.ls()
    assert sorted(e["key"] for e in entries) == sorted(keys) and entries[0]["tier"] == "dram"
    assert len(client.ls(limit=1)) == 3
    # verify goes in batches of keys: the server's lock is never held for a whole
    # tier's read.
    sent = []
    real = client._rpc.call
    client._rpc.call = lambda req, *a, **k: (sent.append(req), real(req, *a, **k))[1]
    assert client.verify(batch=2) == {"checked": 3, "bad": []}
    del client._rpc.call
    assert [len(r.keys) for r in sent if isinstance(r, p.Verify)] == [2, 1]
    assert client.pin(keys[:1]) == 1
    res = client.evict(everything=True)
    assert res["count"] == 2 and res["skipped"] == 1
    assert client.unpin(keys[:1]) == 1
    with pytest.raises(NotFoundError):
        client.pin(keys[1:2])
    assert client.verify()["bad"] == []
    assert client.health(deep=True)["status"] == "ok"
    assert client.clear()["count"] == 1 and client.stats()["entries"] == 0


def test_server_absent_is_peer_unavailable_in_bounded_time(client_factory):
    client = client_factory(f"tcp://127.0.0.1:{free_port()}", timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(PeerUnavailableError):
        client.lookup(prompt(4))
    assert time.monotonic() - start < 3.0


def test_a_calls_timeout_bounds_its_first_hello_too(client_factory):
    """A client that has not reached its server yet says hello within the call's own
    timeout, not the client's (a decode worker started while its server is down
    would wait the client's timeout per request)."""
    client = client_factory(f"tcp://127.0.0.1:{free_port()}", timeout_s=10.0)
    for call in (client.drop_select, client.get):
        start = time.monotonic()
        with pytest.raises((PeerUnavailableError, KVTimeoutError)):
            call(prompt(4), timeout=0.5)
        assert time.monotonic() - start < 3.0


def test_concurrent_drop_selects_claim_each_pending_consumer_once(clean_server, client_factory):
    from kvstore.core import protocol as p
    client = client_factory(clean_server)
    client.insert(prompt(8, 7), make_kv(8, 7))
    keys = tuple(client.keys_for(prompt(8, 7)))
    toks = tuple(client._prompt(prompt(8, 7)).tokens)
    first = client._rpc.call(p.Acquire(keys=keys, tokens=toks, claim=True))
    assert len(first["entries"]) == 2
    # A second drop_select while the first is in flight finds nothing left to claim...
    assert client._rpc.call(p.Acquire(keys=keys, tokens=toks, claim=True))["entries"] == []
    # ...while a non-destructive get still can read it.
    assert client.get(prompt(8, 7)).matched_tokens == 8
    client._rpc.call(p.Release(aid=first["aid"], drop=False))  # gives the claim back
    assert client.drop_select(prompt(8, 7)).matched_tokens == 8
    assert client.lookup(prompt(8, 7)).matched_tokens == 0


def test_large_te_insert_goes_straight_from_the_callers_buffer(clean_server, client_factory):
    """From ``direct_write_min_bytes`` a TE insert registers the caller's buffers for
    the call and writes from them: no copy into staging, no staging buffer at all,
    nothing left registered. Page-multiple entries (4 KiB a token), a hidden tensor
    (its own allocation: a second registered span) included."""
    from kvstore.core.layout import KVLayout

    layout = KVLayout(num_layers=4, kv_heads=4, head_dim=64, dtype="float16", block_tokens=4)
    client = client_factory(clean_server, layout=layout, same_node=False,
                            staging_bytes=64 << 10)  # smaller than the prompt
    client._data.direct_write_min_bytes = 64 << 10
    n = 42  # 10 full blocks and a partial one: 168 KiB
    kv = make_kv(n, seed=5, layout=layout)
    hidden = torch.arange(300, dtype=torch.float32)
    assert client.insert(prompt(n), kv, hidden=hidden).new_blocks == 11
    engine = client._data.engine
    assert engine.transport is not None and engine._stage is None  # never staged
    assert engine.transport.regions() == []  # the caller's spans were unregistered
    into = np.zeros(layout.nbytes(n) + 4096, dtype=np.uint8)
    got = client.drop_select(prompt(n), into=into)
    assert got.matched_tokens == n and np.array_equal(got.kv.numpy(), kv)
    assert torch.equal(got.hidden, hidden)


def test_small_or_scattered_te_inserts_use_staging(clean_server, client_factory):
    # Below the threshold, or sub-page entries (their page-padded extents would each
    # be a TE transfer from the caller's buffer; staging bridges the gaps): staged.
    small = client_factory(clean_server, same_node=False)
    small._data.direct_write_min_bytes = 1 << 20
    small.insert(prompt(8, seed=1), make_kv(8, seed=1))  # 1 KiB: under the threshold
    assert small._data.engine._stage is not None
    scattered = client_factory(clean_server, same_node=False)
    scattered._data.direct_write_min_bytes = 0
    kv = make_kv(64, seed=2)  # 16 entries of 512 bytes, a page apart in the arena
    scattered.insert(prompt(64, seed=2), kv)
    assert scattered._data.engine._stage is not None
    got = scattered.drop_select(prompt(64, seed=2))
    assert np.array_equal(got.kv.numpy(), kv)


def test_an_insert_that_skips_blocks_the_server_holds_sends_only_the_rest(clean_server,
                                                                          client_factory):
    """A prefix cache saving a prompt whose head it found stored sends only the rest
    (``skip_blocks``); the whole prompt reads back. If the server lost a skipped block
    meanwhile, nothing is stored and no reservation stays."""
    client = client_factory(clean_server)
    bt = LAYOUT.block_tokens
    head, whole = prompt(2 * bt, 31), prompt(2 * bt, 31) + prompt(bt + 3, 32)
    kv = make_kv(len(whole), 33)
    client.insert(head, kv[:LAYOUT.nbytes(2 * bt)])
    res = client.insert(whole, kv[LAYOUT.nbytes(2 * bt):], skip_blocks=2)
    assert (res.new_blocks, res.existing_blocks) == (2, 2)
    assert res.nbytes == kv.size - LAYOUT.nbytes(2 * bt)
    assert np.array_equal(client.get(whole).kv.numpy(), kv)

    client.evict(keys=client.keys_for(whole)[1:2])  # the server loses block 1
    other = prompt(2 * bt, 31) + prompt(bt, 34)
    with pytest.raises(NotFoundError, match="lacks block 1"):
        client.insert(other, make_kv(bt, 35), skip_blocks=2)
    stats = client.stats()
    assert stats["reservations"] == 0
    assert client.lookup(other).matched_tokens == bt  # block 0 only: nothing of it stored


def test_the_one_way_release_is_applied_before_the_clients_next_request(clean_server,
                                                                         client_factory):
    """drop_select does not wait for its release's reply: the client's next request
    sees it applied (one DEALER, served in order), and the late reply is dropped as
    stale instead of being taken for the next call's answer."""
    client = client_factory(clean_server)
    for i in range(5):
        client.insert(prompt(12, 40 + i), make_kv(12, 40 + i))
        assert client.drop_select(prompt(12, 40 + i)).matched_tokens == 12
        stats = client.stats()  # the reply to this stats call, not the release's
        assert stats["leases"] == 0 and stats["entries"] == 0
    assert client.lookup(prompt(12, 40)).matched_tokens == 0


def test_a_failed_one_way_release_is_logged_not_lost_in_silence(clean_server, client_factory,
                                                                caplog):
    client = client_factory(clean_server)
    client._rpc.send(p.Release(aid=424242, drop=True))  # no such lease
    with caplog.at_level("WARNING", logger="kvstore.client.rpc"):
        client.stats()  # reads past the release's (error) reply
    assert any("one-way release" in r.getMessage() for r in caplog.records), caplog.text
