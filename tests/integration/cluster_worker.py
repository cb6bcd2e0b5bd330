"""A long-lived cluster client process for the cluster tests.

``python -m tests.integration.cluster_worker ETCD_URL TE_HOST`` reads one JSON job
per line on stdin and answers one JSON line on stdout; it knows only the etcd
address (a ``ClusterClient``). Long-lived so the test can kill a node while this
process still lists it, which is the failover path a fresh process might miss.

Jobs (``op``):
* ``insert`` ``ids``: insert each prompt; per id the node it now lives on, or the error;
* ``select`` ``ids``, ``drop``: drop_select (or get) each; per id matched tokens,
  whether the bytes are the ones inserted, and the seconds it took;
* ``nodes``: node ids registered in etcd, and those this client considers live;
* ``nvme_prefix`` ``address``, ``ids``: per id, how many leading blocks the node at
  ``address`` holds on NVMe (what a restart must serve again);
* ``entries``: per live node, its entry count and NVMe entry count (its own stats);
* ``quit``.

Prompts and their KV bytes are pure functions of the prompt id.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import xxhash

from kvstore.client.client import KVStoreClient
from kvstore.cluster.client import ClusterClient
from kvstore.core.errors import KVStoreError
from kvstore.core.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
NTOKENS = 16  # four blocks per prompt
TIMEOUT_S = 2.0


def prompt_tokens(pid: int) -> list[int]:
    # The first token is the id: no two prompts share a block, so they spread.
    return [100_000 + pid, *np.random.default_rng(pid).integers(0, 50_000, NTOKENS - 1).tolist()]


def prompt_kv(pid: int) -> np.ndarray:
    return np.random.default_rng(10_000 + pid).integers(0, 256, LAYOUT.nbytes(NTOKENS),
                                                        dtype=np.uint8)


def _digest(data: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(data))


def insert(client: ClusterClient, job: dict) -> dict:
    out = {}
    for pid in job["ids"]:
        try:
            res = client.insert(prompt_tokens(pid), prompt_kv(pid))
            out[pid] = {"node": client.placement(prompt_tokens(pid))[0].node_id,
                        "new": res.new_blocks}
        except KVStoreError as exc:
            out[pid] = {"error": type(exc).__name__, "message": str(exc)}
    return out


def select(client: ClusterClient, job: dict) -> dict:
    out = {}
    for pid in job["ids"]:
        start = time.monotonic()
        read = client.drop_select if job.get("drop", True) else client.get
        res = read(prompt_tokens(pid))
        got = b"" if res.kv is None else res.kv.numpy()
        want = prompt_kv(pid)[:LAYOUT.nbytes(res.matched_tokens)] if res.matched_tokens else b""
        out[pid] = {"matched": res.matched_tokens, "seconds": time.monotonic() - start,
                    "bytes_ok": (not res.matched_tokens) or _digest(got) == _digest(want)}
    return out


def nodes(client: ClusterClient, job: dict) -> dict:
    return {"registered": sorted(client.nodes.registered()), "live": sorted(client.nodes.nodes())}


def nvme_prefix(client: ClusterClient, job: dict) -> dict:
    with KVStoreClient(job["address"], layout=LAYOUT, timeout_s=TIMEOUT_S) as admin:
        on_nvme = {e["key"] for e in admin.ls(tier="nvme")}
        out = {}
        for pid in job["ids"]:
            keys = admin.keys_for(prompt_tokens(pid))
            n = 0
            while n < len(keys) and keys[n] in on_nvme:
                n += 1
            out[pid] = n
    return out


def entries(client: ClusterClient, job: dict) -> dict:
    out = {}
    for node_id, info in client.nodes.nodes().items():
        with KVStoreClient(info.address, timeout_s=TIMEOUT_S) as admin:  # admin: no TE
            stats = admin.stats()
        out[node_id] = {"entries": stats["entries"],
                        "nvme": stats["tiers"].get("nvme", {}).get("entries", 0)}
    return out


JOBS = {"insert": insert, "select": select, "nodes": nodes, "nvme_prefix": nvme_prefix,
        "entries": entries}


def main() -> None:
    etcd, te_host = sys.argv[1], sys.argv[2]
    with ClusterClient(etcd, LAYOUT, timeout_s=TIMEOUT_S, refresh_s=0.5, te_host=te_host,
                       staging_bytes=1 << 20) as client:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            job = json.loads(line)
            if job["op"] == "quit":
                return
            print(json.dumps(JOBS[job["op"]](client, job)), flush=True)


if __name__ == "__main__":
    main()
