"""``kvstore``: the admin CLI.

Talks to servers over the control plane only (``kvstore.client.rpc.Channel``): an admin
command never starts a Transfer Engine, so it is quick and cannot touch KV bytes.
Each command prints a readable table, or JSON with ``--json`` (always a list with
one object per ``--server``), and fails with one line on stderr and exit 1 (the
server said no, was unreachable or refused the key) or 2 (bad arguments).
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from pathlib import Path

import click

from kvstore.core import protocol as p
from kvstore.cli.admin import Admin, fail, server_options
from kvstore.cli.cluster import cluster_stats, nodes
from kvstore.cli.cluster import etcd_option as cluster_etcd_option
from kvstore.cli.cluster import prefix_option as cluster_prefix_option
from kvstore.cli.entries import (
    LS_PAGE,
    clear,
    demote,
    evict,
    ls,
    pin,
    unpin,
    verify,
)
from kvstore.cli.group import CONTEXT, AdminGroup, OneLineUsageError, emit, one_line
from kvstore.cli.params import FiniteFloatRange
from kvstore.cli.views import stats_view
from kvstore.cli.format import format_count

# Re-exported: these lived here before cli_group.py / cli_entries.py.
__all__ = ["CONTEXT", "LS_PAGE", "AdminGroup", "OneLineUsageError", "bench",
           "clear", "cli", "demo", "demote", "emit", "evict", "health", "keys", "ls", "main", "one_line",
           "pin", "stats", "unpin", "verify"]

log = logging.getLogger(__name__)


@click.group(cls=AdminGroup, context_settings=CONTEXT)
@click.option("--debug", is_flag=True, envvar="KVSTORE_DEBUG",
              help="Log at DEBUG and show tracebacks of unexpected errors.")
@click.version_option(package_name="kvstore", prog_name="kvstore")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Inspect and steer kvstore servers.

    Every command that talks to a server takes --server (repeat it, or list several
    in KVSTORE_CLIENT_SERVER, to address several nodes), the CURVE key options and
    --json. Shell completion: eval "$(_KVSTORE_COMPLETE=bash_source kvstore)".
    """
    ctx.meta["kvstore.debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")


# ------------------------------------------------------------------ stats / health
@cli.command(context_settings=CONTEXT)
@server_options
@click.option("--watch", type=FiniteFloatRange(min=0.1), metavar="SECONDS",
              help="Refresh every SECONDS until interrupted (with --json: JSON Lines, "
                   "one compact list per refresh).")
@click.option("--count", type=click.IntRange(min=1), help="With --watch: stop after COUNT refreshes.")
@click.option("--cluster", is_flag=True, help="Every node registered in etcd, summed and per node.")
@cluster_etcd_option
@cluster_prefix_option
def stats(admin: Admin, watch: float | None, count: int | None, cluster: bool,
          etcd: str | None, prefix: str | None) -> None:
    """Per node and tier: capacity, use, entries, hits, traffic, evictions, leases."""
    if cluster:
        return cluster_stats(admin, etcd, prefix, watch=watch, count=count)
    shown = 0
    while True:
        results = admin.call_each(lambda: p.Stats())
        if watch and not admin.as_json and sys.stdout.isatty():
            click.clear()
        emit(admin, [(s, r["stats"]) for s, r in results],
             lambda s, st: stats_view(s, st), json_lines=bool(watch))
        shown += 1
        if not watch or (count and shown >= count):
            return
        time.sleep(watch)


@cli.command(context_settings=CONTEXT)
@server_options
@click.option("--deep", is_flag=True, help="Also check the index invariants (O(entries)).")
def health(admin: Admin, deep: bool) -> None:
    """Exit 0 if every server answers (and passes --deep), else 1: for probes."""
    results = admin.call_each(lambda: p.Health(deep=deep))
    emit(admin, results, lambda s, r: f"{s}: {r.get('status', 'ok')} "
         f"(up {format_count(round(r.get('uptime_s', 0)))}s)")


# ------------------------------------------------------------------ keys / bench / demo
@cli.command(context_settings=CONTEXT)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="client", show_default=True,
              help="Files are NAME.key (public) and NAME.key_secret.")
@click.option("--force", is_flag=True, help="Overwrite an existing keypair of that name.")
def keys(directory: str, name: str, force: bool) -> None:
    """Generate a CURVE keypair (ZeroMQ certificate files) into DIRECTORY."""
    from kvstore.cli.admin import generate_keypair

    public, secret = generate_keypair(directory, name, force)
    click.echo(f"public key: {public}\nsecret key: {secret}")


def _run_tool(module: str, args: tuple[str, ...]) -> None:
    # tools/ is not part of the installed package; an editable install (or a run from
    # the checkout) has it beside kvstore/, whatever the current directory is.
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "tools" / "__init__.py").exists() and str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        fail(f"{module} is not available ({exc}); run it from a source checkout")
    code = mod.main(list(args))
    sys.exit(code or 0)


_PASS = {**CONTEXT, "ignore_unknown_options": True, "allow_extra_args": True}


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Run the benchmarks (tools.bench; arguments pass through, try --help)."""
    _run_tool("tools.bench", args)


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo(args: tuple[str, ...]) -> None:
    """Run the two-node demo (tools.demo), or with --single-node the single-node
    walk-through (tools.walkthrough); other arguments pass through, try --help."""
    if "--single-node" in args:
        _run_tool("tools.walkthrough", tuple(a for a in args if a != "--single-node"))
    if "-h" in args or "--help" in args:  # before the tool's own usage, which ends the run
        click.echo("kvstore demo --single-node [--tokens N] [--data-dir DIR] [--keep]: "
                   "the single-node walk-through (tools.walkthrough)\n")
    _run_tool("tools.demo", args)



cli.add_command(ls)  # the entry commands: kvstore/cli/entries.py
cli.add_command(evict)
cli.add_command(demote)
cli.add_command(clear)
cli.add_command(pin)
cli.add_command(unpin)
cli.add_command(verify)
cli.add_command(nodes)  # the cluster view: kvstore/cli/cluster.py


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``kvstore``."""
    cli.main(args=argv, prog_name="kvstore")
