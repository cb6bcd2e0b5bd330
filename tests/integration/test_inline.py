"""A drop_select's bytes in its acquire's reply (``Acquire.inline``), against real servers.

A client off the server's node asks for up to ``client.inline_max_bytes`` of a prompt
in the acquire's reply; the server sends them as a frame after the reply when they
are all in DRAM, fit its ``server.inline_max_bytes`` and the request came over the
ZeroMQ port, or as the bytes after it when it came over the stream door (where such
a client sends its requests by default: tests/integration/test_stream_door.py).
Everything else reads over TE, as before. The client verifies every entry as it
copies it out of the reply (receives it, over the door). The tests marked
``DOORS`` run both ways.
"""

import dataclasses
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zmq

from kvstore.client.client import KVStoreClient
from kvstore.client.local import LocalChannel
from kvstore.client.rpc import Channel
from kvstore.core import protocol as p
from kvstore.core.config import ClientConfig
from kvstore.core.errors import ChecksumError, TierFullError
from kvstore.core.layout import KVLayout
from kvstore.server.loop import INLINE_BACKLOG, INLINE_COPY_MAX
from tests.integration.conftest import LAYOUT, damage_at_rest, make_kv, wait_for

pytestmark = pytest.mark.timeout(120)
# Entries of one page each: a prompt's lie back to back in the arena (LAYOUT's do not).
PAGED = KVLayout(num_layers=2, kv_heads=2, head_dim=64, dtype="float16", block_tokens=4)


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(2000 + seed).integers(0, 50_000, n).tolist()


def reader(client_factory, server, cap: int = 4 << 20, stream: bool = True, **opts):
    """A client off the server's node (TE), asking for up to ``cap`` bytes inline, its
    requests over the stream door (``stream``) or the ROUTER; the data-path
    operations it ran are in its ``.ops``."""
    ops: list[str] = []
    client = client_factory(server, same_node=False,
                            config=ClientConfig(inline_max_bytes=cap, stream_socket=stream),
                            observer=lambda op, s, ok: ops.append(op), **opts)
    client.ops = ops
    client.hello()
    assert client._rpc.stream is (stream and bool(client.hello().get("stream_port")))
    return client


DOORS = pytest.mark.parametrize("stream", [True, False], ids=["stream door", "router"])


def inline_views(client) -> int:
    """Inline replies the server sent from its arena itself (no copy)."""
    return client.stats()["inline_views"]


def inline_stats(client) -> tuple[int, int]:
    stats = client.stats()
    return stats["inline_replies"], stats["inline_bytes"]


@DOORS
def test_a_small_drop_select_comes_in_its_acquires_reply(clean_server, client_factory, stream):
    producer = client_factory(clean_server)  # same node: writes through the arena
    consumer = reader(client_factory, clean_server, stream=stream)
    assert consumer.hello()["inline_max"] == 4 << 30
    before = inline_stats(producer)
    views = inline_views(producer)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(13, 16, generator=g).bfloat16()
    for seed, n in enumerate([13, 4, 37]):  # sub-page entries: the arena has gaps
        kv = make_kv(n, seed)
        producer.insert(prompt(n, seed), kv, hidden=hidden if seed == 0 else None)
        got = consumer.drop_select(prompt(n, seed))
        assert got.matched_tokens == n and np.array_equal(got.kv.numpy(), kv)
        if seed == 0:
            assert torch.equal(got.hidden, hidden)
    replies, nbytes = inline_stats(producer)
    hidden_bytes = hidden.numel() * hidden.element_size()
    # Every byte moved in the replies (the hidden entry with its prompt), none over TE.
    assert replies - before[0] == 3
    assert nbytes - before[1] >= LAYOUT.nbytes(13 + 4 + 37) + hidden_bytes
    assert "inline_read" in consumer.ops and "te_read" not in consumer.ops
    # The one-entry prompt went from the arena itself, the others as copies (their
    # sub-page entries have gaps between them in the arena).
    assert inline_views(producer) == views + 1
    # Asked by the consumer: served after its own one-way release (another client's
    # request, over another door, may be served before it).
    stats = consumer.stats()
    assert stats["entries"] == 0 and stats["leases"] == 0


