"""The push-back watchdog times its own wakes (``kvstore.server.loop.watch_gap``): how
late they come on a loaded host is how early it answers ``busy`` a queued request
whose caller is about to stop waiting (``Server.watch_ahead_s``). ``Server._watch``
runs here in a thread of its own with the look's steps stood in for: the server's
sockets and queue are tested in tests/integration/test_busy.py."""

from __future__ import annotations

import threading
import time
import types

from kvstore.server import loop
from kvstore.server.loop import WATCH_LATE, WATCH_MEMORY_S, WATCH_S, Server, watch_gap


def _after(peak: float, gap: float, seconds: float) -> float:
    for _ in range(round(seconds / gap)):
        peak = watch_gap(peak, gap)
    return peak


def test_looks_on_time_keep_the_fixed_margin():
    """Looks that come about every WATCH_S (an idle or lightly loaded host) never
    widen the margin past WATCH_LATE periods: nothing changes there."""
    peak = _after(WATCH_S, WATCH_S * 1.1, 60.0)
    assert 2 * peak < WATCH_LATE * WATCH_S, peak


def test_a_late_look_widens_the_margin_then_it_fades():
    """One look 0.5 s late (CPU hogs, the GIL held by a checksumming serving thread)
    is remembered: the margin covers a look that late; it halves every
    WATCH_MEMORY_S of looks on time, back to the fixed margin."""
    peak = watch_gap(WATCH_S, 0.5)
    assert peak == 0.5
    assert watch_gap(peak, 0.2) > 0.45  # a later, shorter late look does not hide it
    half = _after(peak, WATCH_S, WATCH_MEMORY_S)
    assert abs(half - 0.25) < 0.01, half
    assert 2 * _after(peak, WATCH_S, 6 * WATCH_MEMORY_S) < WATCH_LATE * WATCH_S
    assert watch_gap(half, 0.4) == 0.4  # a new, longer one takes over at once


class _Socket:
    """The server's socket lock, telling when the watchdog asks for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asked = threading.Event()

    def __enter__(self) -> None:
        self.asked.set()
        self.lock.acquire()

    def __exit__(self, *exc) -> None:
        self.lock.release()


def _watchdog(**looks) -> Server:
    """A Server with only what ``Server._watch`` reads: the socket lock, the serving
    thread's state and the look's three steps (``looks``)."""
    srv = object.__new__(Server)
    srv._stop = False
    srv._sock_lock = _Socket()
    srv._watch_gap = WATCH_S
    srv._working_since = None
    for name, step in looks.items():
        setattr(srv, name, step)
    return srv


def _run(srv: Server, until) -> None:
    watchdog = threading.Thread(target=srv._watch, args=(None,), daemon=True)
    watchdog.start()
    try:
        until()
    finally:
        srv._stop = True
        watchdog.join(5)
    assert not watchdog.is_alive()


def test_waiting_for_the_socket_while_the_server_polls_is_not_lateness():
    """The serving thread holds the socket while it polls, idle (up to POLL_MS). A
    watchdog that woke as a request ended waits that out: not a late look, or an
    unloaded server would answer busy to a lookup queued behind any 20 ms request."""
    looked = []
    srv = _watchdog(_forward=looked.append, _drain=lambda: looked.append("drain"),
                    _expire_queued=looked.append)
    held = srv._sock_lock

    def poll_idle() -> None:
        held.lock.acquire()
        srv._working_since = time.monotonic() - 1.0  # at work: the watchdog looks
        try:
            assert held.asked.wait(10)
            srv._working_since = None  # done; now polling, idle
            time.sleep(0.5)
        finally:
            held.lock.release()
        time.sleep(0.1)

    _run(srv, poll_idle)
    assert not looked  # (nothing in flight once it had the socket)
    assert srv._watch_gap < 0.5, srv._watch_gap


def test_a_slow_look_widens_the_margin_of_the_next_and_a_late_wake_its_own(monkeypatch):
    """A wake 0.3 s late answers busy what has under 0.6 s left in that very look,
    not only in the next (its caller may not last until then), and the next look
    remembers it. A look that takes 0.6 s (the GIL held elsewhere) counts too."""
    real_sleep = time.sleep
    aheads: list[float] = []
    wakes = iter([0.3])  # the first wake comes 0.3 s late, the others on time
    clock = types.SimpleNamespace(monotonic=time.monotonic,
                                  sleep=lambda s: real_sleep(next(wakes, s)))
    monkeypatch.setattr(loop, "time", clock)
    srv = _watchdog(_forward=lambda staged: None, _expire_queued=aheads.append)
    srv._drain = lambda: real_sleep(0.6) if len(aheads) == 1 else None  # the 2nd look
    srv._working_since = time.monotonic() - 1.0

    def three_looks() -> None:
        while len(aheads) < 3:
            real_sleep(0.01)

    _run(srv, three_looks)
    assert aheads[0] >= 0.6, aheads  # its own late wake
    assert aheads[1] >= 0.6, aheads  # the late wake remembered
    assert aheads[2] >= 1.2, aheads  # the slow look
