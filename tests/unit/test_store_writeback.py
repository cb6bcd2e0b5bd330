"""Background writeback: NVMe copies of the entries the next demotions would take,
written without the store's lock, so demotion under pressure is an index flip.
Real tiers, real LMDB; the rounds are driven by calling ``writeback_step`` (the
server runs it in a thread: tests/integration/test_server.py covers that)."""

import time

from kvstore.store import Store
from tests.unit.conftest import data, key, put, store_config, toks, where


def _copies(store):
    return {int.from_bytes(r.key, "little") for r in store.entries() if r.nvme_copy is not None}


def _rounds(store):
    while store.writeback_step():
        pass


def test_copies_what_the_next_two_demotions_take_then_demotion_writes_nothing(make_store,
                                                                              monkeypatch):
    # DRAM 20, high 0.95 / low 0.85: copying starts above 13 (low - 2 (high - low)).
    store = make_store(dram=20, nvme=40, high=0.95, low=0.85)
    for i in range(1, 19):
        put(store, [i])
    _rounds(store)
    assert _copies(store) == {1, 2, 3, 4, 5}  # the five LRU entries: 18 - 13
    assert store.stats()["writebacks"] == 5 and all(t == "dram" for t in where(store).values())
    store.check_integrity()
    nvme = store.place.tiers["nvme"]
    writes = []
    real = nvme.write_many
    monkeypatch.setattr(nvme, "write_many", lambda *a: (writes.append(a), real(*a)))
    put(store, [19])
    put(store, [20])  # 20 of 20 > 95%: the shed down to 85% takes 1, 2, 3
    assert writes == [] and {i for i, t in where(store).items() if t == "nvme"} == {1, 2, 3}
    assert store.stats()["demotions"] == 3
    acq = store.acquire([key(1)], [toks(1)])  # served back from NVMe, exact
    assert store.read(acq.id, 0) == data(1)
    store.release(acq.id)


def test_nothing_below_the_start(make_store):
    store = make_store(dram=20, nvme=40, high=0.95, low=0.85)
    for i in range(1, 14):  # 13 of 20: not above low - 2 (high - low)
        put(store, [i])
    assert store.writeback_step() == 0 and _copies(store) == set()


def test_nothing_without_nvme(make_store):
    store = make_store(dram=4, high=0.5, low=0.4)
    put(store, [1, 2])
    assert store.writeback_step() == 0


def test_writeback_never_evicts_and_skips_pinned_and_leased(make_store):
    store = make_store(dram=8, nvme=2, high=0.9, low=0.6)  # copies due from 0 %
    for i in range(1, 3):
        put(store, [i])
    store.demote([key(1), key(2)])  # NVMe is full of real entries
    for i in range(3, 8):
        put(store, [i])
    store.pin([key(3)])
    held = store.acquire([key(4)], [toks(4)])
    _rounds(store)
    assert _copies(store) == set() and where(store)[1] == where(store)[2] == "nvme"
    store.release(held.id)
    store.check_integrity()


def test_an_entry_that_moves_or_goes_during_the_round_keeps_no_copy(make_store):
    store = make_store(dram=8, nvme=16, high=0.9, low=0.6)
    for i in range(1, 7):
        put(store, [i])
    plan = store.place.plan_writeback(1 << 30)
    assert [int.from_bytes(r.key, "little") for r, _ in plan] == [1, 2, 3, 4, 5, 6]
    store.check_integrity()  # mid-round: the copy extents in flight balance
    # While the bytes are written (without the lock), 1 is consumed and goes, and 2
    # is demoted: the round holds nothing, so neither waits for it.
    acq = store.acquire([key(1)], [toks(1)], claim=True)
    store.release(acq.id, drop=True)
    assert 1 not in where(store) and store.demote([key(2)]) == 1
    assert store.place.finish_writeback(plan, written=True) == 4
    assert _copies(store) == {3, 4, 5, 6} and where(store)[2] == "nvme"
    assert store.place.tiers["nvme"].used == 5 * 4096  # 2 itself, and four copies
    store.check_integrity()


