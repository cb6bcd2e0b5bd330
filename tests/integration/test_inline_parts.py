"""An acquire's inline bytes in parts (``Acquire.inline_part``): the client copies and
verifies each part while the next is on the wire.

Against real servers: the parts hold whole entries, arrive exact whether the server
sends them from its arena or from a copy, and a bad entry in any part is a checksum
miss reported with the release, the parts still on their way dropped on arrival.
Against a peer that misbehaves (a ROUTER socket of the test's own): a part that is
missing, out of order or of the wrong length ends the take with an error within the
call's deadline, and the channel stays usable.
"""

import dataclasses
import threading

import msgpack
import numpy as np
import pytest
import zmq

from kvstore.client.rpc import Channel
from kvstore.core import protocol as p
from kvstore.core.config import ClientConfig
from kvstore.core.errors import ChecksumError, InvalidRequestError, KVTimeoutError
from tests.integration.conftest import LAYOUT, damage_at_rest, make_kv
from tests.integration.test_inline import PAGED, _acquire, inline_stats, prompt

pytestmark = pytest.mark.timeout(120)
PART = 64 << 10  # the smallest part a client may ask for


def reader(client_factory, server, part: int = PART, **opts):
    """A client off the server's node asking for every prompt inline, in ``part``s
    (over the ROUTER: the stream door sends the bytes whole)."""
    ops: list[str] = []
    client = client_factory(server, same_node=False,
                            config=ClientConfig(inline_max_bytes=4 << 20,
                                                inline_part_bytes=part,
                                                stream_socket=False),
                            observer=lambda op, s, ok: ops.append(op), **opts)
    client.ops = ops
    return client


def part_sizes(server, req: p.Acquire) -> tuple[list[int], bytes]:
    """The lengths of the parts the server sends ``req``'s bytes in, and the bytes
    joined, over a channel of the test's own (the lease released unused)."""
    ch = Channel(server.address, timeout_s=10.0)
    try:
        got = ch.call(req, take=lambda result, parts: [bytes(b) for b in parts])
        assert "take_error" not in got, got.get("take_error")
        ch.call(p.Release(aid=got["aid"], drop=False))
        joined = ch.call(req)  # no take: the parts come joined, as one would
        ch.call(p.Release(aid=joined["aid"], drop=False))
    finally:
        ch.close()
    assert bytes(joined["inline_data"]) == b"".join(got["taken"])
    return [len(b) for b in got["taken"]], b"".join(got["taken"])


@pytest.mark.parametrize("layout, ntokens", [(PAGED, 256), (LAYOUT, 1200)],
                         ids=["from-the-arena", "copied"])
