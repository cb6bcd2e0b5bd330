"""Parsing and formatting for the ``kvstore`` admin CLI: pure functions, no I/O.

Parsers raise ``ValueError`` with a message fit for one line of a click error;
``kvstore.cli.main`` wraps them in click parameter types.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable, Mapping, Sequence

from kvstore.core.config import format_size, parse_size
from kvstore.core.errors import ConfigError

KEY_HEX_CHARS = 32
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?", re.IGNORECASE)
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


# ------------------------------------------------------------------ parsing
def parse_duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"5m"``, ``"1h30m"``, ``"2d"`` -> seconds (bare number: seconds)."""
    s = text.strip().replace(" ", "")
    if not s:
        raise ValueError("empty duration")
    total, pos = 0.0, 0
    for match in _DURATION_PART.finditer(s):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _SECONDS[(match.group(2) or "s").lower()]
        pos = match.end()
    if pos != len(s):
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 5m, 1h30m, 2d)")
    return total


def parse_bytes(text: str) -> int:
    """``"1GiB"`` -> 1073741824; must be > 0."""
    try:
        n = parse_size(text)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    if n <= 0:
        raise ValueError(f"size must be > 0, got {text!r}")
    return n


def parse_tokens(text: str) -> list[int]:
    """``"1,2,3"`` (commas and/or whitespace, or a JSON list) -> token ids."""
    s = text.strip()
    if s.startswith("["):
        try:
            items = json.loads(s)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list of token ids: {exc}") from None
        if not isinstance(items, list):
            raise ValueError("token JSON must be a list of ints")
    else:
        items = [p for p in re.split(r"[\s,]+", s) if p]
    tokens = []
    for item in items:
        # JSON gives ints (a float or bool is a mistake); text gives digit strings.
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise ValueError(f"not a token id: {item!r}")
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"not a token id: {item!r}") from None
        if not 0 <= value < 2**31:
            raise ValueError(f"token id out of range 0..2**31-1: {item!r}")
        tokens.append(value)
    if not tokens:
        raise ValueError("no token ids given")
    return tokens


def parse_key(text: str) -> bytes:
    """32 hex characters -> a 16-byte key."""
    s = text.strip().lower().removeprefix("0x")
    if len(s) != KEY_HEX_CHARS or not re.fullmatch(r"[0-9a-f]+", s):
        raise ValueError(f"a key is {KEY_HEX_CHARS} hex characters, got {text!r}")
    return bytes.fromhex(s)


# ------------------------------------------------------------------ formatting
def format_bytes(n: float | int | None) -> str:
    return "-" if n is None else format_size(int(n))


def format_duration(seconds: float | None) -> str:
    """Seconds -> ``"850ms"``, ``"42s"``, ``"4m12s"``, ``"3h05m"``, ``"2d04h"``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_ratio(part: float, whole: float) -> str:
    """``part / whole`` as a percentage; ``"-"`` when there is nothing to divide."""
    return "-" if not whole else f"{100.0 * part / whole:.1f}%"


def format_count(n: Any) -> str:
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        return "-" if n is None else str(n)
    return f"{n:,}" if isinstance(n, int) or float(n).is_integer() else f"{n:,.3f}"


def render_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table; numeric-looking cells are right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, table has {len(headers)} columns")
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for row in cells:
        lines.append("  ".join(_align(c, w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _align(cell: str, width: int) -> str:
    numeric = cell == "-" or bool(re.fullmatch(r"-?[\d,.]+(%|[KMGT]?i?B|ms|s)?", cell))
    return cell.rjust(width) if numeric else cell.ljust(width)


def render_pairs(pairs: Iterable[tuple[str, Any]]) -> str:
    """``name: value`` lines with the values aligned."""
    items = [(k, str(v)) for k, v in pairs]
    width = max((len(k) for k, _ in items), default=0)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in items)


def jsonable(obj: Any) -> Any:
    """Results as JSON-ready values: bytes -> hex, NamedTuples -> objects, sets -> lists."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj).hex()
    if hasattr(obj, "_asdict"):
        return {k: jsonable(v) for k, v in obj._asdict().items()}
    if isinstance(obj, Mapping):
        return {str(jsonable(k)) if not isinstance(k, str) else k: jsonable(v)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def to_json(obj: Any) -> str:
    return json.dumps(jsonable(obj), indent=2, sort_keys=True)


def to_json_line(obj: Any) -> str:
    """``obj`` as compact JSON on one line (a line of JSON Lines: ``--json --watch``).
    One line always: ``json.dumps`` escapes any newline inside a string."""
    return json.dumps(jsonable(obj), sort_keys=True, separators=(",", ":"))
