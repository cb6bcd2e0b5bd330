"""A TE read of large entries (256 KiB or more) is verified on the client's
low-priority hashing thread (kvstore/client/checks.py): against a real server, over
real TE, it returns exact bytes, and bytes damaged at rest are still a checksum miss,
reported and dropped, with the good entries kept."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.client.checks import BACKGROUND_MIN_ENTRY_BYTES
from kvstore.core.errors import ChecksumError
from kvstore.layout import KVLayout
from tests.integration.conftest import damage_at_rest

# 8 layers x 4 heads x 128 dims x fp16 x K and V x 16 tokens: 256 KiB an entry.
BIG = KVLayout(num_layers=8, kv_heads=4, head_dim=128, dtype="float16", block_tokens=16)
TOKENS = 64  # 4 entries, 1 MiB


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