def test_parts_hold_whole_entries_and_arrive_exact(server_factory, client_factory, layout,
                                                   ntokens):
    """Page-sized entries lie back to back in the arena (sent from it); sub-page ones
    have gaps (the server sends a copy). Either way: parts of at least ``PART`` bytes
    of whole entries, the last maybe shorter, exactly the stored bytes."""
    srv = server_factory(dram="64MiB", nvme="0", block_tokens=layout.block_tokens)
    producer = client_factory(srv, layout=layout)
    consumer = reader(client_factory, srv, layout=layout)
    assert consumer.hello()["inline_parts"] is True
    kv = make_kv(ntokens, 31, layout)
    entry = layout.block_nbytes
    assert kv.size % entry == 0 and kv.size > 2 * PART
    producer.insert(prompt(ntokens, 31), kv)
    req = dataclasses.replace(_acquire(producer, prompt(ntokens, 31), inline=4 << 20),
                              inline_part=PART)
    sizes, data = part_sizes(srv, req)
    assert data == kv.tobytes() and len(sizes) == -(-kv.size // (-(-PART // entry) * entry))
    assert all(n % entry == 0 and n >= PART for n in sizes[:-1]) and sizes[-1] % entry == 0
    took: list[int] = []  # the client's drop_selects take parts as they come
    take_parts = consumer._data.take_parts
    consumer._data.take_parts = lambda *a, **k: took.append(1) or take_parts(*a, **k)
    for seed in (32, 33):  # the client's own drop_select, into a new and a reused buffer
        kv = make_kv(ntokens, seed, layout)
        producer.insert(prompt(ntokens, seed), kv)
        out = np.zeros(kv.size + 4096, np.uint8) if seed == 33 else None
        got = consumer.drop_select(prompt(ntokens, seed), into=out)
        assert got.matched_tokens == ntokens and np.array_equal(got.kv.numpy(), kv)
    assert consumer.ops.count("inline_read") == 2 and "te_read" not in consumer.ops
    assert len(took) == 2
    assert inline_stats(producer)[0] == 4  # part_sizes' two acquires, then these two
    stats = consumer.stats()  # (prompt 31's entries stay: part_sizes only looked)
    assert stats["entries"] == ntokens // layout.block_tokens and stats["leases"] == 0


def test_a_bad_entry_in_a_later_part_is_a_miss_and_the_parts_after_it_are_dropped(
        server_factory, client_factory):
    n = 256  # 64 entries of a page: four parts of 16
    srv = server_factory(dram="64MiB", nvme="0", block_tokens=PAGED.block_tokens)
    producer = client_factory(srv, layout=PAGED)
    consumer = reader(client_factory, srv, layout=PAGED)
    producer.insert(prompt(n, 41), make_kv(n, 41, PAGED))
    keys = producer.keys_for(prompt(n, 41))
    damage_at_rest(producer, [keys[20], keys[40]])  # in the second part and the third
    before = producer.stats()
    took: list[int] = []
    take_parts = consumer._data.take_parts
    consumer._data.take_parts = lambda *a, **k: took.append(1) or take_parts(*a, **k)
    with pytest.raises(ChecksumError) as err:
        consumer.drop_select(prompt(n, 41))
    assert took == [1]  # in parts
    assert err.value.position == 20  # the first bad entry, reported with the release
    stats = producer.stats()
    assert stats["checksum_failures"] - before["checksum_failures"] == 2
    assert stats["leases"] == 0
    assert {e["key"] for e in producer.ls()} == set(keys) - {keys[20], keys[40]}
    # The parts the failed take left unread were dropped when they came: the same
    # client goes on, exactly.
    producer.insert(prompt(n, 42), make_kv(n, 42, PAGED))
    got = consumer.drop_select(prompt(n, 42))
    assert np.array_equal(got.kv.numpy(), make_kv(n, 42, PAGED))


# A server from before parts: it knows ``inline`` but not ``inline_part``, and its
# hello says nothing of parts.
_OLDER_SERVER = ("import runpy, sys\n"
                 "from kvstore.core import protocol\n"
                 "from kvstore.server import loop\n"
                 "del protocol.Acquire.CHECKS['inline_part']\n"
                 "hello = loop.Server.hello\n"
                 "def older(self):\n"
                 "    info = hello(self)\n"
                 "    del info['inline_parts']\n"
                 "    return info\n"
                 "loop.Server.hello = older\n"
                 "sys.argv[0] = 'kvstore-server'\n"
                 "runpy.run_module('kvstore.server', run_name='__main__')\n")


def test_a_server_from_before_parts_sends_one_part(server_factory, client_factory):
    """A client that kept a newer server's hello while an older build took its
    address is refused once (``inline_part`` unknown), reads that prompt over TE, says
    hello again and then asks for its bytes inline in one part."""
    srv = server_factory(nvme="0", block_tokens=PAGED.block_tokens)
    consumer = reader(client_factory, srv, layout=PAGED)
    assert consumer.hello()["inline_parts"] is True
    srv.stop()
    srv.argv[1:3] = ["-c", _OLDER_SERVER]
    srv.start()
    producer = client_factory(srv, layout=PAGED)
    for seed in (51, 52):
        producer.insert(prompt(256, seed), make_kv(256, seed, PAGED))
        got = consumer.drop_select(prompt(256, seed))
        assert np.array_equal(got.kv.numpy(), make_kv(256, seed, PAGED))
    assert consumer.ops == ["te_read", "inline_read"] and consumer._inline_part() is None
    assert consumer.stats()["errors"] == 1  # the one refused acquire


# --------------------------------------------------------------- a peer that misbehaves
class Peer:
    """A ROUTER that answers each request with the messages ``script(rid)`` gives (a
    callable among them is called instead of sent: a wait)."""

    def __init__(self, script) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.script = script
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            rid = msgpack.unpackb(frame)["id"]
            for message in self.script(rid):
                if callable(message):
                    message()
                else:
                    self.sock.send_multipart([ident, *message])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def reply(rid: int, parts: list[int]) -> bytes:
    return p.encode_ok(rid, {"aid": 5, "entries": [], "inline": sum(parts), "parts": parts})


@pytest.mark.parametrize("case", ["missing", "out-of-order", "short", "another-reply",
                                  "three-frames"])
def test_a_part_that_is_wrong_or_missing_ends_the_take_with_an_error(case):
    def script(rid: int) -> list[list[bytes]]:
        if rid > 1:  # the call after the bad one: an ordinary reply
            return [[p.encode_ok(rid, {"status": "ok"})]]
        first = [reply(rid, [4, 4, 4]), b"aaaa"]
        return {
            "missing": [first, [p.encode_part(rid, 1), b"bbbb"]],
            "out-of-order": [first, [p.encode_part(rid, 2), b"cccc"],
                             [p.encode_part(rid, 1), b"bbbb"]],
            "short": [first, [p.encode_part(rid, 1), b"bbb"], [p.encode_part(rid, 2), b"cccc"]],
            "another-reply": [first, [p.encode_part(rid + 7, 1), b"bbbb"]],
            "three-frames": [first, [p.encode_part(rid, 1), b"bb", b"bb"]],
        }[case]

    peer = Peer(script)
    ch = Channel(peer.address, timeout_s=1.0)
    seen: list[bytes] = []
    try:
        req = p.Acquire(keys=(b"k" * 16,), tokens=(b"t",), inline=1 << 20, inline_part=PART)
        got = ch.call(req, take=lambda result, parts: [seen.append(bytes(b)) for b in parts])
        error = got["take_error"]
        assert isinstance(error, KVTimeoutError if case == "missing" else InvalidRequestError)
        assert got["aid"] == 5 and "taken" not in got  # the lease is the caller's to release
        assert seen[0] == b"aaaa" and b"cccc" not in seen
        # What came after is dropped on arrival: the next call gets its own reply.
        assert ch.call(p.Health(), timeout_s=2.0) == {"status": "ok"}
    finally:
        ch.close()
        peer.close()


def test_each_part_is_taken_before_the_next_is_sent():
    """The take sees a part as soon as it is here: the peer sends the second part
    only once the first was handed over (joining all parts first would hang)."""
    first_taken = threading.Event()

    def script(rid: int) -> list:
        return [[reply(rid, [4, 4]), b"aaaa"], lambda: first_taken.wait(5),
                [p.encode_part(rid, 1), b"bbbb"]]

    def take(result, parts):
        got = []
        for buf in parts:
            got.append(bytes(buf))
            first_taken.set()
        return got

    peer = Peer(script)
    ch = Channel(peer.address, timeout_s=3.0)
    try:
        req = p.Acquire(keys=(b"k" * 16,), tokens=(b"t",), inline=1 << 20, inline_part=PART)
        got = ch.call(req, take=take)
        assert got.get("taken") == [b"aaaa", b"bbbb"], got.get("take_error")
    finally:
        ch.close()
        peer.close()


@pytest.mark.parametrize("frames", [1, 2])
def test_parts_without_inline_are_an_ordinary_reply(frames, caplog):
    def script(rid: int) -> list:
        head = p.encode_ok(rid, {"aid": 6, "entries": [], "parts": [4, 4]})
        return [[head, b"aaaa"][:frames], [p.encode_part(rid, 1), b"bbbb"]]

    peer = Peer(script)
    ch = Channel(peer.address, timeout_s=3.0)
    try:
        req = p.Acquire(keys=(b"k" * 16,), tokens=(b"t",), inline=1 << 20, inline_part=PART)
        got = ch.call(req, take=lambda result, parts: list(parts))
        assert got == {"aid": 6, "entries": []}  # no bytes: read over TE
    finally:
        ch.close()
        peer.close()


def test_a_req_socket_gets_its_bytes_in_one_part(server_factory, client_factory):
    """A REQ peer reads one message per request: the server never sends it parts."""
    srv = server_factory(dram="64MiB", nvme="0", block_tokens=PAGED.block_tokens)
    producer = client_factory(srv, layout=PAGED)
    kv = make_kv(256, 61, PAGED)
    producer.insert(prompt(256, 61), kv)
    req = dataclasses.replace(_acquire(producer, prompt(256, 61), inline=4 << 20),
                              inline_part=PART)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.address)
    try:
        sock.send(p.encode_request(1, req))
        assert sock.poll(10_000)
        frames = sock.recv_multipart()
        _, result = p.decode_reply(frames[0], 1 << 30)
        assert "parts" not in result and frames[1] == kv.tobytes()
        sock.send(p.encode_request(2, p.Release(aid=result["aid"], drop=False)))
        assert sock.poll(10_000)
        rid, released = p.decode_reply(sock.recv_multipart()[0], 1 << 30)
        assert rid == 2 and "error" not in released
    finally:
        sock.close(0)
        ctx.term()