@DOORS
def test_into_a_reused_buffer_and_a_get_that_keeps_the_entries(clean_server, client_factory, stream):
    producer = client_factory(clean_server)
    consumer = reader(client_factory, clean_server, stream=stream)
    kv = make_kv(40, 7)
    producer.insert(prompt(40, 7), kv)
    out = torch.zeros(LAYOUT.nbytes(40) + 4096, dtype=torch.uint8)
    for _ in range(2):
        got = consumer.get(prompt(40, 7), into=out)
        assert got.matched_tokens == 40 and np.array_equal(got.kv.numpy(), kv)
        assert got.kv.data_ptr() == out.data_ptr()  # landed in the caller's buffer
    assert consumer.drop_select(prompt(40, 7), into=out).matched_tokens == 40
    assert "te_read" not in consumer.ops and consumer.stats()["entries"] == 0  # (as above)


@DOORS
def test_over_either_limit_or_skipping_blocks_the_bytes_go_over_te(server_factory,
                                                                    client_factory, stream):
    srv = server_factory(dram="16MiB", env={"KVSTORE_SERVER_INLINE_MAX_BYTES": "16KiB"})
    producer = client_factory(srv)
    small = reader(client_factory, srv, cap=8 << 10, stream=stream)  # under the prompt below
    big = reader(client_factory, srv, stream=stream)  # asks for 4 MiB: the server sends at most 16 KiB
    kv = make_kv(200, 8)  # 25 KiB of KV: over both limits
    assert LAYOUT.nbytes(200) > 16 << 10
    for client in (small, big):
        producer.insert(prompt(200, 8), kv)
        got = client.drop_select(prompt(200, 8))
        assert got.matched_tokens == 200 and np.array_equal(got.kv.numpy(), kv)
        assert client.ops.count("te_read") == 1 and "inline_read" not in client.ops
    # Within both limits, but the caller holds the first blocks: what moves goes over TE.
    producer.insert(prompt(8, 9), make_kv(8, 9))
    got = big.drop_select(prompt(8, 9), skip_blocks=1)
    assert np.array_equal(got.kv.numpy(), make_kv(8, 9)[LAYOUT.nbytes(4):])
    assert big.ops.count("te_read") == 2
    # And within both: in the reply.
    producer.insert(prompt(8, 9), make_kv(8, 9))
    assert big.drop_select(prompt(8, 9)).matched_tokens == 8
    assert "inline_read" in big.ops and inline_stats(producer)[0] == 1


def test_a_server_that_sends_none_is_never_asked(server_factory, client_factory):
    srv = server_factory(env={"KVSTORE_SERVER_INLINE_MAX_BYTES": "0"})
    producer = client_factory(srv)
    consumer = reader(client_factory, srv)
    assert consumer.hello()["inline_max"] == 0
    assert consumer._inline(0) is None  # the field is left out (as for older servers)
    producer.insert(prompt(9, 1), make_kv(9, 1))
    assert np.array_equal(consumer.drop_select(prompt(9, 1)).kv.numpy(), make_kv(9, 1))
    assert consumer.ops == ["te_read"] and inline_stats(producer) == (0, 0)


