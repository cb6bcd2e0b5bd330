"""Mooncake Store as its users run it, for the side-by-side benchmark.

``start_master(node, ...)`` runs ``mooncake_master`` (from the mooncake wheel) with
its bundled HTTP metadata server on one node; ``MooncakeSide`` is one
``MooncakeDistributedStore`` client over TCP, used by tools/bench/cluster_worker.py:

* producer (node A): mounts the global segment that holds the objects (the
  counterpart of kvstore-server's DRAM tier on A) and ``batch_put_from`` each
  prompt's blocks, one object per block, from a registered buffer;
* consumer (node B): mounts no segment; ``batch_get_into`` a registered buffer,
  then ``batch_remove(force=True)`` -- drop after read, as kvstore's drop_select.

Object keys are the same chained block hashes kvstore computes (kvstore.core.hashing),
as hex, so both stores pay for keying a prompt. Mooncake keeps a lease on an
object after a get (``default_kv_lease_ttl``); ``force=True`` removes it anyway,
which is what a consumer that owns the prompt does.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np

from kvstore.core.hashing import block_keys, namespace_of
from kvstore.core.layout import KVLayout

log = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0


class Master(NamedTuple):
    proc: subprocess.Popen
    address: str  # host:rpc_port, for MooncakeDistributedStore.setup
    metadata: str  # http://host:port/metadata


def master_binary() -> str:
    """``mooncake_master`` next to this Python (the venv's bin), else on PATH."""
    here = Path(os.sys.executable).parent / "mooncake_master"
    found = str(here) if here.exists() else shutil.which("mooncake_master")
    if not found:
        raise FileNotFoundError("mooncake_master not found: install mooncake-transfer-engine")
    return found


def start_master(node, log_path: Path) -> Master:
    """``mooncake_master`` on ``node`` with the HTTP metadata server, waited for."""
    rpc, http, metrics = node.free_port(), node.free_port(), node.free_port()
    argv = [master_binary(), f"--rpc_port={rpc}", f"--rpc_address={node.host}",
            "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
            f"--http_metadata_server_host={node.host}", f"--metrics_port={metrics}",
            "--eviction_high_watermark_ratio=0.95"]
    with open(log_path, "ab") as out:
        proc = node.popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    node.wait_port(node.host, rpc, START_TIMEOUT_S, proc=proc)
    node.wait_port(node.host, http, START_TIMEOUT_S, proc=proc)
    return Master(proc, f"{node.host}:{rpc}", f"http://{node.host}:{http}/metadata")


class MooncakeSide:
    """One MooncakeDistributedStore client (see the module doc for the roles)."""

    def __init__(self, cfg: dict, layouts: dict[str, KVLayout]) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.layouts = layouts
        self.store = MooncakeDistributedStore()
        segment = cfg["segment_bytes"] if cfg["role"] == "producer" else 0
        rc = self.store.setup(cfg["host"], cfg["metadata"], segment, 16 << 20, "tcp", "",
                              cfg["master"])
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        self._maps: list[mmap.mmap] = []
        self.out = self.source_buffer(cfg["max_bytes"], "out") if cfg["role"] == "consumer" \
            else None
        self._ns = {name: namespace_of("bench", lay, 0, 1, b"") for name, lay in layouts.items()}

    def source_buffer(self, nbytes: int, name: str) -> np.ndarray:
        """A page-aligned buffer registered with the store (put_from/get_into need it)."""
        mem = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
        arr = np.frombuffer(mem, dtype=np.uint8)
        rc = self.store.register_buffer(arr.ctypes.data, arr.size)
        if rc != 0:
            raise RuntimeError(f"register_buffer({nbytes}) for {name} returned {rc}")
        self._maps.append(mem)
        return arr

    def _keys(self, name: str, pid: int, ntokens: int) -> tuple[list[str], list[int]]:
        from tools.bench.cluster_worker import entry_sizes, prompt_tokens

        layout = self.layouts[name]
        keys = block_keys(self._ns[name], prompt_tokens(pid, ntokens), layout.block_tokens).keys
        return [k.hex() for k in keys], entry_sizes(layout, ntokens)

    def put(self, name: str, pid: int, ntokens: int, data: np.ndarray) -> None:
        keys, sizes = self._keys(name, pid, ntokens)
        ptrs = (data.ctypes.data + np.concatenate(([0], np.cumsum(sizes)[:-1]))).tolist()
        rcs = self.store.batch_put_from(keys, ptrs, sizes)
        bad = [rc for rc in rcs if rc != 0]
        if bad:
            raise RuntimeError(f"batch_put_from: {len(bad)} of {len(keys)} failed, e.g. {bad[0]}")

    def get(self, name: str, pid: int, ntokens: int) -> np.ndarray:
        keys, sizes = self._keys(name, pid, ntokens)
        total = sum(sizes)
        base = self.out.ctypes.data
        ptrs = (base + np.concatenate(([0], np.cumsum(sizes)[:-1]))).tolist()
        got = self.store.batch_get_into(keys, ptrs, sizes)
        if list(got) != sizes:
            bad = next(g for g, s in zip(got, sizes) if g != s)
            raise RuntimeError(f"batch_get_into: got {bad} for a {sizes[0]}-byte object")
        rcs = self.store.batch_remove(keys, True)
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"batch_remove: {[rc for rc in rcs if rc != 0][:3]}")
        return self.out[:total]

    def close(self) -> None:
        self.store.close()
