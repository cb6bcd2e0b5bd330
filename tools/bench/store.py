"""Single-node benchmarks: keys, the DRAM and NVMe tiers through the store, the index.

Each function is a section of ``tools.bench`` and returns rows (dicts). Every row
puts kvstore next to the plain operation doing the same work on the same machine
(a numpy memcpy, a plain file read/write, one xxh3 call over the same bytes), so
the ratio says what kvstore's book-keeping costs, whatever the machine.
"""

from __future__ import annotations

import itertools
import mmap
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from kvstore.core.config import KVStoreConfig
from kvstore.core.hashing import block_keys, block_token_bytes, checksum, namespace_of
from kvstore.core.layout import KVLayout
from kvstore.store.facade import Store
from kvstore.client.shm import map_shared
from tiers.nvme import NvmeTier
from tools.bench import BenchOptions, Row, Timing, measure, ratio

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
        t = measure(lambda tokens=tokens: block_keys(ns, tokens, BIG.block_tokens),
                    repeat=opts.repeat * 2)
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
        t = measure(lambda view=view: checksum(view), repeat=opts.repeat)
        base = copy.best * size / nbytes
        rows.append({"table": "xxh3_64 checksum vs memcpy", "bytes": size,
                     "checksum GB/s": size / t.best / 1e9,
                     "memcpy GB/s": nbytes / copy.best / 1e9,
                     "checksum / memcpy time": ratio(t.best, base)})
    return rows


# ------------------------------------------------------------------ shared set-up
class Prompt(NamedTuple):
    """One prompt's entries as a writer holds them: keys, token blocks, bytes."""

    keys: list[bytes]
    tokens: list[bytes]
    sizes: list[int]
    chunks: list[np.ndarray]  # views of one contiguous buffer, entry by entry
    nbytes: int


def make_prompt(layout: KVLayout, nbytes: int, seed: int) -> Prompt:
    """A prompt of about ``nbytes`` of KV (whole blocks), random tokens and bytes."""
    ntokens = max(1, nbytes // layout.block_nbytes) * layout.block_tokens
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 150_000, size=ntokens)
    keys = block_keys(namespace_of("bench/model", layout), ids, layout.block_tokens).keys
    sizes = layout.entry_sizes(ntokens)
    data = rng.integers(0, 256, size=sum(sizes), dtype=np.uint8)
    bounds = np.cumsum([0, *sizes])
    chunks = [data[a:b] for a, b in itertools.pairwise(bounds)]
    return Prompt(keys, block_token_bytes(ids, layout.block_tokens), sizes, chunks, sum(sizes))


def open_store(workdir: Path, **tiers: Any) -> Store:
    """A store of its own in ``workdir`` with these ``[tiers]`` settings."""
    cfg = KVStoreConfig().replace(store={"data_dir": str(workdir / "store")}, tiers=tiers)
    return Store(cfg)


def put(store: Store, p: Prompt) -> None:
    """What a local writer does: reserve, copy each entry in, checksum, commit."""
    res = store.reserve(p.keys, p.sizes, p.tokens)
    for i, (place, chunk) in enumerate(zip(res.placements, p.chunks)):
        if place is not None:  # None: already stored (dedup), nothing to send
            store.write(res.id, i, chunk)
    store.commit(res.id, [checksum(c) for c in p.chunks])


def put_shared(store: Store, arena: np.ndarray, p: Prompt) -> None:
    """The same-node client path: memcpy straight into the mapped DRAM arena."""
    res = store.reserve(p.keys, p.sizes, p.tokens)
    for place, chunk in zip(res.placements, p.chunks):
        if place is not None:
            arena[place.offset:place.offset + place.nbytes] = chunk
    store.commit(res.id, [checksum(c) for c in p.chunks])


def get(store: Store, p: Prompt) -> list[bytes]:
    """A local reader: acquire, read each entry (a copy the reader keeps), release."""
    acq = store.acquire(p.keys, p.tokens)
    try:
        return [store.read(acq.id, i) for i in range(len(acq.entries))]
    finally:
        store.release(acq.id)


def get_shared(store: Store, arena: np.ndarray, p: Prompt, out: np.ndarray) -> None:
    acq = store.acquire(p.keys, p.tokens)
    pos = 0
    for e in acq.entries:
        out[pos:pos + e.nbytes] = arena[e.offset:e.offset + e.nbytes]
        pos += e.nbytes
    store.release(acq.id)


