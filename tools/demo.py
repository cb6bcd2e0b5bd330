"""``make run``: disaggregated prefill/decode across two kvstore nodes.

Two ``kvstore-server`` nodes (network namespaces where allowed, else loopback
ports). Node A prefills each prompt with a small local Llama and inserts its KV
into A's server; node B gets the hand-off (the prompt and A's address, as vLLM's
``kv_transfer_params`` would carry), ``drop_select``s the KV from A, and continues
greedy decoding. This process computes the same answers in one process with
Hugging Face ``generate`` and says "identical" only if every token matches.

    python -m tools.demo [--prompt-lengths 7,16,100,300] [--decode-tokens 32] [--loopback]

Ctrl-C or SIGTERM: servers and workers are killed by PID and the namespaces deleted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # children inherit it; before any mooncake import

from tools.demo_report import render
from tools.netns import ClusterError, Node, make_cluster

log = logging.getLogger("tools.demo")

DEFAULT_LENGTHS = (7, 16, 100, 300)  # under a block, one block, not multiples of 16
DEFAULT_DECODE = 32
WORKER_TIMEOUT_S = 120.0
_SERVER_MAIN = "from kvstore.server import main; main()"


class PromptRun(NamedTuple):
    length: int
    matched_tokens: int
    blocks: int
    nbytes: int
    prefill_s: float
    insert_s: float
    transfer_s: float
    decode_s: float
    tokens: list[int] | None  # node B's [first token, *decoded]; None on a miss
    reference: list[int]  # the single-process run's tokens

    @property
    def identical(self) -> bool:
        return self.tokens is not None and self.tokens == self.reference


class DemoResult(NamedTuple):
    kind: str  # "netns" | "loopback"
    hosts: tuple[str, str]
    runs: list[PromptRun]
    stats: dict[str, dict[str, Any]]  # "A after prefill", "A after decode", "B after decode"
    decode_tokens: int
    dtype: str

    @property
    def all_identical(self) -> bool:
        return bool(self.runs) and all(r.identical for r in self.runs)


class DemoError(RuntimeError):
    """A node or worker failed; the message carries the tail of its log."""


# -------------------------------------------------------------- processes
class _Server(NamedTuple):
    node: Node
    address: str  # tcp://host:port
    port: int
    proc: subprocess.Popen
    log_path: str


def _launch_server(node: Node, data_dir: str, log_path: str) -> _Server:
    port = node.free_port()
    argv = [sys.executable, "-c", _SERVER_MAIN, "--host", node.host, "--port", str(port),
            "--te-host", node.host, "--data-dir", data_dir, "--dram", "64MiB",
            "--nvme", "128MiB", "--log-level", "WARNING"]
    with open(log_path, "w") as logf:
        proc = node.popen(argv, stdout=logf, stderr=subprocess.STDOUT)
    return _Server(node, f"tcp://{node.host}:{port}", port, proc, log_path)


def _wait_ready(server: _Server) -> str:
    try:
        server.node.wait_port(server.node.host, server.port, timeout=60, proc=server.proc)
    except ClusterError as exc:
        raise DemoError(f"{exc}\n{_tail(server.log_path)}") from None
    return server.address


def _worker(node: Node, role: str, server: str, args: argparse.Namespace,
            stdin: int | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "tools.demo_node", role, "--server", server,
            "--te-host", node.host, "--lengths", ",".join(map(str, args.prompt_lengths)),
            "--decode-tokens", str(args.decode_tokens), "--dtype", args.dtype]
    return node.popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True, cwd=_repo_root())


def _finish(proc: subprocess.Popen, role: str, stdin: str | None = None) -> list[dict]:
    try:
        out, err = proc.communicate(input=stdin, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
        raise DemoError(f"{role} worker timed out after {WORKER_TIMEOUT_S:.0f}s\n{err[-3000:]}")
    if proc.returncode != 0:
        raise DemoError(f"{role} worker failed (exit {proc.returncode})\n{err[-3000:]}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _tail(path: str, nbytes: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-nbytes:]
    except OSError:
        return ""


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ the run
def _references(lengths: Sequence[int],
                args: argparse.Namespace) -> dict[int, tuple[list[int], list[int]]]:
    """length -> (prompt, its tokens from one process with HF ``generate``)."""
    import torch

    from tools import model as demo_model

    demo_model.configure_torch(1)
    model = demo_model.build_model(dtype=getattr(torch, args.dtype))
    vocab = model.config.vocab_size
    prompts = {n: demo_model.make_prompt(n, 0, vocab) for n in lengths}
    return {n: (p, demo_model.reference_tokens(model, p, args.decode_tokens))
            for n, p in prompts.items()}


def run_demo(args: argparse.Namespace,
             progress: Callable[[str], None] = lambda msg: log.info("%s", msg)) -> DemoResult:
    """Run the whole demo; ``progress`` hears each step (the CLI prints them)."""
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp, \
            make_cluster(2, prefer_netns=not args.loopback) as cluster:
        a, b = cluster.nodes
        progress(f"starting 2 kvstore-server nodes in "
                 f"{'network namespaces' if cluster.kind == 'netns' else 'loopback ports'}: "
                 f"A={a.host}, B={b.host}")
        launched = [_launch_server(node, os.path.join(tmp, name), os.path.join(tmp, f"{name}.log"))
                    for node, name in ((a, "a"), (b, "b"))]
        server_a, server_b = map(_wait_ready, launched)
        progress(f"servers up: A {server_a}, B {server_b}; prefill on A, decode on B")
        # B imports and builds its model while A prefills; it reads hand-offs from stdin.
        decoder = _worker(b, "decode", server_b, args, stdin=subprocess.PIPE)
        prefiller = _worker(a, "prefill", server_a, args)
        reference = _references(args.prompt_lengths, args)
        progress("single-process reference run done")
        prefilled = _finish(prefiller, "prefill")
        progress(f"A prefilled and inserted {len(args.prompt_lengths)} prompts; "
                 "handing them to B")
        handoffs = "".join(json.dumps({"handoff": r["handoff"]}) + "\n"
                           for r in prefilled if "handoff" in r)
        decoded = _finish(decoder, "decode", stdin=handoffs)
        progress("B decoded; stopping servers")
    stats_b = next(r["stats"] for r in decoded if "stats" in r)
    stats = {"A after prefill": next(r["stats"] for r in prefilled if "stats" in r),
             "A after decode": stats_b.get(server_a, {}),
             "B after decode": stats_b.get(server_b, {})}
    pre = [r for r in prefilled if "handoff" in r]
    dec = [r for r in decoded if "length" in r]
    if not len(pre) == len(dec) == len(args.prompt_lengths):
        raise DemoError(f"{len(args.prompt_lengths)} prompts, but A handed off {len(pre)} "
                        f"and B answered {len(dec)}")
    runs = [_prompt_run(p, d, reference[d["length"]]) for p, d in zip(pre, dec)]
    return DemoResult(cluster.kind, (a.host, b.host), runs, stats, args.decode_tokens, args.dtype)


def _prompt_run(pre: dict, dec: dict, reference: tuple[list[int], list[int]]) -> PromptRun:
    prompt, expected = reference
    if pre["handoff"]["tokens"] != prompt:  # B answers hand-offs in order
        raise DemoError(f"node A prefilled a different {len(prompt)}-token prompt than "
                        "the reference run")
    return PromptRun(dec["length"], dec["matched_tokens"], dec.get("blocks", 0), dec["nbytes"],
                     pre["prefill_s"], pre["insert_s"], dec["transfer_s"],
                     dec.get("decode_s", 0.0), dec["tokens"], expected)


# ------------------------------------------------------------------- CLI
def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or any(v <= 0 or v > 1500 for v in values):
        raise argparse.ArgumentTypeError("prompt lengths must be in 1..1500")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-lengths", type=_lengths, default=list(DEFAULT_LENGTHS),
                    help="comma-separated prompt lengths [7,16,100,300]")
    ap.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE,
                    help=f"tokens node B decodes per prompt [{DEFAULT_DECODE}]")
    ap.add_argument("--loopback", action="store_true",
                    help="loopback ports instead of network namespaces")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    if not 1 <= args.decode_tokens <= 500:
        ap.error("--decode-tokens must be in 1..500")
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Explicitly: a shell's background job inherits SIGINT ignored, and Ctrl-C must still stop us.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    start = time.monotonic()
    try:
        result = run_demo(args, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("interrupted: servers stopped, namespaces removed", file=sys.stderr)
        return 130
    except DemoError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    print(render(result, time.monotonic() - start))
    return 0 if result.all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
