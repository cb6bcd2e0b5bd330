"""Raw TE alone, many transfer patterns side by side: how the transfer section's
``TRANSFER_PATTERNS`` (tools/bench/cluster.py) were chosen.

    python -m tools.bench.rawte_sweep [--patterns coalesced,per-block,slices-2,...]
                                      [--quick] [--json PATH]

Runs only the raw-TE system of the transfer section (same two nodes, layouts, prompt
lengths and interleaving; tools/bench/rawte.py has the patterns) and prints each
pattern's get GB/s per point, the winner, and each pattern's geometric mean of its
speed over the winner's: 1.0 would be a pattern that won everywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

from tools.bench import BenchOptions, Row

DEFAULT = ("coalesced", "per-block", "slices-2", "slices-4", "slices-8", "slices-16",
           "threads-2", "threads-4")


def sweep(opts: BenchOptions, patterns: tuple[str, ...]) -> list[Row]:
    from tools.bench.cluster import _run_points, _sizes

    rows: list[Row] = []
    for layout, sizes in _sizes(opts).items():
        _run_points(opts, rows, layout, sizes, ("rawte",), "cpu", "interleaved", patterns)
    return rows


def summarize(rows: list[Row], op: str = "get") -> tuple[list[str], list[list[str]]]:
    """(header, lines) of a table: one line per point with each pattern's GB/s and
    the winner, then the geometric mean of each pattern's GB/s over the winner's."""
    points: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.get("table") == "prompts" and r["op"] == op and r["system"].startswith("rawte-"):
            points.setdefault((r["layout"], r["tokens"]), {})[r["system"][6:]] = r["GB/s"]
    patterns = list(dict.fromkeys(p for by in points.values() for p in by))
    lines, rel = [], {p: [] for p in patterns}
    for (layout, tokens), by in points.items():
        best = max(by, key=by.__getitem__)
        for p in patterns:
            rel[p].append(by.get(p, math.nan) / by[best])
        lines.append([layout, str(tokens), *(f"{by.get(p, math.nan):.2f}" for p in patterns),
                      best])
    means = [math.exp(sum(map(math.log, v)) / len(v)) if v else math.nan
             for v in rel.values()]
    lines.append(["geomean / best", "", *(f"{m:.2f}" for m in means), ""])
    return ["layout", "tokens", *patterns, "won"], lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.rawte_sweep",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", default=",".join(DEFAULT))
    parser.add_argument("--quick", action="store_true", help="the quick sizes")
    parser.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = parser.parse_args(argv)
    patterns = tuple(p.strip() for p in args.patterns.split(",") if p.strip())
    with tempfile.TemporaryDirectory(prefix="bench-rawte-") as work:
        rows = sweep(BenchOptions(quick=args.quick, workdir=Path(work)), patterns)
    head, lines = summarize(rows)
    print(f"\nraw TE get GB/s (median run), load {os.getloadavg()[0]:.1f}")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for line in lines:
        print("| " + " | ".join(line) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_avg": os.getloadavg(), "rows": rows},
                                              indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
