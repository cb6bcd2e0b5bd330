"""How the ``kvstore`` CLI shows stats and entry listings as text (pure functions)."""

from __future__ import annotations

from typing import Any, Mapping

from kvstore.cli.format import (format_bytes, format_count, format_duration, format_ratio,
                                render_pairs, render_table)
from kvstore.core.protocol import TIER_ORDER

SORT_FIELDS = ("age", "last-access", "size", "tier", "pins", "pending", "key", "prompt")
ENTRY_HEADERS = ("KEY", "TIER", "SIZE", "TOKENS", "AGE", "IDLE", "PINS", "PENDING", "NS")
NS_SHOWN = 8  # hex digits of the namespace tag in the table (--json has all 16)


# ------------------------------------------------------------------ stats
def stats_view(server: str, st: Mapping[str, Any]) -> str:
    """One node's stats: a per-tier table, then the node-wide counters."""
    # HIT%: blocks served from this tier / every block looked up (hits + misses), so
    # the tiers' rates add up to the node's; IN: committed into the tier by writers,
    # OUT: served to readers from where each entry was found (docs/operations.md).
    table = render_table(["TIER", "CAPACITY", "USED", "USED%", "ENTRIES", "HITS", "HIT%",
                          "IN", "OUT"], _tier_rows(st))
    return "\n".join([node_header(server, st), table, "", render_pairs(_counter_pairs(st))])


def _tier_rows(st: Mapping[str, Any]) -> list[list[str]]:
    """One row per tier (fastest first), then the node's total."""
    hits, misses = st.get("hits", 0), st.get("misses", 0)
    lookups = hits + misses
    tiers = st.get("tiers", {})
    rows = []
    for name in sorted(tiers, key=lambda t: TIER_ORDER.index(t) if t in TIER_ORDER else 9):
        t = tiers[name]
        rows.append([name, format_bytes(t.get("capacity")), format_bytes(t.get("used")),
                     format_ratio(t.get("used", 0), t.get("capacity", 0)),
                     format_count(t.get("entries")), format_count(t.get("hits")),
                     format_ratio(t.get("hits", 0), lookups), format_bytes(t.get("bytes_in")),
                     format_bytes(t.get("bytes_out"))])
    cap = sum(t.get("capacity", 0) for t in tiers.values())
    used = sum(t.get("used", 0) for t in tiers.values())
    rows.append(["total", format_bytes(cap), format_bytes(used), format_ratio(used, cap),
                 format_count(st.get("entries")), format_count(hits),
                 format_ratio(hits, lookups), format_bytes(st.get("bytes_in")),
                 format_bytes(st.get("bytes_out"))])
    return rows


def _counter_pairs(st: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The node-wide counters as (label, value) lines."""
    hits, misses = st.get("hits", 0), st.get("misses", 0)
    lookups = hits + misses
    pairs = [
        ("hits / misses", f"{format_count(hits)} / {format_count(misses)} "
                          f"(hit rate {format_ratio(hits, lookups)})"),
        ("bytes in / out", f"{format_bytes(st.get('bytes_in'))} / "
                           f"{format_bytes(st.get('bytes_out'))}"),
        ("evictions", format_count(st.get("evictions"))),
        ("demotions / promotions", f"{format_count(st.get('demotions'))} / "
                                   f"{format_count(st.get('stagings', st.get('promotions')))}"),
        ("checksum failures", format_count(st.get("checksum_failures", 0)
                                           + st.get("commit_checksum_failures", 0))),
        ("open leases", f"{format_count(st.get('leases'))} "
                        f"({format_count(st.get('leased_entries'))} entries)"),
        ("open reservations", format_count(st.get("reservations"))),
        ("pinned entries", format_count(st.get("pinned_entries"))),
        ("expired reservations / leases", f"{format_count(st.get('reservations_expired'))} / "
                                          f"{format_count(st.get('leases_expired'))}"),
    ]
    if "requests" in st:
        pairs.append(("requests (errors)", f"{format_count(st['requests'])} "
                                           f"({format_count(st.get('errors'))})"))
    if "busy" in st or "late_writes" in st:  # (servers before these counters: neither)
        pairs.append(("busy / late writes / reads", f"{format_count(st.get('busy'))} / "
                      f"{format_count(st.get('late_writes'))} / "
                      f"{format_count(st.get('late_reads'))}"))
    return pairs


def node_header(server: str, st: Mapping[str, Any]) -> str:
    up = st.get("uptime_s")
    return f"{server}" + (f"  (up {format_duration(up)})" if up is not None else "")


# ------------------------------------------------------------------ ls
def sort_entries(entries: list[dict], by: str, reverse: bool,
                 prompt_order: list[bytes] | None) -> list[dict]:
    """Entries ordered by a ``SORT_FIELDS`` name; ``age`` means oldest first."""
    if by == "prompt":
        if prompt_order is None:
            by = "age"
        else:
            pos = {k: i for i, k in enumerate(prompt_order)}
            return sorted(entries, key=lambda e: pos.get(e["key"], len(pos)), reverse=reverse)
    keys = {
        "age": lambda e: e.get("created", 0.0),
        "last-access": lambda e: e.get("last_access", 0.0),
        "size": lambda e: e.get("nbytes", 0),
        "tier": lambda e: (TIER_ORDER.index(e["tier"]) if e.get("tier") in TIER_ORDER else 9,
                           e.get("last_access", 0.0)),
        "pins": lambda e: e.get("pins", 0),
        "pending": lambda e: e.get("pending", 0),
        "key": lambda e: e["key"],
    }
    return sorted(entries, key=keys[by], reverse=reverse)


def entry_row(e: Mapping[str, Any]) -> list[str]:
    return [e["key"], str(e.get("tier")), format_bytes(e.get("nbytes")),
            format_count(e.get("ntokens")), format_duration(e.get("age_s")),
            format_duration(e.get("idle_s")), format_count(e.get("pins")),
            format_count(e.get("pending")), (e.get("namespace") or "-")[:NS_SHOWN]]


def ls_table(server: str, result: Mapping[str, Any]) -> str:
    entries = result["entries"]
    head = f"{server}: {len(entries)} of {result['total']} entries"
    if result.get("offset"):
        head += f" (from #{result['offset']})"
    if "prompt_blocks" in result:
        head += (f"; the prompt has {result['prompt_blocks']} blocks, the first "
                 f"{result['stored_prefix_blocks']} stored")
    if not entries:
        return head
    return head + "\n" + render_table(ENTRY_HEADERS, [entry_row(e) for e in entries])
