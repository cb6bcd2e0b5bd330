"""The scheduler's cap on queued save orders (kvstore.connector.v1_scheduler
.QueuedSaveOrders): bytes count from the order until every worker has reported
letting them go; a lost report is let go after REPORT_WAIT_S."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from kvstore.connector import v1_scheduler  # noqa: E402
from kvstore.connector.v1_scheduler import QueuedSaveOrders  # noqa: E402


def test_an_order_leaves_only_when_every_worker_reported():
    q = QueuedSaveOrders(limit=100, workers=2)
    assert q.admit("a", 60)
    assert not q.admit("b", 60)  # 120 > 100 with something queued
    q.released(["a"])  # one of two workers
    assert q.queued == 60 and q.pending() and not q.admit("b", 60)
    q.released(["a"])
    assert q.queued == 0 and not q.pending()
    assert q.admit("b", 60)


def test_an_empty_queue_takes_any_order_and_chunks_add_up():
    q = QueuedSaveOrders(limit=10, workers=1)
    assert q.admit("big", 1000)  # larger than the cap, alone: made
    assert not q.admit("next", 1)
    q.released(["big"])
    assert q.admit("c", 4) and q.admit("c", 4)  # two chunk orders of one request
    q.released(["c"])
    assert q.queued == 8 and q.pending()  # one report of two orders: both still held
    q.released(["c"])
    assert q.queued == 0
    q.released(["c", "unknown"])  # late or foreign reports change nothing
    assert q.queued == 0


def test_a_request_whose_reports_never_come_is_let_go(monkeypatch, caplog):
    now = [1000.0]
    monkeypatch.setattr(v1_scheduler.time, "monotonic", lambda: now[0])
    q = QueuedSaveOrders(limit=100, workers=1)
    assert q.admit("lost", 90)
    now[0] += v1_scheduler.REPORT_WAIT_S - 1
    assert q.admit("x", 5)  # fits
    assert not q.admit("y", 50)
    now[0] += 2  # "lost" is past the wait; "x" (ordered later) is not
    with caplog.at_level(logging.WARNING, logger="kvstore.connector.v1_scheduler"):
        assert q.admit("y", 50)
    assert q.queued == 55
    assert sum("never came" in r.getMessage() for r in caplog.records) == 1
    q.released(["lost"])  # its report, late: nothing left to count down
    assert q.queued == 55


def test_a_later_order_of_the_request_restarts_its_wait(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(v1_scheduler.time, "monotonic", lambda: now[0])
    q = QueuedSaveOrders(limit=100, workers=1)
    assert q.admit("chunked", 10)
    now[0] += v1_scheduler.REPORT_WAIT_S - 1
    assert q.admit("chunked", 10)  # its next chunk
    now[0] += 2
    assert q.pending() and q.queued == 20  # not let go: its last order is recent
