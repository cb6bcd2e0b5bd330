"""One side (producer or consumer) of one system in the two-node benchmark.

    python -m tools.bench.cluster_worker '{"system": "kvstore", "role": "producer", ...}'

Reads one JSON command per stdin line and answers one JSON line on stdout, so the
parent (tools/bench/cluster.py) drives producer and consumer in lock step and
times each operation *inside* the process that does it (the pipe is not timed).

Commands: ``{"op": "put", "pid", "ntokens", "layout"}`` -> ``{"s", "nbytes", "digest"}``;
``{"op": "get", "pid", "ntokens", "layout", "digest"[, "pattern"]}`` -> ``{"s", "nbytes"}``
(the bytes are checked against the producer's digest, untimed; raw TE takes the
transfer ``pattern`` of tools/bench/rawte.py and answers ``"transfers"`` too);
``{"op": "fill", "start", "count", "layout", "ntokens"}`` stores ``count`` prompts
that stay (index growth);
``{"op": "exit"}``. An error answers ``{"error": ...}`` and the worker goes on.

Prompt ``pid`` of ``n`` tokens is a pure function of (pid, n): token ids start with
the pid (no shared prefixes), and its KV bytes are one random buffer per layout
with the pid stamped into the first 8 bytes of every block.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np
import xxhash

from kvstore.core.config import load_config
from kvstore.core.layout import KVLayout

LAYOUTS = {
    # Llama-3-8B-like, one TP rank: 2 MiB per 16-token block.
    "large": KVLayout(num_layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=16),
    # A small model: 64 KiB per block.
    "small": KVLayout(num_layers=8, kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16),
    # Index filler: 512-byte entries, so tens of thousands of them cost little memory.
    "tiny": KVLayout(num_layers=1, kv_heads=1, head_dim=8, dtype="float16", block_tokens=16),
}


def entry_sizes(layout: KVLayout, ntokens: int) -> list[int]:
    """``layout.entry_sizes`` without its torch call per block (8 ms at 2 048 blocks,
    which would be charged to Mooncake's and raw TE's timings)."""
    full, rest = divmod(ntokens, layout.block_tokens)
    return [layout.block_nbytes] * full + ([layout.nbytes(rest)] if rest else [])


def prompt_tokens(pid: int, ntokens: int) -> np.ndarray:
    toks = (np.arange(ntokens, dtype=np.int64) * 7919 + pid * 104729) % 50_000
    toks[0] = 100_000 + pid
    return toks


class PromptData:
    """The producer's KV bytes: one random buffer per layout, restamped per prompt."""

    def __init__(self, layout: KVLayout, max_tokens: int, buffer: np.ndarray | None = None):
        self.layout = layout
        nbytes = layout.nbytes(max_tokens)
        self.buf = buffer[:nbytes] if buffer is not None else np.empty(nbytes, np.uint8)
        self.buf[:] = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)

    def make(self, pid: int, ntokens: int) -> np.ndarray:
        data = self.buf[:self.layout.nbytes(ntokens)]
        block = self.layout.block_nbytes
        whole = data.size // block
        stamp = np.frombuffer(np.int64(pid).tobytes(), np.uint8)
        data[:whole * block].reshape(whole, block)[:, :8] = stamp
        return data


def digest(data: Any) -> str:
    if not isinstance(data, np.ndarray):  # a torch tensor, maybe in VRAM (--gpu)
        data = data.cpu().numpy()
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(data))


def on_device(device: str, data: np.ndarray, pool: dict) -> Any:
    """``data`` where the workload keeps KV: host memory, or VRAM for --gpu runs
    (copied into one reused device buffer, outside the timed part)."""
    if device == "cpu":
        return data
    import torch

    if "buf" not in pool or pool["buf"].numel() < data.size:
        pool["buf"] = torch.empty(data.size, dtype=torch.uint8, device=device)
    out = pool["buf"][:data.size]
    out.copy_(torch.from_numpy(data))
    return out


