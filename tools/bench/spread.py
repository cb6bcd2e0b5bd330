"""How evenly cluster placement spreads prompts that share a template, per rule.

    python -m tools.bench.spread [--quick] [--plots docs/img]

The workload: every prompt is one shared 512-token template (a system prompt or chat
template) plus its own tail of 16..2000 tokens, block 16; the producer stores the
first ``n - 1`` tokens of a prompt of ``n``. Each rule places the stored lists on 3
nodes by rendezvous hashing (the code ClusterClient runs, on node ids alone: no
server, no etcd). Per rule:

* ``max:mean`` and ``cv``: the busiest node's load over the mean, and the
  coefficient of variation across nodes, where a prompt's load on its node is its
  tokens (what its insert and its drop_select move); ``prompts max:mean`` counts
  requests instead;
* ``agree n``, ``agree n-2``: the fraction of prompts whose decode side, asking for
  the whole prompt (one token more than stored) or one token fewer, reaches the node
  that holds them; ``probed``: reads that first ask two homes what they hold.

Rules: today's (``key[min(P, nkeys) - 1]``, P = 1, and P = 64 as the old docs
advised), the new one (kvstore.cluster.placement) at several P, and bounded-load
rendezvous (a node over ``c`` times the mean load passes the prompt to the next one
in its order) given every insert's exact global load, its best case.

Columns avoid "/" so tools.bench.plot does not take them for throughput ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kvstore.cluster.membership import rendezvous_order
from kvstore.cluster.placement import placement_keys
from kvstore.core.config import ClusterConfig
from kvstore.core.hashing import block_keys
from tools.bench import BenchOptions, Row

BLOCK = 16
TEMPLATE_TOKENS = 512
TAILS = (16, 2000)  # tokens after the template, inclusive
NAMESPACE = xxhash.xxh3_128_digest(b"tools.bench.spread")
PLOT_NAME = "cluster-spread.png"
DEFAULT_P = ClusterConfig().placement_blocks


class Prompt(NamedTuple):
    tokens: np.ndarray  # the whole prompt (int32); all but its last token are stored

    @property
    def stored(self) -> np.ndarray:
        return self.tokens[:-1]

    @property
    def shorter(self) -> np.ndarray:  # what a decode side one token short asks for
        return self.tokens[:-2]


class Spread(NamedTuple):
    rule: str
    homes: list[str]  # the producer's node per prompt
    agree_longer: float
    agree_shorter: float
    probed: float  # reads that ask more than one home first


def workload(prompts: int, seed: int = 0) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    template = rng.integers(0, 128_000, TEMPLATE_TOKENS)
    out = []
    for tail in rng.integers(TAILS[0], TAILS[1] + 1, prompts):
        out.append(Prompt(np.concatenate([template, rng.integers(0, 128_000, tail)])
                          .astype("<i4")))
    return out


# ------------------------------------------------------------------ rules
def home(key: bytes, nodes: Sequence[str]) -> str:
    return rendezvous_order(key, nodes)[0]


def old_home(tokens: np.ndarray, p: int, nodes: Sequence[str]) -> str:
    """Today's rule: the key of block ``min(P, nkeys) - 1``, partial or not."""
    keys = block_keys(NAMESPACE, tokens[:p * BLOCK], BLOCK).keys
    return home(keys[-1], nodes)


def old_spread(prompts: list[Prompt], nodes: Sequence[str], p: int) -> Spread:
    homes = [old_home(x.stored, p, nodes) for x in prompts]
    return Spread(f"before: block min(P, nkeys) - 1, P={p}", homes,
                  _mean(old_home(x.tokens, p, nodes) == h for x, h in zip(prompts, homes)),
                  _mean(old_home(x.shorter, p, nodes) == h for x, h in zip(prompts, homes)),
                  0.0)


def new_homes(tokens: np.ndarray, p: int, nodes: Sequence[str]) -> list[str]:
    """The homes a read of this list asks, its own first (ClusterClient._route)."""
    keys = placement_keys(NAMESPACE, tokens, BLOCK, p)
    return list(dict.fromkeys(home(key, nodes) for key in keys))


def new_spread(prompts: list[Prompt], nodes: Sequence[str], p: int) -> Spread:
    homes = [new_homes(x.stored, p, nodes)[0] for x in prompts]
    longer = [new_homes(x.tokens, p, nodes) for x in prompts]
    shorter = [new_homes(x.shorter, p, nodes) for x in prompts]
    label = {1: "P=1 (first block)", DEFAULT_P: f"P={p} (default)"}.get(p, f"P={p}")
    return Spread(f"after: block before the last, {label}", homes,
                  _mean(h in c for h, c in zip(homes, longer)),
                  _mean(h in c for h, c in zip(homes, shorter)),
                  _mean(len(c) > 1 for c in longer))


