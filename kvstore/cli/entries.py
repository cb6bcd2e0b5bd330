"""The ``kvstore`` commands that act on stored entries: ls, evict, clear, pin,
unpin, verify. Each addresses every ``--server`` and reports per node (cli_group.emit).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from kvstore.core import protocol as p
from kvstore.core.errors import KVStoreError
from kvstore.cli.admin import Admin, server_options
from kvstore.cli.group import CONTEXT, emit
from kvstore.cli.params import FiniteFloatRange, KeyType, NamespaceType, SizeType, TokensType, fail
from kvstore.cli.prompt import has_model_options, namespace_tag, prompt_keys, prompt_options
from kvstore.cli.views import SORT_FIELDS, ls_table, sort_entries
from kvstore.cli.format import format_bytes, format_count, parse_duration

LS_PAGE = 1000


# ------------------------------------------------------------------ ls
@click.command(context_settings=CONTEXT)
@server_options
@click.option("--tier", type=click.Choice(p.TIER_ORDER), help="Only entries on this tier.")
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

    def listing(server: str, channel: Any) -> dict:
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
        return result

    # Admin.map: a node that fails (down, timed out, said no) is one error line and
    # exit 1 after the others' listings, as for stats and the rest.
    emit(admin, admin.map(listing), ls_table)


def _dur(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _all_entries(channel: Any, tier: str | None) -> list[dict]:
    out: list[dict] = []
    cursor: bytes | None = None
    while True:
        reply = channel.call(p.Ls(tier=tier, cursor=cursor, limit=LS_PAGE))
        out.extend(reply["entries"])
        cursor = reply.get("next")
        if cursor is None:
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
@click.command(context_settings=CONTEXT)
@server_options
@click.option("--tier", type=click.Choice(p.TIER_ORDER), help="Only from this tier.")
@click.option("--bytes", "nbytes", type=SizeType(), help="Free this much, LRU first (1GiB).")
@click.option("--fraction", type=FiniteFloatRange(0, 1, min_open=True),
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
    selected = _selected(keys, prefix, nbytes, fraction, everything, prompt)
    results = admin.call_each(lambda: p.Evict(
        tier=tier, nbytes=nbytes, fraction=fraction, keys=tuple(selected) or None,
        everything=everything, dry_run=dry_run))
    verb = "would evict" if dry_run else "evicted"
    emit(admin, [(s, {**r, "dry_run": dry_run, "keys": [k.hex() for k in r["keys"]]})
                 for s, r in results],
         lambda s, r: _removed_text(s, verb, r, dry_run))
    _named_found(admin, selected, results, tier)


def _named_found(admin: Admin, selected: list[bytes], results: list[tuple[str, dict]],
                 tier: str | None) -> None:
    """Entries named by key or prompt of which no server asked holds one (none
    chosen, none kept as pinned or being read): a stderr line and exit 1, as for a
    server that said no (a script's ``evict --key K || ...`` learns K is not there).
    Some of them stored is success: a prompt's hidden-state entry may never have been
    written."""
    if not selected or any(r["count"] or r.get("skipped") for _, r in results):
        return
    where = f"in the {tier} tier of" if tier else "on"
    click.echo(f"kvstore evict: none of the {len(selected)} entries named is stored {where} "
               f"{', '.join(admin.servers)}", err=True)
    sys.exit(1)


def _selected(keys: tuple[bytes, ...], prefix: list[int] | None, nbytes: int | None,
              fraction: float | None, everything: bool, prompt: dict) -> list[bytes]:
    """The keys named by --key and a prompt; exactly one way of choosing, or exit 2."""
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
    return selected


@click.command(context_settings=CONTEXT)
@server_options
@click.option("--tier", type=click.Choice(["gpu", "dram"]), help="Only from this tier.")
@click.option("--bytes", "nbytes", type=SizeType(), help="Move this much down, LRU first (1GiB).")
@click.option("--fraction", type=FiniteFloatRange(0, 1, min_open=True),
              help="Move this fraction of the (tier's) entries' bytes down, LRU first.")
@click.option("--key", "keys", type=KeyType(), multiple=True, help="This entry (hex); repeatable.")
@click.option("--prefix", "prefix", type=TokensType(), metavar="TOKENS",
              help="The entries of this prompt (token ids; same as --tokens).")
@click.option("--all", "everything", is_flag=True, help="Every entry (of --tier).")
@prompt_options
@click.option("--dry-run", is_flag=True, help="Only show what would move.")
def demote(admin: Admin, tier: str | None, nbytes: int | None, fraction: float | None,
           keys: tuple[bytes, ...], prefix: list[int] | None, everything: bool, dry_run: bool,
           **prompt: Any) -> None:
    """Move entries one tier down (gpu -> dram -> nvme), least recently used first,
    instead of removing them (evict does that); pinned and leased stay.

    Select exactly one way, as for evict. An entry no lower tier has room for is
    evicted, as under memory pressure (the output counts them). Entries on the
    last tier have nothing below and are never chosen.
    """
    selected = _selected(keys, prefix, nbytes, fraction, everything, prompt)
    results = admin.call_each(lambda: p.Demote(
        tier=tier, nbytes=nbytes, fraction=fraction, keys=tuple(selected) or None,
        everything=everything, dry_run=dry_run))
    emit(admin, [(s, {**r, "dry_run": dry_run, "keys": [k.hex() for k in r["keys"]]})
                 for s, r in results],
         lambda s, r: _demoted_text(s, r, dry_run))


def _demoted_text(server: str, reply: dict, dry_run: bool) -> str:
    if dry_run:
        return _removed_text(server, "would demote", reply, True)
    text = (f"{server}: demoted {format_count(reply['demoted'])} entries, "
            f"{format_bytes(reply['nbytes'])}")
    if reply.get("evicted"):
        text += f"; {format_count(reply['evicted'])} evicted (no room below)"
    if reply.get("skipped"):
        text += f" ({format_count(reply['skipped'])} pinned or being read, kept)"
    return text


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


@click.command(context_settings=CONTEXT)
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
def _pin_command(name: str, req_cls: type, doc: str) -> click.Command:
    @click.command(name, context_settings=CONTEXT, help=doc)
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
    return command


pin = _pin_command("pin", p.Pin, "Pin entries: they never demote or get evicted until unpinned.")
unpin = _pin_command("unpin", p.Unpin, "Undo one pin of each entry.")


# ------------------------------------------------------------------ verify
@click.command(context_settings=CONTEXT)
@server_options
def verify(admin: Admin) -> None:
    """Re-check every entry's checksum; report and drop the bad ones."""
    # Admin.map: a node that fails is one error line (exit 1); the others are still
    # verified and reported.
    results = admin.map(lambda server, channel: _verify_node(admin, server, channel))
    emit(admin, results, lambda s, r: f"{s}: checked {format_count(r['checked'])} entries, "
         f"{len(r['bad'])} bad" + "".join(f"\n  dropped {k}" for k in r["bad"]))
    if any(r["bad"] for _, r in results):
        sys.exit(1)


def _verify_node(admin: Admin, server: str, channel: Any) -> dict:
    """Verify one node in batches of keys (``protocol.verify_batches``: 512 keys or
    64 MiB): real progress, and the server's store lock is held for one batch at a
    time, never for a whole tier's read."""
    try:
        entries = _all_entries(channel, None)
    except KVStoreError as exc:
        raise _as_verify(exc) from None
    checked, bad = 0, []
    with click.progressbar(length=len(entries), label=f"verifying {server}",
                           file=sys.stderr,
                           hidden=admin.as_json or not sys.stderr.isatty()) as bar:
        for batch in p.verify_batches(entries):
            reply = channel.call(p.Verify(keys=batch))
            checked += reply["checked"]
            bad += [k.hex() for k in reply["bad"]]
            bar.update(len(batch))
    return {"checked": checked, "bad": bad}


def _as_verify(exc: KVStoreError) -> KVStoreError:
    """An error of verify's listing (``ls`` requests) told as verify's: the operator
    ran verify, not ls ("not reachable within 1s for verify")."""
    text = str(exc)
    for said, meant in ((f" for {p.Ls.OP}", " for verify"), (f" to {p.Ls.OP} ", " to verify ")):
        if said in text:
            text = text.replace(said, meant, 1)
            break
    else:
        text = f"{text} (listing the entries to verify)"
    try:
        return type(exc)(text)
    except Exception:  # noqa: BLE001 - a class that takes other arguments
        return KVStoreError(text)
