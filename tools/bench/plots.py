"""PNG plots of the two-node benchmark rows (matplotlib, Agg: no display needed).

``render(section, rows, outdir)`` is called by tools/bench/cluster.py after each
section (into ``bench-results/img/``); ``python -m tools.bench.plots [bench-results]
[--out DIR]`` re-renders from the JSON files a run left behind (default DIR:
``<results>/img``; docs/img only when named), ``--markdown`` prints the docs' table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg"): the backend must be chosen first

Row = dict[str, Any]
RAW = "rawte-"  # raw TE's systems, one per transfer pattern (tools/bench/rawte.py)
STYLE = {"kvstore": ("tab:blue", "o", "-"), "mooncake": ("tab:orange", "s", "-")}
RAW_STYLES = [("tab:green", "^", "-"), ("tab:olive", "v", "--"), ("tab:cyan", "<", ":"),
              ("tab:purple", ">", "-."), ("tab:gray", "x", "--")]
LABEL = {"kvstore": "kvstore", "mooncake": "Mooncake Store"}


def line_style(system: str, raw_index: int) -> tuple[str, str, str]:
    if system.startswith(RAW):
        return RAW_STYLES[raw_index % len(RAW_STYLES)]
    return STYLE.get(system, ("gray", "x", "-"))


def label(system: str) -> str:
    return f"raw TE, {system[len(RAW):]}" if system.startswith(RAW) else LABEL.get(system, system)


def render(section: str, rows: list[Row], outdir: Path) -> list[Path]:
    outdir.mkdir(parents=True, exist_ok=True)
    if section.startswith("transfer"):
        return [*_transfer(rows, outdir, section)]
    if section == "entries":
        return [_entries(rows, outdir)]
    return []


def _series(rows: list[Row], table: str, x: str, y: str, **match: Any) -> dict[str, tuple]:
    out: dict[str, tuple[list, list]] = {}
    for r in rows:
        if r.get("table") == table and all(r.get(k) == v for k, v in match.items()):
            xs, ys = out.setdefault(r["system"], ([], []))
            xs.append(r[x])
            ys.append(r[y])
    return out


def _plot(ax, series: dict[str, tuple], ylabel: str, title: str, logy: bool = False) -> None:
    raw = [s for s in series if s.startswith(RAW)]
    for system, (xs, ys) in series.items():
        color, marker, line = line_style(system, raw.index(system) if system in raw else 0)
        ax.plot(xs, ys, marker=marker, color=color, ls=line, label=label(system))
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)


def _transfer(rows: list[Row], outdir: Path, section: str) -> list[Path]:
    paths = []
    layouts = sorted({r["layout"] for r in rows if r.get("table") == "prompts"})
    for layout in layouts:
        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        for ax, op in zip(axes[0], ("put", "get")):
            _plot(ax, _series(rows, "prompts", "tokens", "GB/s", layout=layout, op=op),
                  "GB/s (median run)", f"{op}: throughput, {layout} layout")
        _plot(axes[1][0], _series(rows, "prompts", "tokens", "p50 ms", layout=layout,
                                  op="put+get"),
              "ms per prompt (p50)", f"put + get latency, {layout} layout", logy=True)
        _plot(axes[1][1], _series(rows, "prompts", "tokens", "CPU s/GB", layout=layout,
                                  op="put+get"),
              "CPU s per GB (all processes)", f"put + get CPU cost, {layout} layout")
        for ax in axes[1]:
            ax.set_xlabel("prompt tokens")
        axes[0][0].legend()
        fig.tight_layout()
        path = outdir / f"{section}-{layout}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    paths.append(_ratio_plot(rows, outdir, section))
    return paths


def _ratio_plot(rows: list[Row], outdir: Path, section: str) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r_key, style in (("kv/rawte", "-"), ("kv/mooncake", "--")):
        for layout in sorted({r["layout"] for r in rows if r.get("table") == "ratios"}):
            pts = [(r["tokens"], r[r_key]) for r in rows if r.get("table") == "ratios"
                   and r["layout"] == layout and r["op"] == "get" and not math.isnan(r[r_key])]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, style, marker="o", label=f"get, {layout}: {r_key}"
                        + (" (best pattern)" if r_key == "kv/rawte" else ""))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.9, color="gray", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("kvstore GB/s / other GB/s")
    ax.set_title("kvstore relative to the fastest raw-TE pattern (floor) and Mooncake Store;"
                 " > 1: kvstore faster", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = outdir / f"{section}-ratios.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _entries(rows: list[Row], outdir: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, op in zip(axes[:2], ("put", "get")):
        _plot(ax, _series(rows, "entries", "entries", "p50 ms", op=op), "ms per prompt (p50)",
              f"{op} latency vs entries held")
    rss = _series(rows, "entries", "entries", "store RSS MiB", op="get")
    for system in [s for s in rss if s.startswith(RAW)]:
        rss.pop(system)  # no index: its "store" is just the producer's buffer
    _plot(axes[2], rss, "MiB", "RSS: kvstore-server (index + touched arena) / mooncake_master")
    for ax in axes:
        ax.set_xscale("symlog", base=2, linthresh=1024)
        ax.set_xlabel("entries held")
    axes[0].legend()
    fig.tight_layout()
    path = outdir / "entries.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown(rows: list[Row]) -> str:
    """The transfer rows as the docs' table: one line per (layout, tokens, op), each
    raw-TE pattern's GB/s, and kvstore against the fastest of them (named)."""
    cells: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        if r.get("table") == "prompts":
            # solo points (one system at a time, tools/bench/cluster.py) are marked
            tokens = f"{r['tokens']} (solo)" if r.get("mode") == "solo" else r["tokens"]
            cells.setdefault((r["layout"], tokens, r["MiB"], r["op"]), {})[r["system"]] = r
    raw = list(dict.fromkeys(s for by in cells.values() for s in by if s.startswith(RAW)))
    names = [s[len(RAW):] for s in raw]
    head = ("| layout | tokens | MiB | op | kvstore GB/s | Mooncake GB/s | raw TE GB/s: "
            + " / ".join(names) + " | best raw TE | kv/Mooncake | kv/best raw TE "
            "| p50 / max ms kvstore | p50 / max ms Mooncake | p50 / max ms best raw TE "
            "| CPU s/GB kv / Mc / best TE | runs |")
    lines = [head, "|" + "---|" * 15]
    nan = math.nan
    for (layout, tokens, mib, op), by in cells.items():
        kv, mc = by.get("kvstore", {}), by.get("mooncake", {})
        speeds = {s: by[s]["GB/s"] for s in raw if s in by}
        best = max(speeds, key=speeds.__getitem__) if speeds else None
        te = by.get(best, {}) if best else {}
        g = [x.get("GB/s", nan) for x in (kv, mc, te)]
        # max, not p99: a point has 2 - 40 runs (tools/bench/cluster_run.py: Samples.row)
        lat = [f"{x.get('p50 ms', nan):.0f} / {x.get('max ms', nan):.0f}" for x in (kv, mc, te)]
        runs = "/".join(str(x.get("runs", "-")) for x in (kv, mc, te))
        cpu = " / ".join(f"{x.get('CPU s/GB', nan):.2f}" for x in (kv, mc, te))
        each = " / ".join(f"{speeds.get(s, nan):.2f}" for s in raw)
        lines.append(f"| {layout} | {tokens} | {mib:g} | {op} | {g[0]:.2f} | {g[1]:.2f} | "
                     f"{each} | {best[len(RAW):] if best else '-'} | {_div(g[0], g[1])} | "
                     f"{_div(g[0], g[2])} | {lat[0]} | {lat[1]} | {lat[2]} | {cpu} | {runs} |")
    return "\n".join(lines)


def _div(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and not math.isnan(b) else "nan"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default="bench-results")
    parser.add_argument("--out", default=None,
                        help="where to draw (default: RESULTS/img; docs/img only when named)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the transfer results as the docs' markdown table")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads((Path(args.results) / "transfer.json").read_text())["rows"]))
        return 0
    out = Path(args.out) if args.out else Path(args.results) / "img"
    for path in sorted(Path(args.results).glob("*.json")):
        doc = json.loads(path.read_text())
        for png in render(doc.get("section", path.stem), doc.get("rows", []), out):
            print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
