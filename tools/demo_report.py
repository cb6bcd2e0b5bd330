"""The demo's printed report: one row per prompt, then each node's tier occupancy.

Pure formatting of a ``tools.demo.DemoResult``; the word "identical" appears only
when node B's tokens equal the single-process run's tokens exactly.
"""

from __future__ import annotations

from typing import Any

from kvstore.config import format_size


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2g}" if seconds > 0 and nbytes else "-"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()
    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _verdict(run) -> str:
    if run.tokens is None:
        return f"MISS ({run.matched_tokens}/{run.length} tokens found)"
    if run.identical:
        return "identical"
    first = next(i for i, (x, y) in enumerate(zip(run.tokens, run.reference)) if x != y) \
        if len(run.tokens) == len(run.reference) else min(len(run.tokens), len(run.reference))
    return f"DIFFERENT from token {first}"


def _prompt_rows(result) -> list[str]:
    header = ["prompt tokens", "blocks moved", "bytes", "transfer", "GB/s", "prefill (A)",
              "insert (A)", "decode (B)", "B vs single process"]
    rows = [[str(r.length), str(r.blocks), format_size(r.nbytes), _ms(r.transfer_s),
             _gbps(r.nbytes, r.transfer_s), _ms(r.prefill_s), _ms(r.insert_s),
             f"{_ms(r.decode_s)} ({result.decode_tokens + 1} tok)", _verdict(r)]
            for r in result.runs]
    return _table(header, rows)


def _occupancy(stats: dict[str, Any]) -> str:
    tiers = stats.get("tiers") or {}
    parts = [f"{name} {format_size(t.get('used', 0))}/{format_size(t.get('capacity', 0))} "
             f"({t.get('entries', 0)} entries)" for name, t in sorted(tiers.items())]
    return ", ".join(parts) or "(no stats)"


def _occupancy_rows(result) -> list[str]:
    rows = [[when, str(s.get("entries", "-")), _occupancy(s)] for when, s in result.stats.items()]
    return _table(["node", "entries", "tier occupancy (used/capacity)"], rows)


def render(result, elapsed_s: float) -> str:
    where = ("network namespaces" if result.kind == "netns" else "loopback ports (one host)")
    a, b = result.hosts
    identical = sum(r.identical for r in result.runs)
    lines = [
        f"kvstore disaggregated demo: 2 nodes in {where}: A={a} (prefill), B={b} (decode)",
        (f"model: local Llama ({result.dtype}), greedy decode of {result.decode_tokens} tokens "
         "after the first; KV moved A -> B by drop_select over Mooncake TE (TCP)"),
        "",
        *_prompt_rows(result),
        ("transfer: drop_select on B (acquire, TE read, checksum check, release); the first "
         "from a peer includes TE's connection set-up"),
        "",
        *_occupancy_rows(result),
        "",
    ]
    if result.all_identical:
        lines.append(f"node B's tokens are identical to a single-process run for all "
                     f"{len(result.runs)} prompts ({elapsed_s:.1f} s)")
    else:
        lines.append(f"MISMATCH: node B's tokens equal the single-process run for only "
                     f"{identical} of {len(result.runs)} prompts ({elapsed_s:.1f} s)")
    return "\n".join(lines)
