"""``kvstore``: the admin CLI.

Talks to servers over the control plane only (``kvstore.rpc.Channel``): an admin
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
from typing import Any, Callable

import click

from kvstore import protocol as p
from kvstore.cli_admin import (Admin, KeyType, NamespaceType, SizeType, TokensType, fail,
                               has_model_options, namespace_tag, prompt_keys, prompt_options,
                               server_options)
from kvstore.cli_cluster import cluster_stats, nodes
from kvstore.cli_cluster import etcd_option as cluster_etcd_option
from kvstore.cli_cluster import prefix_option as cluster_prefix_option
from kvstore.cli_views import SORT_FIELDS, ls_table, sort_entries, stats_view
from kvstore.cliformat import format_bytes, format_count, parse_duration, to_json
from kvstore.errors import KVStoreError

log = logging.getLogger(__name__)
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
LS_PAGE = 1000
VERIFY_BATCH = 512


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


class AdminGroup(click.Group):
    """Turns any error a command lets escape into one line, never a traceback: exit 1
    (the server said no, or was unreachable), or exit 2 for bad arguments - click's
    own usage errors included, shown without its usage block."""

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
        except KVStoreError as exc:
            raise click.ClickException(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the promise is one line, not a traceback
            if ctx.meta.get("kvstore.debug"):
                raise
            raise click.ClickException(f"unexpected {type(exc).__name__}: {exc}") from None


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


def emit(admin: Admin, results: list[tuple[str, Any]], render: Callable[[str, Any], str]) -> None:
    """Print each node's result (JSON list or rendered text), then fail if any node failed."""
    if results and admin.as_json:
        click.echo(to_json([{"server": s, **r} for s, r in results]))
    elif results:
        click.echo("\n\n".join(render(s, r) for s, r in results))
    admin.finish()


# ------------------------------------------------------------------ stats / health
@cli.command(context_settings=CONTEXT)
@server_options
@click.option("--watch", type=click.FloatRange(min=0.1), metavar="SECONDS",
              help="Refresh every SECONDS until interrupted.")
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
             lambda s, st: stats_view(s, st))
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


# ------------------------------------------------------------------ ls
@cli.command(context_settings=CONTEXT)
@server_options
@click.option("--tier", type=click.Choice(p.TIERS), help="Only entries on this tier.")
@click.option("--older-than", "older", metavar="DURATION", callback=lambda c, _, v: _dur(v),
              help="Only entries created more than DURATION ago (30s, 5m, 1h30m, 2d).")
@click.option("--newer-than", "newer", metavar="DURATION", callback=lambda c, _, v: _dur(v),
              help="Only entries created less than DURATION ago.")
@click.option("--idle-longer-than", "idle", metavar="DURATION", callback=lambda c, _, v: _dur(v),
              help="Only entries not accessed for DURATION.")
@click.option("--pinned", is_flag=True, help="Only pinned entries.")
@click.option("--namespace", "ns_hex", type=NamespaceType(), metavar="HEX",
              help="Only entries written in this namespace (hex prefix of the NS column; "
                   "or give --model-id/--layers/... without --tokens).")
@prompt_options
@click.option("--sort", "sort_by", type=click.Choice(SORT_FIELDS), default=None,
              help="Sort field [default: prompt order with --tokens, else age].")
@click.option("--reverse", is_flag=True, help="Reverse the sort order.")
@click.option("--limit", type=click.IntRange(min=0), default=50, show_default=True,
              help="Show at most this many entries (0: all).")
@click.option("--offset", type=click.IntRange(min=0), default=0, help="Skip this many first.")
def ls(admin: Admin, tier: str | None, older: float | None, newer: float | None,
       idle: float | None, pinned: bool, ns_hex: str | None, sort_by: str | None,
       reverse: bool, limit: int, offset: int, **prompt: Any) -> None:
    """List entries: tier, size, age, last access, pins, pending consumers, namespace."""
    wanted = None
    if prompt.get("tokens") is None and prompt.get("prompt_file") is None \
            and has_model_options(prompt):
        if ns_hex is not None:
            fail("give --namespace or the model options, not both")
        ns_hex = namespace_tag(prompt).hex()  # the model's namespace, no prompt
    else:
        wanted = prompt_keys(prompt)
    now = time.time()
    results = []
    for server, channel in admin.each():
        entries = _all_entries(channel, tier)
        keep = [e for e in entries if _matches(e, now, older, newer, idle, pinned, wanted)
                and (ns_hex is None or _tag(e).startswith(ns_hex))]
        ordered = sort_entries(keep, sort_by or ("prompt" if wanted else "age"), reverse,
                               wanted.all_keys if wanted else None)
        page = ordered[offset:offset + limit] if limit else ordered[offset:]
        result = {"total": len(keep), "offset": offset,
                  "entries": [_public(e, now) for e in page]}
        if wanted is not None:
            result["prompt_blocks"] = len(wanted.keys)
            result["stored_prefix_blocks"] = _stored_prefix(wanted.keys, keep)
        results.append((server, result))
    emit(admin, results, ls_table)


