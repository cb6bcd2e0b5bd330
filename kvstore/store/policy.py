"""Which entries leave a tier: pure choice logic, no I/O, no store state.

The store calls a policy with the entries of one tier as ``Candidate``s and the
number of bytes it must free; the policy answers which keys go, in order. Whether
"go" means demote to the next tier or evict for good is the store's business.

Invariant every policy keeps: a pinned or leased candidate is never chosen; it
is reported in ``Selection.skipped`` instead so callers can say why space was
not freed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import NamedTuple, Protocol

from kvstore.core.errors import ConfigError


class Sortable(Protocol):
    """What a policy orders by: a ``Candidate`` or an index ``Record``."""

    @property
    def key(self) -> bytes: ...
    @property
    def last_access(self) -> float: ...
    @property
    def created(self) -> float: ...


class Candidate(NamedTuple):
    key: bytes
    nbytes: int
    last_access: float
    created: float
    pins: int
    leases: int

    @property
    def movable(self) -> bool:
        return self.pins == 0 and self.leases == 0


class Selection(NamedTuple):
    keys: list[bytes]  # in the order they should go
    nbytes: int  # sum of their sizes
    skipped: list[bytes]  # pinned or leased candidates passed over before enough was found


class EvictionPolicy(ABC):
    """Orders candidates; ``select`` takes from the front until enough bytes go."""

    name: str

    @staticmethod
    @abstractmethod
    def sort_key(entry: Sortable) -> tuple:
        """Where an entry goes in the order (smallest first), ending with its key so
        no two entries tie. Takes anything with the fields used (a ``Candidate`` or
        an index ``Record``): the store keeps its tiers in this order."""

    def order(self, candidates: Iterable[Candidate]) -> list[Candidate]:
        """Candidates, first to go first."""
        return sorted(candidates, key=self.sort_key)

    def select(self, candidates: Iterable[Candidate], nbytes: int | None) -> Selection:
        """Enough movable candidates to free ``nbytes`` (all movable ones if None).

        Frees fewer than asked when there are not enough movable candidates; the
        caller decides whether that is an error.
        """
        return self.take(self.order(candidates), nbytes)

    def take(self, ordered: Iterable[Candidate], nbytes: int | None) -> Selection:
        """``select`` over candidates already in policy order; consumes ``ordered``
        only as far as needed (the store passes a lazy walk of its tier order)."""
        keys: list[bytes] = []
        skipped: list[bytes] = []
        freed = 0
        for cand in ordered:
            if nbytes is not None and freed >= nbytes:
                break
            if not cand.movable:
                skipped.append(cand.key)
                continue
            keys.append(cand.key)
            freed += cand.nbytes
        return Selection(keys, freed, skipped)

    def select_fraction(self, candidates: Iterable[Candidate], fraction: float) -> Selection:
        """The first ``fraction`` of the tier's bytes in policy order (movable only)."""
        cands = list(candidates)
        total = sum(c.nbytes for c in cands)
        return self.select(cands, int(total * fraction + 0.5))


class LRUPolicy(EvictionPolicy):
    """Least recently used first; ties broken by age, then key (deterministic)."""

    name = "lru"

    @staticmethod
    def sort_key(entry: Sortable) -> tuple:
        return (entry.last_access, entry.created, entry.key)


class FIFOPolicy(EvictionPolicy):
    """Oldest insert first, whatever its use: cheap and scan-resistant to re-reads."""

    name = "fifo"

    @staticmethod
    def sort_key(entry: Sortable) -> tuple:
        return (entry.created, entry.key)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str = "lru") -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}; one of {sorted(POLICIES)}") from None


def over_watermark(used: int, incoming: int, capacity: int, high: float) -> bool:
    """True when ``used + incoming`` would exceed ``high`` of ``capacity``."""
    return used + incoming > high * capacity


def demote_mark(high: float, low: float) -> float:
    """The fraction of a tier above which the background demotes its entries that
    have NVMe copies (halfway from ``low`` to ``high``): ahead of the high
    watermark, where a request's reserve would shed on the serving thread."""
    return (high + low) / 2


def bytes_to_free(used: int, incoming: int, capacity: int, low: float) -> int:
    """Bytes that must leave so ``used + incoming`` is at most ``low`` of capacity."""
    return max(0, used + incoming - int(low * capacity))
