"""The push-back watchdog times its own looks (``kvstore.server.loop.watch_gap``): how
late they come on a loaded host is how early it answers ``busy`` a queued request
whose caller is about to stop waiting (``Server.watch_ahead_s``)."""

from __future__ import annotations

from kvstore.server.loop import WATCH_LATE, WATCH_MEMORY_S, WATCH_S, watch_gap


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
