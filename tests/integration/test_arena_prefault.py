"""The DRAM arena's pages are mapped ahead of use, in the server from start and in a
same-node client from its first copy, unless configured off: real server processes,
their page tables read from /proc/<pid>/smaps, and every prompt read back byte for
byte."""

from __future__ import annotations

import glob
import os
import time

import numpy as np
import pytest

from kvstore.core.config import ClientConfig
from tests.integration.conftest import LAYOUT, make_kv
from tests.unit.test_prefault import mapped_kib, wait_mapped

pytestmark = pytest.mark.timeout(120)

ARENA = 64 << 20
TOKENS = 3 * LAYOUT.block_tokens


def _arena_of(srv) -> str:
    (path,) = glob.glob(f"/dev/shm/kvstore-*-{srv.proc.pid}")
    return path


def _round_trip(writer, reader) -> None:
    tokens = list(range(TOKENS))
    writer.insert(tokens, make_kv(TOKENS, seed=5))
    got = reader.drop_select(tokens)
    assert got.matched_tokens == TOKENS
    assert np.array_equal(got.kv.numpy(), make_kv(TOKENS, seed=5))


def test_server_and_same_node_client_map_the_whole_arena_ahead(server_factory, client_factory):
    srv = server_factory(dram="64MiB", nvme="0")
    path = _arena_of(srv)
    assert wait_mapped(path, srv.proc.pid, ARENA // 1024) == ARENA // 1024
    # A client that maps the arena but copies nothing (a scheduler's, looking up)
    # leaves its mapping alone.
    looker = client_factory(srv, same_node=True)
    looker.hello()  # maps the arena
    assert looker._data.uses_shared_memory
    assert looker.lookup(list(range(TOKENS))).matched_tokens == 0
    time.sleep(0.5)
    assert mapped_kib(path, "self") == 0
    writer = client_factory(srv, same_node=True)
    _round_trip(writer, client_factory(srv, same_node=False))
    # the writer's mapping, whole; the looker's still untouched
    assert wait_mapped(path, "self", ARENA // 1024) == ARENA // 1024


def test_a_hello_again_to_the_same_server_keeps_the_mapping_a_restart_replaces_it(
        server_factory, client_factory):
    """Re-mapping on every hello would populate the whole arena again each time (after
    a timeout, a lost peer): the same server's file is mapped once; a restarted
    server's new file gets a new mapping, and the copies go there."""
    srv = server_factory(dram="64MiB", nvme="0", reservation_lease=30)
    writer = client_factory(srv, same_node=True)
    reader = client_factory(srv, same_node=False)
    _round_trip(writer, reader)
    first = writer._data.segment.shm
    writer._hello = None  # what a timeout does
    writer.hello()
    assert writer._data.segment.shm is first
    _round_trip(writer, reader)
    srv.restart()
    writer._hello = None
    writer.hello()
    assert writer._data.segment.shm is not first
    _round_trip(writer, client_factory(srv, same_node=False))


def test_with_prefault_off_pages_are_mapped_only_when_used(server_factory, client_factory):
    srv = server_factory(dram="64MiB", nvme="0", extra=("--no-dram-prefault",))
    path = _arena_of(srv)
    writer = client_factory(srv, same_node=True, config=ClientConfig(prefault_arena=False))
    _round_trip(writer, client_factory(srv, same_node=False))
    time.sleep(1.0)
    # A few blocks, a room and what the server's own threads touched: far from all.
    assert mapped_kib(path, srv.proc.pid) < ARENA // 1024 // 4
    assert mapped_kib(path, "self") < ARENA // 1024 // 4
    assert os.path.exists(path)
