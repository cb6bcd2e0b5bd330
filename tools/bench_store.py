"""Single-node benchmarks: keys, the DRAM and NVMe tiers through the store, the index.

Each function is a section of ``tools.bench`` and returns rows (dicts). Every row
puts kvstore next to the plain operation doing the same work on the same machine
(a numpy memcpy, a plain file read/write, one xxh3 call over the same bytes), so
the ratio says what kvstore's book-keeping costs, whatever the machine.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from kvstore.hashing import block_keys, checksum, namespace_of
from kvstore.layout import KVLayout
from tools.bench import BenchOptions, Row, measure, ratio

MB = 1e6
# A Llama-3-8B-shaped rank: 32 layers, 8 KV heads of 128, bf16 -> 2 MiB per 16-token block.
BIG = KVLayout(num_layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=16)


def bench_hashing(opts: BenchOptions) -> list[Row]:
    """Keys of a 128k-token prompt, by input form, against one xxh3_128 over the same
    bytes (the floor: hashing with no chain and no per-block Python)."""
    ntokens = 128 * 1024
    ns = namespace_of("bench/model", BIG)
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 150_000, size=ntokens, dtype=np.int64)
    forms = {"list[int]": arr.tolist(), "numpy int64": arr, "torch int64": torch.from_numpy(arr)}
    raw = arr.astype("<i4").tobytes()
    floor = measure(lambda: xxhash.xxh3_128_digest(raw), repeat=opts.repeat * 4)
    rows: list[Row] = []
    for form, tokens in forms.items():
        t = measure(lambda: block_keys(ns, tokens, BIG.block_tokens), repeat=opts.repeat * 2)
        rows.append({"table": "block_keys, 128k tokens, 16-token blocks", "input": form,
                     "keys": ntokens // BIG.block_tokens, "best ms": t.best * 1e3,
                     "median ms": t.median * 1e3, "target ms": 10.0,
                     "one xxh3_128 ms": floor.best * 1e3,
                     "x floor": ratio(t.best, floor.best)})
    rows += _checksum_rows(opts)
    return rows


def _checksum_rows(opts: BenchOptions) -> list[Row]:
    """xxh3_64 (the commit / NVMe-read check) against a memcpy of the same bytes."""
    nbytes = opts.pick(16 << 20, 64 << 20)
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    copy = measure(lambda: np.copyto(dst, src), repeat=opts.repeat)
    rows = []
    for size in (BIG.block_nbytes, nbytes):
        view = src[:size]
        t = measure(lambda: checksum(view), repeat=opts.repeat)
        base = copy.best * size / nbytes
        rows.append({"table": "xxh3_64 checksum vs memcpy", "bytes": size,
                     "checksum GB/s": size / t.best / 1e9,
                     "memcpy GB/s": nbytes / copy.best / 1e9,
                     "checksum / memcpy time": ratio(t.best, base)})
    return rows
