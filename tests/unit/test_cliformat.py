"""Parsers and formatters of the admin CLI."""

import json

import pytest

from kvstore.cli.format import (format_duration, format_ratio, jsonable, parse_bytes,
                               parse_duration, parse_key, parse_tokens, render_pairs,
                               render_table, to_json)


@pytest.mark.parametrize("text,seconds", [
    ("90", 90), ("90s", 90), ("5m", 300), ("1h30m", 5400), ("2d", 172800),
    ("250ms", 0.25), ("1.5h", 5400), ("1w", 604800), (" 1h 5s ", 3605)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "5x", "m5", "1h-3m", "-5s"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_parse_bytes():
    assert parse_bytes("1GiB") == 2**30
    assert parse_bytes("512") == 512
    for bad in ("0", "lots", "-1GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_parse_tokens():
    assert parse_tokens("1,2,3") == [1, 2, 3]
    assert parse_tokens("1 2\n3,, 4") == [1, 2, 3, 4]
    assert parse_tokens("[5, 6]") == [5, 6]
    for bad in ("", "1,x", "-1", str(2**31), "[1, true]", "{}", "[1.5]"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def test_parse_key():
    key = bytes(range(16))
    assert parse_key(key.hex()) == key
    assert parse_key("0x" + key.hex().upper()) == key
    for bad in ("abc", key.hex() + "00", "g" * 32):
        with pytest.raises(ValueError):
            parse_key(bad)


def test_format_duration():
    assert [format_duration(s) for s in (0.25, 42, 252, 11100, 187200)] == \
        ["250ms", "42s", "4m12s", "3h05m", "2d04h"]
    assert format_duration(None) == "-" and format_duration(float("nan")) == "-"


def test_format_ratio():
    assert format_ratio(1, 4) == "25.0%" and format_ratio(0, 0) == "-"


def test_render_table_aligns_numbers_right():
    text = render_table(["NAME", "SIZE"], [["dram", "1.0GiB"], ["nvme-long", "12B"]])
    lines = text.splitlines()
    assert lines[0].startswith("NAME       SIZE")
    assert lines[1] == "dram       1.0GiB"
    assert lines[2] == "nvme-long     12B"
    with pytest.raises(ValueError):
        render_table(["A"], [["1", "2"]])


def test_render_pairs():
    assert render_pairs([("a", 1), ("long", "x")]) == "a:    1\nlong: x"


def test_jsonable():
    from typing import NamedTuple

    class R(NamedTuple):
        keys: list
        nbytes: int

    out = jsonable({"r": R([b"\x01\x02"], 3), b"k": {1, 2}, "f": float("inf")})
    assert out == {"r": {"keys": ["0102"], "nbytes": 3}, "6b": [1, 2], "f": None}
    assert json.loads(to_json(out)) == out
