"""Index records damaged at rest (what a bit flip in a msgpack value gives: a field of
the wrong type or an impossible value that still decodes): a real server is stopped,
rows of its LMDB index are edited behind its back, and it starts again on the same
data dir. Every damaged record must be dropped at load (its NVMe space free, one log
line with how many), the rest served exactly as stored, never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lmdb
import msgpack
import numpy as np
import pytest

from kvstore.core import protocol as p
from kvstore.core.errors import IntegrityError
from kvstore.store.index import COMMITTED, Index, Record, decode, encode
from tests.integration.conftest import LAYOUT, ServerProc, make_kv

pytestmark = pytest.mark.timeout(120)

# The stored value: format, then Record's fields after the key.
FIELDS = ["fmt", *Record._fields[1:]]
NTOK = 4 * LAYOUT.block_tokens  # 4 blocks a prompt
DROPPED_LINE = "index records that are undecodable or damaged"


def prompt(i: int) -> tuple[list[int], np.ndarray]:
    return list(range(1000 * i + 1, 1000 * i + 1 + NTOK)), make_kv(NTOK, seed=i)


def set_field(name: str, value: object) -> Callable[[list], None]:
    return lambda fields: fields.__setitem__(FIELDS.index(name), value)


def on_nvme(server: ServerProc, client, n: int) -> list[list[bytes]]:
    """Insert prompts 0..n-1 and demote them all to NVMe (the tier whose records the
    index keeps across a restart); each prompt's keys."""
    for i in range(n):
        tokens, kv = prompt(i)
        client.insert(tokens, kv)
    client._rpc.call(p.Demote(tier="dram", everything=True))
    assert {e["tier"] for e in client.ls()} == {"nvme"}
    assert len(client.ls()) == 4 * n
    return [client.keys_for(prompt(i)[0]) for i in range(n)]


def damage(server: ServerProc, edits: dict[bytes, Callable[[list], None]]) -> None:
    """Stop the server, edit those rows of its index, start it again on the data dir
    (fails, with the server's log, if it does not come up)."""
    server.stop()
    env = lmdb.open(str(server.data_dir / "index"), subdir=True, map_size=1 << 30)
    with env.begin(write=True) as txn:
        for key, edit in edits.items():
            fields = msgpack.unpackb(txn.get(key), raw=False)
            edit(fields)
            txn.put(key, msgpack.packb(fields, use_bin_type=True))
    env.close()
    server.start()


def log_since_start(server: ServerProc) -> str:
    return server.log()[server._log_start:]


def check_served(client, n: int, first_gone: dict[int, int]) -> None:
    """Each prompt is served up to its first dropped block (``first_gone``: prompt ->
    block), with matched tokens and bytes that agree with what was inserted."""
    for i in range(n):
        tokens, kv = prompt(i)
        blocks = first_gone.get(i, 4)
        result = client.get(tokens)
        assert result.matched_tokens == blocks * LAYOUT.block_tokens, i
        if blocks:
            want = kv[:LAYOUT.nbytes(result.matched_tokens)].tobytes()
            assert result.kv.numpy().tobytes() == want, i


def test_fields_of_the_wrong_type_are_dropped_at_start_not_a_crash(server_factory,
                                                                   client_factory):
    """created a string, last_access nil, pins or ends a string: the victim heaps
    compared them and the start died with a TypeError (and left its arena)."""
    server = server_factory()
    client = client_factory(server)
    keys = on_nvme(server, client, 6)
    used = client.stats()["tiers"]["nvme"]["used"]
    client.close()
    damage(server, {keys[0][1]: set_field("created", "yesterday"),
                    keys[1][2]: set_field("last_access", None),
                    keys[2][1]: set_field("pins", "x"),
                    keys[3][3]: set_field("ends", "x"),
                    keys[4][0]: set_field("created", float("nan"))})
    log = log_since_start(server)
    assert "Traceback" not in log
    assert log.count(DROPPED_LINE) == 1 and f"dropping 5 {DROPPED_LINE}" in log
    client = client_factory(server)
    stored = {e["key"] for e in client.ls()}
    assert len(stored) == 24 - 5
    assert not stored & {keys[0][1], keys[1][2], keys[2][1], keys[3][3], keys[4][0]}
    # Their NVMe extents are free: the tier accounts for the kept entries only.
    assert client.stats()["tiers"]["nvme"]["used"] == used * 19 // 24
    assert client.health(deep=True)["status"] == "ok"
    check_served(client, 6, {0: 1, 1: 2, 2: 1, 3: 3, 4: 0})
    assert client.stats()["checksum_failures"] == 0