def test_a_round_in_flight_never_keeps_a_reserve_from_its_room(make_store):
    # A CI run failed so: a reserve needing the whole DRAM tier met entries a round
    # held, and was refused "full" (tests/integration/test_multinode.py).
    store = make_store(dram=8, nvme=32, high=0.5, low=0.2)
    for i in range(1, 4):
        put(store, [i])
    plan = store.place.plan_writeback(1 << 30)
    assert plan  # the round has chosen 1..3 and is writing them
    put(store, list(range(10, 18)))  # all 8 pages: 1..3 must go down now
    assert all(where(store)[i] == "nvme" for i in (1, 2, 3))
    assert store.place.finish_writeback(plan, written=True) == 0  # all moved: no copies
    store.check_integrity()
    acq = store.acquire([key(i) for i in (1, 2, 3)], [toks(i) for i in (1, 2, 3)])
    assert [store.read(acq.id, j) for j in range(3)] == [data(i) for i in (1, 2, 3)]
    store.release(acq.id)


def test_a_failed_write_records_nothing(make_store):
    store = make_store(dram=8, nvme=16, high=0.9, low=0.6)
    for i in range(1, 7):
        put(store, [i])
    plan = store.place.plan_writeback(1 << 30)
    assert store.place.finish_writeback(plan, written=False) == 0
    assert _copies(store) == set() and store.place.tiers["nvme"].used == 0
    assert store.stats()["leased_entries"] == 0
    store.check_integrity()


def test_rounds_are_bounded(make_store):
    store = make_store(dram=20, nvme=40, high=0.95, low=0.85)
    for i in range(1, 19):
        put(store, [i])
    plan = store.place.plan_writeback(2 * 4096)  # five are due, two fit the round
    assert [int.from_bytes(r.key, "little") for r, _ in plan] == [1, 2]
    assert store.place.finish_writeback(plan, written=True) == 2
    assert store.config.policy.writeback_batch_bytes == 64 << 20  # the default round


def test_an_entry_with_a_writeback_copy_survives_a_restart(tmp_path):
    cfg = store_config(tmp_path / "data", dram=8, nvme=16, high=0.9, low=0.6)
    with Store(cfg) as store:
        for i in range(1, 7):
            put(store, [i])
        _rounds(store)
        assert _copies(store) == {1, 2, 3, 4, 5, 6}
    with Store(cfg) as store:  # the DRAM tier is gone; the copies are NVMe entries now
        assert where(store) == {i: "nvme" for i in range(1, 7)}
        acq = store.acquire([key(i) for i in range(1, 7)], [toks(i) for i in range(1, 7)])
        assert [store.read(acq.id, j) for j in range(6)] == [data(i) for i in range(1, 7)]
        store.release(acq.id)
        store.check_integrity()


def test_the_thread_runs_the_rounds_and_close_waits_for_it(make_store):
    import time

    store = make_store(dram=20, nvme=40, high=0.95, low=0.85)
    for i in range(1, 19):
        put(store, [i])
    store.start_writeback(idle_s=0.01)
    deadline = time.monotonic() + 10
    while _copies(store) != {1, 2, 3, 4, 5}:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    store.close()
    assert not store._writeback_thread.is_alive()


def test_it_can_be_turned_off(tmp_path):
    cfg = store_config(tmp_path / "data", dram=20, nvme=40, high=0.95, low=0.85)
    cfg = cfg.replace(policy={"background_writeback": False})
    with Store(cfg) as store:
        for i in range(1, 19):
            put(store, [i])
        assert store.writeback_step() == 0 and _copies(store) == set()


def test_a_tier_whose_every_entry_has_its_copy_costs_a_round_no_walk(make_store,
                                                                      monkeypatch):
    """An idle server whose DRAM entries all have their NVMe copies: each round
    walked the victim window (under the store's lock then: 190 ms at 300k entries,
    every 50 ms). The catalog counts each tier's copies, so such a round returns at
    once; once an entry without a copy joins the tier, rounds walk again."""
    store = make_store(dram=8, nvme=16, high=0.9, low=0.6)  # copies due from 0 %
    for i in range(1, 7):
        put(store, [i])
    _rounds(store)
    assert _copies(store) == {1, 2, 3, 4, 5, 6}
    assert store.catalog.copied == {"dram": 6, "nvme": 0}
    store.check_integrity()  # (the counts agree with the records)
    walks = []
    real = store.place.writeback_candidates
    monkeypatch.setattr(store.place, "writeback_candidates",
                        lambda *a, **k: (walks.append(a), real(*a, **k))[1])
    assert store.writeback_step() == 0 and walks == []
    put(store, [7])
    assert store.writeback_step() > 0 and len(walks) == 1 and 7 in _copies(store)
    # The counts follow drops and demotions too.
    acq = store.acquire([key(1)], [toks(1)], claim=True)
    store.release(acq.id, drop=True)
    store.demote([key(2)])
    assert store.catalog.copied == {"dram": 5, "nvme": 0}
    store.check_integrity()