@DOORS
def test_bytes_bad_at_rest_are_a_checksum_miss_reported_and_dropped(clean_server,
                                                                      client_factory, stream):
    producer = client_factory(clean_server)
    consumer = reader(client_factory, clean_server, stream=stream)
    producer.insert(prompt(12, 5), make_kv(12, 5))
    keys = producer.keys_for(prompt(12, 5))
    damage_at_rest(producer, keys[1:])
    before = producer.stats()
    with pytest.raises(ChecksumError) as err:
        consumer.drop_select(prompt(12, 5))
    assert "inline_read" in consumer.ops
    assert err.value.position == 1  # the first bad entry, reported with the release
    stats = producer.stats()
    assert stats["transfer_checksum_failures"] == before["transfer_checksum_failures"]
    assert stats["leases"] == 0
    if stream:  # the server ended the lease once sent: the drop took them all, unchecked
        assert stats["checksum_failures"] == before["checksum_failures"]
        assert stats["unchecked_checksum_failures"] - \
            before["unchecked_checksum_failures"] == 1
        assert producer.ls() == []
    else:  # re-checked at rest: both bad ones dropped, the good one stays
        assert stats["checksum_failures"] - before["checksum_failures"] == 2
        assert {e["key"] for e in producer.ls()} == {keys[0]}


def _acquire(client: KVStoreClient, tokens: list[int], inline: int) -> p.Acquire:
    pr = client._prompt(tokens)
    return p.Acquire(keys=tuple(pr.keys), tokens=tuple(pr.tokens), inline=inline)


def test_only_the_zeromq_port_sends_bytes_and_they_are_exactly_the_entries(clean_server,
                                                                            client_factory):
    producer = client_factory(clean_server)
    kv = make_kv(20, 3)
    producer.insert(prompt(20, 3), kv)
    req = _acquire(producer, prompt(20, 3), inline=1 << 20)
    router = Channel(clean_server.address, timeout_s=10.0)
    local = LocalChannel(router.call(p.Hello())["local"], timeout_s=10.0,
                         max_bytes=router.max_bytes)
    try:
        over_local = local.call(req)
        assert "inline" not in over_local and "inline_data" not in over_local
        over_router = router.call(req)
        assert over_router["inline"] == kv.size
        assert bytes(over_router["inline_data"]) == kv.tobytes()
        assert [e[:3] for e in over_router["entries"]] == [e[:3] for e in over_local["entries"]]
        for got in (over_local, over_router):
            router.call(p.Release(aid=got["aid"], drop=False))
    finally:
        router.close()
        local.close()
    assert producer.lookup(prompt(20, 3)).matched_tokens == 20


def _stuck_peer(address: str) -> tuple[zmq.Context, zmq.Socket]:
    """A peer whose libzmq takes one message at a time and whose socket buffers are
    small: what it has not read stays with the server (a stopped process, a slow link)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 64 << 10)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


def _assert_replies_hold(producer, n: int) -> None:
    """With every lease run out, the ``n``-token prompt's entries are still held: a
    reply sent from the arena is on its way (said in words when none is)."""
    held = producer.stats()["leased_entries"]
    assert held == n // PAGED.block_tokens, (
        f"{held} entries held after {inline_views(producer)} replies from the arena: "
        "none still on its way (the kernel's buffers took them whole)")


def test_replies_a_peer_leaves_unread_are_bounded(server_factory, client_factory):
    """A peer that asks and never reads cannot make the server hold more than
    INLINE_BACKLOG replies' worth of bytes: past that, replies name TE addresses."""
    cap = 1 << 20
    # A patient server: 100 asks at once on a loaded machine can be estimated to start
    # after busy_after_s (2 s), and then they, and the stats asked meanwhile, are
    # answered busy (push-back, tests/integration/test_busy.py), not what is tested.
    srv = server_factory(dram="64MiB", env={"KVSTORE_SERVER_INLINE_MAX_BYTES": str(cap)},
                         extra=("--busy-after", "60"))
    producer = client_factory(srv)
    n = 8192  # 1 MiB of KV in 2 048 blocks: each reply carries all of it
    assert LAYOUT.nbytes(n) == cap
    producer.insert(prompt(n, 6), make_kv(n, 6))
    req = dataclasses.replace(_acquire(producer, prompt(n, 6), inline=cap), lease_s=60.0)
    asks = 100  # 100 MiB if nothing bounded it; the sockets' buffers take a few
    ch = Channel(srv.address, timeout_s=30.0)
    ctx, sock = _stuck_peer(srv.address)
    try:
        for i in range(asks):
            sock.send(p.encode_request(i + 1, req))
        # The server answers every ask while nothing is read (each holds a lease).
        wait_for(lambda: producer.stats()["leases"] >= asks, 30, "every ask to be served")
        got = []
        while len(got) < asks:
            assert sock.poll(10_000), f"only {len(got)} of {asks} replies"
            got.append(sock.recv_multipart())
        for frames in got:
            rid, result = p.decode_reply(frames[0], 1 << 30)
            assert "error" not in result and len(result["entries"]) == n // 4
            assert len(frames) == 1 + ("inline" in result)
            if len(frames) == 2:
                assert frames[1] == make_kv(n, 6).tobytes()
            ch.send(p.Release(aid=result["aid"], drop=False))
    finally:
        sock.close(0)
        ctx.term()
        ch.close()
    sent = sum(len(frames) == 2 for frames in got)
    assert inline_stats(producer)[0] == sent
    assert INLINE_BACKLOG <= sent < asks, sent  # a backlog, then TE addresses
    deadline = time.monotonic() + 10
    while producer.stats()["leases"]:
        assert time.monotonic() < deadline, "the releases were never applied"
        time.sleep(0.05)
    assert producer.lookup(prompt(n, 6)).matched_tokens == n


