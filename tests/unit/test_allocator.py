"""ExtentAllocator against a plain model: a dict of live ranges."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.core.errors import ConfigError, IntegrityError, InvalidRequestError, TierFullError
from tiers.allocator import ExtentAllocator, Run

PAGE = 4096
sizes_st = st.lists(st.integers(1, 5 * PAGE), min_size=1, max_size=6)


def snapshot(a: ExtentAllocator):
    return a.used, a.live_count, a.runs()


class AllocatorModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = ExtentAllocator(64 * PAGE, PAGE)
        self.live: dict[int, int] = {}  # offset -> rounded length
        self.freed: list[tuple[int, int]] = []

    def _round(self, n):
        return -(-n // PAGE) * PAGE

    @rule(sizes=sizes_st)
    def allocate_many(self, sizes):
        rounded = [self._round(n) for n in sizes]
        before, largest = snapshot(self.a), self.a.largest_free
        try:
            offsets = self.a.allocate_many(sizes)
        except TierFullError:
            assert snapshot(self.a) == before  # all or nothing
            assert sum(rounded) > largest  # it would have fitted in one run
            return
        assert sum(rounded) <= 64 * PAGE - sum(self.live.values())
        if sum(rounded) <= largest:  # one run big enough: back to back
            assert offsets == [offsets[0] + sum(rounded[:i]) for i in range(len(sizes))]
        for off, ln in zip(offsets, rounded):
            assert off % PAGE == 0 and off + ln <= 64 * PAGE
            for o2, l2 in self.live.items():
                assert off + ln <= o2 or o2 + l2 <= off, "overlap"
            self.live[off] = ln

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        off = data.draw(st.sampled_from(sorted(self.live)))
        ln = self.live.pop(off)
        self.a.free(off, ln - data.draw(st.integers(0, PAGE - 1)))  # any size in the pages
        self.freed.append((off, ln))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_many(self, data):
        """A batch, in any order: neighbours merge into one run (check_integrity
        proves the free set is still maximal runs)."""
        offs = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1,
                                  unique=True))
        batch = [(off, self.live[off] - data.draw(st.integers(0, PAGE - 1))) for off in offs]
        self.a.free_many(batch)
        for off in offs:
            self.freed.append((off, self.live.pop(off)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_many_back_to_back(self, data):
        """A release's batch: neighbouring live ranges, in order (the one-run path,
        ``_free_run``), each given with any size inside its pages."""
        offs = sorted(self.live)
        i = data.draw(st.integers(0, len(offs) - 1))
        run = [offs[i]]
        while run[-1] + self.live[run[-1]] in self.live:
            run.append(run[-1] + self.live[run[-1]])
        run = run[:data.draw(st.integers(1, len(run)))]
        self.a.free_many([(off, self.live[off] - data.draw(st.integers(0, PAGE - 1)))
                          for off in run])
        for off in run:
            self.freed.append((off, self.live.pop(off)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_many_with_a_bad_range_frees_nothing(self, data):
        offs = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1,
                                  unique=True))
        bad = data.draw(st.sampled_from(["twice", "past the end", "wrong length",
                                         "inside a live range"]))
        batch = [(off, self.live[off]) for off in offs]
        first = batch[0]
        wrong = {"twice": first, "past the end": (64 * PAGE + PAGE, PAGE),
                 "wrong length": (first[0], first[1] + PAGE),
                 "inside a live range": (first[0] + PAGE, PAGE)}[bad]
        if bad == "inside a live range" and (first[1] == PAGE or first[0] + PAGE in self.live):
            wrong = first  # a one-page range has no inside: give it twice instead
        batch.insert(data.draw(st.integers(0, len(batch))), wrong)
        before = snapshot(self.a)
        with pytest.raises(IntegrityError):
            self.a.free_many(batch)
        assert snapshot(self.a) == before

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free_raises(self, data):
        off, ln = data.draw(st.sampled_from(self.freed))
        if off in self.live:
            return
        before = snapshot(self.a)
        with pytest.raises(IntegrityError):
            self.a.free(off, ln)
        assert snapshot(self.a) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def retain(self, data):
        """A room split into the entries written into it: the pieces stay live, the
        gaps around them go back to the free set."""
        off = data.draw(st.sampled_from(sorted(self.live)))
        pages = self.live[off] // PAGE
        starts = sorted(data.draw(st.sets(st.integers(0, pages - 1), max_size=pages)))
        pieces = []
        for i, page in enumerate(starts):
            room = (starts[i + 1] if i + 1 < len(starts) else pages) - page
            size = data.draw(st.integers(1, room * PAGE))  # any size within its pages
            pieces.append((off + page * PAGE, size))
        self.a.retain(off, data.draw(st.permutations(pieces)))
        del self.live[off]
        for start, size in pieces:
            self.live[start] = self._round(size)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def retain_back_to_back(self, data):
        """A room as a writer fills it: whole pages back to back from its start, the
        tail (if any) free again; a last piece may end mid-page (its page is kept)."""
        off = data.draw(st.sampled_from(sorted(self.live)))
        pages = self.live[off] // PAGE
        sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=pages)
                          .filter(lambda s: sum(s) <= pages))
        pieces, at = [], off
        for n in sizes:
            pieces.append((at, n * PAGE))
            at += n * PAGE
        if data.draw(st.booleans()):
            pieces[-1] = (pieces[-1][0], pieces[-1][1] - data.draw(st.integers(1, PAGE - 1)))
        self.a.retain(off, pieces)
        del self.live[off]
        for start, size in pieces:
            self.live[start] = self._round(size)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def retain_with_a_bad_piece_changes_nothing(self, data):
        off = data.draw(st.sampled_from(sorted(self.live)))
        ln = self.live[off]
        bad = data.draw(st.sampled_from([
            (off + 1, PAGE),  # not page-aligned
            (off + ln - PAGE, 2 * PAGE),  # leaves the range
            (off - PAGE, PAGE),  # starts before it
        ]))
        pieces = [(off, PAGE), bad] if bad[0] >= off + PAGE else [bad]
        overlapping = [(off, ln), (off, PAGE)]  # two pieces over one page
        before = snapshot(self.a)
        with pytest.raises(InvalidRequestError):
            self.a.retain(off, data.draw(st.sampled_from([pieces, overlapping])))
        assert snapshot(self.a) == before

    @rule(page=st.integers(0, 63))
    def retain_in_a_range_not_live_raises(self, page):
        if page * PAGE in self.live:
            return
        before = snapshot(self.a)
        with pytest.raises(IntegrityError):
            self.a.retain(page * PAGE, [(page * PAGE, PAGE)])
        assert snapshot(self.a) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def claim_over_live_raises(self, data):
        off = data.draw(st.sampled_from(sorted(self.live)))
        before = snapshot(self.a)
        with pytest.raises(IntegrityError):
            self.a.claim(off, PAGE)
        assert snapshot(self.a) == before

    @rule(page=st.integers(0, 63), pages=st.integers(1, 4))
    def claim_if_free(self, page, pages):
        off, ln = page * PAGE, min(pages, 64 - page) * PAGE
        free = all(off + ln <= o or o + l <= off for o, l in self.live.items())
        if free:
            self.a.claim(off, ln)
            self.live[off] = ln
        else:
            with pytest.raises(IntegrityError):
                self.a.claim(off, ln)

    @invariant()
    def books_balance(self):
        self.a.check_integrity()
        assert self.a.used == sum(self.live.values())
        assert self.a.live_count == len(self.live)
        free_bytes = sum(r.nbytes for r in self.a.runs())
        assert free_bytes + self.a.used == 64 * PAGE

    @invariant()
    def empty_means_one_run(self):
        if not self.live:
            assert self.a.runs() == [Run(0, 64 * PAGE)]


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 3 * PAGE), min_size=1, max_size=40))
def test_batch_on_empty_allocator_is_contiguous(sizes):
    a = ExtentAllocator(256 * PAGE, PAGE)
    offsets = a.allocate_many(sizes)
    rounded = [a.round_up(n) for n in sizes]
    assert offsets == [sum(rounded[:i]) for i in range(len(sizes))]
    assert a.used == sum(rounded) and a.free_runs == (0 if a.used == a.capacity else 1)


@settings(max_examples=50, deadline=None)
@given(pages=st.lists(st.integers(1, 4), min_size=1, max_size=120), tail=st.integers(0, 9),
       ragged=st.one_of(st.just(0), st.integers(1, PAGE - 1)))
def test_a_long_room_retained_back_to_back(pages, tail, ragged):
    """A room of many entries, as a 2 048-block put fills it: each piece live at its
    own offset, the room's tail (if any) one free run again, the books whole (with
    and without a last piece that ends mid-page)."""
    a = ExtentAllocator(1024 * PAGE, PAGE)
    a.allocate_many([PAGE])  # (the room starts past another range)
    room = a.allocate_many([(sum(pages) + tail) * PAGE])[0]
    pieces, at = [], room
    for n in pages:
        pieces.append((at, n * PAGE))
        at += n * PAGE
    pieces[-1] = (pieces[-1][0], pieces[-1][1] - ragged)  # ragged: the general path
    a.retain(room, pieces)
    a.check_integrity()
    assert a.live_count == 1 + len(pieces)
    assert a.used == PAGE + sum(pages) * PAGE
    assert all(a.is_live(start, n) for start, n in pieces)


def test_retain_with_a_malformed_piece_changes_nothing():
    a = ExtentAllocator(64 * PAGE, PAGE)
    room = a.allocate_many([4 * PAGE])[0]
    before = snapshot(a)
    for bad in ([(room, PAGE), (room + PAGE, PAGE, "x")], [(room,)], [(room, PAGE), ()]):
        with pytest.raises((ValueError, TypeError)):
            a.retain(room, bad)
        assert snapshot(a) == before
    a.check_integrity()


def test_churn_then_free_everything_is_one_run():
    rng = random.Random(7)
    a = ExtentAllocator(4096 * PAGE, PAGE)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off, n = live.pop(rng.randrange(len(live)))
            a.free(off, n)
        else:
            sizes = [rng.randint(1, 8 * PAGE) for _ in range(rng.randint(1, 4))]
            try:
                live.extend(zip(a.allocate_many(sizes), sizes))
            except TierFullError:
                pass
    a.check_integrity()
    assert a.free_runs > 1  # the churn did fragment the space
    for off, n in live:
        a.free(off, n)
    assert a.runs() == [Run(0, a.capacity)] and a.used == 0 and a.live_count == 0


def test_fragmented_batch_splits_across_runs():
    a = ExtentAllocator(8 * PAGE, PAGE)
    offs = a.allocate_many([PAGE] * 8)
    for off in offs[::2]:  # free every other page: four one-page holes
        a.free(off, PAGE)
    assert a.largest_free == PAGE
    got = a.allocate_many([PAGE, 10, PAGE])
    assert sorted(got) == offs[:6:2] and a.used == 7 * PAGE
    with pytest.raises(TierFullError):
        a.allocate_many([PAGE, PAGE])  # one page free, two asked: nothing taken
    assert a.used == 7 * PAGE and a.runs() == [Run(6 * PAGE, PAGE)]


def test_full_leaves_books_unchanged():
    a = ExtentAllocator(4 * PAGE, PAGE)
    a.allocate_many([PAGE + 1])
    before = snapshot(a)
    with pytest.raises(TierFullError):
        a.allocate_many([PAGE, PAGE, 1])
    assert snapshot(a) == before


def test_bad_requests():
    a = ExtentAllocator(4 * PAGE + 100, PAGE)
    assert a.capacity == 4 * PAGE  # the partial page is unusable
    for bad in ([0], [-5], [1.5], [True]):
        with pytest.raises(InvalidRequestError):
            a.allocate_many(bad)
    with pytest.raises(IntegrityError):
        a.free(0, PAGE)  # never allocated
    for off in (1, -PAGE, 4 * PAGE):
        with pytest.raises(InvalidRequestError):
            a.claim(off, PAGE)
    assert a.allocate_many([]) == [] and a.used == 0
    (off,) = a.allocate_many([PAGE])
    with pytest.raises(IntegrityError):
        a.free(off, 2 * PAGE)  # wrong size for a live range
    with pytest.raises(ConfigError):
        ExtentAllocator(PAGE, 3000)
    with pytest.raises(ConfigError):
        ExtentAllocator(100, PAGE)


def test_claim_splits_run_and_restores_after_restart():
    a = ExtentAllocator(16 * PAGE, PAGE)
    a.claim(4 * PAGE, 2 * PAGE + 1)
    a.claim(0, PAGE)
    assert a.runs() == [Run(PAGE, 3 * PAGE), Run(7 * PAGE, 9 * PAGE)]
    assert a.used == 4 * PAGE
    a.check_integrity()
    a.free(4 * PAGE, 2 * PAGE + 1)
    a.free(0, PAGE)
    assert a.runs() == [Run(0, 16 * PAGE)]