# ------------------------------------------------------------------ systems
class KVStoreSide:
    """KVStoreClient against the server on node A (same-node path for the producer)."""

    def __init__(self, cfg: dict) -> None:
        from kvstore.client.client import KVStoreClient

        # KVSTORE_CLIENT_* settings reach the clients (e.g. KVSTORE_CLIENT_TE_PIECE_BYTES).
        client_cfg = load_config(sections=("client",)).client
        self.clients = {name: KVStoreClient(cfg["server"], layout=LAYOUTS[name],
                                            te_host=cfg["host"], same_node=cfg["same_node"],
                                            timeout_s=120.0, staging_bytes=cfg["staging_bytes"],
                                            config=client_cfg)
                        for name in cfg["layouts"]}
        self.device = cfg.get("device", "cpu")
        # + a page: room for the hidden-state entry drop_select may bring along
        self.out = np.empty(cfg["max_bytes"] + 4096, np.uint8) if cfg["role"] == "consumer" \
            else None
        # Where a get's time goes (``last_split``): the acquire's round trip (with the
        # bytes in its reply when they come inline) and the data move (TE read, or the
        # copy out of the reply; each with its checksums), timed around the client's
        # own calls; the rest of a get is its keys and book-keeping. Inline bytes that
        # come in parts are copied inside the acquire, each part as it arrives: that
        # copying, with the waits for the parts after the first, counts as move, and
        # the acquire is the rest of its time (up to the first part).
        self.last_split: dict[str, float] = {}
        if cfg["role"] == "consumer":
            for client in self.clients.values():
                time_calls(client, "_acquire", "acquire", self.last_split)
                for name in ("read", "take_inline"):
                    time_calls(client._data, name, "move", self.last_split)
                time_calls(client._data, "take_parts", "parts", self.last_split)

    def put(self, name: str, pid: int, ntokens: int, data: np.ndarray) -> None:
        res = self.clients[name].insert(prompt_tokens(pid, ntokens), data)
        if res.existing_blocks:
            raise RuntimeError(f"prompt {pid} was already stored ({res})")

    def get(self, name: str, pid: int, ntokens: int) -> Any:
        # Into one reused buffer, as Mooncake's get_into and raw TE do (see the docs
        # for what a fresh output buffer per call costs).
        self.last_split.update(acquire=0.0, move=0.0, parts=0.0)
        res = self.clients[name].drop_select(prompt_tokens(pid, ntokens), into=self.out)
        parts = self.last_split.pop("parts")
        self.last_split["acquire"] -= parts
        self.last_split["move"] += parts
        if res.matched_tokens != ntokens:
            raise RuntimeError(f"drop_select matched {res.matched_tokens}/{ntokens} tokens")
        # --gpu: the consumer wants the KV in VRAM; the client hands back host memory.
        return res.kv.numpy() if self.device == "cpu" else res.kv.to(self.device)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def time_calls(obj: Any, name: str, part: str, sink: dict[str, float]) -> None:
    """Shadow ``obj.name`` (on the instance) with a wrapper adding each call's
    seconds to ``sink[part]`` (also tools.bench.parts')."""
    func = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            sink[part] = sink.get(part, 0.0) + time.perf_counter() - start

    setattr(obj, name, timed)


def make_side(cfg: dict):
    if cfg["system"] == "kvstore":
        return KVStoreSide(cfg)
    if cfg["system"] == "rawte":
        from tools.bench.rawte import RawTESide

        return RawTESide(cfg)
    if cfg["system"] == "mooncake":
        from tools.bench.mooncake import MooncakeSide

        return MooncakeSide(cfg, LAYOUTS)
    raise ValueError(f"unknown system {cfg['system']!r}")


# ------------------------------------------------------------------ loop
class Worker:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.side = make_side(cfg)
        self.data: dict[str, PromptData] = {}
        self.device = cfg.get("device", "cpu")
        self._device_pool: dict = {}

    def _data(self, name: str, ntokens: int) -> PromptData:
        if name not in self.data:
            max_tokens = self.cfg["max_tokens"].get(name, ntokens)
            pinned = getattr(self.side, "source_buffer", None)
            buf = pinned(LAYOUTS[name].nbytes(max_tokens), name) if pinned else None
            self.data[name] = PromptData(LAYOUTS[name], max_tokens, buf)
        return self.data[name]

    def put(self, cmd: dict) -> dict:
        host = self._data(cmd["layout"], cmd["ntokens"]).make(cmd["pid"], cmd["ntokens"])
        data = on_device(self.device, host, self._device_pool)
        start = time.perf_counter()
        self.side.put(cmd["layout"], cmd["pid"], cmd["ntokens"], data)
        return {"s": time.perf_counter() - start, "nbytes": int(host.size),
                "digest": digest(host)}

    def get(self, cmd: dict) -> dict:
        # "pattern": how raw TE moves the prompt (tools/bench/rawte.py); others have one
        how = {"pattern": cmd["pattern"]} if "pattern" in cmd else {}
        start = time.perf_counter()
        out = self.side.get(cmd["layout"], cmd["pid"], cmd["ntokens"], **how)
        seconds = time.perf_counter() - start
        if cmd.get("digest") and digest(out) != cmd["digest"]:
            raise RuntimeError(f"prompt {cmd['pid']}: the bytes that arrived differ")
        reply = {"s": seconds, "nbytes": int(out.size if isinstance(out, np.ndarray)
                                              else out.numel())}
        if hasattr(self.side, "last_transfers"):
            reply["transfers"] = self.side.last_transfers
        if getattr(self.side, "last_split", None):
            reply["split"] = dict(self.side.last_split)
        return reply

    def fill(self, cmd: dict) -> dict:
        start = time.perf_counter()
        for pid in range(cmd["start"], cmd["start"] + cmd["count"]):
            self.put({**cmd, "pid": pid})
        return {"s": time.perf_counter() - start}

    def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "info":
            return self.side.info() if hasattr(self.side, "info") else {}
        if op == "peer":
            self.side.peer = cmd["peer"]
            return {}
        return getattr(self, op)(cmd)


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[0])
    worker = Worker(cfg)
    profiler = _profiler(cfg)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            reply = worker.handle(cmd)
        except Exception as exc:  # noqa: BLE001 - report to the parent, keep serving
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    if profiler is not None:
        profiler.stop()
        path = f"{cfg['profile']}/{cfg['system']}-{cfg['role']}"
        with open(f"{path}.txt", "w") as f:
            f.write(profiler.output_text(unicode=False, show_all=False))
        with open(f"{path}.html", "w") as f:
            f.write(profiler.output_html())
    worker.side.close()
    return 0


def _profiler(cfg: dict):
    """pyinstrument over the whole command loop when the parent asks (--profile)."""
    if not cfg.get("profile"):
        return None
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.0005)
    profiler.start()
    return profiler


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
