"""The admin CLI's float options refuse NaN and infinity as bad arguments (exit 2,
one line naming the option), before any server is contacted."""

from __future__ import annotations

import socket

import click
import pytest
from click.testing import CliRunner

from kvstore.cli.main import cli


def _unused_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False,
                              prog_name="kvstore")


def _usage_error(args: list[str]) -> str:
    """``kvstore ARGS`` against an address nothing listens on (with a short timeout
    unless ARGS sets one): it must end as a usage error, exit 2; its stderr."""
    extra = [] if "--timeout" in args else ["--timeout", "1"]
    result = run(*args, "--server", _unused_address(), *extra)
    assert result.exit_code == 2, result.output
    return result.stderr


# Every float option of kvstore/cli/*.py: stats --watch, the servers' --timeout (every
# command that talks to a server), evict/demote --fraction.
@pytest.mark.parametrize("args,option", [
    (["stats", "--watch", "nan"], "--watch"),
    (["stats", "--watch", "inf"], "--watch"),
    (["stats", "--watch", "Infinity"], "--watch"),
    (["stats", "--watch", "1e999"], "--watch"),  # float() makes it inf
    (["stats", "--cluster", "--watch", "nan"], "--watch"),
    (["stats", "--timeout", "nan"], "--timeout"),
    (["stats", "--timeout", "inf"], "--timeout"),
    (["health", "--timeout", "-inf"], "--timeout"),
    (["evict", "--fraction", "nan"], "--fraction"),
    (["evict", "--fraction", "-nan"], "--fraction"),
    (["demote", "--fraction", "nan"], "--fraction"),
    (["demote", "--fraction", "inf"], "--fraction"),
])
def test_nan_and_infinity_are_usage_errors(args, option):
    [line] = _usage_error(args).strip().splitlines()
    assert line.startswith(f"kvstore {args[0]}: {option}: ") and "finite" in line, line


def test_nan_timeout_from_the_environment_is_a_usage_error():
    result = run("health", "--server", _unused_address(), env={"KVSTORE_CLIENT_TIMEOUT_S": "nan"})
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("kvstore health: --timeout: "), result.stderr


@pytest.mark.parametrize("args,message", [
    (["stats", "--watch", "0.05"], "kvstore stats: --watch: 0.05 is not in the range x>=0.1"),
    (["stats", "--timeout", "-1"], "kvstore stats: --timeout: -1.0 is not in the range x>=0.01"),
    (["stats", "--timeout", "0"], "kvstore stats: --timeout: 0.0 is not in the range x>=0.01"),
    (["evict", "--fraction", "0"], "kvstore evict: --fraction: 0.0 is not in the range 0<x<=1"),
    (["demote", "--fraction", "1.5"], "kvstore demote: --fraction: 1.5 is not in the range 0<x<=1"),
    (["stats", "--watch", "soon"], "kvstore stats: --watch: 'soon' is not a valid float"),
])
def test_the_ranges_still_hold(args, message):
    stderr = _usage_error(args)
    assert stderr.strip().startswith(message), stderr


def test_finite_float_range_type():
    from kvstore.cli.params import FiniteFloatRange

    kind = FiniteFloatRange(0, 1, min_open=True)
    assert kind.convert("0.5", None, None) == 0.5 and kind.convert("1", None, None) == 1.0
    assert kind.convert(0.25, None, None) == 0.25
    for bad in ("nan", "inf", "-inf", float("nan"), float("inf")):
        with pytest.raises(click.BadParameter, match="not a finite number"):
            kind.convert(bad, None, None)
    with pytest.raises(click.BadParameter, match="not in the range"):
        kind.convert("0", None, None)
    assert "x>=0.1" in FiniteFloatRange(min=0.1)._describe_range()
