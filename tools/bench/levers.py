"""Issue 12's levers, each against what it replaced, side by side in one run (one node).

    python -m tools.bench.levers [--layout large] [--tokens 2048] [--reps 9]

Eight kvstore-servers on loopback (DRAM only, ``parts.server_opts``): one with
``--verify-commits inline`` (the commit hashes every byte before it answers, as
before), seven with the default ``background``, two of them without rooms (each
put variant runs on a server of its own, idle since the last round). Then,
round by round so that every variant sees the same moment of this noisy machine,
the same prompt size is moved by each variant and each call timed in the calling
process:

* ``put``, same node (memcpy into the server's shared arena):
  ``inline, 1 thread`` (the old path), ``background, 1 thread``,
  ``background, 2 threads`` (``kvstore.client.shm.COPY_THREADS``, for entries of
  ``PARALLEL_MIN_ENTRY_BYTES`` or more; reserve, copy, commit: two round trips),
  ``background, 2 threads, room, ZeroMQ`` (the copy into
  the room the last insert's reply granted, then one ``put`` over the server's ZeroMQ
  port), ``background, 2 threads, room, booked first`` (that ``put`` over the
  server's same-node Unix socket, kvstore/server/local.py, answered once the server
  has booked it: ``KVSTORE_STORE_ANSWER_FIRST=false``), ``background, 2 threads at
  any size, room`` (entries of any size copied on two threads, as before
  ``PARALLEL_MIN_ENTRY_BYTES``), ``background, 2 threads, room, Python's GC`` (a
  server with Python's own garbage-collector settings: ``KVSTORE_SERVER_GC_YOUNG=0``)
  and ``background, 2 threads, room`` (now: answered first, booked right after the
  reply);
* ``get`` over TE (loopback TCP, into a reused buffer):
  ``spin, acked release`` (the old path: one TE sync transfer per run of entries,
  which busy-waits a core, hashed after it landed, and a release that waits for its
  reply), ``spin, one-way release``, ``spin, 2 MiB pieces`` (``client.te_piece_bytes
  = 2MiB``: several sync transfers in flight), ``streamed, one-way release``
  (``client.te_wait = "yield"``: async pieces hashed as they land, the wait yielding),
  ``streamed, sleeping, Python's GC`` (from a server with Python's own GC settings),
  ``streamed, sleeping`` (now, for a prompt over ``client.inline_max_bytes``:
  ``"sleep"``, the wait sleeping between polls; every other variant asks for no
  bytes inline) and ``in the acquire's reply`` (now, up to that size: the bytes come
  with the acquire, no TE read);
* ``put-te``, a producer on another node (TE write from the caller's buffer):
  ``spin`` (hash after the transfer) against ``streamed`` (hash while it flies,
  yielding) and ``streamed, sleeping`` (TE writers get no rooms).

Rooms are switched off (``KVSTORE_POLICY_ROOM_FRACTION=0``) on the servers of every
variant but the five room ones; the same-node socket is off
(``KVSTORE_SERVER_LOCAL_SOCKET=false``) on all of them but the last four, and the
last runs on a server as shipped.

Prints the median ms of each variant and its ratio to the old path (> 1: faster).
Both ends are on this machine, so TE's numbers are loopback's, not a network's; the
transfer section of ``python -m tools.bench`` measures two namespaces.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.integration.conftest import ServerFactory
from tools.bench.cluster_worker import LAYOUTS
from tools.bench.parts import server_opts

MiB = 1 << 20
PIECE = 2 * MiB

PUTS = ("inline, 1 thread", "background, 1 thread", "background, 2 threads",
        "background, 2 threads, room, ZeroMQ", "background, 2 threads, room, booked first",
        "background, 2 threads at any size, room", "background, 2 threads, room, Python's GC",
        "background, 2 threads, room")
GETS = ("spin, acked release", "spin, one-way release", "spin, 2 MiB pieces",
        "streamed, one-way release", "streamed, sleeping, Python's GC", "streamed, sleeping",
        "in the acquire's reply")
TE_PUTS = ("spin", "streamed", "streamed, sleeping")
NO_SOCKET = {"KVSTORE_SERVER_LOCAL_SOCKET": "false"}  # same-node requests over ZeroMQ
NO_ROOMS = {"KVSTORE_POLICY_ROOM_FRACTION": "0", **NO_SOCKET}  # reserve, then commit


def _acked(client: Any) -> Callable[[], None]:
    """Make ``client``'s one-way sends wait for their reply (the old release); returns
    the undo."""
    rpc = client._rpc
    rpc.send = lambda req, timeout_s=None: rpc.call(req, timeout_s) and None
    return lambda: rpc.__dict__.pop("send", None)


def run(layout_name: str, ntokens: int, reps: int) -> dict[str, dict[str, float]]:
    """{"put": {variant: median ms}, "get": {...}}."""
    from kvstore.client import shm
    from kvstore.client.client import KVStoreClient
    from kvstore.core.config import ClientConfig

    layout = LAYOUTS[layout_name]
    nbytes = layout.nbytes(ntokens)
    base = Path(tempfile.mkdtemp(prefix="bench-levers-"))
    servers = ServerFactory(base)
    times: dict[str, dict[str, list[float]]] = {"put": defaultdict(list),
                                                "put-te": defaultdict(list),
                                                "get": defaultdict(list)}
    threads, big = shm.COPY_THREADS, shm.PARALLEL_MIN_ENTRY_BYTES
    try:
        opts = server_opts(layout, nbytes)
        inline = servers(extra=("--verify-commits", "inline"), env=NO_ROOMS, **opts)
        background = servers(env=NO_ROOMS, **opts)
        # Each put variant on a server of its own, idle since the last round like the
        # others: a server that has just served a request answers the next one faster
        # (its threads are awake), which would favour whichever variant runs second.
        two_threads = servers(env=NO_ROOMS, **opts)
        rooms_zmq = servers(env=NO_SOCKET, **opts)
        booked_first = servers(env={"KVSTORE_STORE_ANSWER_FIRST": "false"}, **opts)
        any_size = servers(**opts)
        python_gc = servers(env={"KVSTORE_SERVER_GC_YOUNG": "0"}, **opts)
        rooms = servers(**opts)  # as shipped: rooms, the same-node socket, answer first

        def client(srv: Any, same_node: Any, piece: int = 0, wait: str = "spin",
                   inline: int = 0) -> KVStoreClient:
            return KVStoreClient(srv.address, layout=layout, timeout_s=60, same_node=same_node,
                                 staging_bytes=nbytes + 64 * MiB,
                                 config=ClientConfig(te_piece_bytes=piece, te_wait=wait,
                                                     inline_max_bytes=inline))

        # writer, its copy threads, and the smallest average entry copied on several
        writers = {PUTS[0]: (client(inline, True), 1, big),
                   PUTS[1]: (client(background, True), 1, big),
                   PUTS[2]: (client(two_threads, True), threads, big),
                   PUTS[3]: (client(rooms_zmq, True), threads, big),
                   PUTS[4]: (client(booked_first, True), threads, big),
                   PUTS[5]: (client(any_size, True), threads, 0),
                   PUTS[6]: (client(python_gc, True), threads, big),
                   PUTS[7]: (client(rooms, True), threads, big)}
        # The getters read what a same-node writer stored on the background server
        # (Python's GC one: on that server).
        feeder, gc_feeder = client(background, True), client(python_gc, True)
        readers = {GETS[0]: (client(background, False), feeder),
                   GETS[1]: (client(background, False), feeder),
                   GETS[2]: (client(background, False, PIECE), feeder),
                   GETS[3]: (client(background, False, wait="yield"), feeder),
                   GETS[4]: (client(python_gc, False, wait="sleep"), gc_feeder),
                   GETS[5]: (client(background, False, wait="sleep"), feeder),
                   GETS[6]: (client(background, False, wait="sleep",
                                    inline=ClientConfig().inline_max_bytes), feeder)}
        te_writers = {TE_PUTS[0]: client(background, False),
                      TE_PUTS[1]: client(background, False, wait="yield"),
                      TE_PUTS[2]: client(background, False, wait="sleep")}
        undo = _acked(readers[GETS[0]][0])
        kv = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        out = np.empty(nbytes + MiB, np.uint8)
        serial = 0
        for rep in range(reps + 1):
            for name, (writer, nthreads, min_entry) in writers.items():
                serial += 1
                tokens = (np.arange(ntokens) + serial * ntokens) % 50_000
                shm.COPY_THREADS, shm.PARALLEL_MIN_ENTRY_BYTES = nthreads, min_entry
                start = time.perf_counter()
                writer.insert(tokens, kv=kv)
                took = time.perf_counter() - start
                shm.COPY_THREADS, shm.PARALLEL_MIN_ENTRY_BYTES = threads, big
                writer.drop_select(tokens, into=out)  # leave the server empty again
                if rep:  # the first round is a warm-up (page faults, TE start)
                    times["put"][name].append(took)
            for name, writer in te_writers.items():
                serial += 1
                tokens = (np.arange(ntokens) + serial * ntokens) % 50_000
                start = time.perf_counter()
                writer.insert(tokens, kv=kv)
                took = time.perf_counter() - start
                feeder.drop_select(tokens, into=out)
                if rep:
                    times["put-te"][name].append(took)
            for name, (reader, source) in readers.items():
                serial += 1
                tokens = (np.arange(ntokens) + serial * ntokens) % 50_000
                source.insert(tokens, kv=kv)
                start = time.perf_counter()
                got = reader.drop_select(tokens, into=out)
                took = time.perf_counter() - start
                if got.matched_tokens != ntokens:
                    raise RuntimeError(f"{name}: got {got.matched_tokens} of {ntokens} tokens")
                if rep:
                    times["get"][name].append(took)
        undo()
        for c in [*(w for w, _, _ in writers.values()), feeder, gc_feeder,
                  *(r for r, _ in readers.values()), *te_writers.values()]:
            c.close()
    finally:
        shm.COPY_THREADS, shm.PARALLEL_MIN_ENTRY_BYTES = threads, big
        servers.stop_all()
        shutil.rmtree(base, ignore_errors=True)
    return {op: {k: statistics.median(v) * 1e3 for k, v in t.items()} for op, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="issue 12's levers side by side")
    parser.add_argument("--layout", default="large", choices=sorted(LAYOUTS))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args(argv)
    result = run(args.layout, args.tokens, args.reps)
    mib = LAYOUTS[args.layout].nbytes(args.tokens) / MiB
    print(f"{args.layout} layout, {args.tokens} tokens ({mib:.0f} MiB), median of {args.reps}, "
          "ratio = old path's ms / this one's:")
    for op, variants in result.items():
        old = next(iter(variants.values()))
        for name, ms in variants.items():
            print(f"  {op:6s}  {name:28s} {ms:8.2f} ms  {old / ms:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
