"""Inserts in one round trip: after an insert the server sets aside room for the
writer's next one, which copies into it and stores with one ``put``. Writers on the
server's node only (memcpy into the shared arena); a TE writer reserves and commits.

Real server processes; every prompt read back (over TE, loopback TCP) is checked
byte for byte."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from kvstore.core.errors import (BusyError, KVStoreError, KVTimeoutError, NotFoundError,
                                 PeerUnavailableError, TierFullError)
from kvstore.core.layout import KVLayout
from tests.integration.conftest import LAYOUT, make_kv, record_ops, wait_for

pytestmark = pytest.mark.timeout(120)

TOKENS = 4 * LAYOUT.block_tokens + 3  # four full blocks and a partial one


def _tokens(pid: int, n: int = TOKENS) -> list[int]:
    return [50_000 + pid, *range(n - 1)]


def _read_back(reader, pid: int, n: int = TOKENS):
    got = reader.drop_select(_tokens(pid, n))
    assert got.matched_tokens == n
    assert np.array_equal(got.kv.numpy(), make_kv(n, seed=pid))
    return got


def test_the_second_insert_is_one_put_and_stores_the_same_bytes(server_factory, client_factory):
    srv = server_factory(dram="8MiB", nvme="0")
    writer = client_factory(srv, same_node=True)
    reader = client_factory(srv, same_node=False)
    ops = record_ops(writer)
    first = writer.insert(_tokens(1), make_kv(TOKENS, seed=1), hidden=torch.tensor([7]))
    assert ops == ["reserve", "commit"] and writer.stats()["rooms"] == 1
    for pid in (2, 3, 4):
        ops.clear()
        res = writer.insert(_tokens(pid), make_kv(TOKENS, seed=pid),
                            hidden=torch.tensor([pid]))
        assert ops == ["put"], ops
        assert res == first
        assert (res.new_blocks, res.existing_blocks) == (5, 0)
    for pid in (1, 2, 3, 4):
        got = _read_back(reader, pid)
        assert got.hidden.tolist() == [7 if pid == 1 else pid]
    # From the reader: its drop_selects end with one-way releases over its own
    # connection, which the writer's faster same-node socket may overtake.
    stats = reader.stats()
    assert stats["rooms"] == 1 and stats["entries"] == 0 and stats["reservations"] == 0
    writer.close()  # gives its room back
    deadline = time.monotonic() + 5
    while reader.stats()["rooms"]:
        assert time.monotonic() < deadline, "the closed writer's room was not given back"
        time.sleep(0.02)
    assert reader.stats()["tiers"]["dram"]["used"] == 0


@pytest.mark.parametrize("one_call", [True, False])
def test_a_prompts_flat_bytes_go_into_its_room_in_one_copy_call(server_factory,
                                                                client_factory, monkeypatch,
                                                                one_call):
    """A writer's insert of flat KV bytes (whole, or after blocks it skips) is one
    ``copy_run`` call into its room, and stores what an entry-by-entry copy stores:
    every prompt read back byte for byte, with the extension's one-call copy and
    without it (``SCATTER_RUN`` missing: the entry-by-entry ``copy_in``)."""
    from kvstore.client import shm

    if one_call and shm.SCATTER_RUN is None:
        pytest.skip("kvstore.client._ntcopy built without xxhash.h")
    if not one_call:
        monkeypatch.setattr(shm, "SCATTER_RUN", None)
    runs: list[int] = []
    copy_run = shm.copy_run

    def counted(*args, **kw):
        got = copy_run(*args, **kw)
        runs.append(got is not None)
        return got

    monkeypatch.setattr("kvstore.client.datapath.copy_run", counted)
    # Rooms that outlast a stall of a loaded machine (each insert must be a put).
    srv = server_factory(dram="8MiB", nvme="0", reservation_lease=30.0)
    writer = client_factory(srv, same_node=True)
    reader = client_factory(srv, same_node=False)
    writer.insert(_tokens(1), make_kv(TOKENS, seed=1))  # reserve + commit: its room
    ops = record_ops(writer)
    for pid in (2, 3):
        assert writer.insert(_tokens(pid), make_kv(TOKENS, seed=pid)).new_blocks == 5
    head = 2 * LAYOUT.block_tokens
    writer.insert(_tokens(4, head), make_kv(TOKENS, seed=4)[:LAYOUT.nbytes(head)])
    res = writer.insert(_tokens(4), make_kv(TOKENS, seed=4)[LAYOUT.nbytes(head):],
                        skip_blocks=2)
    assert (res.new_blocks, res.existing_blocks) == (3, 2)
    assert ops == ["put"] * 4, ops
    assert runs == [one_call] * 4
    for pid in (1, 2, 3, 4):
        _read_back(reader, pid)
    got = reader.drop_select(_tokens(4, head))
    assert got.matched_tokens == head
    assert np.array_equal(got.kv.numpy(), make_kv(TOKENS, seed=4)[:LAYOUT.nbytes(head)])
    assert reader.stats()["entries"] == 0


def test_a_writer_over_te_asks_for_no_room(server_factory, client_factory):
    srv = server_factory(dram="8MiB", nvme="0")
    writer = client_factory(srv, same_node=False)
    ops = record_ops(writer)
    for pid in (1, 2):
        writer.insert(_tokens(pid), make_kv(TOKENS, seed=pid))
    assert ops == ["reserve", "commit"] * 2 and writer.stats()["rooms"] == 0
    for pid in (1, 2):
        _read_back(writer, pid)


def test_blocks_already_stored_dedup_and_are_counted_as_existing(server_factory,
                                                                 client_factory):
    srv = server_factory(dram="8MiB", nvme="0")
    writer = client_factory(srv)
    reader = client_factory(srv, same_node=False)
    writer.insert(_tokens(9), make_kv(TOKENS, seed=9))  # a room for a whole prompt
    writer.insert(_tokens(1, 2 * LAYOUT.block_tokens), make_kv(TOKENS, seed=1)[
        :LAYOUT.nbytes(2 * LAYOUT.block_tokens)])
    ops = record_ops(writer)
    res = writer.insert(_tokens(1), make_kv(TOKENS, seed=1))  # its first two blocks are stored
    assert ops == ["put"] and (res.new_blocks, res.existing_blocks) == (3, 2)
    _read_back(reader, 9)
    _read_back(reader, 1)  # one consumer takes the whole prompt...
    got = reader.drop_select(_tokens(1, 2 * LAYOUT.block_tokens))  # ...the other the head
    assert got.matched_tokens == 2 * LAYOUT.block_tokens
    assert reader.stats()["entries"] == 0


def test_a_skipped_block_the_server_lost_fails_the_insert_as_before(server_factory,
                                                                      client_factory):
    srv = server_factory(dram="8MiB", nvme="0")
    writer = client_factory(srv)
    writer.insert(_tokens(1), make_kv(TOKENS, seed=1))  # now it holds a room
    assert writer.stats()["rooms"] == 1
    rest = make_kv(TOKENS, seed=2)[LAYOUT.nbytes(2 * LAYOUT.block_tokens):]
    with pytest.raises(NotFoundError, match="lacks block"):
        writer.insert(_tokens(2), rest, skip_blocks=2)  # prompt 2 was never stored
    stats = writer.stats()
    assert stats["entries"] == 5 and stats["reservations"] == 0


def test_a_reclaimed_room_means_a_reserve_not_a_failure(server_factory, client_factory):
    srv = server_factory(dram="8MiB", nvme="0", reservation_lease=0.4)
    writer = client_factory(srv)
    reader = client_factory(srv, same_node=False)
    writer.insert(_tokens(1), make_kv(TOKENS, seed=1))
    time.sleep(0.6)  # past the room's lease: the server reclaims it
    deadline = time.monotonic() + 5
    while writer.stats()["rooms"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert writer.stats()["rooms_expired"] == 1
    ops = record_ops(writer)
    writer.insert(_tokens(2), make_kv(TOKENS, seed=2))
    assert ops == ["reserve", "commit"]
    # and one the client still thinks it holds, which the server reclaimed: put,
    # refused, then reserve; nothing else changes
    writer._room = writer._room._replace(usable_until=time.monotonic() + 60)
    writer._call(__import__("kvstore.core.protocol", fromlist=["Abort"]).Abort(
        rid=writer._room.id))
    ops.clear()
    writer.insert(_tokens(3), make_kv(TOKENS, seed=3))
    assert ops == ["put", "reserve", "commit"]
    for pid in (1, 2, 3):
        _read_back(reader, pid)


def test_a_room_of_a_restarted_server_is_never_written(server_factory, client_factory):
    # A lease long enough that the room is still the client's to use after the
    # restart (with the default 2 s it is used only for 1 s, less than a restart
    # can take on a loaded machine, and the insert then never tries it).
    srv = server_factory(dram="8MiB", nvme="0", reservation_lease=30)
    writer = client_factory(srv)
    writer.insert(_tokens(1), make_kv(TOKENS, seed=1))
    old_arena = writer._data.segment.shm
    srv.restart()
    ops = record_ops(writer)
    # The room is the old process's: the copy lands in its arena file (which the
    # new server never maps), the put is refused, the insert reserves anew.
    writer.insert(_tokens(2), make_kv(TOKENS, seed=2))
    assert ops == ["put", "reserve", "commit"], ops
    assert writer._data.segment.shm is not old_arena
    _read_back(client_factory(srv, same_node=False), 2)


def test_a_hello_between_taking_a_room_and_copying_never_writes_the_new_servers_arena(
        server_factory, client_factory):
    """Another thread of the writer says hello to a restarted server after this insert
    took its room and before it copies: the copy still goes through the granting
    server's arena (orphaned now), never at the room's offsets in the new server's
    arena, where another writer's entries lie; the insert then reserves anew."""
    srv = server_factory(dram="8MiB", nvme="0", reservation_lease=30)
    writer = client_factory(srv)
    writer.insert(_tokens(1), make_kv(TOKENS, seed=1))
    room = writer._room
    assert room is not None
    srv.restart()
    other = client_factory(srv)
    stored, pid = 0, 100
    while stored < room.offset + room.nbytes + LAYOUT.nbytes(TOKENS):  # past the room
        stored += other.insert(_tokens(pid), make_kv(TOKENS, seed=pid)).nbytes
        pid += 1
    others = range(100, pid)
    take = writer._take_room

    def take_then_hello(sizes):
        taken = take(sizes)
        writer._hello = None  # what another thread's timeout does, and its hello:
        writer.hello()        # the data path maps the new server's arena now
        return taken

    writer._take_room = take_then_hello
    ops = record_ops(writer)
    writer.insert(_tokens(2), make_kv(TOKENS, seed=2))
    assert ops == ["put", "reserve", "commit"], ops  # the room was tried, then refused
    reader = client_factory(srv, same_node=False)
    for p in (2, *others):
        _read_back(reader, p)