def test_rounds_that_write_nothing_take_a_tenth_of_the_time_at_most(make_store,
                                                                     monkeypatch):
    """The writeback thread waits at least WRITEBACK_IDLE_FACTOR times as long as a
    round that wrote nothing took (its walk takes a core and the GIL)."""
    import threading

    from kvstore.store import facade

    store = make_store(dram=8, nvme=16, high=0.9, low=0.6)
    waits = []

    class Stop(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            self.set()  # one round is enough
            return True

    def busy_round() -> int:  # 30 ms of this thread's CPU, nothing written
        start = time.thread_time()
        while time.thread_time() - start < 0.03:
            pass
        return 0

    monkeypatch.setattr(store, "_writeback_stop", Stop())
    monkeypatch.setattr(store, "writeback_step", busy_round)
    store.start_writeback(idle_s=0.05)
    store._writeback_thread.join(5)
    assert len(waits) == 1 and waits[0] >= facade.WRITEBACK_IDLE_FACTOR * 0.03
    assert waits[0] <= facade.WRITEBACK_PAUSE_MAX_S


def test_a_round_that_only_waited_for_the_lock_is_not_paused_for_it(make_store,
                                                                    monkeypatch):
    """The pause counts the round's CPU time: a round that waited a second for the
    store's lock (slow work on the serving thread) must not stop the writeback and
    the demotion ahead for nine more."""
    import threading

    store = make_store(dram=8, nvme=16, high=0.9, low=0.6)
    waits = []

    class Stop(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            self.set()
            return True

    held = threading.Event()

    def holder():
        with store._lock:
            held.set()
            time.sleep(0.5)

    other = threading.Thread(target=holder)
    other.start()
    held.wait(5)
    monkeypatch.setattr(store, "_writeback_stop", Stop())
    store.start_writeback(idle_s=0.05)  # its round waits ~0.5 s for the lock
    store._writeback_thread.join(5)
    other.join()
    assert waits == [0.05]


def test_the_walk_of_the_window_is_made_without_the_stores_lock(make_store, monkeypatch):
    """The walk is O(entries in the window); requests go on meanwhile. What changed
    during it is checked again under the lock: an entry that went, or was pinned,
    gets no copy."""
    import threading

    store = make_store(dram=8, nvme=16, high=0.9, low=0.6)  # copies due from 0 %
    for i in range(1, 7):
        put(store, [i])
    free = []
    real = store.place.writeback_candidates

    def candidates(*args):
        def other_thread():  # a request's thread, taking the store's lock
            free.append(store._lock.acquire(timeout=5))
            store._lock.release()
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        keys = real(*args)
        acq = store.acquire([key(1)], [toks(1)], claim=True)  # 1 is consumed, 2 pinned
        store.release(acq.id, drop=True)
        store.pin([key(2)])
        return keys

    monkeypatch.setattr(store.place, "writeback_candidates", candidates)
    _rounds(store)
    assert free and all(free) and _copies(store) == {3, 4, 5, 6}
    store.check_integrity()


def test_demotion_runs_ahead_of_the_high_watermark_off_the_request_path(make_store,
                                                                          monkeypatch):
    """Past halfway from low to high, the writeback thread flips the victims that
    have their copies (no write), in chunks of DEMOTE_CHUNK per hold of the lock,
    down to the low watermark: the next puts shed nothing on the request path."""
    from kvstore.store import facade

    # DRAM 20, high 0.95 / low 0.85: copies from 13, demotion ahead from 18 (0.90).
    store = make_store(dram=20, nvme=40, high=0.95, low=0.85)
    for i in range(1, 19):
        put(store, [i])
    _rounds(store)
    assert store.demote_step() == 0  # 18 of 20: not past the mark
    put(store, [19])  # 19 of 20: past the mark, not over high (no shed)
    assert store.stats()["demotions"] == 0
    holds = []
    real = store.place.demote_ahead
    monkeypatch.setattr(store.place, "demote_ahead",
                        lambda most, going=False: holds.append(going) or real(most, going))
    monkeypatch.setattr(facade, "DEMOTE_CHUNK", 1)
    nvme = store.place.tiers["nvme"]
    writes = []
    real_write = nvme.write_many
    monkeypatch.setattr(nvme, "write_many", lambda *a: (writes.append(a), real_write(*a)))
    assert store.demote_step() == 2 * 4096  # down to 17 of 20 (low): 1 and 2 flipped
    assert holds == [False, True, True] and writes == []  # one entry per hold, to low
    assert {i for i, t in where(store).items() if t == "nvme"} == {1, 2}
    put(store, [20])  # 18 of 20: no shed
    assert store.stats()["demotions"] == 2 and writes == []
    store.check_integrity()


def test_demotion_ahead_stops_at_a_victim_without_its_copy(make_store):
    """Nothing is written under the lock: a victim the writeback has not copied yet
    waits for its copy (the request path still sheds it if a reserve needs room)."""
    store = make_store(dram=20, nvme=40, high=0.95, low=0.85)
    for i in range(1, 20):
        put(store, [i])  # no writeback round: no copies
    assert store.demote_step() == 0 and store.stats()["demotions"] == 0
    _rounds(store)
    assert store.demote_step() > 0 and store.stats()["demotions"] == 2


def test_demotion_ahead_passes_over_pinned_entries_at_the_front(make_store, monkeypatch):
    """Pinned (or leased) entries never demote, and idle pinned template blocks sit
    at the front of the order: a chunk passes over them instead of ending there."""
    from kvstore.store import facade

    monkeypatch.setattr(facade, "DEMOTE_CHUNK", 2)
    store = make_store(dram=20, nvme=40, high=0.95, low=0.85)
    for i in range(1, 20):
        put(store, [i])
    _rounds(store)
    store.pin([key(1), key(2)])
    assert store.demote_step() == 2 * 4096
    assert {i for i, t in where(store).items() if t == "nvme"} == {3, 4}
    store.check_integrity()


def test_demotion_ahead_counts_whole_pages_and_stops_at_the_low_watermark(make_store):
    """The tier's use counts whole pages: an entry of half a page takes one. The
    demotion counts what it frees the same way, so it stops at the low watermark
    rather than demoting twice what it needed."""
    store = make_store(dram=20, nvme=40, high=0.95, low=0.85)
    for i in range(1, 20):
        put(store, [i], nbytes=2048)  # 19 pages of 20 in use
    _rounds(store)
    assert store.demote_step() == 2 * 4096  # 19 -> 17 pages: two entries, not four
    assert {i for i, t in where(store).items() if t == "nvme"} == {1, 2}


def test_the_last_tier_evicts_ahead_of_the_high_watermark(make_store, monkeypatch):
    """A server without NVMe: past halfway from low to high, the writeback thread
    evicts the DRAM tier's victims down to the low watermark, in chunks of
    DEMOTE_CHUNK per hold of the lock, pinned entries passed over; the next put
    sheds nothing on the request path."""
    from kvstore.store import facade

    monkeypatch.setattr(facade, "DEMOTE_CHUNK", 1)
    store = make_store(dram=20, high=0.95, low=0.85)
    for i in range(1, 19):
        put(store, [i])
    assert store.evict_step() == 0  # 18 of 20: not past the mark (0.90)
    put(store, [19])  # 19 of 20: past the mark, not over high (no shed)
    store.pin([key(1)])
    holds = []
    real = store.place.evict_ahead
    monkeypatch.setattr(store.place, "evict_ahead",
                        lambda most, going=False: holds.append(going) or real(most, going))
    assert store.stats()["evictions"] == 0
    assert store.evict_step() == 2 * 4096  # down to 17 of 20 (low): 2 and 3 evicted
    assert holds == [False, True, True]  # one entry per hold of the lock, to low
    assert set(where(store)) == {1, *range(4, 20)} and store.stats()["evictions"] == 2
    put(store, [20])  # 18 of 20: no shed
    assert store.stats()["evictions"] == 2
    store.check_integrity()


def test_nvme_evicts_its_own_entries_ahead_and_keeps_the_copies(make_store):
    """With NVMe, the NVMe tier evicts ahead: its own least recently used entries,
    not the copies of entries served from DRAM (those are the next demotions, an
    index flip each); the demotions then find room and the puts shed nothing there."""
    store = make_store(dram=4, nvme=20, high=0.95, low=0.85)
    for i in range(1, 23):
        put(store, [i])  # DRAM sheds inline into NVMe (no background rounds)
    _rounds(store)
    nvme = store.place.tiers["nvme"]
    on_nvme = sorted(i for i, t in where(store).items() if t == "nvme")
    copies = _copies(store)
    assert nvme.used > 0.90 * nvme.capacity and copies, (on_nvme, copies, nvme.used)
    evicted = store.stats()["evictions"]
    freed = store.evict_step()
    assert freed > 0 and nvme.used <= 0.85 * nvme.capacity
    gone = set(on_nvme) - set(where(store))
    assert gone == set(on_nvme[:len(gone)])  # the least recently used first
    assert _copies(store) == copies  # no copy dropped
    assert store.stats()["evictions"] == evicted + len(gone)
    store.check_integrity()


def test_nothing_evicts_ahead_with_background_writeback_off(tmp_path):
    cfg = store_config(tmp_path / "data", dram=20, high=0.95, low=0.85)
    store = Store(cfg.replace(policy={"background_writeback": False, "high_watermark": 0.95,
                                      "low_watermark": 0.85}))
    try:
        for i in range(1, 20):
            put(store, [i])
        assert store.evict_step() == 0 and len(where(store)) == 19
    finally:
        store.close()


def test_pinned_entries_are_out_of_the_order_so_any_number_of_them_stops_nothing(
        make_store, monkeypatch):
    """Pinned entries (template blocks, say) are not in the victim order at all: a
    chunk of eviction (or demotion) ahead meets none of them, however many sit
    where the least recently used entries are; unpinned, they are back in it."""
    from kvstore.store import facade, placement

    monkeypatch.setattr(facade, "DEMOTE_CHUNK", 1)  # a chunk passes over 16 at most
    store = make_store(dram=60, high=0.95, low=0.85)
    for i in range(1, 57):
        put(store, [i])  # 56 of 60: past the mark (54)
    store.pin([key(i) for i in range(1, 41)])  # the 40 least recently used
    assert 40 > placement.DEMOTE_SKIP_FACTOR * facade.DEMOTE_CHUNK
    assert store.evict_step() == 5 * 4096  # down to 51 (low)
    assert set(where(store)) == {*range(1, 41), *range(46, 57)}
    store.unpin([key(i) for i in range(1, 41)])
    put(store, [57, 58, 59])  # 54 of 60, then the mark again
    put(store, [60])
    assert store.evict_step() == 4 * 4096 and set(where(store)) - {*range(5, 61)} == set()
    store.check_integrity()


def test_a_writers_open_room_counts_as_used_and_the_next_room_fits(make_store):
    """A writer's open room is its next insert: the background makes room for it as
    for stored entries. (Left out, the tier's real use stayed over the high
    watermark, where no room is granted: writers fell back to two round trips.)"""
    store = make_store(dram=20, high=0.95, low=0.85)
    for i in range(1, 15):
        put(store, [i])  # 14 of 20
    room = store.grant_room(5 * 4096)  # 19 of 20 in use: past the mark (18)
    assert room is not None
    assert store.evict_step() == 2 * 4096 and set(where(store)) == set(range(3, 15))
    store.abort(room.id)  # 12 of 20: the next room of 5 fits below high (19)
    assert store.grant_room(5 * 4096) is not None


def test_copies_of_entries_read_again_push_out_no_nvme_entry(make_store):
    """A copy whose entry was read after it was copied is no next demotion any
    more (it left the writeback's window): eviction ahead does not count such
    copies, so they cannot push out entries that live on NVMe alone (a shed on the
    request path, over the high watermark, drops copies first)."""
    store = make_store(dram=20, nvme=24, high=0.95, low=0.85)
    for i in range(1, 19):
        put(store, [i])  # DRAM 18 of 20: the window is 18 - 13 = 5 entries
    _rounds(store)
    assert _copies(store) == {1, 2, 3, 4, 5}
    acq = store.acquire([key(i) for i in range(1, 6)], [toks(i) for i in range(1, 6)])
    store.release(acq.id)  # read again: the most recently used now
    store.demote([key(i) for i in range(11, 19)])  # DRAM 10: no window at all
    for i in range(19, 28):
        put(store, [i])
        store.demote([key(i)])
    nvme = store.place.tiers["nvme"]
    assert nvme.used == 22 * 4096 > 0.90 * nvme.capacity  # 17 entries and 5 copies
    assert store.evict_step() == 0 and store.stats()["evictions"] == 0
    assert sum(t == "nvme" for t in where(store).values()) == 17
    assert _copies(store) == {1, 2, 3, 4, 5}
    store.check_integrity()
