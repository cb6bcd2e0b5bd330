"""The namespace tag records carry (for ``kvstore ls --namespace``) and the per-tier
bytes in / out counters of ``Store.stats()``. Real tiers, real LMDB."""

from __future__ import annotations

import msgpack
import pytest

from kvstore.core.errors import InvalidRequestError
from kvstore.store.index import Index, Record
from kvstore.store.facade import Store
from tests.unit.conftest import ENTRY, key, put, store_config, toks, where

NS = bytes(range(16))


def test_reserve_namespace_is_kept_in_records_through_demotion_and_restart(tmp_path):
    cfg = store_config(tmp_path / "data", dram=4, nvme=4)
    with Store(cfg) as store:
        put(store, [1, 2], namespace=NS)
        put(store, [3])  # a local put without a namespace
        assert store.demote([key(1)]) == 1
        tags = {int.from_bytes(r.key, "little"): r.namespace for r in store.entries()}
        assert tags == {1: NS[:8], 2: NS[:8], 3: b""}
        assert where(store)[1] == "nvme"
    with Store(cfg) as store:  # the NVMe record was read back from LMDB
        assert {int.from_bytes(r.key, "little"): r.namespace
                for r in store.entries()} == {1: NS[:8]}


def test_an_eight_byte_namespace_is_accepted_as_is(make_store):
    store = make_store()
    put(store, [1], namespace=NS[:8])
    assert [r.namespace for r in store.entries()] == [NS[:8]]


@pytest.mark.parametrize("bad", [b"x" * 5, b"x" * 17, "0123456789abcdef"])
def test_bad_namespace_is_refused_and_changes_nothing(make_store, bad):
    store = make_store()
    with pytest.raises(InvalidRequestError, match="namespace"):
        store.reserve([key(1)], [ENTRY], [toks(1)], namespace=bad)
    assert store.stats()["reservations"] == 0 and store.stats()["entries"] == 0


def test_records_written_before_the_namespace_field_still_decode(tmp_path):
    """An LMDB value in the old field list (no namespace) loads with an empty tag."""
    index = Index(tmp_path / "idx", 1 << 20)
    rec = Record(key(7), "nvme", 0, ENTRY, 16, toks(7), 123, 1.0, 2.0, 0, 1, b"")
    old_fields = (1, *rec[1:-2])  # format 1, every field up to nvme_copy
    with index._env.begin(write=True) as txn:
        txn.put(rec.key, msgpack.packb(old_fields, use_bin_type=True))
    # (and, older than ``ends`` too, each pending consumer may end there)
    assert index.get(key(7)) == rec._replace(ends=rec.pending)
    assert index.get(key(7)).namespace == b""
    index.close()


def test_per_tier_bytes_in_and_out_count_where_entries_were_committed_and_found(make_store):
    store = make_store(dram=4, nvme=4)
    put(store, [1, 2])
    store.demote([key(1)])
    acq = store.acquire([key(1), key(2), key(3)], [toks(1), toks(2), toks(3)])
    store.release(acq.id)
    st = store.stats()
    dram, nvme = st["tiers"]["dram"], st["tiers"]["nvme"]
    assert (dram["bytes_in"], nvme["bytes_in"]) == (2 * ENTRY, 0)
    # 1 was found on NVMe (then staged up), 2 in DRAM; 3 is a miss.
    assert (dram["bytes_out"], nvme["bytes_out"]) == (ENTRY, ENTRY)
    assert (dram["hits"], nvme["hits"], st["misses"]) == (1, 1, 1)
    assert st["bytes_out"] == dram["bytes_out"] + nvme["bytes_out"]
