"""An expired read lease ends like release(drop=False): a drop_select consumer that
let its lease lapse has failed, so the entry's pending count stays and its claim
goes back; the next consumer gets the entry (docs/architecture.md, "Store")."""

import time

import pytest

from kvstore.core.errors import LeaseExpiredError
from tests.unit.conftest import key, put, toks


def test_an_expired_claiming_lease_keeps_the_entry_pending(make_store, monkeypatch):
    store = make_store(dram=4)
    put(store, [1])
    first = store.acquire([key(1)], [toks(1)], lease_s=30.0, claim=True)
    assert len(first.entries) == 1
    # while the claim is open, a second drop_select finds nothing to claim
    assert store.acquire([key(1)], [toks(1)], claim=True).entries == []
    # Then the clock jumps past the lease (this store runs no thread of its own).
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 60.0)
    assert store.reap() == 1
    with pytest.raises(LeaseExpiredError):
        store.release(first.id, drop=True)  # too late: counts for nothing
    assert [r.pending for r in store.entries()] == [1]
    second = store.acquire([key(1)], [toks(1)], claim=True)
    assert len(second.entries) == 1
    assert store.release(second.id, drop=True) == 1  # delivered once, then freed
    assert list(store.entries()) == []
    store.check_integrity()


def test_a_send_hold_outlives_its_lease_and_keeps_the_entries(make_store):
    """Entries whose bytes a server is still sending from the arena (hold_send) stay
    where they are however the lease ends, taken or expired: the claim goes back on
    time, the entries go only once the send is over (end_send)."""
    store = make_store(dram=4)
    put(store, [1, 2])
    acq = store.acquire([key(1), key(2)], [toks(1), toks(2)], lease_s=0.05, claim=True)
    store.hold_send(acq.id)
    time.sleep(0.08)
    assert store.reap() == 1  # the lease ended on time, its claim with it
    store.check_integrity()  # the send's holds are counted
    again = store.acquire([key(1), key(2)], [toks(1), toks(2)], claim=True)
    assert len(again.entries) == 2
    assert store.release(again.id, drop=True) == 0  # taken, but held: nothing goes yet
    assert store.evict(everything=True).nbytes == 0
    assert sorted(r.pending for r in store.entries()) == [0, 0]
    assert store.end_send(acq.id) == 2  # the send is over: the taken entries go
    assert list(store.entries()) == []
    store.check_integrity()
