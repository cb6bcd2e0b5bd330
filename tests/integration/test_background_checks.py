"""A TE read is verified on the client's low-priority hashing thread
(kvstore/client/checks.py): entries of 256 KiB or more always, smaller ones (64 KiB)
in batches where the C extension has ``hashes``. Against a real server, over real TE,
it returns exact bytes, and bytes damaged at rest are still a checksum miss,
reported and dropped, with the good entries kept."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore.client import checks
from kvstore.client.checks import BACKGROUND_MIN_ENTRY_BYTES
from kvstore.core.errors import ChecksumError
from kvstore.layout import KVLayout
from tests.integration.conftest import damage_at_rest

# 8 layers x 4 heads x 128 dims x fp16 x K and V x 16 tokens: 256 KiB an entry.
BIG = KVLayout(num_layers=8, kv_heads=4, head_dim=128, dtype="float16", block_tokens=16)
TOKENS = 64  # 4 entries, 1 MiB
# 8 layers x 2 heads x 64 dims x fp16 x K and V x 16 tokens: 64 KiB an entry.
SMALL = KVLayout(num_layers=8, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
SMALL_TOKENS = 1024  # 64 entries, 4 MiB: several of the thread's claims


def _kv(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BIG.nbytes(TOKENS), dtype=np.uint8)


def _tokens(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(TOKENS)]


@pytest.fixture
def big_server(server_factory):
    return server_factory(dram="16MiB", nvme="0", block_tokens=BIG.block_tokens)


def test_large_entries_are_checked_in_the_background_and_come_back_exact(
        big_server, client_factory):
    assert BIG.nbytes(BIG.block_tokens) >= BACKGROUND_MIN_ENTRY_BYTES
    writer = client_factory(big_server, layout=BIG)
    reader = client_factory(big_server, layout=BIG, same_node=False, staging_bytes=4 << 20)
    into = np.empty(BIG.nbytes(TOKENS), np.uint8)
    for seed in range(3):
        writer.insert(_tokens(seed), _kv(seed))
        got = reader.drop_select(_tokens(seed), into=into)
        assert got.matched_tokens == TOKENS and np.array_equal(into, _kv(seed))
    assert "kvstore-verify" in {t.name for t in threading.enumerate()}


def test_large_entries_damaged_at_rest_are_a_checksum_miss(big_server, client_factory):
    writer = client_factory(big_server, layout=BIG)
    reader = client_factory(big_server, layout=BIG, same_node=False, staging_bytes=4 << 20)
    writer.insert(_tokens(7), _kv(7))
    keys = writer.keys_for(_tokens(7))
    damage_at_rest(writer, [keys[1], keys[3]])
    before = writer.stats()["checksum_failures"]
    with pytest.raises(ChecksumError):
        reader.drop_select(_tokens(7), into=np.empty(BIG.nbytes(TOKENS), np.uint8))
    # The reader reported the entry it found; the server re-checked the lease, counted
    # both bad entries and dropped them; the good ones stay.
    stats = reader.stats()
    assert stats["checksum_failures"] - before == 2 and stats["leases"] == 0
    assert {e["key"] for e in reader.ls()} == {keys[0], keys[2]}


@pytest.mark.skipif(checks.HASHES is None, reason="the C extension has no hashes")
def test_small_entries_go_to_the_thread_in_batches_exact_or_a_checksum_miss(
        server_factory, client_factory, monkeypatch):
    srv = server_factory(dram="32MiB", nvme="0", block_tokens=SMALL.block_tokens)
    writer = client_factory(srv, layout=SMALL)
    reader = client_factory(srv, layout=SMALL, same_node=False, staging_bytes=8 << 20)
    claims: list[int] = []  # how many entries each call of the thread's hashes took
    landing: list[int] = []  # entries hashed on the reader's thread as they landed
    batches: list[int] = []  # the landed batches handed to the checks
    first_bad, landed, finish = checks.first_bad, checks.LandedChecks.landed, \
        checks.LandedChecks.finish
    in_landed = threading.local()

    def counted(out, items):
        if threading.current_thread().name == "kvstore-verify":
            claims.append(len(items))
        elif getattr(in_landed, "on", False):
            landing.append(len(items))
        return first_bad(out, items)

    def spied(self, items):
        batches.append(len(items))
        in_landed.on = True
        try:
            return landed(self, items)
        finally:
            in_landed.on = False

    def finished(self):
        # Give the nice-19 thread a chance before the reader hashes what is left: on a
        # loaded machine it may not get a core during the read at all.
        deadline = time.monotonic() + 10
        while not claims and time.monotonic() < deadline:
            time.sleep(0.01)
        return finish(self)

    monkeypatch.setattr(checks, "first_bad", counted)
    monkeypatch.setattr(checks.LandedChecks, "landed", spied)
    monkeypatch.setattr(checks.LandedChecks, "finish", finished)
    n = SMALL.nbytes(SMALL_TOKENS)
    kv = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
    toks = [50_000 + i for i in range(SMALL_TOKENS)]
    writer.insert(toks, kv)
    into = np.empty(n, np.uint8)
    got = reader.drop_select(toks, into=into)
    assert got.matched_tokens == SMALL_TOKENS and np.array_equal(into, kv)
    per = checks.BATCH_BYTES // SMALL.nbytes(SMALL.block_tokens)
    assert sum(batches) == SMALL_TOKENS // SMALL.block_tokens  # every entry, through them
    assert landing == []  # none hashed as it landed: every one went to the thread
    assert claims and all(1 <= c <= per for c in claims)  # batches, by the thread
    toks = [60_000 + i for i in range(SMALL_TOKENS)]
    writer.insert(toks, kv)
    keys = writer.keys_for(toks)
    damage_at_rest(writer, [keys[40], keys[50]])
    before = writer.stats()["checksum_failures"]
    with pytest.raises(ChecksumError):
        reader.drop_select(toks, into=into)
    stats = reader.stats()
    assert stats["checksum_failures"] - before == 2 and stats["leases"] == 0
    assert {e["key"] for e in reader.ls()} == set(keys) - {keys[40], keys[50]}
