"""Errors of kvstore, and how a caller must treat each one.

Two families matter to a caller:

* ``MissError`` and its subclasses are *misses*: the KV could not be provided
  (absent, corrupt, expired, peer gone, timed out). The engine falls back to
  recomputing those tokens. The connector never lets one of these reach vLLM.
* Everything else is *fatal* for the request that raised it: a bug, bad
  configuration or bad input that retrying will not fix.

Every error carries a stable ``code`` string; the wire protocol sends it and the
client turns it back into the same class with ``error_from_code``.
"""

from __future__ import annotations

# The tier-level roots live in tiers/ (which imports nothing from kvstore); they are
# kvstore's errors under the same names, not wrappers.
from tiers.errors import (  # noqa: F401  (re-exported)
    ConfigError,
    IntegrityError,
    InvalidRequestError,
    KVStoreError,
    MissError,
    TierFullError,
)


# ---------------------------------------------------------------- misses
# (MissError and TierFullError: tiers/errors.py)
class NotFoundError(MissError):
    """A miss: the key (or reservation / lease id) is not stored."""

    code = "not_found"


class ChecksumError(MissError):
    """A miss: stored or transferred bytes failed their xxh3_64 check.

    The bad entry is dropped and counted; the caller recomputes.
    """

    code = "checksum"
    # On a client read: the bad entry's index in the lease, reported with the release.
    position: int | None = None


class LeaseExpiredError(MissError):
    """A miss: the reservation or acquisition lease ran out and was reclaimed."""

    code = "lease_expired"


class KVTimeoutError(MissError):
    """A miss: an operation did not finish within its bound."""

    code = "timeout"


class PeerUnavailableError(MissError):
    """A miss: the server or transfer peer is gone or not answering."""

    code = "unavailable"


class TransferError(MissError):
    """A miss: a Transfer Engine transfer returned an error code."""

    code = "transfer"


class BusyError(MissError):
    """A miss: the server could not start this request within its budget
    (``server.busy_after_s``): slow work ahead of it. Nothing was done; retry
    later or recompute. (Also a write the store reached after its writer's
    deadline, whose message then says ``LATE_WRITE``.)"""

    code = "busy"


# In the message of a BusyError for a write the store reached after its writer's
# deadline (kvstore.store.writes): the writer tells it from an overload refusal by this.
LATE_WRITE = "after its writer stopped waiting"
LATE_READ = "after its reader stopped waiting"


class StorageError(MissError):
    """A miss for a writer: the server could not write its index or its files
    (file system full, read-only, I/O error). Nothing was changed; the server stays
    up and serves what it has. Counted in ``storage_errors`` and logged; free
    space on the data dir's file system to end it."""

    code = "storage"


# ---------------------------------------------------------------- fatal
# (ConfigError, InvalidRequestError, IntegrityError: tiers/errors.py)
class AuthError(KVStoreError):
    """Fatal: the control plane refused the client's credentials."""

    code = "auth"


def _all_subclasses(cls: type[KVStoreError]) -> list[type[KVStoreError]]:
    out: list[type[KVStoreError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_ERRORS: list[type[KVStoreError]] = [KVStoreError, *_all_subclasses(KVStoreError)]
_BY_CODE = {c.code: c for c in _ERRORS}


def error_from_code(code: str, message: str) -> KVStoreError:
    """Rebuild the error a server sent; unknown codes become ``KVStoreError``."""
    return _BY_CODE.get(code, KVStoreError)(message)


def is_miss(err: BaseException) -> bool:
    return isinstance(err, MissError)