def test_placements_of_a_server_a_new_hello_no_longer_finds_are_never_written(
        server_factory, client_factory):
    """No rooms: the insert reserves on one server process, another thread's hello
    then finds a restarted one before the copy. The reply's placements are the old
    server's: the insert fails as the peer being gone (a miss to retry), and the new
    server's arena, where another writer's entries lie at those offsets, is not
    touched."""
    srv = server_factory(dram="8MiB", nvme="0", env={"KVSTORE_POLICY_ROOM_FRACTION": "0"})
    writer = client_factory(srv)
    writer.insert(_tokens(1), make_kv(TOKENS, seed=1))
    reserve = writer._reserve
    others: list[int] = []

    def reserve_then_restart(*args, **kwargs):
        reserved = reserve(*args, **kwargs)
        srv.restart()
        other = client_factory(srv)
        for pid in range(100, 104):  # from offset 0, past the placements (the 2nd prompt's)
            other.insert(_tokens(pid), make_kv(TOKENS, seed=pid))
            others.append(pid)
        writer._hello = None  # another thread's timeout, and its hello
        writer.hello()
        return reserved

    writer._reserve = reserve_then_restart
    error: Exception | None = None
    try:
        writer.insert(_tokens(2), make_kv(TOKENS, seed=2))
    except KVStoreError as exc:
        error = exc
    reader = client_factory(srv, same_node=False)
    for pid in others:  # not one byte of theirs was overwritten
        _read_back(reader, pid)
    assert isinstance(error, PeerUnavailableError) and "another process" in str(error), error


