"""``kvstore ls`` pages: key order across every tier (the catalog's key pages hold
memory-tier and NVMe records alike), every record exactly once, a tier filter, and
a cursor that survives entries going between pages."""

from __future__ import annotations

import pytest

from kvstore.core.errors import InvalidRequestError
from tests.unit.conftest import key, put


def _all_pages(store, tier=None, limit=3):
    keys, after, pages = [], None, 0
    while True:
        page, after = store.entries_page(tier=tier, after=after, limit=limit)
        keys += [r.key for r in page]
        pages += 1
        if after is None:
            return keys, pages


def test_pages_cover_every_record_once_in_key_order_across_tiers(make_store):
    store = make_store(dram=8, nvme=8)
    for i in range(1, 13):  # 12 entries, 8 fit DRAM: the oldest demote to NVMe
        put(store, [i])
    store.demote([key(i) for i in (9, 11)])
    tiers = {r.key: r.tier for r in store.entries()}
    assert set(tiers.values()) == {"dram", "nvme"}
    keys, pages = _all_pages(store)
    assert keys == sorted(key(i) for i in range(1, 13))
    assert pages == 4 + 1  # 12 records in pages of 3, then the empty last one
    for tier, limit in (("nvme", 2), ("dram", 100)):
        got, _ = _all_pages(store, tier=tier, limit=limit)
        assert got == sorted(k for k, t in tiers.items() if t == tier)


def test_a_cursor_whose_key_went_between_pages_still_continues_after_it(make_store):
    store = make_store(dram=8)
    for i in range(1, 7):
        put(store, [i])
    first, after = store.entries_page(limit=2)
    assert after == first[-1].key
    store.evict(keys=[after])  # the page's last key is gone before the next page
    second, end = store.entries_page(after=after, limit=10)
    assert end is None
    assert [r.key for r in first + second] == sorted(key(i) for i in range(1, 7))


def test_bad_page_arguments_are_refused(make_store):
    store = make_store(dram=2)
    with pytest.raises(InvalidRequestError):
        store.entries_page(tier="tape")
    with pytest.raises(InvalidRequestError):
        store.entries_page(limit=0)


def test_a_tier_filter_looks_at_a_bounded_number_of_keys_per_page(make_store, monkeypatch):
    from kvstore.store import admin

    monkeypatch.setattr(admin, "LS_SCAN_FACTOR", 2)
    store = make_store(dram=40, nvme=8)
    for i in range(1, 31):
        put(store, [i])
    store.demote([key(30)])  # the one NVMe entry, last in key order
    page, after = store.entries_page(tier="nvme", limit=1)
    assert page == [] and after is not None  # short: 2 keys looked at, go on from there
    keys, pages = _all_pages(store, tier="nvme", limit=1)
    assert keys == [key(30)] and pages > 2
