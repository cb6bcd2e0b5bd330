"""One client process of the load test (tools/bench/load.py).

    python -m tools.bench.load_worker '{"system": "kvstore", "role": "producer", ...}'

Prints ``{"ready": pid}`` once connected, then answers one JSON line per command
line on stdin: ``{"op": "run", "seconds"}`` runs the role's loop that long and
answers its counts and latencies; ``{"op": "stats"}`` (kvstore) answers the
server's stats; ``{"op": "exit"}`` ends it.

Roles: a ``producer`` inserts fresh prompts as fast as it can and appends each one
a consumer should take to its announce file (``pid ntokens`` lines), except every
``abandon_every``-th prompt, which nobody ever reads (a request that never reached
decode): those only leave by eviction, so demotion and eviction run all the time.
A ``consumer`` follows one producer's announce file and drop_selects its prompts in
order, ``lag`` prompts behind the newest, then checks the bytes that came against
the ones the producer wrote (a pure function of the prompt id, see
``PromptData``): every select must be exact, a clean prefix, or a miss.
``holder`` (Mooncake only) mounts the segment the objects live in -- Mooncake's
counterpart of kvstore-server's DRAM tier -- and waits.

Systems: ``kvstore`` (KVStoreClient: insert / drop_select) and ``mooncake``
(MooncakeDistributedStore: batch_put_from / batch_get_into / batch_remove), both
through the sides of tools/bench/cluster_worker.py and tools/bench/mooncake.py.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from collections import Counter, deque
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np

from tools.bench.cluster_worker import LAYOUTS, KVStoreSide, PromptData, prompt_tokens
from tools.bench.mooncake import MooncakeSide

PID_STRIDE = 10_000_000  # producer i's prompts are i * PID_STRIDE + 1, + 2, ...
_POLL_S = 0.002  # a consumer with nothing to take waits this long
# A producer whose insert failed waits this long before its next one, as an engine
# goes on with other work: a refusal answered in microseconds must not turn the
# producer into a spinning loop that takes the CPU from everyone else.
_BACKOFF_S = 0.01


class KVStoreLoad(KVStoreSide):
    def select(self, name: str, pid: int, ntokens: int) -> np.ndarray:
        """The bytes of the longest stored prefix (empty: a miss), dropped there."""
        res = self.clients[name].drop_select(prompt_tokens(pid, ntokens), into=self.out)
        return res.kv.numpy() if res.matched_tokens else self.out[:0]

    def stats(self) -> dict:
        return next(iter(self.clients.values())).stats()


class PutRefused(RuntimeError):
    """Mooncake refused blocks of a prompt; ``kind`` names its first error code
    (-200, NO_AVAILABLE_HANDLE: no room in any segment)."""

    def __init__(self, code: int, refused: int, total: int) -> None:
        super().__init__(f"batch_put_from refused {refused} of {total} blocks ({code})")
        self.kind = f"PutRefused({code})"


class MooncakeLoad(MooncakeSide):
    def put(self, name: str, pid: int, ntokens: int, data: np.ndarray) -> None:
        keys, sizes = self._keys(name, pid, ntokens)
        ptrs = (data.ctypes.data + np.concatenate(([0], np.cumsum(sizes)[:-1]))).tolist()
        bad = [rc for rc in self.store.batch_put_from(keys, ptrs, sizes) if rc != 0]
        if bad:
            raise PutRefused(bad[0], len(bad), len(keys))

    def select(self, name: str, pid: int, ntokens: int) -> np.ndarray:
        """The leading blocks that are still stored (empty: a miss), then removed --
        the prefix a drop_select would serve; a block evicted from the middle ends it."""
        keys, sizes = self._keys(name, pid, ntokens)
        ptrs = (self.out.ctypes.data + np.concatenate(([0], np.cumsum(sizes)[:-1]))).tolist()
        got = self.store.batch_get_into(keys, ptrs, sizes)
        whole = next((i for i, (g, s) in enumerate(zip(got, sizes)) if g != s), len(sizes))
        if whole:
            self.store.batch_remove(keys[:whole], True)
        return self.out[:sum(sizes[:whole])]


def make_side(cfg: dict):
    if cfg["system"] == "kvstore":
        return KVStoreLoad(cfg)
    if cfg["system"] == "mooncake":
        if cfg["role"] == "holder":  # the one that mounts the segment
            return MooncakeLoad({**cfg, "role": "producer"}, LAYOUTS)
        return MooncakeLoad({**cfg, "segment_bytes": 0}, LAYOUTS)
    raise ValueError(f"unknown system {cfg['system']!r}")


# ------------------------------------------------------------------ loops
class Tally:
    """What one process did in its run: latencies of the ops that answered, the
    errors (by class) of those that raised, and for a consumer what came back."""

    def __init__(self) -> None:
        self.lat: list[float] = []
        self.errors: Counter[str] = Counter()
        self.hits = self.partial = self.misses = 0
        self.wrong_selects = self.wrong_bytes = 0
        self.nbytes = 0

    def as_dict(self, seconds: float) -> dict:
        return {"seconds": seconds, "lat": [round(x, 6) for x in self.lat],
                "errors": dict(self.errors), "hits": self.hits, "partial": self.partial,
                "misses": self.misses, "wrong_selects": self.wrong_selects,
                "wrong_bytes": self.wrong_bytes, "bytes": self.nbytes}


def produce(side, cfg: dict, prompts: PromptData, seconds: float) -> Tally:
    name, tally = cfg["layout"], Tally()
    rng = random.Random(cfg["index"])
    block = LAYOUTS[name].block_tokens
    lo, hi = cfg["min_tokens"] // block, cfg["max_tokens"] // block
    count = 0
    end = time.monotonic() + seconds
    with open(cfg["announce"], "a") as announce:
        while time.monotonic() < end:
            count += 1
            pid, ntokens = cfg["index"] * PID_STRIDE + count, rng.randint(lo, hi) * block
            data = prompts.make(pid, ntokens)
            start = time.perf_counter()
            try:
                side.put(name, pid, ntokens, data)
            except Exception as exc:  # noqa: BLE001 - counted; the load goes on
                tally.errors[error_kind(exc)] += 1
                time.sleep(_BACKOFF_S)
                continue
            tally.lat.append(time.perf_counter() - start)
            tally.nbytes += data.size
            if count % cfg["abandon_every"]:
                announce.write(f"{pid} {ntokens}\n")
                announce.flush()
    return tally


def error_kind(exc: Exception) -> str:
    """How a failed operation is counted: its class, or what ``kind`` it names."""
    return getattr(exc, "kind", "") or type(exc).__name__


class Announcements:
    """The whole lines a producer has appended to its announce file so far."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.rest = Path(path), 0, b""

    def new(self) -> list[tuple[int, int]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        *lines, self.rest = (self.rest + chunk).split(b"\n")
        return [(int(a), int(b)) for a, b in (line.split() for line in lines)]


def consume(side, cfg: dict, prompts: PromptData, seconds: float) -> Tally:
    name, tally = cfg["layout"], Tally()
    feed, backlog = Announcements(cfg["announce"]), deque()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        backlog.extend(feed.new())
        if len(backlog) <= cfg["lag"]:
            time.sleep(_POLL_S)
            continue
        pid, ntokens = backlog.popleft()
        start = time.perf_counter()
        try:
            got = side.select(name, pid, ntokens)
        except Exception as exc:  # noqa: BLE001 - a miss the caller recomputes; counted
            tally.errors[error_kind(exc)] += 1
            continue
        tally.lat.append(time.perf_counter() - start)
        if got.size == 0:
            tally.misses += 1
            continue
        expected = prompts.make(pid, ntokens)
        wrong = int(np.count_nonzero(got != expected[:got.size])) if got.size <= expected.size \
            else got.size
        tally.wrong_selects += wrong > 0
        tally.wrong_bytes += wrong
        tally.nbytes += got.size
        if got.size == expected.size:
            tally.hits += 1
        else:
            tally.partial += 1
    return tally


def handle(side, cfg: dict, prompts: PromptData | None, cmd: dict) -> dict:
    if cmd["op"] == "run":
        loop = {"producer": produce, "consumer": consume}[cfg["role"]]
        start = time.monotonic()
        tally = loop(side, cfg, prompts, cmd["seconds"])
        return tally.as_dict(time.monotonic() - start)
    if cmd["op"] == "stats":
        return side.stats()
    raise ValueError(f"unknown op {cmd['op']!r}")


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[0])
    side = make_side(cfg)
    prompts = None
    if cfg["role"] != "holder":
        # Mooncake puts from registered memory only
        pinned = getattr(side, "source_buffer", None) if cfg["role"] == "producer" else None
        nbytes = LAYOUTS[cfg["layout"]].nbytes(cfg["max_tokens"])
        prompts = PromptData(LAYOUTS[cfg["layout"]], cfg["max_tokens"],
                             pinned(nbytes, "kv") if pinned else None)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            reply = handle(side, cfg, prompts, cmd)
        except Exception as exc:  # noqa: BLE001 - report to the parent
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply, default=str), flush=True)
    side.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
