"""``begin_insert``: an insert written layer by layer (the connector's layer-wise saves),
against a real same-node kvstore-server: into the room the client holds (one ``put``)
or a reservation (reserve, commit), copying each layer's slice of every entry into the
shared arena; readers get exactly the bytes, every way of not finishing gives the room
back, and a room whose lease runs out is never written: the insert is stored whole."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from kvstore.core.errors import InvalidRequestError, NotFoundError
from tests.integration.conftest import LAYOUT, make_kv, record_ops


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
    fresh = client_factory(server)  # holds no room: begin_insert reserves, and is refused
    with pytest.raises(NotFoundError):  # a skipped block the server does not hold
        fresh.begin_insert(list(range(900, 900 + 3 * bt)), skip_blocks=1)
    assert stats(client)["reservations"] == 0
    # Holding a room (its last insert's reply granted it), it learns at the commit.
    lacking = list(range(900, 900 + 3 * bt))
    part = make_kv(2 * bt, seed=5)
    pending = client.begin_insert(lacking, skip_blocks=1)
    assert pending is not None
    with pytest.raises(NotFoundError):
        pending.commit(part)
    assert client.get(lacking).matched_tokens == 0
    assert stats(client)["reservations"] == 0 and stats(client)["rooms"] == 0


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


def _tokens(pid: int) -> list[int]:
    return [70_000 + pid, *range(3 * LAYOUT.block_tokens + 1)]  # 3 full blocks + 2 tokens


def _layer_by_layer(client, pid: int):
    tokens = _tokens(pid)
    data = make_kv(len(tokens), seed=pid)
    pending = client.begin_insert(tokens)
    assert pending is not None and pending.nbytes == data.size
    for layer in reversed(range(LAYOUT.num_layers)):
        pending.write_layer(data, layer)
    return pending, data


def test_a_layer_wise_insert_uses_the_clients_room_one_put(server_factory, client_factory):
    """The first layer-wise insert reserves and commits, and its commit asks for a room;
    every later one writes its layers into that room and stores them with one ``put``
    (nothing sent before the commit). A reader over TE gets exactly the bytes."""
    srv = server_factory(dram="8MiB", nvme="0", reservation_lease=30)
    writer = client_factory(srv, same_node=True)
    reader = client_factory(srv, same_node=False)
    ops = record_ops(writer)
    pending, data = _layer_by_layer(writer, 1)
    assert ops == ["reserve"]
    res = pending.commit(data)
    assert ops == ["reserve", "commit"] and res.new_blocks == 4
    assert writer.stats()["rooms"] == 1
    for pid in (2, 3):
        ops.clear()
        pending, data = _layer_by_layer(writer, pid)
        assert ops == []  # the room was the client's already
        res = pending.commit(data)
        assert ops == ["put"]
        assert (res.new_blocks, res.existing_blocks, res.ntokens) == (4, 0, len(_tokens(pid)))
    for pid in (1, 2, 3):
        got = reader.drop_select(_tokens(pid))
        assert got.matched_tokens == len(_tokens(pid))
        assert np.array_equal(got.kv.numpy(), make_kv(len(_tokens(pid)), seed=pid))
    assert writer.stats()["reservations"] == 0


def test_layers_go_into_the_arena_of_the_server_that_granted_the_room(server_factory,
                                                                      client_factory):
    """The server restarts and another thread of the writer says hello to the new one
    between taking the room and writing the layers: they land in the granting
    server's (orphaned) arena, never at the room's offsets in the new server's, where
    another writer's entries lie; the commit's put is refused, the prompt is stored
    whole."""
    srv = server_factory(dram="8MiB", nvme="0", reservation_lease=30)
    writer = client_factory(srv, same_node=True)
    writer.insert(_tokens(20), make_kv(len(_tokens(20)), seed=20))  # grants the room
    srv.restart()
    other = client_factory(srv, same_node=True)
    for pid in range(100, 104):  # from offset 0, past where the room lay
        other.insert(_tokens(pid), make_kv(len(_tokens(pid)), seed=pid))
    take = writer._take_room

    def take_then_hello(sizes):
        taken = take(sizes)
        writer._hello = None  # another thread's timeout, and its hello
        writer.hello()
        return taken

    writer._take_room = take_then_hello
    ops = record_ops(writer)
    pending, data = _layer_by_layer(writer, 21)
    res = pending.commit(data)
    assert ops == ["put", "reserve", "commit"], ops
    assert res.new_blocks == 4
    reader = client_factory(srv, same_node=False)
    for pid in (21, *range(100, 104)):
        got = reader.drop_select(_tokens(pid))
        assert got.matched_tokens == len(_tokens(pid))
        assert np.array_equal(got.kv.numpy(), make_kv(len(_tokens(pid)), seed=pid))


def test_a_room_whose_lease_runs_out_is_never_written_and_the_insert_is_whole(
        server_factory, client_factory):
    """With a 4 s lease a room is written for at most 3 s after it was asked for: a layer
    that comes later is not copied into it, and the commit gives the room back and
    inserts the whole prompt anew (reserve, commit). And a room the server reclaimed
    before the commit (all layers written in time, the put then too late) is stored
    whole too. Both read back exactly."""
    srv = server_factory(dram="8MiB", nvme="0", reservation_lease=4.0)
    writer = client_factory(srv, same_node=True)
    reader = client_factory(srv, same_node=False)
    ops = record_ops(writer)
    writer.insert(_tokens(10), make_kv(len(_tokens(10)), seed=10))  # grants the room

    tokens = _tokens(11)
    data = make_kv(len(tokens), seed=11)
    pending = writer.begin_insert(tokens)
    ops.clear()
    pending.write_layer(data, 0)
    time.sleep(3.1)  # past the write deadline (lease 4 s, minus a quarter)
    pending.write_layer(data, 1)
    assert pending.expired
    res = pending.commit(data)
    assert ops == ["reserve", "commit"]  # (the room went back with a plain abort)
    assert res.new_blocks == 4

    tokens = _tokens(12)
    data = make_kv(len(tokens), seed=12)
    pending, data = _layer_by_layer(writer, 12)  # the room the last commit granted
    ops.clear()
    time.sleep(5.5)  # the lease ends and the reaper takes the room back
    res = pending.commit(data)
    assert ops[0] == "put" and ops[1:] == ["reserve", "commit"]
    assert res.new_blocks == 4 and not pending.expired
    # Only the second room ran out: the first was given back when it was not written.
    assert writer.stats()["rooms_expired"] == 1
    for pid in (10, 11, 12):
        got = reader.drop_select(_tokens(pid))
        assert got.matched_tokens == len(_tokens(pid))
        assert np.array_equal(got.kv.numpy(), make_kv(len(_tokens(pid)), seed=pid))
    assert writer.stats()["reservations"] == 0
