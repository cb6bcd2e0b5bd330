"""A client process for multi-process tests: ``python -m tests.integration.client_worker JSON``.

Runs one job and prints one JSON line. Jobs:
* ``insert``: insert prompts ``ids`` into ``servers[id % len(servers)]``;
* ``consume``: drop_select every prompt in ``ids`` (from its server), retrying misses
  until every id is claimed in ``taken_dir`` (by anyone) or ``deadline_s`` passes;
  reports each full match with the digest of the bytes it got;
* ``select``: drop_select each id once, report what came back;
* ``stats``: every server's stats;
* ``seq``: the jobs in ``steps`` one after the other, in this one process;
* ``wait_nvme``: wait until ``servers[0]`` has at least ``min_entries`` on NVMe;
* ``hang_after_reserve``: reserve a prompt's blocks, write the first, print, sleep.
* ``hang_after_acquire``: start a drop_select (acquire with claim, read the bytes),
  print, sleep before the release: a consumer that dies holding a read lease.

Prompts and their KV bytes are pure functions of the prompt id, so any process can
check what another stored.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import numpy as np
import xxhash

from kvstore.client.client import KVStoreClient
from kvstore.core.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)


def prompt_tokens(pid: int, ntokens: int) -> list[int]:
    # The first token is the id: no two prompts share a prefix.
    rest = np.random.default_rng(pid).integers(0, 50_000, ntokens - 1).tolist()
    return [100_000 + pid, *rest]


def prompt_kv(pid: int, ntokens: int) -> np.ndarray:
    return np.random.default_rng(10_000 + pid).integers(0, 256, LAYOUT.nbytes(ntokens),
                                                        dtype=np.uint8)


def digest(data: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(data))


def _clients(job: dict) -> list[KVStoreClient]:
    return [KVStoreClient(addr, layout=LAYOUT, te_host=job.get("te_host", "127.0.0.1"),
                          same_node=job.get("same_node", "auto"), timeout_s=10.0,
                          staging_bytes=4 << 20) for addr in job["servers"]]


def insert(job: dict, clients: list[KVStoreClient]) -> dict:
    n = job["ntokens"]
    done = []
    for pid in job["ids"]:
        res = clients[pid % len(clients)].insert(prompt_tokens(pid, n), prompt_kv(pid, n))
        done.append([pid, res.new_blocks, res.existing_blocks])
    return {"inserted": done}


def _claim(taken_dir: str, pid: int) -> bool:
    try:
        os.close(os.open(os.path.join(taken_dir, str(pid)), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def consume(job: dict, clients: list[KVStoreClient]) -> dict:
    n, taken = job["ntokens"], job["taken_dir"]
    deadline = time.monotonic() + job.get("deadline_s", 60)
    got, partial = [], []
    ids = list(job["ids"])
    random.Random(os.getpid()).shuffle(ids)
    while ids and time.monotonic() < deadline:
        for pid in list(ids):
            if os.path.exists(os.path.join(taken, str(pid))):
                ids.remove(pid)
                continue
            res = clients[pid % len(clients)].drop_select(prompt_tokens(pid, n), timeout=5)
            if res.matched_tokens == n:
                got.append([pid, digest(res.kv.numpy())])
                _claim(taken, pid)
                ids.remove(pid)
            elif res.matched_tokens:
                partial.append([pid, res.matched_tokens])
        time.sleep(0.01)
    return {"got": got, "partial": partial, "unfinished": ids}


def select(job: dict, clients: list[KVStoreClient]) -> dict:
    """drop_select each id once: [[id, matched_tokens, digest or None], ...]."""
    n, out = job["ntokens"], []
    for pid in job["ids"]:
        res = clients[pid % len(clients)].drop_select(prompt_tokens(pid, n), timeout=5)
        out.append([pid, res.matched_tokens, None if res.kv is None else digest(res.kv.numpy())])
    return {"selected": out}


def stats(job: dict, clients: list[KVStoreClient]) -> dict:
    return {"stats": [c.stats() for c in clients]}


def wait_nvme(job: dict, clients: list[KVStoreClient]) -> dict:
    deadline = time.monotonic() + job.get("deadline_s", 20)
    while time.monotonic() < deadline:
        tiers = clients[0].stats()["tiers"]
        if tiers.get("nvme", {}).get("entries", 0) >= job["min_entries"]:
            return {"tiers": tiers}
        time.sleep(0.1)
    return {"tiers": clients[0].stats()["tiers"], "timeout": True}


def hang_after_reserve(job: dict, clients: list[KVStoreClient]) -> dict:
    from kvstore.core import protocol as p
    from kvstore.core.hashing import block_keys, block_token_bytes

    client, pid, n = clients[0], job["pid"], job["ntokens"]
    keys = block_keys(client.namespace, prompt_tokens(pid, n), LAYOUT.block_tokens).keys
    toks = block_token_bytes(prompt_tokens(pid, n), LAYOUT.block_tokens)
    sizes = LAYOUT.entry_sizes(n)
    seg = client._segment()
    res = client._rpc.call(p.Reserve(keys=tuple(keys), sizes=tuple(sizes), tokens=tuple(toks)))
    # Some bytes land, as if the process died mid-transfer.
    client._data.write(seg, [prompt_kv(pid, n)[:sizes[0]]], [res["placements"][0]])
    print(json.dumps({"reserved": len(keys)}), flush=True)
    time.sleep(600)
    return {}


def hang_after_acquire(job: dict, clients: list[KVStoreClient]) -> dict:
    from kvstore.core import protocol as p
    from kvstore.core.hashing import block_keys, block_token_bytes

    client, pid, n = clients[0], job["pid"], job["ntokens"]
    keys = block_keys(client.namespace, prompt_tokens(pid, n), LAYOUT.block_tokens).keys
    toks = block_token_bytes(prompt_tokens(pid, n), LAYOUT.block_tokens)
    client._segment()
    # What drop_select sends first; its Release(drop=True) never comes.
    acq = client._rpc.call(p.Acquire(keys=tuple(keys), tokens=tuple(toks), claim=True))
    out = client._data.read(client._segment(acq["segment"]), acq["entries"])
    print(json.dumps({"acquired": len(acq["entries"]), "digest": digest(out)}), flush=True)
    time.sleep(600)
    return {}


def seq(job: dict, clients: list[KVStoreClient]) -> dict:
    """Run ``steps`` (jobs without servers) in order with the same clients."""
    return {"steps": [JOBS[step["job"]]({**job, **step}, clients) for step in job["steps"]]}


JOBS = {"seq": seq, "insert": insert, "consume": consume, "select": select, "stats": stats,
        "wait_nvme": wait_nvme,
        "hang_after_reserve": hang_after_reserve, "hang_after_acquire": hang_after_acquire}


def main() -> None:
    job = json.loads(sys.argv[1])
    clients = _clients(job)
    try:
        print(json.dumps(JOBS[job["job"]](job, clients)), flush=True)
    finally:
        for c in clients:
            c.close()


if __name__ == "__main__":
    main()
