"""Who a drop_select takes from: a consumer takes only what was inserted for its prompt.

P is 3 blocks, P2 is P plus 2 more (so they share P's 3 blocks), Q shares only P's
first 2 blocks and was never inserted. Every insertion order, every consumer order:
each inserted prompt's consumer gets its whole prompt, exact; Q's drop_select reads
the shared blocks but takes nothing; afterwards the store is empty.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.integration.conftest import LAYOUT

pytestmark = pytest.mark.timeout(120)

BT = LAYOUT.block_tokens
P = list(range(1, 3 * BT + 1))
P2 = P + list(range(500, 500 + 2 * BT))
Q = P[:2 * BT] + list(range(900, 900 + BT))
PROMPTS = {"P": P, "P2": P2}


def _kv(tokens: list[int]) -> np.ndarray:
    # Per-token bytes that depend only on the token position and id: shared blocks
    # of two prompts have identical bytes (as the KV of a shared prefix does).
    out = np.zeros(LAYOUT.nbytes(len(tokens)), dtype=np.uint8)
    per = LAYOUT.token_nbytes
    for i, t in enumerate(tokens):
        out[i * per:(i + 1) * per] = (t * 7 + i) % 251
    return out


@pytest.mark.parametrize("consume", list(itertools.permutations(["P", "P2", "Q"])),
                         ids="-".join)
@pytest.mark.parametrize("insert", [("P", "P2"), ("P2", "P")], ids="-".join)
def test_each_consumer_takes_only_its_prompts_insert(clean_server, client_factory, insert,
                                                     consume):
    client = client_factory(clean_server)
    for name in insert:
        client.insert(PROMPTS[name], _kv(PROMPTS[name]))
    for name in consume:
        if name == "Q":  # shares P's first two blocks; no insert of its own
            got = client.drop_select(Q)
            assert got.matched_tokens in (0, 2 * BT)
            if got.matched_tokens:
                assert np.array_equal(got.kv.numpy(), _kv(Q)[:got.kv.numel()])
            continue
        tokens = PROMPTS[name]
        got = client.drop_select(tokens)
        assert got.matched_tokens == len(tokens), (name, got.matched_tokens)
        assert np.array_equal(got.kv.numpy(), _kv(tokens))
    assert client.ls() == [], "blocks left that no consumer can take"
    assert client.drop_select(P).matched_tokens == 0


def test_a_second_consumer_of_one_insert_misses(clean_server, client_factory):
    client = client_factory(clean_server)
    client.insert(P, _kv(P))
    assert client.drop_select(P).matched_tokens == len(P)
    assert client.drop_select(P).matched_tokens == 0  # handed out once
    client.insert(P, _kv(P))
    client.insert(P, _kv(P))  # inserted twice: two consumers
    assert client.drop_select(P).matched_tokens == len(P)
    assert client.drop_select(P).matched_tokens == len(P)
    assert client.ls() == []


def test_a_longer_request_takes_the_stored_prompt(clean_server, client_factory):
    # A consumer asking for more than was stored (the decode side's prompt is the
    # prefill's plus a token) takes the stored prompt: its insert ended inside.
    client = client_factory(clean_server)
    client.insert(P, _kv(P))
    got = client.drop_select(P + [7, 8, 9])
    assert got.matched_tokens == len(P) and np.array_equal(got.kv.numpy(), _kv(P))
    assert client.ls() == []
