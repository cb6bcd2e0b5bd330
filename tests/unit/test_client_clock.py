"""A remote server's clock, as a client learns it from its hello: the server's
``now`` less the midpoint of the round trip ("sent at 100.0, answered at 100.2,
server said 130.1: the server is 30.0 s ahead, give or take 0.1")."""

import pytest

from kvstore.client.client import _CLOCK_ERROR_S, clock_offset


def test_the_offset_is_now_less_the_round_trips_midpoint():
    assert clock_offset(100.0, 130.1, 100.2) == pytest.approx(30.0)
    assert clock_offset(100.0, 99.5, 100.0) == pytest.approx(-0.5)


def test_a_round_trip_too_slow_to_bound_the_error_gives_no_offset():
    assert clock_offset(100.0, 100.0, 100.0 + 2 * _CLOCK_ERROR_S) == pytest.approx(-_CLOCK_ERROR_S)
    assert clock_offset(100.0, 100.0, 100.0 + 2 * _CLOCK_ERROR_S + 0.01) is None
    assert clock_offset(100.0, 100.0, 99.0) is None  # our clock stepped back meanwhile


@pytest.mark.parametrize("now", [None, "100.0", True, [100.0]])
def test_a_server_that_does_not_say_its_time_gives_no_offset(now):
    assert clock_offset(100.0, now, 100.1) is None
