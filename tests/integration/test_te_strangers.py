"""TE has no authentication: a stranger's TE engine can write into a server's DRAM
arena. Bytes written there by anyone but the reservation's owner are never served:
after commit they fail the reader's checksum (reported: the server counts and drops
them); before commit they fail the commit's own check: at once with
``verify_commits = "inline"`` (nothing stored), in the server's scrub just after the
commit with "background" (dropped and counted)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.core.errors import ChecksumError
from kvstore.transport.te import Transport
from tests.integration.client_worker import prompt_kv, prompt_tokens
from tests.integration.conftest import wait_checked

pytestmark = pytest.mark.timeout(120)

N = 64  # 16 blocks of 512 B


@pytest.fixture
def stranger():
    """A TE engine that is no kvstore client: it only knows the server's segment."""
    te = Transport("127.0.0.1")
    buf = te.allocate_buffer(1 << 20)
    buf.array[:] = np.random.default_rng(666).integers(0, 256, buf.array.size, dtype=np.uint8)
    yield te, buf
    te.close()


def _overwrite(stranger, hello: dict, offset: int, nbytes: int) -> None:
    te, buf = stranger
    base = hello["te_probe"][0]  # the DRAM arena's first page: its base address
    te.write(hello["segment"], [buf.address], [base + offset], [nbytes])


@pytest.mark.parametrize("same_node", [True, False], ids=["shm", "te"])
def test_a_strangers_write_after_commit_is_never_served(server_factory, client_factory,
                                                        stranger, same_node):
    srv = server_factory()
    owner = client_factory(srv, same_node=False)
    owner.insert(prompt_tokens(1, N), prompt_kv(1, N))
    wait_checked(owner)  # the commit's bytes are checked: what follows is at rest
    hello = owner.hello()
    keys = owner.keys_for(prompt_tokens(1, N))
    where = {e["key"]: e["offset"] for e in owner.ls()}
    for key in keys[4:8]:
        _overwrite(stranger, hello, where[key], 512)
    reader = client_factory(srv, same_node=same_node)
    with pytest.raises(ChecksumError):
        reader.get(prompt_tokens(1, N))
    stats = reader.stats()
    assert stats["checksum_failures"] == 4  # reported by the reader, re-checked, dropped
    got = reader.get(prompt_tokens(1, N))  # what is left is exact: the first 4 blocks
    assert got.matched_tokens == 16
    assert np.array_equal(got.kv.numpy(), prompt_kv(1, N)[:16 * 128])


@pytest.mark.parametrize("mode", ["inline", "background"])
def test_a_strangers_write_before_commit_is_caught(server_factory, client_factory, stranger,
                                                   mode):
    """inline: the commit fails and stores nothing. background (the default): the
    commit answers, the server's scrub thread finds the entry bad soon after, counts
    and drops it; a reader in between verifies what it gets and is never served it."""
    srv = server_factory(extra=("--verify-commits", mode))
    owner = client_factory(srv, same_node=False)
    owner.hello()
    real = owner._data.write

    def write_then_stranger(seg, buffers, placements):
        sums = real(seg, buffers, placements)  # the owner's bytes landed ...
        _overwrite(stranger, owner.hello(), placements[3][1], 512)  # ... then a stranger's
        return sums

    owner._data.write = write_then_stranger
    if mode == "inline":
        with pytest.raises(ChecksumError):
            owner.insert(prompt_tokens(2, N), prompt_kv(2, N))
        stats = owner.stats()
        assert stats["commit_checksum_failures"] == 1 and stats["entries"] == 0
        assert owner.lookup(prompt_tokens(2, N)).matched_tokens == 0
        return
    owner.insert(prompt_tokens(2, N), prompt_kv(2, N))
    deadline = time.monotonic() + 30
    while owner.stats()["commit_checksum_failures"] < 1:
        assert time.monotonic() < deadline, "the scrub never found the stranger's bytes"
        time.sleep(0.05)
    stats = owner.stats()
    assert stats["commit_checksum_failures"] == 1 and stats["entries"] == 15
    assert stats["unchecked_entries"] == 0
    got = owner.get(prompt_tokens(2, N))  # the prefix before the bad block, exact
    assert got.matched_tokens == 3 * 4
    assert np.array_equal(got.kv.numpy(), prompt_kv(2, N)[:3 * 4 * 128])