def test_an_unsent_reply_holds_its_entries_but_not_its_lease(server_factory, client_factory):
    """A prompt's entries back to back in the arena go out without a copy: ZeroMQ
    sends from the arena itself. Until a reply's bytes are out, the store holds its
    entries: they can be neither evicted nor dropped, nor their room written, however
    soon the lease ends (here a client's 0.2 s lease, then a drop_select that takes
    the prompt). The lease itself ends on time, so the reader that stopped keeps no
    claim from the consumers behind it. When the peer reads at last, every reply that
    came with bytes carries the stored ones; once they are out the entries go."""
    cap = 1 << 20
    n = 1024  # 1 MiB of KV in 256 entries of a page: the tier has room for one such prompt
    srv = server_factory(dram=str(cap + (cap >> 1)), nvme="0",
                         block_tokens=PAGED.block_tokens,
                         env={"KVSTORE_SERVER_INLINE_MAX_BYTES": str(cap)},
                         extra=("--busy-after", "60"))  # (40 asks queued: as above)
    producer = client_factory(srv, layout=PAGED)
    assert PAGED.nbytes(n) == cap
    producer.insert(prompt(n, 7), make_kv(n, 7, PAGED))
    short = dataclasses.replace(_acquire(producer, prompt(n, 7), inline=cap), lease_s=0.2)
    asks = 40  # the first claims the prompt's consumer, as a drop_select does
    expired = producer.stats()["leases_expired"]
    ctx, sock = _stuck_peer(srv.address)
    try:
        for i in range(asks):  # spaced out, as _STOPPED_PEER's (below) and for its reason
            sock.send(p.encode_request(i + 1, dataclasses.replace(short, claim=i == 0)))
            time.sleep(0.05)
        # Every ask was served and its lease has run out (not a fixed sleep: a loaded
        # machine may serve them late; a lease-free moment before any was served
        # would prove nothing).
        wait_for(lambda: (s := producer.stats())["leases"] == 0
                 and s["leases_expired"] - expired >= asks, 10, "the leases to run out")
        _assert_replies_hold(producer, n)
        # Its claim went back: another consumer takes the prompt, exactly.
        consumer = reader(client_factory, srv, cap=cap, layout=PAGED)
        res = consumer.drop_select(prompt(n, 7))
        assert res.matched_tokens == n and res.kv.numpy().tobytes() == make_kv(n, 7, PAGED).tobytes()
        # Taken, and held while replies still hold views of them.
        assert producer.evict(everything=True)["count"] == 0
        with pytest.raises(TierFullError):  # no room but the held entries'
            producer.insert(prompt(n, 8), make_kv(n, 8, PAGED))
        got = []
        while len(got) < asks:
            assert sock.poll(10_000), f"only {len(got)} of {asks} replies"
            got.append(sock.recv_multipart())
    finally:
        sock.close(0)
        ctx.term()
    with_bytes = [frames for frames in got if len(frames) == 2]
    assert with_bytes
    for frames in with_bytes:
        assert frames[1] == make_kv(n, 7, PAGED).tobytes()
    # All out: the holds go at the next reap, and the taken prompt with them.
    deadline = time.monotonic() + 10
    while producer.lookup(prompt(n, 7)).matched_tokens:
        assert time.monotonic() < deadline, "the entries outlived the replies"
        time.sleep(0.05)
    producer.insert(prompt(n, 8), make_kv(n, 8, PAGED))
    assert producer.health(deep=True)["status"] == "ok"


