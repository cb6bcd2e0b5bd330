"""Eviction policies: the pure choice of which keys leave a tier."""

import pytest

from kvstore.core.errors import ConfigError
from kvstore.store.policy import POLICIES, Candidate, bytes_to_free, make_policy, over_watermark


def cand(i: int, last_access: float, created: float | None = None, pins: int = 0,
         leases: int = 0, nbytes: int = 100) -> Candidate:
    return Candidate(bytes([i]) * 16, nbytes, last_access,
                     float(i) if created is None else created, pins, leases)


def k(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


@pytest.mark.parametrize("name", sorted(POLICIES))
class TestEveryPolicy:
    def test_frees_at_least_the_bytes_asked(self, name):
        sel = make_policy(name).select([cand(i, i) for i in range(10)], 250)
        assert sel.nbytes == 300 and len(sel.keys) == 3

    def test_never_chooses_pinned_or_leased(self, name):
        cands = [cand(1, 1, pins=1), cand(2, 2, leases=2), cand(3, 3), cand(4, 4)]
        sel = make_policy(name).select(cands, None)
        assert sel.keys == k(3, 4)
        assert sorted(sel.skipped) == k(1, 2)

    def test_not_enough_movable_frees_what_it_can(self, name):
        cands = [cand(1, 1, pins=1), cand(2, 2)]
        sel = make_policy(name).select(cands, 1000)
        assert sel.keys == k(2) and sel.nbytes == 100

    def test_nothing_asked_nothing_chosen(self, name):
        assert make_policy(name).select([cand(1, 1)], 0).keys == []

    def test_fraction(self, name):
        sel = make_policy(name).select_fraction([cand(i, i) for i in range(10)], 0.5)
        assert len(sel.keys) == 5


def test_lru_takes_least_recently_used_first():
    # store [1,2,3] -> touch 1 -> need room for one -> evicts [2]
    cands = [cand(1, 10.0, created=1), cand(2, 2.0, created=2), cand(3, 3.0, created=3)]
    assert make_policy("lru").select(cands, 100).keys == k(2)
    assert make_policy("lru").select(cands, 300).keys == k(2, 3, 1)


def test_fifo_ignores_access():
    cands = [cand(1, 10.0, created=1), cand(2, 2.0, created=2)]
    assert make_policy("fifo").select(cands, 100).keys == k(1)


def test_skipped_lists_only_what_was_passed_over():
    cands = [cand(1, 1), cand(2, 2, pins=1), cand(3, 3)]
    sel = make_policy("lru").select(cands, 100)
    assert sel.keys == k(1) and sel.skipped == []


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError):
        make_policy("random")


def test_watermarks():
    assert not over_watermark(90, 5, 100, 0.95)
    assert over_watermark(90, 6, 100, 0.95)
    assert bytes_to_free(90, 6, 100, 0.85) == 11
    assert bytes_to_free(10, 6, 100, 0.85) == 0
