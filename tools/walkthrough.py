"""The single-node walk-through (issue 2): one store, every tier, one restart.

    python -m tools.walkthrough [--tokens 200] [--data-dir DIR] [--keep]

1. Insert prompt A's KV (HF layout, a small model-shaped random tensor) -> DRAM.
2. Read A back from DRAM and compare it with the original tensors.
3. Insert prompt B: DRAM holds one prompt, so the LRU policy demotes A to NVMe.
4. Acquire A: staged from NVMe into DRAM, checksum-verified, compared again
   (staging A in pushes B down to NVMe in turn).
5. Close the store, open a new one on the same data dir: DRAM records are gone,
   NVMe records are kept (B, and A too where staging kept its NVMe copy);
   ``verify()`` re-checks every survivor's checksum and the survivors are read
   back and compared once more.

Every step prints a row; the run fails (exit 1) if any comparison fails.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvstore.core.config import KVStoreConfig, format_size
from kvstore.core.hashing import block_keys, block_token_bytes, checksum, namespace_of
from kvstore.core.layout import KVLayout, pack_hf, unpack_hf
from kvstore.store.facade import Store

LAYOUT = KVLayout(num_layers=4, kv_heads=2, head_dim=32, dtype="bfloat16", block_tokens=16)
MODEL = "walkthrough/tiny-llama-shaped"
PAGE = 4096


class Prompt(NamedTuple):
    name: str
    keys: list[bytes]
    tokens: list[bytes]  # int32le ids of each entry's block
    past: list[tuple[torch.Tensor, torch.Tensor]]  # HF [1, heads, seq, dim] per layer
    ntokens: int


class Step(NamedTuple):
    step: str
    prompt: str
    before: str  # where the prompt's entries were before the step
    after: str
    entries: int
    check: str
    ms: float


def make_prompt(name: str, ntokens: int, seed: int) -> Prompt:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32_000, (ntokens,), generator=g)
    shape = (1, LAYOUT.kv_heads, ntokens, LAYOUT.head_dim)
    past = [(torch.randn(shape, generator=g).to(torch.bfloat16),
             torch.randn(shape, generator=g).to(torch.bfloat16))
            for _ in range(LAYOUT.num_layers)]
    keys = block_keys(namespace_of(MODEL, LAYOUT), ids, LAYOUT.block_tokens).keys
    return Prompt(name, keys, block_token_bytes(ids, LAYOUT.block_tokens), past, ntokens)


def insert(store: Store, p: Prompt) -> None:
    """What a prefill writer does: pack, reserve, copy each entry, commit checksums."""
    data = pack_hf(LAYOUT, p.past).numpy()
    sizes = LAYOUT.entry_sizes(p.ntokens)
    bounds = np.cumsum([0, *sizes])
    chunks = [data[a:b] for a, b in itertools.pairwise(bounds)]
    res = store.reserve(p.keys, sizes, p.tokens)
    for i, place in enumerate(res.placements):
        if place is not None:
            store.write(res.id, i, chunks[i])
    store.commit(res.id, [checksum(c) for c in chunks])


def read_back(store: Store, p: Prompt) -> tuple[list[str], bool]:
    """Acquire, read and unpack; True when every tensor equals the original."""
    acq = store.acquire(p.keys, p.tokens)
    try:
        tiers = [e.tier for e in acq.entries]
        if acq.matched_tokens != p.ntokens:
            return tiers, False
        data = b"".join(store.read(acq.id, i) for i in range(len(acq.entries)))
    finally:
        store.release(acq.id)
    back = unpack_hf(LAYOUT, torch.frombuffer(bytearray(data), dtype=torch.uint8), p.ntokens)
    same = all(torch.equal(k, k2) and torch.equal(v, v2)
               for (k, v), (k2, v2) in zip(p.past, back))
    return tiers, same


def where(store: Store, p: Prompt) -> list[str]:
    return store.lookup(p.keys, p.tokens).tiers


def summarize(tiers: list[str]) -> str:
    if not tiers:
        return "(none)"
    counts = {t: tiers.count(t) for t in dict.fromkeys(tiers)}
    return ", ".join(f"{n} {t}" for t, n in counts.items())


def run(data_dir: Path, ntokens: int) -> list[Step]:
    a, b = make_prompt("A", ntokens, seed=1), make_prompt("B", ntokens, seed=2)
    prompt_bytes = sum(-(-n // PAGE) * PAGE for n in LAYOUT.entry_sizes(ntokens))
    # DRAM holds one prompt (and a bit): a second insert must move the first one down.
    cfg = KVStoreConfig().replace(
        store={"data_dir": str(data_dir)},
        tiers={"dram_bytes": int(prompt_bytes * 1.1) + PAGE, "nvme_bytes": 4 * prompt_bytes})
    steps: list[Step] = []

    def step(name: str, p: Prompt, fn) -> None:
        before = summarize(where(store, p))
        start = time.perf_counter()
        check = fn()
        ms = (time.perf_counter() - start) * 1e3
        steps.append(Step(name, p.name, before, summarize(where(store, p)), len(p.keys),
                          check, ms))

    def verified(p: Prompt) -> str:
        tiers, same = read_back(store, p)
        return f"served from {summarize(tiers)}: {'identical' if same else 'MISMATCH'}"

    def note(name: str, p: Prompt, check: str) -> None:
        now = summarize(where(store, p))
        steps.append(Step(name, p.name, now, now, len(p.keys), check, 0.0))

    store = Store(cfg)
    try:
        step("1 insert", a, lambda: (insert(store, a), "committed")[1])
        step("2 read back", a, lambda: verified(a))
        step("3 insert (demotes A)", b, lambda: (insert(store, b), "committed")[1])
        note("  A after 3", a, f"LRU demotions so far: {store.stats()['demotions']}")
        step("4 acquire (stages A)", a, lambda: verified(a))
        note("  B after 4", b, f"stagings so far: {store.stats()['stagings']}")
        store.check_integrity()
    finally:
        store.close()

    store = Store(cfg)
    try:
        kept = where(store, a)
        note("5 reopen: lookup", a, "kept: staged entries keep their NVMe copy" if kept
             else "dropped: it lived only in DRAM")

        def survivors() -> str:
            v = store.verify()
            return f"verify(): {v.checked} checked, {len(v.bad)} bad"

        step("5 reopen: verify", b, survivors)
        step("5 reopen: read", b, lambda: verified(b))
        if kept:
            step("5 reopen: read", a, lambda: verified(a))
        store.check_integrity()
    finally:
        store.close()
    return steps


def render(steps: list[Step], data_dir: Path, ntokens: int) -> str:
    head = (f"kvstore single-node walk-through: {ntokens}-token prompts, {LAYOUT}, "
            f"{format_size(LAYOUT.nbytes(ntokens))} of KV each, data dir {data_dir}")
    cols = ("step", "prompt", "entries", "tiers before", "tiers after", "check", "ms")
    rows = [(s.step, s.prompt, str(s.entries), s.before, s.after, s.check, f"{s.ms:.1f}")
            for s in steps]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = [head, "", "  ".join(c.ljust(w) for c, w in zip(cols, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def ok(steps: list[Step]) -> bool:
    """The expected story: every read identical, A demoted then staged, A gone and
    B kept after the restart, no bad checksum."""
    by = {s.step: s for s in steps}
    reads = [s for s in steps if s.check.startswith("served from")]
    n = by["1 insert"].entries
    reopened_b = [s for s in steps if s.step == "5 reopen: read" and s.prompt == "B"]
    return (all(s.check.endswith("identical") for s in reads) and len(reads) >= 3
            and by["1 insert"].after == f"{n} dram"
            and by["  A after 3"].after == f"{n} nvme"
            and by["4 acquire (stages A)"].before == f"{n} nvme"
            and by["4 acquire (stages A)"].after == f"{n} dram"
            and by["5 reopen: verify"].check.endswith(" 0 bad")
            and len(reopened_b) == 1 and reopened_b[0].before == f"{n} nvme"
            and reopened_b[0].check.endswith("identical"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.walkthrough", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200,
                        help="prompt length (not a multiple of 16: shows the partial entry)")
    parser.add_argument("--data-dir", help="use this (empty) dir instead of a temp one")
    parser.add_argument("--keep", action="store_true", help="keep the data dir afterwards")
    args = parser.parse_args(argv)
    if args.tokens <= 0:
        parser.error("--tokens must be > 0")
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="kvstore-walkthrough-"))
    try:
        steps = run(data_dir, args.tokens)
    finally:
        if not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)
    print(render(steps, data_dir, args.tokens))
    good = ok(steps)
    print("\nresult:", "every read identical; NVMe entries survived the restart" if good
          else "FAILED: see the rows above")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
