"""A remote server's clock, as a client learns it from its hello: the server's
``now`` less the midpoint of the round trip ("sent at 100.0, answered at 100.2,
server said 130.1: the server is 30.0 s ahead, give or take 0.1"), and the
deadlines a writer on another node puts on its writes in that clock."""

import time

import pytest

from kvstore.client.client import _CLOCK_ERROR_S, _DEADLINE_SLACK_S, KVStoreClient, clock_offset
from kvstore.core import protocol as p
from kvstore.core.errors import LATE_WRITE, BusyError


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


@pytest.fixture
def remote():
    """A client of a server on another node (nothing listens: only its reckoning of
    deadlines is used, as after a hello that said ``now``)."""
    client = KVStoreClient("tcp://127.0.0.1:9", same_node=False, timeout_s=2.0)
    client._hello = {"now": 0.0, "host_id": "elsewhere"}
    yield client
    client.close()


def test_a_remote_writers_deadline_is_in_the_servers_clock(remote):
    remote._clock = 30.0  # the server is 30 s ahead of us
    before = time.time()
    deadline, wait = remote._deadline()
    assert before + 30.0 + 2.0 <= deadline <= time.time() + 30.0 + 2.0
    assert wait == 2.0 + _DEADLINE_SLACK_S


def test_no_deadline_without_a_measured_clock_or_for_a_server_that_says_no_time(remote):
    remote._clock = None  # no hello quick enough to measure by
    assert remote._deadline() == (None, None)
    remote._clock, remote._hello = 0.0, {"host_id": "elsewhere"}  # an older server
    assert remote._deadline() == (None, None)
    remote._hello = None  # (between a lost server and the next hello)
    assert remote._deadline() == (None, None)


def test_a_slow_rehello_keeps_the_offset_measured_for_the_same_machine(remote):
    remote._clock, remote._hello_host = 30.0, "elsewhere"
    slow = 1.0 + 2 * _CLOCK_ERROR_S  # answered too late to measure by
    assert remote._clock_of({"now": 131.0, "host_id": "elsewhere"}, 100.0, 100.0 + slow) \
        == 30.0
    assert remote._clock_of({"now": 131.0, "host_id": "another"}, 100.0, 100.0 + slow) is None
    assert remote._clock_of({"host_id": "elsewhere"}, 100.0, 100.1) is None  # older server
    assert remote._clock_of({"now": 110.05, "host_id": "another"}, 100.0, 100.1) \
        == pytest.approx(10.0)


def _refused(client, message: str):
    """``client``'s commit answered ``busy`` with ``message`` (as the server words it)."""
    def call(req, timeout_s=None, take=None):
        raise BusyError(message)

    client._rpc.call = call
    deadline, wait = client._deadline()
    with pytest.raises(BusyError):
        client._call(p.Commit(rid=1, checksums=(1,), deadline=deadline), wait)


def test_a_late_refusal_before_the_deadline_by_our_reckoning_forgets_the_offset(remote):
    remote._clock, remote._hello_host = 0.0, "elsewhere"
    _refused(remote, "server busy: the request would start after 2.5 s")  # overload
    assert remote._clock == 0.0 and remote._hello is not None
    _refused(remote, f"commit reached the store 31.0 s {LATE_WRITE}: nothing stored")
    assert remote._clock is None and remote._hello is None  # measured again at hello