# ------------------------------------------------------------------ DRAM tier
SMALL = KVLayout(num_layers=8, kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)


def bench_dram(opts: BenchOptions) -> list[Row]:
    """A whole prompt in and out of the DRAM tier, one reserve/commit and one
    acquire/release each, against one numpy memcpy of the same bytes."""
    total = opts.pick(32 << 20, 256 << 20)
    rows: list[Row] = []
    for layout in (SMALL, BIG):
        p = make_prompt(layout, total, seed=2)
        store = open_store(opts.workdir, dram_bytes=int(p.nbytes / 0.8) + (1 << 20),
                           nvme_bytes=0)
        try:
            rows += _dram_rows(store, p, opts.repeat)
        finally:
            store.close()
    return rows


def _dram_rows(store: Store, p: Prompt, repeat: int) -> list[Row]:
    src = np.concatenate(p.chunks)
    dst = np.empty_like(src)
    copy = measure(lambda: np.copyto(dst, src), repeat=repeat)
    arena = map_shared(store.dram_shared_path, store.stats()["tiers"]["dram"]["capacity"])
    cases = {
        "put (reserve+write+commit)": (lambda: put(store, p), store.clear),
        "put via shared map": (lambda: put_shared(store, arena, p), store.clear),
    }
    rows = [_copy_row(name, p, measure(fn, repeat=repeat, setup=setup), copy)
            for name, (fn, setup) in cases.items()]
    store.clear()
    put(store, p)
    rows.append(_copy_row("get (acquire+read+release)", p,
                          measure(lambda: get(store, p), repeat=repeat), copy))
    rows.append(_copy_row("get via shared map", p,
                          measure(lambda: get_shared(store, arena, p, dst), repeat=repeat), copy))
    store.check_integrity()
    return rows


def _copy_row(op: str, p: Prompt, t: Timing, copy: Timing) -> Row:
    return {"table": "DRAM tier vs numpy memcpy (best of runs)", "op": op,
            "entry KiB": p.sizes[0] / 1024, "entries": len(p.sizes), "MB": p.nbytes / MB,
            "store GB/s": p.nbytes / t.best / 1e9, "memcpy GB/s": p.nbytes / copy.best / 1e9,
            "store/memcpy": ratio(copy.best, t.best)}


# ------------------------------------------------------------------ NVMe tier
def bench_nvme(opts: BenchOptions) -> list[Row]:
    """The NVMe tier's own write+fsync and cold read against a plain buffered file
    doing the same I/O in the same directory, then the store's demotion (an insert
    that pushes an equal prompt down to NVMe) and staging (an acquire of a prompt on
    NVMe: read, verify, copy into DRAM) against the plain I/O they contain."""
    total = opts.pick(32 << 20, 256 << 20)
    rows: list[Row] = []
    for layout in (SMALL, BIG):
        p = make_prompt(layout, total, seed=3)
        rows += _tier_rows(opts, p)
        rows += _store_nvme_rows(opts, p, make_prompt(layout, total, seed=4))
    return rows