def _dur(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _all_entries(channel: Any, tier: str | None) -> list[dict]:
    out: list[dict] = []
    cursor: int | None = 0
    while cursor is not None:
        reply = channel.call(p.Ls(tier=tier, cursor=cursor, limit=LS_PAGE))
        out.extend(reply["entries"])
        cursor = reply.get("next")
    return out


def _stored_prefix(chain: list[bytes], entries: list[dict]) -> int:
    """How many of the prompt's leading blocks are stored (what a select would get)."""
    stored = {e["key"] for e in entries}
    n = 0
    while n < len(chain) and chain[n] in stored:
        n += 1
    return n


def _matches(e: dict, now: float, older: float | None, newer: float | None,
             idle: float | None, pinned: bool, wanted: Any) -> bool:
    age = now - e.get("created", now)
    return ((older is None or age > older) and (newer is None or age < newer)
            and (idle is None or now - e.get("last_access", now) > idle)
            and (not pinned or e.get("pins", 0) > 0)
            and (wanted is None or e["key"] in wanted.position))


def _tag(e: dict) -> str:
    """An entry's namespace tag as hex; "" for entries written without one."""
    tag = e.get("namespace") or b""
    return tag.hex() if isinstance(tag, bytes) else ""


def _public(e: dict, now: float) -> dict:
    """An entry for output: hex key, ages in seconds; offsets and tokens left out."""
    return {"key": e["key"].hex(), "tier": e.get("tier"), "nbytes": e.get("nbytes"),
            "ntokens": e.get("ntokens"), "created": e.get("created"),
            "last_access": e.get("last_access"), "age_s": now - e.get("created", now),
            "idle_s": now - e.get("last_access", now), "pins": e.get("pins"),
            "pending": e.get("pending"), "checksum": e.get("checksum"), "namespace": _tag(e)}


# ------------------------------------------------------------------ evict / clear
@cli.command(context_settings=CONTEXT)
@server_options
@click.option("--tier", type=click.Choice(p.TIERS), help="Only from this tier.")
@click.option("--bytes", "nbytes", type=SizeType(), help="Free this much, LRU first (1GiB).")
@click.option("--fraction", type=click.FloatRange(0, 1, min_open=True),
              help="Free this fraction of the (tier's) entries' bytes, LRU first.")
@click.option("--key", "keys", type=KeyType(), multiple=True, help="This entry (hex); repeatable.")
@click.option("--prefix", "prefix", type=TokensType(), metavar="TOKENS",
              help="The entries of this prompt (token ids; same as --tokens).")
@click.option("--all", "everything", is_flag=True, help="Every entry (of --tier).")
@prompt_options
@click.option("--dry-run", is_flag=True, help="Only show what would go.")
def evict(admin: Admin, tier: str | None, nbytes: int | None, fraction: float | None,
          keys: tuple[bytes, ...], prefix: list[int] | None, everything: bool, dry_run: bool,
          **prompt: Any) -> None:
    """Remove entries for good, least recently used first; pinned and leased stay.

    Select exactly one way: --bytes, --fraction, --key, a prompt (--prefix/--tokens
    or --prompt-file, with the model options), or --all.
    """
    if prefix is not None:
        if prompt.get("tokens") is not None:
            fail("--prefix and --tokens are the same option; give one")
        prompt["tokens"] = prefix
    wanted = prompt_keys(prompt)
    # A prompt's entries include its hidden-state entry, if the writer stored one.
    selected = list(keys) + (wanted.all_keys if wanted else [])
    chosen = [nbytes is not None, fraction is not None, bool(selected), everything]
    if sum(chosen) != 1:
        fail("give exactly one of --bytes, --fraction, --key/--prefix, --all")
    results = admin.call_each(lambda: p.Evict(
        tier=tier, nbytes=nbytes, fraction=fraction, keys=tuple(selected) or None,
        everything=everything, dry_run=dry_run))
    verb = "would evict" if dry_run else "evicted"
    emit(admin, [(s, {**r, "dry_run": dry_run, "keys": [k.hex() for k in r["keys"]]})
                 for s, r in results],
         lambda s, r: _removed_text(s, verb, r, dry_run))


def _removed_text(server: str, verb: str, reply: dict, show_keys: bool) -> str:
    count, keys = reply["count"], reply.get("keys", [])
    text = f"{server}: {verb} {format_count(count)} entries, {format_bytes(reply['nbytes'])}"
    if reply.get("skipped"):
        text += f" ({format_count(reply['skipped'])} pinned or being read, kept)"
    if show_keys and keys:
        text += "\n" + "\n".join(f"  {k}" for k in keys)
        if count > len(keys):
            text += f"\n  ... and {count - len(keys)} more"
    return text


@cli.command(context_settings=CONTEXT)
@server_options
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def clear(admin: Admin, yes: bool) -> None:
    """Remove every entry on every tier (pinned too; entries being read stay)."""
    if not yes:
        click.confirm(f"Remove every entry on {', '.join(admin.servers)}?", abort=True,
                      err=True)
    results = admin.call_each(lambda: p.Clear())
    emit(admin, results, lambda s, r: _removed_text(s, "cleared", r, False))


# ------------------------------------------------------------------ pin / unpin
def _pin_command(name: str, req_cls: type, doc: str) -> None:
    @cli.command(name, context_settings=CONTEXT, help=doc)
    @server_options
    @click.option("--key", "keys", type=KeyType(), multiple=True, help="Entry key (hex); repeatable.")
    @prompt_options
    def command(admin: Admin, keys: tuple[bytes, ...], **prompt: Any) -> None:
        wanted = prompt_keys(prompt)
        selected = list(keys) + (wanted.keys if wanted else [])
        if not selected:
            fail("give --key or --tokens/--prompt-file")
        results = admin.call_each(lambda: req_cls(keys=tuple(selected)))
        past = "pinned" if name == "pin" else "unpinned"
        emit(admin, results, lambda s, r: f"{s}: {past} {r['count']} entries")


_pin_command("pin", p.Pin, "Pin entries: they never demote or get evicted until unpinned.")
_pin_command("unpin", p.Unpin, "Undo one pin of each entry.")


# ------------------------------------------------------------------ verify
@cli.command(context_settings=CONTEXT)
@server_options
def verify(admin: Admin) -> None:
    """Re-check every entry's checksum; report and drop the bad ones."""
    results = []
    for server, channel in admin.each():
        results.append((server, _verify_node(admin, server, channel)))
    emit(admin, results, lambda s, r: f"{s}: checked {format_count(r['checked'])} entries, "
         f"{len(r['bad'])} bad" + "".join(f"\n  dropped {k}" for k in r["bad"]))
    if any(r["bad"] for _, r in results):
        sys.exit(1)


def _verify_node(admin: Admin, server: str, channel: Any) -> dict:
    """Verify one node in batches of keys: real progress, and the server's store lock
    is held for one batch at a time, never for a whole tier's read."""
    keys = [e["key"] for e in _all_entries(channel, None)]
    checked, bad = 0, []
    with click.progressbar(length=len(keys), label=f"verifying {server}", file=sys.stderr,
                           hidden=admin.as_json or not sys.stderr.isatty()) as bar:
        for start in range(0, len(keys), VERIFY_BATCH):
            batch = tuple(keys[start:start + VERIFY_BATCH])
            reply = channel.call(p.Verify(keys=batch))
            checked += reply["checked"]
            bad += [k.hex() for k in reply["bad"]]
            bar.update(len(batch))
    return {"checked": checked, "bad": bad}


# ------------------------------------------------------------------ keys / bench / demo
@cli.command(context_settings=CONTEXT)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="client", show_default=True,
              help="Files are NAME.key (public) and NAME.key_secret.")
@click.option("--force", is_flag=True, help="Overwrite an existing keypair of that name.")
def keys(directory: str, name: str, force: bool) -> None:
    """Generate a CURVE keypair (ZeroMQ certificate files) into DIRECTORY."""
    from kvstore.cli_admin import generate_keypair

    public, secret = generate_keypair(directory, name, force)
    click.echo(f"public key: {public}\nsecret key: {secret}")


def _run_tool(module: str, args: tuple[str, ...]) -> None:
    # tools/ is not part of the installed package; an editable install (or a run from
    # the checkout) has it beside kvstore/, whatever the current directory is.
    checkout = Path(__file__).resolve().parent.parent
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


cli.add_command(nodes)  # the cluster view: kvstore/cli_cluster.py


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``kvstore``."""
    cli.main(args=argv, prog_name="kvstore")
if __name__ == "__main__":
    main()