def test_a_room_granted_before_the_client_said_hello_again_is_dropped(server_factory,
                                                                     client_factory):
    """After a timeout or a lost peer the client says hello again: the server may be
    another process by then, so a room from before is never written."""
    srv = server_factory(dram="8MiB", nvme="0")
    writer = client_factory(srv)
    writer.insert(_tokens(1), make_kv(TOKENS, seed=1))
    assert writer._room is not None
    writer._hello = None  # what a timeout or a lost peer does
    ops = record_ops(writer)
    writer.insert(_tokens(2), make_kv(TOKENS, seed=2))
    assert ops == ["reserve", "commit"]
    for pid in (1, 2):
        _read_back(client_factory(srv, same_node=False), pid)


def test_a_smaller_room_than_the_insert_is_given_back(server_factory, client_factory):
    srv = server_factory(dram="8MiB", nvme="0")
    writer = client_factory(srv)
    writer.insert(_tokens(1, 16), make_kv(16, seed=1))  # a room of one block
    ops = record_ops(writer)
    writer.insert(_tokens(2), make_kv(TOKENS, seed=2))
    assert ops == ["reserve", "commit"]
    assert writer._room.nbytes >= LAYOUT.nbytes(TOKENS)  # asked big enough this time
    assert writer.stats()["rooms"] == 1  # the small one went back
    ops.clear()
    writer.insert(_tokens(3, 16), make_kv(16, seed=3))  # fits in the bigger one
    assert ops == ["put"]


