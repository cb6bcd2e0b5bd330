"""``begin_insert``: an insert written layer by layer (the connector's layer-wise saves),
against a real same-node kvstore-server: reserve, copy each layer's slice of every
entry into the shared arena, commit; readers get exactly the bytes, and every way of
not finishing gives the room back."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.core.errors import InvalidRequestError, NotFoundError
from tests.integration.conftest import LAYOUT, make_kv


def stats(client) -> dict:
    return client.stats()


def test_layers_written_in_any_order_then_committed_read_back_exactly(server, client_factory):
    client = client_factory(server)
    tokens = list(range(10, 10 + 3 * LAYOUT.block_tokens + 2))  # 3 full blocks + 2 tokens
    data = make_kv(len(tokens), seed=1)
    pending = client.begin_insert(tokens)
    assert pending is not None and pending.nbytes == data.size
    layers = list(range(LAYOUT.num_layers))
    random.Random(0).shuffle(layers)
    for layer in layers[:-1]:  # the last one is left for the commit to write
        pending.write_layer(data, layer)
    assert stats(client)["entries"] == 0  # nothing is visible before the commit
    res = pending.commit(data)
    assert (res.new_blocks, res.ntokens, res.nbytes) == (4, len(tokens), data.size)
    got = client.get(tokens)
    assert got.matched_tokens == len(tokens)
    assert np.array_equal(got.kv.numpy(), data)


def test_skip_blocks_and_blocks_already_stored(server, client_factory):
    client = client_factory(server)
    bt = LAYOUT.block_tokens
    tokens = list(range(500, 500 + 4 * bt))
    data = make_kv(len(tokens), seed=2)
    client.insert(tokens[:2 * bt], data[:LAYOUT.nbytes(2 * bt)])
    pending = client.begin_insert(tokens, skip_blocks=2)
    rest = data[LAYOUT.nbytes(2 * bt):]
    assert pending.nbytes == rest.size
    pending.write_layer(rest, 0)
    res = pending.commit(rest)
    assert (res.new_blocks, res.existing_blocks) == (2, 2)
    assert np.array_equal(client.get(tokens).kv.numpy(), data)
    with pytest.raises(NotFoundError):  # a skipped block the server does not hold
        client.begin_insert(list(range(900, 900 + 3 * bt)), skip_blocks=1)
    assert stats(client)["reservations"] == 0


def test_abort_and_bad_input_give_the_room_back(server, client_factory):
    client = client_factory(server)
    tokens = list(range(40, 40 + 2 * LAYOUT.block_tokens))
    data = make_kv(len(tokens), seed=3)
    pending = client.begin_insert(tokens)
    pending.write_layer(data, 0)
    pending.abort()
    with pytest.raises(InvalidRequestError):
        pending.commit(data)
    assert stats(client)["entries"] == 0 and stats(client)["reservations"] == 0

    pending = client.begin_insert(tokens)
    pending.write_layer(data, 99)  # not a layer: nothing written
    with pytest.raises(InvalidRequestError, match="bytes for an insert"):
        pending.commit(data[:-1])  # one byte short: refused, and the room given back
    assert stats(client)["entries"] == 0 and stats(client)["reservations"] == 0
    assert client.get(tokens).matched_tokens == 0


def test_no_parts_without_the_shared_arena(server, client_factory):
    """Over TE (not the same node's arena) there is nothing to write into early: the
    caller inserts whole, and nothing stays reserved."""
    client = client_factory(server, same_node=False)
    assert client.begin_insert(list(range(64))) is None
    assert stats(client)["reservations"] == 0


@pytest.mark.parametrize("count_skipped", [True, False])
def test_a_prompt_saved_in_two_parts_is_taken_whole_by_one_drop(server, client_factory,
                                                                count_skipped):
    """A chunked prefill saves its first part, then the rest with ``skip_blocks``. As a
    continuation (``count_skipped`` False) the first part is not counted again, so
    one decode's drop_select takes every entry; counted again (a keep-mode skip over
    another writer's blocks), the first part waits for a second consumer."""
    client = client_factory(server)
    bt = LAYOUT.block_tokens
    tokens = list(range(1200, 1200 + 4 * bt))
    data = make_kv(len(tokens), seed=4)
    client.insert(tokens[:2 * bt], data[:LAYOUT.nbytes(2 * bt)])
    client.insert(tokens, data[LAYOUT.nbytes(2 * bt):], skip_blocks=2,
                  count_skipped=count_skipped)
    got = client.drop_select(tokens)
    assert got.matched_tokens == len(tokens) and np.array_equal(got.kv.numpy(), data)
    assert stats(client)["entries"] == (0 if not count_skipped else 2)
