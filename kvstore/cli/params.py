"""The ``kvstore`` CLI's argument handling: the one way a command refuses bad
arguments (``fail``), and the click parameter types over ``kvstore.cli.format``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn

import click

from kvstore.cli.format import parse_bytes, parse_key, parse_tokens
from kvstore.core.hashing import NAMESPACE_TAG_BYTES


def fail(message: str) -> NoReturn:
    """Bad arguments: one line and exit 2 (``kvstore.cli.main.one_line`` shows it)."""
    raise click.UsageError(message, ctx=click.get_current_context(silent=True))


def parse_namespace(value: str) -> str:
    """--namespace: hex, a prefix of the 16-hex-digit tag (or of the full 32-digit
    fingerprint, whose first 16 digits are the tag) -> lower-case hex prefix."""
    text = value.strip().lower()
    if not text or len(text) > 2 * 2 * NAMESPACE_TAG_BYTES or any(
            c not in "0123456789abcdef" for c in text):
        raise ValueError(f"not a hex namespace (up to 32 hex digits): {value!r}")
    return text[:2 * NAMESPACE_TAG_BYTES]


# ------------------------------------------------------------------ parameter types
class _Parsed(click.ParamType):
    parse: Callable[[str], Any]

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return type(self).parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class SizeType(_Parsed):
    name = "size"
    parse = staticmethod(parse_bytes)


class KeyType(_Parsed):
    name = "hexkey"
    parse = staticmethod(parse_key)


class NamespaceType(_Parsed):
    name = "hex"
    parse = staticmethod(parse_namespace)


class TokensType(_Parsed):
    name = "tokens"
    parse = staticmethod(parse_tokens)


class FiniteFloatRange(click.FloatRange):
    """A ``click.FloatRange`` that refuses NaN and infinity: ``float()`` takes "nan",
    "inf" and "1e999", and NaN passes every range check (each comparison is false).
    The CLI's float options all use it, so ``--watch nan`` is exit 2, not a hang."""

    name = "float range"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number (the range is "
                      f"{self._describe_range()})", param, ctx)
        return super().convert(number, param, ctx)


def apply(decorators: list[Callable]) -> Callable:
    """Apply a list of click decorators (listed in --help order)."""
    def wrap(f: Callable) -> Callable:
        for deco in reversed(decorators):
            f = deco(f)
        return f
    return wrap