@pytest.mark.parametrize("ntokens", [0, LAYOUT.block_tokens // 2, 2 * LAYOUT.block_tokens])
def test_a_record_whose_ntokens_disagrees_with_its_tokens_is_dropped(server_factory,
                                                                     client_factory, ntokens):
    """A hit counts its records' ntokens as matched tokens: a damaged one told a client
    of more or fewer tokens than the bytes it got (then unpacking them failed)."""
    server = server_factory()
    client = client_factory(server)
    keys = on_nvme(server, client, 2)
    client.close()
    damage(server, {keys[0][2]: set_field("ntokens", ntokens)})
    client = client_factory(server)
    tokens, kv = prompt(0)
    result = client.drop_select(tokens)
    assert result.matched_tokens == 2 * LAYOUT.block_tokens  # up to the dropped block
    assert result.kv.numpy().tobytes() == kv[:LAYOUT.nbytes(2 * LAYOUT.block_tokens)].tobytes()
    tokens, kv = prompt(1)  # the other prompt, untouched
    assert client.get(tokens).kv.numpy().tobytes() == kv.tobytes()
    assert client.stats()["checksum_failures"] == 0
    assert f"dropping 1 {DROPPED_LINE}" in log_since_start(server)


def test_negative_counts_are_dropped_at_start(server_factory, client_factory):
    """pins, pending or ends below zero loaded as they were (and check_integrity then
    failed on them)."""
    server = server_factory()
    client = client_factory(server)
    keys = on_nvme(server, client, 4)
    client.close()
    damage(server, {keys[0][1]: set_field("pins", -5), keys[1][2]: set_field("pending", -5),
                    keys[2][3]: set_field("ends", -3)})
    client = client_factory(server)
    assert client.health(deep=True)["status"] == "ok"
    assert len(client.ls()) == 16 - 3
    check_served(client, 4, {0: 1, 1: 2, 2: 3})
    assert f"dropping 3 {DROPPED_LINE}" in log_since_start(server)


# ------------------------------------------------------------------ the check itself
def good(i: int = 1) -> Record:
    return Record(i.to_bytes(16, "little"), "nvme", 8192, 512, 4, bytes(range(16)), 77,
                  1_700_000_000.5, 1_700_000_001.5, 1, 2, b"meta", COMMITTED, None,
                  b"n" * 8, 1)


BAD: dict[str, list[Any]] = {  # field -> damaged values that still decode (msgpack round trip)
    "offset": [-4096, "x", 1.5, None, True],
    "nbytes": [0, -512, "x", None],
    "ntokens": [0, 2, 8, -4, "4", 4.0],
    "tokens": [b"", b"abc", "abcd", 7],
    "checksum": [-1, -(1 << 63), "x", 1.0],
    "created": ["yesterday", None, float("nan"), float("inf"), -1.0],
    "last_access": [None, "x", float("nan")],
    "pins": [-5, "x", None, 1.5, True],
    "pending": [-5, "x", None],
    "ends": [-3, "x", None],
    "meta": [7, "text", b"m" * 1025],
    "namespace": [7, b"n" * 5, b"n" * 16, "nnnnnnnn"],
    "nvme_copy": [-4096, "x", 1.5],
    "tier": [7, None, ["nvme"]],
    "state": [7, None],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in BAD.items() for v in vs])
def test_decode_refuses_each_damaged_field_and_names_it(field, value):
    rec = good()
    raw = list(msgpack.unpackb(encode(rec), raw=False))
    raw[FIELDS.index(field)] = value
    with pytest.raises(IntegrityError, match=f"damaged index record {rec.key.hex()}: "
                                             f"bad {field}:"):
        decode(rec.key, msgpack.packb(raw, use_bin_type=True))


def test_decode_keeps_what_the_store_writes():
    for rec in [good(), good()._replace(pins=0, pending=0, ends=0, meta=b"", namespace=b"",
                                        tier="dram", nvme_copy=4096, created=0,
                                        last_access=5)]:
        assert decode(rec.key, encode(rec)) == rec
    with pytest.raises(IntegrityError, match="bad key"):
        decode(b"k" * 15, encode(good()))


def test_load_drops_damaged_rows_and_says_how_many_once(tmp_path, caplog):
    path = tmp_path / "index"
    idx = Index(path, map_size=16 << 20)
    idx.put_many([good(i)._replace(offset=i * 4096) for i in range(10)])
    idx.close()
    env = lmdb.open(str(path), map_size=16 << 20)
    with env.begin(write=True) as txn:
        for i, (field, value) in enumerate([("pins", -1), ("created", "x"), ("ntokens", 0)]):
            raw = msgpack.unpackb(txn.get(good(i).key), raw=False)
            raw[FIELDS.index(field)] = value
            txn.put(good(i).key, msgpack.packb(raw, use_bin_type=True))
    env.close()
    idx = Index(path, map_size=16 << 20)
    with caplog.at_level(logging.WARNING, logger="kvstore.store.index"):
        result = idx.load({"nvme"})
    assert sorted(r.key for r in result.kept) == [good(i).key for i in range(3, 10)]
    assert (result.dropped, result.damaged) == (3, 3)
    lines = [r.getMessage() for r in caplog.records if DROPPED_LINE in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"dropping 3 {DROPPED_LINE}")
    assert len(idx) == 7  # the damaged rows are gone from the index too
    idx.close()
