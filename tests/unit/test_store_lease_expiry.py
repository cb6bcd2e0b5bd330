"""An expired read lease ends like release(drop=False): a drop_select consumer that
let its lease lapse has failed, so the entry's pending count stays and its claim
goes back; the next consumer gets the entry (docs/architecture.md, "Store")."""

import time

import pytest

from kvstore.core.errors import LeaseExpiredError
from tests.unit.conftest import key, put, toks


def test_an_expired_claiming_lease_keeps_the_entry_pending(make_store):
    store = make_store(dram=4)
    put(store, [1])
    first = store.acquire([key(1)], [toks(1)], lease_s=0.05, claim=True)
    assert len(first.entries) == 1
    # while the claim is open, a second drop_select finds nothing to claim
    assert store.acquire([key(1)], [toks(1)], claim=True).entries == []
    time.sleep(0.08)
    assert store.reap() == 1
    with pytest.raises(LeaseExpiredError):
        store.release(first.id, drop=True)  # too late: counts for nothing
    assert [r.pending for r in store.entries()] == [1]
    second = store.acquire([key(1)], [toks(1)], claim=True)
    assert len(second.entries) == 1
    assert store.release(second.id, drop=True) == 1  # delivered once, then freed
    assert list(store.entries()) == []
    store.check_integrity()
