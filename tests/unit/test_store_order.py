"""The kept victim order (kvstore/store/order.py) walks each tier in exactly the
order the policy would sort it, through random puts, hits, moves and drops."""

import random

import pytest

from kvstore.core.errors import KVStoreError
from kvstore.store.policy import make_policy
from kvstore.store.order import GroupOrder
from tests.unit.conftest import key, put, toks


def _walked(order):
    walk = order.walk()
    try:
        return [r.key for r in walk]
    finally:
        walk.close()


def _check_orders(store):
    sort_key = store.place.policy.sort_key
    for name in store.tier_names:
        members = [store.catalog.records[k] for k in store.catalog.by_tier[name]
                   if not store.catalog.records[k].pins]  # pinned: never victims
        assert _walked(store.catalog.orders[name]) == [r.key for r in sorted(members, key=sort_key)]
        assert _walked(store.catalog.orders[name]) == _walked(store.catalog.orders[name])  # walk keeps items
        # The walk of a snapshot (a writeback round's, without the lock): the same
        # order, and the kept heap left exactly as it was.
        order = store.catalog.orders[name]
        heap = list(order._heap)
        assert [r.key for r in order.walk_snapshot(order.snapshot())] == \
            [r.key for r in sorted(members, key=sort_key)]
        assert order._heap == heap
    copies = sorted((store.catalog.records[k] for k in store.catalog.copies), key=sort_key)
    assert _walked(store.catalog.copy_order) == [r.key for r in copies]


@pytest.mark.parametrize("policy,seed", [("lru", 1), ("lru", 2), ("fifo", 3)])
def test_walk_matches_the_policy_sort(make_store, monkeypatch, policy, seed):
    import kvstore.store.order as so

    monkeypatch.setattr(so, "_SLACK", 4)  # rebuilds happen within the test
    rng = random.Random(seed)
    store = make_store(dram=6, nvme=10, high=0.8, low=0.5)
    store.place.policy = make_policy(policy)
    store.catalog.set_sort_key(store.place.policy.sort_key)
    for step in range(200):
        ids = rng.sample(range(24), rng.randint(1, 3))
        op = rng.choice(["put", "put", "hit", "hit", "demote", "evict", "pin"])
        try:
            if op == "put":
                put(store, ids)
            elif op == "hit":
                acq = store.acquire([key(i) for i in ids], [toks(i) for i in ids])
                store.release(acq.id, drop=rng.random() < 0.3)
            elif op == "demote":
                store.demote([key(i) for i in ids])
            elif op == "evict":
                store.evict(nbytes=rng.randint(0, 3) * 4096)
            else:
                stored = [key(i) for i in ids if key(i) in store.catalog.records]
                store.pin(stored) if rng.random() < 0.5 else store.unpin(stored)
        except KVStoreError:
            pass
        _check_orders(store)
    store.check_integrity()


def test_stale_repeated_and_touched_items_and_rebuild_bounds_the_heap():
    from kvstore.store.index import Record

    recs: dict[bytes, Record] = {}

    def rec(i, t):
        return Record(key(i), "dram", 0, 1, 1, b"", 0, 0.0, t, 0, 1, b"")

    order = GroupOrder(make_policy("lru").sort_key, recs.get, lambda: recs)
    for i in range(5):
        recs[key(i)] = rec(i, float(i))
        order.push(recs[key(i)])
    recs[key(0)] = rec(0, 9.0)  # touched: its old item is stale now
    order.push(recs[key(0)])
    order.push(recs[key(2)])  # the same item twice
    del recs[key(3)]  # gone
    assert _walked(order) == [key(1), key(2), key(4), key(0)]
    recs[key(1)] = rec(1, 10.0)  # a hit without a push: found late, put back in place
    assert _walked(order) == [key(2), key(4), key(0), key(1)]
    for _ in range(3000):
        order.push(recs[key(2)])
    assert len(order._heap) <= 2 * len(recs) + 1024 + 1
    assert _walked(order) == [key(2), key(4), key(0), key(1)]


def test_a_snapshot_walk_sees_what_changed_after_the_snapshot(make_store):
    """Taken under the lock, walked without it: an entry read (touched) meanwhile
    comes out at its new place, one dropped meanwhile not at all."""
    store = make_store(dram=8, nvme=0, high=0.99, low=0.9)
    for i in range(1, 6):
        put(store, [i])
    order = store.catalog.orders["dram"]
    snap = order.snapshot()
    acq = store.acquire([key(2)], [toks(2)])  # 2 read: the most recently used now
    store.release(acq.id)
    acq = store.acquire([key(4)], [toks(4)], claim=True)
    store.release(acq.id, drop=True)  # 4 gone
    assert [int.from_bytes(r.key, "little") for r in order.walk_snapshot(snap)] == [1, 3, 5, 2]