def bounded_spread(prompts: list[Prompt], nodes: Sequence[str], c: float) -> Spread:
    """First-block rendezvous, skipping nodes over ``c`` x the mean load (global view).
    A consumer cannot know what the producer skipped: it asks the plain home."""
    load = dict.fromkeys(nodes, 0)
    homes, agree = [], []
    for x in prompts:
        order = rendezvous_order(block_keys(NAMESPACE, x.tokens[:BLOCK], BLOCK).keys[0], nodes)
        size = x.stored.size
        cap = c * (sum(load.values()) + size) / len(nodes)
        chosen = next((n for n in order if load[n] + size <= cap), order[0])
        load[chosen] += size
        homes.append(chosen)
        agree.append(chosen == order[0])
    return Spread(f"bounded-load rendezvous, first block, c={c:g}", homes,
                  _mean(agree), _mean(agree), 0.0)


def _mean(flags: object) -> float:
    values = [bool(f) for f in flags]  # type: ignore[attr-defined]
    return sum(values) / len(values) if values else 0.0


# ------------------------------------------------------------------ measuring
def loads(spread: Spread, prompts: list[Prompt], nodes: Sequence[str],
          weight: Callable[[Prompt], int]) -> list[int]:
    per = dict.fromkeys(nodes, 0)
    for node, x in zip(spread.homes, prompts):
        per[node] += weight(x)
    return [per[n] for n in nodes]


def imbalance(values: list[int]) -> tuple[float, float]:
    """(max over mean, coefficient of variation) of per-node loads."""
    mean = statistics.fmean(values)
    return max(values) / mean, statistics.pstdev(values) / mean


def spreads(prompts: list[Prompt], nodes: Sequence[str]) -> list[Spread]:
    return [old_spread(prompts, nodes, 1), old_spread(prompts, nodes, 64),
            *(new_spread(prompts, nodes, p) for p in (1, 32, 64, 256)),
            bounded_spread(prompts, nodes, 1.25)]


Bar = tuple[str, list[float]]  # a rule's label, each node's share of the load


def bench_spread(opts: BenchOptions) -> list[Row]:
    """The section: 10,000 prompts (2,000 with --quick); the plot only where the
    runner was given a plot directory."""
    rows, bars = measure(opts.pick(2_000, 10_000))
    plots = getattr(opts, "plots", None)
    if plots is not None:
        plot(bars, str(rows[0]["table"]), Path(plots) / PLOT_NAME)
    return rows


def measure(count: int, nodes: int = 3) -> tuple[list[Row], list[Bar]]:
    names = [f"node-{i}" for i in range(nodes)]
    prompts = workload(count)
    rows: list[Row] = []
    bars: list[Bar] = []
    for s in spreads(prompts, names):
        tokens = loads(s, prompts, names, lambda x: x.stored.size)
        peak, cv = imbalance(tokens)
        peak_prompts, _ = imbalance(loads(s, prompts, names, lambda x: 1))
        rows.append({"table": f"{count:,} prompts: {TEMPLATE_TOKENS}-token template + "
                              f"{TAILS[0]}..{TAILS[1]}-token tails, block {BLOCK}, "
                              f"{nodes} nodes",
                     "rule": s.rule, "max:mean": peak, "cv": cv,
                     "prompts max:mean": peak_prompts,
                     "node shares": " ".join(f"{t / sum(tokens):.2f}" for t in tokens),
                     "agree n": s.agree_longer, "agree n-2": s.agree_shorter,
                     "probed": s.probed})
        bars.append((f"{s.rule}  (max:mean {peak:.2f}, agree n {s.agree_longer:.3f})",
                     [t / sum(tokens) for t in tokens]))
    return rows, bars


def plot(bars: list[tuple[str, list[float]]], title: str, out: Path) -> None:
    """One stacked bar per rule: each node's share of the load."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # after use("Agg")

    shares = np.array([s for _, s in bars])
    nodes = shares.shape[1]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 1.4))
    left = np.zeros(len(bars))
    for node in range(nodes):
        ax.barh(range(len(bars)), shares[:, node], left=left, label=f"node {node}")
        left += shares[:, node]
    for even in range(1, nodes):
        ax.axvline(even / nodes, color="black", linewidth=0.6, linestyle=":")
    ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"share of the tokens stored and moved, per node (even: 1/{nodes} each)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from tools.bench import print_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 prompts, not 10,000")
    parser.add_argument("--plots", metavar="DIR", type=Path, default=None,
                        help=f"also draw DIR/{PLOT_NAME} (--plots docs/img: the committed "
                             "one); without it nothing is written")
    args = parser.parse_args(argv)
    rows, bars = measure(BenchOptions(quick=args.quick).pick(2_000, 10_000))
    print_rows("spread", rows)
    if args.plots is not None:
        plot(bars, str(rows[0]["table"]), args.plots / PLOT_NAME)
        print(f"\nwrote {args.plots / PLOT_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
