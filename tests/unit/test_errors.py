"""Error classes: miss vs fatal, stable codes, rebuilt from the wire (kvstore/core/errors.py)."""

from __future__ import annotations

import pytest

from kvstore.core import errors
from kvstore.core.errors import (
    ChecksumError,
    ConfigError,
    IntegrityError,
    InvalidRequestError,
    KVStoreError,
    MissError,
    TierFullError,
    error_from_code,
    is_miss,
)


def _all_error_classes() -> list[type]:
    return [obj for obj in vars(errors).values()
            if isinstance(obj, type) and issubclass(obj, KVStoreError)]


MISSES = {"MissError", "NotFoundError", "ChecksumError", "LeaseExpiredError",
          "KVTimeoutError", "PeerUnavailableError", "TransferError", "TierFullError"}
FATAL = {"KVStoreError", "ConfigError", "InvalidRequestError", "AuthError", "IntegrityError"}


def test_every_class_is_a_known_miss_or_fatal():
    names = {c.__name__ for c in _all_error_classes()}
    assert MISSES | FATAL <= names
    for cls in _all_error_classes():
        assert is_miss(cls("x")) == (cls.__name__ in MISSES or issubclass(cls, MissError))
        # The docstring tells a caller what to do: recompute, or that it is fatal.
        doc = (cls.__doc__ or "").lower()
        assert "miss" in doc or "fatal" in doc, cls


def test_codes_are_unique():
    codes = [c.code for c in _all_error_classes()]
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_error_round_trips_through_its_code(cls):
    err = error_from_code(cls.code, "the message")
    assert type(err) is cls
    assert str(err) == "the message"


def test_unknown_code_becomes_the_base_class():
    err = error_from_code("from-a-newer-server", "m")
    assert type(err) is KVStoreError and not is_miss(err)


def test_is_miss_on_other_exceptions():
    assert not is_miss(ValueError("x"))
    assert is_miss(TierFullError("full")) and is_miss(ChecksumError("bad"))
    for cls in (ConfigError, InvalidRequestError, IntegrityError):
        assert not is_miss(cls("x"))