def test_replies_from_the_arena_reuse_their_slots(server_factory, client_factory):
    """More drop_selects than there are slots, each sent from the arena itself: every
    one comes inline and exact, and its release finds the entries free to go."""
    n = 256  # 256 KiB in 64 entries of a page
    srv = server_factory(dram="8MiB", nvme="0", block_tokens=PAGED.block_tokens)
    producer = client_factory(srv, layout=PAGED)
    consumer = reader(client_factory, srv, layout=PAGED)
    rounds = 3 * INLINE_BACKLOG
    for i in range(rounds):
        kv = make_kv(n, 100 + i, PAGED)
        producer.insert(prompt(n, 100 + i), kv)
        res = consumer.drop_select(prompt(n, 100 + i))
        assert res.matched_tokens == n and res.kv.numpy().tobytes() == kv.tobytes()
        # Its one-way release is served before this (the same connection): the
        # reply's hold was given back first, so the drop freed the entries at once.
        stats = consumer.stats()
        assert stats["entries"] == 0 and stats["leases"] == 0, stats
    assert consumer.ops.count("inline_read") == rounds and "te_read" not in consumer.ops
    assert inline_views(producer) == rounds  # every one from the arena itself
    assert producer.health(deep=True)["status"] == "ok"


# Sends its requests spaced out: while a reply sent from the arena is on its way, the
# server sends the next ones over TE (``INLINE_HOLD_SHARE``), so requests that came
# all at once could leave one or two replies from the arena in all, which the
# kernel's socket buffers (4 MiB and more here) may take whole, holding nothing.
_STOPPED_PEER = """
import os, signal, sys, time, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.RCVHWM, 1)
sock.setsockopt(zmq.RCVBUF, 64 << 10)
sock.connect(sys.argv[1])
for i in range(int(sys.argv[3])):
    sock.send(bytes.fromhex(sys.argv[2]))
    time.sleep(float(sys.argv[4]))
print("sent", flush=True)
sys.stdin.readline()  # the test has seen the replies held
os.kill(os.getpid(), signal.SIGSTOP)  # its libzmq stops too: no heartbeat answered
"""


