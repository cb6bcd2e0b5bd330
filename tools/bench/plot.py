"""Plots from ``python -m tools.bench --json`` output, for docs/benchmarks.md.

    python -m tools.bench.plot run.json [more.json ...] --out docs/img

Draws ``bench-ratios.png`` (every throughput-ratio column of every table: kvstore
against its plain baseline, 1.0 = as fast) and, when the index section is present,
``bench-index.png`` (single-entry ops/s and bytes per entry against entries held).
Later files win where two hold the same section.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # after use("Agg")


def is_ratio(column: str) -> bool:
    """Throughput ratios (``store/memcpy``, ``kvstore/plain``, ``store/lmdb``); not
    rates (``GB/s``, ``ops /s``), sizes (``B/entry``) or time ratios (``... time``)."""
    return ("/" in column and not column.endswith(("/s", "time")) and "B/" not in column)


def load(paths: list[Path]) -> dict[str, Any]:
    sections: dict[str, Any] = {}
    for path in paths:
        sections.update(json.loads(path.read_text())["sections"])
    return {k: v for k, v in sections.items() if isinstance(v, list)}  # skip failed ones


def ratio_bars(sections: dict[str, Any]) -> list[tuple[str, float]]:
    bars = []
    for name, rows in sections.items():
        for row in rows:
            for col, value in row.items():
                if is_ratio(col) and isinstance(value, (int, float)):
                    label = row.get("op") or row.get("input") or f"{row.get('entries', 0):,} entries"
                    size = f", {row['entry KiB']:g} KiB" if "entry KiB" in row else ""
                    bars.append((f"{name}: {label}{size} ({col})", float(value)))
    return bars


def plot_ratios(bars: list[tuple[str, float]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(bars) + 1.2))
    labels, values = zip(*reversed(bars))
    ax.barh(range(len(values)), values, color="#4477aa")
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("kvstore throughput / plain baseline throughput (1.0 = as fast)")
    ax.set_title("kvstore vs plain baselines (best of runs, 2 shared cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_index(rows: list[dict[str, Any]], out: Path) -> None:
    n = [r["entries"] for r in rows]
    fig, (ops, mem) = plt.subplots(1, 2, figsize=(10, 3.6))
    for col in ("acquire+release /s", "reserve+commit /s", "lmdb txn /s"):
        ops.plot(n, [r[col] for r in rows], marker="o", label=col)
    ops.set(xscale="log", yscale="log", xlabel="entries held", ylabel="single-entry ops/s")
    ops.legend(fontsize=7)
    for col in ("RSS B/entry", "LMDB B/entry"):
        mem.plot(n, [r[col] for r in rows], marker="o", label=col)
    mem.set(xscale="log", xlabel="entries held", ylabel="bytes per entry", ylim=(0, None))
    mem.legend(fontsize=7)
    fig.suptitle("index cost vs entries held", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sections = load(args.json)
    written = []
    bars = ratio_bars(sections)
    if bars:
        plot_ratios(bars, args.out / "bench-ratios.png")
        written.append("bench-ratios.png")
    if sections.get("index"):
        plot_index(sections["index"], args.out / "bench-index.png")
        written.append("bench-index.png")
    print(f"wrote {', '.join(written) or 'nothing'} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
