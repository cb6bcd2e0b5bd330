"""The errors a tier raises. ``tiers`` imports nothing from ``kvstore``: these are
the roots of kvstore's own error tree (``kvstore.core.errors`` re-exports them
under the same names and builds the rest on ``KVStoreError``), so a caller that
catches ``kvstore.core.errors.TierFullError`` catches a tier's."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every kvstore error. Fatal unless a subclass says otherwise."""

    code = "internal"


class MissError(KVStoreError):
    """A miss: fall back to recompute. Nothing was changed by the failed call."""

    code = "miss"


class TierFullError(MissError):
    """A miss for a writer: no tier has room (pinned/leased data is never evicted
    to make some). The insert is skipped; readers will recompute those blocks."""

    code = "full"


class ConfigError(KVStoreError):
    """Fatal: invalid configuration. Fix the config and restart."""

    code = "config"


class InvalidRequestError(KVStoreError):
    """Fatal for the request: malformed, oversized or inconsistent input.

    The server replies with this and changes nothing.
    """

    code = "invalid"


class IntegrityError(KVStoreError):
    """Fatal: an internal invariant is broken (a bug). ``check_integrity`` raises it."""

    code = "integrity"