def test_threads_sharing_a_client_never_share_a_room(server_factory, client_factory):
    srv = server_factory(dram="32MiB", nvme="0")
    writer = client_factory(srv)
    reader = client_factory(srv, same_node=False)
    ops = record_ops(writer)
    errors: list[BaseException] = []

    def insert(pids: range) -> None:
        try:
            for pid in pids:
                res = writer.insert(_tokens(pid), make_kv(TOKENS, seed=pid))
                assert res.new_blocks == 5
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=insert, args=(range(10 * t, 10 * t + 10),))
               for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert ops.count("put") > 0
    for pid in range(40):
        _read_back(reader, pid)
    stats = reader.stats()
    assert stats["rooms"] <= 1 and stats["reservations"] == 0 and stats["entries"] == 0


def test_an_idle_writers_room_holds_memory_only_until_its_lease_ends(server_factory,
                                                                       client_factory):
    """The cost of a room: memory no other writer can use while it is held. In a tier
    full of entries nobody may evict (pinned), another writer's insert fails for want
    of it - a miss - but only until the idle room's lease ends."""
    big = KVLayout(num_layers=32, kv_heads=8, head_dim=128, dtype="float16", block_tokens=16)
    block = big.nbytes(16)  # 2 MiB
    # A lease that outlasts the three calls below on a loaded machine.
    srv = server_factory(dram="8MiB", nvme="0", block_tokens=16, reservation_lease=3.0,
                         env={"KVSTORE_POLICY_ROOM_FRACTION": "0.5"})
    a = client_factory(srv, layout=big, staging_bytes=4 * block)
    b = client_factory(srv, layout=big, staging_bytes=4 * block)

    def kv(pid: int, blocks: int) -> np.ndarray:
        return make_kv(16 * blocks, seed=pid, layout=big)

    a.insert(_tokens(1, 16), kv(1, 1), pin=True)  # A holds 2 MiB, and a 2 MiB room
    b.insert(_tokens(2, 16), kv(2, 1), pin=True)  # no room for B: 6 of 8 MiB used
    stats = b.stats()
    assert stats["rooms"] == 1 and stats["tiers"]["dram"]["used"] == 3 * block
    with pytest.raises(TierFullError):  # 4 MiB more, 2 free, all the rest pinned
        b.insert(_tokens(3, 32), kv(3, 2), pin=True)
    wait_for(lambda: b.stats()["rooms_expired"] >= 1, 10, "A's idle room to go back")
    assert b.insert(_tokens(3, 32), kv(3, 2), pin=True).new_blocks == 2
    stats = b.stats()
    assert stats["rooms_expired"] == 1 and stats["entries"] == 4
    assert stats["tiers"]["dram"]["used"] == 4 * block


