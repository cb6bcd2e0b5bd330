"""The frame every ``kvstore`` command runs in: errors as one line (exit 1 when the
server said no or was unreachable, 2 for bad arguments or a bad configuration) and
per-node output."""

from __future__ import annotations

import os
import select
import sys
from collections.abc import Callable
from typing import Any

import click

from kvstore.cli.admin import Admin
from kvstore.cli.format import to_json, to_json_line
from kvstore.core.errors import ConfigError, KVStoreError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class OneLineUsageError(click.UsageError):
    """A usage error shown as its one line (no usage block, no hint); exit 2."""

    def show(self, file: Any = None) -> None:
        click.echo(self.message, err=True)


def one_line(exc: click.UsageError) -> OneLineUsageError:
    """``kvstore evict: --bytes: not a size: 'lots'`` for any click usage error."""
    ctx = exc.ctx
    path = ctx.command_path if ctx is not None else "kvstore"
    param = getattr(exc, "param", None)
    if (isinstance(exc, click.BadParameter) and not isinstance(exc, click.MissingParameter)
            and param is not None):
        name = param.opts[0] if getattr(param, "opts", None) else param.human_readable_name
        text = f"{path}: {name}: {exc.message}"
    else:
        text = f"{path}: {exc.format_message()}"
    return OneLineUsageError(" ".join(text.split()), ctx)


def _command_path(ctx: click.Context) -> str:
    """``kvstore health``: the group's path and the command it was running."""
    sub = ctx.invoked_subcommand
    return f"{ctx.command_path} {sub}" if sub else ctx.command_path


class AdminGroup(click.Group):
    """Turns any error a command lets escape into one line, never a traceback: exit 1
    (the server said no, or was unreachable), or exit 2 for bad arguments - click's
    own usage errors included, shown without its usage block - and for a bad
    configuration (a ``--config`` file or ``KVSTORE_CLIENT_*`` value), which no
    server has seen: a probe's exit 1 means the server, never this machine's setup."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        try:  # the group's own options (kvstore --bogus)
            return super().make_context(info_name, args, parent, **extra)
        except OneLineUsageError:
            raise
        except click.UsageError as exc:
            raise one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OneLineUsageError:
            raise
        except click.UsageError as exc:  # a command's arguments, or an unknown command
            raise one_line(exc) from None
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except ConfigError as exc:  # this machine's config, not a server: exit 2
            raise OneLineUsageError(f"{_command_path(ctx)}: bad configuration: {exc}",
                                    ctx) from None
        except KVStoreError as exc:
            raise click.ClickException(str(exc)) from None
        except BrokenPipeError as exc:
            if not _stdout_closed():  # a socket or pipe of something else: an error
                raise click.ClickException(f"unexpected BrokenPipeError: {exc}") from None
            _quiet_stdout()  # the reader went away (`kvstore stats --watch 1 | head`)
            ctx.exit(1)
        except Exception as exc:  # the promise is one line, not a traceback
            if ctx.meta.get("kvstore.debug"):
                raise
            raise click.ClickException(f"unexpected {type(exc).__name__}: {exc}") from None


def _stdout_closed() -> bool:
    """Whether nobody reads this process's stdout any more (its pipe's reading end is
    closed: poll says POLLERR on the writing end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError):  # no real file behind stdout
        return False


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the pipe it wrote to is closed, and Python's final
    flush of it at exit would raise BrokenPipeError again (with a traceback)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def emit(admin: Admin, results: list[tuple[str, Any]], render: Callable[[str, Any], str],
         json_lines: bool = False) -> None:
    """Print each node's result (JSON list or rendered text), then fail if any node failed.
    ``json_lines`` (``--json --watch``): the list compact on one line, one per refresh
    (click.echo flushes it), so a pipe reader gets JSON Lines."""
    if results and admin.as_json:
        dump = to_json_line if json_lines else to_json
        click.echo(dump([{"server": s, **r} for s, r in results]))
    elif results:
        click.echo("\n\n".join(render(s, r) for s, r in results))
    admin.finish()