def _tier_rows(opts: BenchOptions, p: Prompt) -> list[Row]:
    slab, plain = opts.workdir / "tier.slab", opts.workdir / "plain.bin"
    tier = NvmeTier(str(slab), int(p.nbytes * 1.1) + (1 << 20), direct="auto", fsync="commit")
    exts = tier.allocate_many(p.sizes)
    out = _aligned(p.nbytes)
    outs = _slices(out, p.sizes)
    fd = os.open(plain, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        def tier_write() -> None:
            for ext, chunk in zip(exts, p.chunks):
                tier.write(ext, memoryview(chunk))
            tier.flush()

        def plain_write() -> None:
            for ext, chunk in zip(exts, p.chunks):
                os.pwrite(fd, chunk, ext.offset)
            os.fsync(fd)

        def tier_read() -> None:
            for ext, buf in zip(exts, outs):
                tier.read_into(ext, buf)

        def plain_read() -> None:
            for ext, buf in zip(exts, outs):
                os.preadv(fd, [buf], ext.offset)

        def tier_write_many() -> None:  # adjacent extents: one pwritev per run
            tier.write_many(exts, [memoryview(c) for c in p.chunks])
            tier.flush()

        def tier_read_many() -> None:
            tier.read_many(exts, outs)

        def cold() -> None:
            _drop_cache(slab)
            _drop_cache(plain)

        r = opts.repeat
        w_tier, w_plain = measure(tier_write, r), measure(plain_write, r)
        r_tier, r_plain = measure(tier_read, r, setup=cold), measure(plain_read, r, setup=cold)
        if bytes(out[:p.sizes[0]]) != p.chunks[0].tobytes():
            raise RuntimeError("nvme tier read back different bytes")
        w_many = measure(tier_write_many, r)
        out[:p.sizes[0]] = 0
        r_many = measure(tier_read_many, r, setup=cold)
        if bytes(out[:p.sizes[0]]) != p.chunks[0].tobytes():
            raise RuntimeError("nvme tier read_many read back different bytes")
        table = f"NVMe tier (O_DIRECT={tier.direct}) vs plain buffered file, cold reads"
        return [_io_row(table, "write + fsync", p, w_tier, w_plain),
                _io_row(table, "read (page cache dropped)", p, r_tier, r_plain),
                _io_row(table, "write_many + fsync", p, w_many, w_plain),
                _io_row(table, "read_many (page cache dropped)", p, r_many, r_plain)]
    finally:
        os.close(fd)
        tier.close()
        slab.unlink(missing_ok=True)
        plain.unlink(missing_ok=True)


def _store_nvme_rows(opts: BenchOptions, a: Prompt, b: Prompt) -> list[Row]:
    """DRAM holds one prompt (1.1x its size), so inserting B moves all of A down."""
    store = open_store(opts.workdir, dram_bytes=int(a.nbytes * 1.1), dram_shared=False,
                       nvme_bytes=int(a.nbytes * 2.5) + (4 << 20))
    slab = opts.workdir / "store" / "nvme.slab"
    plain = opts.workdir / "plain.bin"
    fd = os.open(plain, os.O_RDWR | os.O_CREAT, 0o600)
    src = np.concatenate(a.chunks)
    dst = _aligned(a.nbytes)
    try:
        def a_in_dram() -> None:
            store.clear()
            put(store, a)

        def a_on_nvme_alone() -> None:
            a_in_dram()
            put(store, b)
            store.evict(keys=b.keys)
            _drop_cache(slab)

        def stage() -> None:
            acq = store.acquire(a.keys, a.tokens)
            store.release(acq.id)
            if acq.entries[0].tier != "dram" or len(acq.entries) != len(a.keys):
                raise RuntimeError("acquire did not stage the whole prompt into DRAM")

        def plain_demote() -> None:
            np.copyto(dst, src)
            os.pwrite(fd, src, 0)
            os.fsync(fd)

        def plain_stage() -> None:
            os.preadv(fd, [dst], 0)

        r = opts.repeat
        demote = measure(lambda: put(store, b), r, setup=a_in_dram)
        if store.lookup(a.keys, a.tokens).tiers != ["nvme"] * len(a.keys):
            raise RuntimeError("inserting B did not demote all of A to NVMe")
        staged = measure(stage, r, setup=a_on_nvme_alone)
        base_demote = measure(plain_demote, r)
        base_stage = measure(plain_stage, r, setup=lambda: _drop_cache(plain))
        store.check_integrity()
        table = "store demotion / staging vs the plain I/O inside them"
        return [_io_row(table, "insert B, demoting A (copy+write+fsync)", a, demote, base_demote),
                _io_row(table, "acquire A from NVMe (read+verify+stage)", a, staged, base_stage)]
    finally:
        os.close(fd)
        store.close()
        plain.unlink(missing_ok=True)


def _io_row(table: str, op: str, p: Prompt, t: Timing, base: Timing) -> Row:
    return {"table": table, "op": op, "entry KiB": p.sizes[0] / 1024, "MB": p.nbytes / MB,
            "kvstore GB/s": p.nbytes / t.best / 1e9, "plain GB/s": p.nbytes / base.best / 1e9,
            "kvstore/plain": ratio(base.best, t.best)}


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned buffer (what the DRAM arena hands O_DIRECT reads)."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def _slices(buf: np.ndarray, sizes: list[int]) -> list[memoryview]:
    bounds = np.cumsum([0, *sizes])
    return [memoryview(buf[a:b]) for a, b in itertools.pairwise(bounds)]


def _drop_cache(path: Path) -> None:
    """Evict a file's clean pages so the next read goes to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
