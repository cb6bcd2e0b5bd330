"""How the store's parts are wired: one ``Parts`` bundle handed to each group of
operations (writes.py, reads.py, admin.py, audit.py), so each sees the owners of
the state by name and can change state only through them.

Who owns what: ``Catalog`` the records, their index and order (catalog.py), ``Holds`` the
reservations, leases and hold counts (holds.py), ``Placement`` the tiers and the
policy (placement.py), ``ByteIO`` nothing (bytes_io.py). ``Counters`` are the
store's event counts: every part adds to them, only ``Store.stats`` reads them.
``lock`` is the store's one lock (re-entrant): every operation runs under it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.core.config import KVStoreConfig
from kvstore.core.errors import BusyError

if TYPE_CHECKING:
    from kvstore.store.bytes_io import ByteIO
    from kvstore.store.catalog import Catalog
    from kvstore.store.holds import Holds
    from kvstore.store.placement import Placement


@dataclass
class Counters:
    events: Counter = field(default_factory=Counter)  # commits, misses, evictions, ...
    hits: Counter = field(default_factory=Counter)  # blocks served, by the tier they were in
    tier_bytes: Counter = field(default_factory=Counter)  # (tier, "bytes_in"/"bytes_out")


@dataclass
class Parts:
    config: KVStoreConfig
    lock: threading.RLock
    catalog: Catalog
    holds: Holds
    place: Placement
    io: ByteIO
    counters: Counters
    reap_due: Callable[[], None]  # reap now if a reservation or lease has run out


class Operations:
    """Base of each group of store operations: the parts, by name."""

    def __init__(self, parts: Parts) -> None:
        self.config = parts.config
        self.lock = parts.lock
        self.catalog = parts.catalog
        self.holds = parts.holds
        self.place = parts.place
        self.io = parts.io
        self.counts = parts.counters.events
        self.hits = parts.counters.hits
        self.tier_bytes = parts.counters.tier_bytes
        self.reap_due = parts.reap_due

    def late(self, deadline: float | None, op: str, reason: str, nothing: str,
             counter: str, undo: Callable[[], None] | None = None) -> None:
        """``BusyError`` (after ``undo``: give back what the request named) where it
        is past a client's ``deadline`` (this server's wall clock, as the client knows
        it): the client stopped waiting then (a server frozen with the request in its
        socket buffer reads it only when it goes on), so nothing may be done or held
        for it. ``reason`` says which (``errors.LATE_WRITE`` / ``LATE_READ``); counted
        in ``counts[counter]``. Callers check under the store's lock, so a wait for
        it counts too (the lock is re-entrant; a staging's checks run on the staging
        thread, and its ``undo`` takes the lock itself)."""
        if deadline is None:
            return
        late = time.time() - deadline
        if late <= 0:
            return
        if undo is not None:
            undo()
        with self.lock:
            self.counts[counter] += 1
        raise BusyError(f"{op} reached the store {late:.1f} s {reason}: nothing {nothing}")