@pytest.mark.parametrize("peer_timeout", [1.5, 0])
def test_a_stopped_peer_is_let_go_and_its_replies_with_it(server_factory, client_factory,
                                                          peer_timeout):
    """A client that stops for good (SIGSTOP here; a hung host alike) with replies
    it never read: its connection answers no heartbeat, so after
    ``server.peer_timeout_s`` the server closes it, ZeroMQ drops the replies, and the
    entries they held can go again. With the timeout off they stay held. (The
    timeout comes as a flag, 0 from the environment: both reach the server.)"""
    cap = 1 << 20
    n = 1024
    env = {"KVSTORE_SERVER_INLINE_MAX_BYTES": str(cap)}
    flags: tuple[str, ...] = ()
    if peer_timeout:
        flags = ("--peer-timeout", str(peer_timeout))
    else:
        env["KVSTORE_SERVER_PEER_TIMEOUT_S"] = "0"
    srv = server_factory(dram=str(cap + (cap >> 1)), nvme="0",
                         block_tokens=PAGED.block_tokens, env=env, extra=flags)
    producer = client_factory(srv, layout=PAGED)
    producer.insert(prompt(n, 9), make_kv(n, 9, PAGED))
    req = dataclasses.replace(_acquire(producer, prompt(n, 9), inline=cap), lease_s=0.2)
    peer = subprocess.Popen([sys.executable, "-c", _STOPPED_PEER, srv.address,
                             p.encode_request(1, req).hex(), "40", "0.05"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "sent"
        deadline = time.monotonic() + 10
        while inline_views(producer) < 2:  # (more than the kernel's buffers took)
            assert time.monotonic() < deadline, "no reply was sent from the arena"
            time.sleep(0.05)
        time.sleep(0.5)  # the leases (0.2 s) ran out: only the replies hold the entries
        _assert_replies_hold(producer, n)
        assert producer.evict(everything=True)["count"] == 0
        peer.stdin.write("\n")
        peer.stdin.flush()
        time.sleep(peer_timeout + 2.0)  # the timeout, then a reap to settle the slots
        evicted = producer.evict(everything=True)["count"]
        assert evicted == (n // PAGED.block_tokens if peer_timeout else 0), evicted
    finally:
        peer.kill()
        peer.wait(10)
        peer.stdin.close()
        peer.stdout.close()


def test_a_curve_client_reads_over_te(server_factory, client_factory, tmp_path):
    """Under CURVE, ZeroMQ encrypts every byte of a reply: bytes sent inline would be
    slower than TE's read, so a client with CURVE keys never asks for them."""
    from kvstore.server.cli import generate_keys

    server_pub, server_secret = generate_keys(str(tmp_path / "server"), "server")
    client_pub, client_secret = generate_keys(str(tmp_path / "client"), "client")
    (tmp_path / "authorized").mkdir()
    (tmp_path / "authorized" / "client.key").write_bytes(open(client_pub, "rb").read())
    srv = server_factory(extra=("--curve-secret-key", server_secret,
                                "--curve-authorized-keys", str(tmp_path / "authorized")))
    keys = dict(curve_secret_key=client_secret, curve_server_public_key=server_pub)
    producer = client_factory(srv, **keys)
    consumer = reader(client_factory, srv, **keys)
    assert consumer.hello()["inline_max"] == 4 << 30 and consumer._inline(0) is None
    # Nor is there a stream door, which CURVE would not cover.
    assert consumer.hello()["stream_port"] is None and "stream door port" not in srv.log()
    producer.insert(prompt(9, 2), make_kv(9, 2))
    assert np.array_equal(consumer.drop_select(prompt(9, 2)).kv.numpy(), make_kv(9, 2))
    assert consumer.ops == ["te_read"] and inline_stats(producer) == (0, 0)


# A server from before inline replies: the shipped server, its acquire schema without
# the field (as that build's decoder had it); started with --inline-max-bytes 0, its
# hello says inline_max 0 (an older one's says nothing: the same to a client).
_OLDER_SERVER = ("import runpy, sys\n"
                 "from kvstore.core import protocol\n"
                 "del protocol.Acquire.CHECKS['inline']\n"
                 "sys.argv[0] = 'kvstore-server'\n"
                 "runpy.run_module('kvstore.server', run_name='__main__')\n")


# A server from before acquire deadlines (09fb8dd): its decoder refuses the field and
# its hello does not offer it.
_BEFORE_READ_DEADLINES = (
    "import runpy, sys\n"
    "from kvstore.core import protocol\n"
    "from kvstore.server.loop import Server\n"
    "del protocol.Acquire.CHECKS['deadline']\n"
    "said = Server.hello\n"
    "Server.hello = lambda self: {k: v for k, v in said(self).items()\n"
    "                             if k != 'acquire_deadline'}\n"
    "sys.argv[0] = 'kvstore-server'\n"
    "runpy.run_module('kvstore.server', run_name='__main__')\n")


@pytest.mark.parametrize("same_node", [True, False])
def test_a_server_older_than_acquire_deadlines_is_asked_without_one(server_factory,
                                                                  client_factory, same_node):
    """A new client and a server from before acquire deadlines (a rolling upgrade,
    clients first): the client sends none (the hello does not offer them), so no
    acquire is refused, and small drop_selects still come inline."""
    srv = server_factory()
    srv.stop()
    srv.argv[1:3] = ["-c", _BEFORE_READ_DEADLINES]
    srv.start()
    producer = client_factory(srv)
    consumer = reader(client_factory, srv) if not same_node else client_factory(srv)
    assert "acquire_deadline" not in consumer.hello()
    for seed in (5, 6, 7):
        producer.insert(prompt(21, seed), make_kv(21, seed))
        got = consumer.drop_select(prompt(21, seed))
        assert got.matched_tokens == 21 and np.array_equal(got.kv.numpy(), make_kv(21, seed))
    if not same_node:
        assert consumer.ops == ["inline_read"] * 3
    assert consumer.stats()["errors"] == 0


def test_a_client_whose_server_was_replaced_by_an_older_one_reads_over_te(
        server_factory, client_factory):
    """The client keeps a server's hello while the server answers; a newer server
    replaced by an older build at the same address refuses ``inline`` as an unknown
    field. The drop_select asks again without it and reads over TE, and the client
    stops asking."""
    srv = server_factory()
    consumer = reader(client_factory, srv)
    assert consumer.hello()["inline_max"] == 4 << 30
    srv.stop()
    assert srv.argv[1:3] == ["-m", "kvstore.server"]
    srv.argv[1:3] = ["-c", _OLDER_SERVER]
    srv.argv += ["--inline-max-bytes", "0"]
    srv.start()
    producer = client_factory(srv)
    # A miss first: refused, asked again without the field, nothing to read (so no
    # reply names the new segment). The hello is read afresh all the same: the next
    # acquires do not carry the field (else each would be refused once more).
    assert consumer.drop_select(prompt(21, 9)).matched_tokens == 0
    for seed in (3, 4):
        producer.insert(prompt(21, seed), make_kv(21, seed))
        got = consumer.drop_select(prompt(21, seed))
        assert got.matched_tokens == 21 and np.array_equal(got.kv.numpy(), make_kv(21, seed))
    assert consumer.ops == ["te_read", "te_read"] and consumer._inline(0) is None
    stats = consumer.stats()  # after its own one-way release
    assert stats["entries"] == 0 and stats["leases"] == 0
    assert stats["errors"] == 1  # the one refused acquire


# Entries of 38 KiB in 40 KiB of the arena each: a prompt's lie 2 KiB apart there.
GAPPED = KVLayout(num_layers=19, kv_heads=2, head_dim=64, dtype="float16", block_tokens=4)


@DOORS
def test_a_reply_that_would_be_a_large_copy_goes_from_the_arena_or_over_te(
        server_factory, client_factory, stream):
    """Entries not back to back in the arena, more than INLINE_COPY_MAX of them: the
    serving thread does not copy them for a reply. The stream door sends them from
    the arena, entry by entry; over the ROUTER, which sends one frame, they go over
    TE. Exact either way."""
    n = 4 * 244  # 244 entries, 9.1 MiB: over the copy cap, under both inline limits
    assert GAPPED.nbytes(n) > INLINE_COPY_MAX and GAPPED.entry_sizes(4)[0] % 4096
    srv = server_factory(dram="32MiB", nvme="0", block_tokens=GAPPED.block_tokens)
    producer = client_factory(srv, layout=GAPPED)
    consumer = reader(client_factory, srv, cap=64 << 20, stream=stream, layout=GAPPED)
    kv = make_kv(n, 21, GAPPED)
    producer.insert(prompt(n, 21), kv)
    replies, views = inline_stats(producer)[0], inline_views(producer)
    got = consumer.drop_select(prompt(n, 21))
    assert got.matched_tokens == n and np.array_equal(got.kv.numpy(), kv)
    if stream:
        assert consumer.ops.count("inline_read") == 1 and "te_read" not in consumer.ops
        assert inline_views(producer) == views + 1
    else:
        assert consumer.ops.count("te_read") == 1 and "inline_read" not in consumer.ops
        assert inline_stats(producer)[0] == replies
    # Under the cap the ROUTER's reply is a copy, as before.
    small = 4 * 100  # 3.7 MiB
    producer.insert(prompt(small, 22), make_kv(small, 22, GAPPED))
    got = consumer.drop_select(prompt(small, 22))
    assert np.array_equal(got.kv.numpy(), make_kv(small, 22, GAPPED))
    assert consumer.ops.count("inline_read") == 1 + stream


# Entries of 1 MiB (whole pages: a prompt's lie back to back in the arena).
MIB_ENTRIES = KVLayout(num_layers=64, kv_heads=8, head_dim=128, dtype="float16",
                       block_tokens=4)


@DOORS
def test_a_prompt_over_the_routers_bound_comes_over_the_door_and_te_otherwise(
        server_factory, client_factory, stream):
    """Past ROUTER_INLINE_BYTES (one ZeroMQ message's worth) a prompt's bytes still
    follow the reply over the stream door, with the defaults; over the ROUTER they
    are read over TE (the client does not ask for them there, and the server would
    not send them). Exact either way."""
    n = 4 * 66  # 66 entries of 1 MiB
    assert MIB_ENTRIES.entry_sizes(4)[0] == 1 << 20
    assert MIB_ENTRIES.nbytes(n) > p.ROUTER_INLINE_BYTES
    srv = server_factory(dram="160MiB", nvme="0", block_tokens=MIB_ENTRIES.block_tokens)
    producer = client_factory(srv, layout=MIB_ENTRIES)
    consumer = reader(client_factory, srv, cap=ClientConfig().inline_max_bytes,
                      stream=stream, layout=MIB_ENTRIES, staging_bytes=80 << 20)
    assert consumer.hello()["inline_max"] >= MIB_ENTRIES.nbytes(n)
    # What it asks: all it may over the door; over the ROUTER, one message's worth.
    assert consumer._inline(0) == (ClientConfig().inline_max_bytes if stream
                                   else p.ROUTER_INLINE_BYTES)
    kv = make_kv(n, 23, MIB_ENTRIES)
    producer.insert(prompt(n, 23), kv)
    replies, sent = inline_stats(producer)
    got = consumer.drop_select(prompt(n, 23))
    assert got.matched_tokens == n and np.array_equal(got.kv.numpy(), kv)
    if stream:
        assert "inline_read" in consumer.ops and "te_read" not in consumer.ops
        assert inline_stats(producer) == (replies + 1, sent + kv.size)
    else:
        assert "te_read" in consumer.ops and "inline_read" not in consumer.ops
        assert inline_stats(producer) == (replies, sent)
    # The server bounds the ROUTER itself: asked for the bytes there, it names TE
    # addresses (a client whose door failed sends the request it built for the door).
    producer.insert(prompt(n, 24), make_kv(n, 24, MIB_ENTRIES))
    req = _acquire(producer, prompt(n, 24), inline=1 << 30)
    router = Channel(srv.address, timeout_s=30.0)
    try:
        reply = router.call(req)
        assert "error" not in reply and "inline" not in reply and len(reply["entries"]) == 66
        router.send(p.Release(aid=reply["aid"], drop=False))
    finally:
        router.close()