def _settled(client, key: str, want: int, timeout: float = 10.0) -> dict:
    """The server's stats once ``key`` reads ``want`` (it is working off what queued
    while it was stopped)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats[key] == want or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.mark.parametrize("path", ["room put", "reserve, then commit"])
def test_a_write_its_writer_gave_up_on_is_not_stored_when_the_server_goes_on(
        server_factory, client_factory, path):
    """The server is frozen (SIGSTOP) with the writer's put (or commit) in its socket:
    the writer times out and reports the insert failed. Its give-back never comes
    (as when the writer's process ends right after the timeout; a give-back that does
    come is served first, ``Server._gives_back_first``). When the server goes on it
    reads the request after the writer's deadline: refused, the room or reservation
    given back, nothing stored, so the store agrees with what the writer was told.
    The writer then goes on storing."""
    srv = server_factory(dram="8MiB", nvme="0", reservation_lease=30)
    writer = client_factory(srv, same_node=True, timeout_s=1.0)
    reader = client_factory(srv, same_node=False)
    if path == "room put":
        writer.insert(_tokens(1), make_kv(TOKENS, seed=1))  # grants the writer a room
        assert writer._room is not None
        pending = None
    else:
        pending = writer.begin_insert(_tokens(2))  # no room yet: reserves
        assert pending is not None and writer._room is None
    before = reader.stats()
    lost = {"_abort": lambda rid: None}  # (rooms are given back through it too)
    for name, noop in lost.items():
        setattr(writer, name, noop)
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        with pytest.raises((KVTimeoutError, PeerUnavailableError)):
            if pending is None:
                writer.insert(_tokens(2), make_kv(TOKENS, seed=2))
            else:
                pending.commit(make_kv(TOKENS, seed=2))
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    key = "rooms" if path == "room put" else "reservations"
    after = _settled(reader, key, 0)
    assert after[key] == 0, after
    assert (after["entries"], after["commits"]) == (before["entries"], before["commits"])
    assert reader.lookup(_tokens(2)).matched_tokens == 0
    for name in lost:
        delattr(writer, name)
    writer.insert(_tokens(3), make_kv(TOKENS, seed=3))
    _read_back(reader, 3)


@pytest.mark.parametrize("same_node", [True, False], ids=["same node", "over TE"])
def test_a_reserve_its_writer_gave_up_on_holds_nothing_when_the_server_goes_on(
        server_factory, client_factory, same_node):
    """The server is frozen with a writer's reserve in its socket (no room yet): the
    writer times out. When the server goes on it reads the reserve after the
    writer's deadline (over TE: in the server's clock as the writer's hello
    measured it): refused, nothing reserved. Else that reservation, which no
    one will write or commit, would hold the prompt's keys for its whole lease, and
    the writer's next insert of the same prompt (an engine saving it again) would
    dedup onto it (told all 5 blocks exist) and lose every block when it expired:
    nothing stored, the reader a miss."""
    srv = server_factory(dram="8MiB", nvme="0", reservation_lease=30)
    writer = client_factory(srv, same_node=same_node, timeout_s=1.0)
    reader = client_factory(srv, same_node=False)
    _measured(writer)
    ops = record_ops(writer)
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        with pytest.raises((KVTimeoutError, PeerUnavailableError)):
            writer.insert(_tokens(2), make_kv(TOKENS, seed=2))
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    assert ops == ["reserve"], ops
    # The late reserve read (refused; else it would be reserved) before the writer
    # saves the prompt again (its requests now go over a new connection).
    stats = _settled(reader, "late_writes", 1)
    assert (stats["reservations"], stats["late_writes"]) == (0, 1), stats
    res = writer.insert(_tokens(2), make_kv(TOKENS, seed=2))
    assert (res.new_blocks, res.existing_blocks) == (5, 0), res
    _read_back(reader, 2)


def _measured(client) -> None:
    """``client`` said hello and knows the server's clock (a hello of a loaded
    machine may take too long to measure by: say it again)."""
    for _ in range(5):
        client.hello()
        if client._clock is not None:
            break
        client._hello = None
    assert client._clock is not None and abs(client._clock) < 0.25  # (one machine)


def test_a_remote_writer_whose_reckoning_of_the_servers_clock_is_off_measures_again(
        server_factory, client_factory):
    """A writer on another node that believes the server's clock 30 s behind (the
    server's stepped forward since hello measured it) puts deadlines 30 s in the
    server's past on its writes: the first is refused ``busy`` before the writer's
    own deadline, so it measures the clock again at its next call and goes on
    storing; nothing of the refused write is left on the server."""
    srv = server_factory(dram="8MiB", nvme="0")
    writer = client_factory(srv, same_node=False)
    reader = client_factory(srv, same_node=False)
    _measured(writer)
    writer._clock -= 30.0
    with pytest.raises(BusyError, match="reserve reached the store"):
        writer.insert(_tokens(1), make_kv(TOKENS, seed=1))
    assert writer._hello is None and writer._clock is None  # to be measured again
    writer.insert(_tokens(1), make_kv(TOKENS, seed=1))
    # Measured again (None only where that hello was too slow to measure by).
    assert writer._clock is None or abs(writer._clock) < 0.25
    stats = reader.stats()
    assert (stats["reservations"], stats["late_writes"]) == (0, 1), stats
    _read_back(reader, 1)
