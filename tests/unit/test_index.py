"""The LMDB index on a real environment: batched writes, start-up filtering, codec."""

import lmdb
import pytest

from kvstore.core.errors import IntegrityError
from kvstore.store.index import COMMITTED, Index, Record, decode, encode


def rec(i: int, tier: str = "nvme", state: str = COMMITTED) -> Record:
    key = i.to_bytes(16, "little")
    return Record(key, tier, i * 4096, 4096, 16, bytes(range(64)), 0xABCDEF + i,
                  1000.0 + i, 2000.0 + i, 0, 1, b"m" * (i % 3), state)


@pytest.fixture
def index(tmp_path):
    idx = Index(tmp_path / "index", map_size=64 << 20)
    yield idx
    idx.close()


def test_codec_round_trip():
    r = rec(7)
    assert decode(r.key, encode(r)) == r


def test_garbage_value_is_an_integrity_error():
    with pytest.raises(IntegrityError):
        decode(b"k" * 16, b"\xc1not msgpack")
    with pytest.raises(IntegrityError):
        decode(b"k" * 16, encode(rec(1))[:-3])


def test_put_get_delete_in_batches(index):
    index.put_many(rec(i) for i in range(100))
    assert len(index) == 100
    assert index.get(rec(5).key) == rec(5)
    index.apply(put=[rec(200)], delete=[rec(i).key for i in range(50)])
    assert len(index) == 51
    assert index.get(rec(5).key) is None
    assert [r.key for r in index.records()] == sorted([rec(i).key for i in range(50, 100)]
                                                     + [rec(200).key])


def test_uncommitted_records_are_refused(index):
    with pytest.raises(IntegrityError):
        index.put_many([rec(1), rec(2, state="reserved")])
    assert len(index) == 0  # the whole batch rolled back


def test_load_keeps_only_persistent_tiers(tmp_path):
    path = tmp_path / "index"
    idx = Index(path, map_size=64 << 20)
    idx.put_many([rec(1, "nvme"), rec(2, "dram"), rec(3, "gpu"), rec(4, "nvme")])
    idx.close()
    # an undecodable value written behind the index's back is dropped, not fatal
    env = lmdb.open(str(path), map_size=64 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"x" * 16, b"\x92\x01")
    env.close()

    idx = Index(path, map_size=64 << 20)
    result = idx.load({"nvme"})
    assert sorted(r.key for r in result.kept) == [rec(1).key, rec(4).key]
    assert result.dropped == 3
    assert len(idx) == 2
    idx.clear()
    assert len(idx) == 0
    idx.close()


def test_load_falls_back_to_an_nvme_copy(tmp_path):
    from kvstore.store.catalog import on_disk

    path = tmp_path / "index"
    idx = Index(path, map_size=64 << 20)
    staged = rec(1, "dram")._replace(nvme_copy=8192)
    idx.put_many([staged, rec(2, "dram")])
    result = idx.load({"nvme"})
    assert result.kept == [staged._replace(tier="nvme", offset=8192, nvme_copy=None)]
    assert result.dropped == 1
    # The row stays as an older version wrote it, which means the same (a full map
    # must not refuse the start): the catalog reads it as its NVMe copy.
    assert idx.get(staged.key) == staged
    assert on_disk(idx.get(staged.key)) == result.kept[0]
    idx.close()


def test_a_record_written_before_ends_existed_can_still_be_taken():
    """An NVMe record from an older index has no ``ends``: its pending consumers may
    each end there, else a drop_select would read it and never take it."""
    import msgpack

    from kvstore.store.index import _FORMAT, Record, decode, encode

    rec = Record(b"k" * 16, "nvme", 0, 4096, 16, b"\x00" * 64, 7, 1.0, 2.0, 0, 2, b"")
    old = msgpack.packb((_FORMAT, *rec[1:-1]), use_bin_type=True)  # no ``ends`` field
    assert decode(rec.key, old).ends == 2
    assert decode(rec.key, encode(rec._replace(ends=1))).ends == 1  # new records as stored
