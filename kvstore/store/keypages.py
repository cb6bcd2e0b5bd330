"""Every stored key, in key order page by page, held in memory only.

``ls`` pages through a store's records in key order from a cursor, and a page must
cost O(page), not O(entries), so that it never holds the store's lock for long. The
records of memory tiers have no index on disk to keep that order (they die with the
process), so this keeps it: the keys in ``BUCKETS`` sets by their first 12 bits, and
a page sorts only the buckets it walks. Keys are hashes (kvstore.core.hashing), so the
buckets fill evenly: a million entries are ~250 keys a bucket. Adding or removing a
key is one set operation, ~0.3 us, where an LMDB row cost ~2 us and a transaction per
change (docs/architecture.md, "Departures").

Only ``Catalog`` changes it, under the store's lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

BUCKETS = 1 << 12


def bucket_of(key: bytes) -> int:
    """The bucket of ``key``: its first 12 bits (missing bits count as 0), so every
    key of bucket i sorts before every key of bucket i + 1."""
    if len(key) >= 2:
        return key[0] << 4 | key[1] >> 4
    return key[0] << 4 if key else 0


class KeyPages:
    """A set of keys that lists them in key order, a page at a time."""

    def __init__(self, keys: Iterable[bytes] = ()) -> None:
        self._buckets: list[set[bytes] | None] = [None] * BUCKETS
        self.add_many(keys)

    def add_many(self, keys: Iterable[bytes]) -> None:
        buckets = self._buckets
        for key in keys:
            try:
                at = key[0] << 4 | key[1] >> 4  # bucket_of, inlined: a put adds every key
            except IndexError:
                at = bucket_of(key)
            held = buckets[at]
            if held is None:
                buckets[at] = {key}
            else:
                held.add(key)

    def discard_many(self, keys: Iterable[bytes]) -> None:
        buckets = self._buckets
        for key in keys:
            try:
                at = key[0] << 4 | key[1] >> 4
            except IndexError:
                at = bucket_of(key)
            held = buckets[at]
            if held is not None:
                held.discard(key)

    def __iter__(self) -> Iterator[bytes]:
        """Every key, in no particular order."""
        for keys in self._buckets:
            if keys:
                yield from keys

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._buckets if keys)

    def after(self, after: bytes | None, limit: int) -> list[bytes]:
        """Up to ``limit`` keys in key order, from the first one after ``after`` (from
        the first key when None). Sorts only the buckets it takes keys from."""
        out: list[bytes] = []
        if limit <= 0:
            return out
        first = 0 if after is None else bucket_of(after)
        for at in range(first, BUCKETS):
            keys = self._buckets[at]
            if not keys:
                continue
            if after is not None and at == first:
                ordered = sorted(k for k in keys if k > after)
            else:
                ordered = sorted(keys)
            out += ordered[:limit - len(out)]
            if len(out) >= limit:
                break
        return out
