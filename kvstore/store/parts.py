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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.core.config import KVStoreConfig

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
