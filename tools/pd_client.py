"""The client side of a disaggregated deployment, run inside one emulated node.

A process in a network namespace cannot be reached from the root namespace (and the
other way round), so tests and ``tools.demo`` send their HTTP requests and store
queries through this module, started on a node (``tools.netns``):

    python -m tools.pd_client wait --timeout 240 http://10.213.0.1:20000 ...
        exits 0 once every server answers GET /health with 200, else 1
    python -m tools.pd_client run < plan.jsonl > results.jsonl

A plan is JSON lines, run in order; each line is one step:

    {"id": "ref-7", "post": "http://host:port/v1/completions", "body": {...}}
    {"id": "stats", "stats": ["tcp://10.213.0.1:20001", ...]}
    {"id": "proxy", "get": "http://host:port/proxy/stats"}
    {"id": "m", "metrics": "http://host:port/metrics", "names": ["vllm:x_total", ...]}
    {"parallel": [step, step, ...]}   # all at once, one thread each, sent together

Each step prints one result line: ``{"id", "status", "json", "t0", "t1"}`` for HTTP
(``t0``/``t1``: monotonic send and answer times, so callers can see which requests
were in flight together; a streamed body also gets ``"stream_tokens"`` (token ids of
every chunk), ``"stream_usage"`` (the last usage a chunk carried) and
``"first_chunk_s"``), ``{"id", "stats": {address: stats}}`` for stores,
``{"id", "metrics": {name: value}}`` for Prometheus samples (summed over their
labels; a name not on the page is left out), ``{"id", "error"}`` when it failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REQUEST_TIMEOUT_S = 300.0
START_WAIT_S = 60.0  # how long a parallel group's steps wait for each other to start


def _http(step: dict[str, Any], start: threading.Barrier | None = None) -> dict[str, Any]:
    """One HTTP step. ``start``: the steps of a ``parallel`` group each make their
    client (an SSL context each: tens of ms of CPU, one thread at a time), then wait
    for the others, so that they are sent together."""
    out: dict[str, Any] = {"id": step.get("id")}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        if start is not None:
            try:
                start.wait(START_WAIT_S)
            except threading.BrokenBarrierError:
                pass  # one never came: send anyway
        t0 = time.monotonic()
        try:
            if "get" in step:
                r = client.get(step["get"])
            elif step["body"].get("stream"):
                return _stream(client, step, out, t0)
            else:
                r = client.post(step["post"], json=step["body"])
            out.update(status=r.status_code, json=_json(r))
        except httpx.HTTPError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    out.update(t0=t0, t1=time.monotonic())
    return out


def _stream(client: httpx.Client, step: dict[str, Any], out: dict[str, Any],
            t0: float) -> dict[str, Any]:
    tokens: list[int] = []
    first, usage = None, None
    with client.stream("POST", step["post"], json=step["body"]) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            first = first if first is not None else time.monotonic() - t0
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or []:
                tokens.extend(choice.get("token_ids") or [])
            usage = chunk.get("usage") or usage
    out.update(stream_tokens=tokens, stream_usage=usage, first_chunk_s=first, t0=t0,
               t1=time.monotonic())
    return out


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text[:2000]


def _stats(step: dict[str, Any]) -> dict[str, Any]:
    from kvstore.client.client import KVStoreClient

    out: dict[str, Any] = {"id": step.get("id"), "stats": {}}
    for address in step["stats"]:
        try:
            with KVStoreClient(address, timeout_s=10.0) as client:
                stats = client.stats()
                # A reader's release (which carries its bytes) may still be on its way
                # on a loaded machine: wait, briefly, until no read is open.
                deadline = time.monotonic() + 10.0
                while stats.get("leases") and time.monotonic() < deadline:
                    time.sleep(0.05)
                    stats = client.stats()
                out["stats"][address] = stats
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which decides
            out["error"] = f"{address}: {type(exc).__name__}: {exc}"
    return out


def _metrics(step: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": step.get("id")}
    try:
        r = httpx.get(step["metrics"], timeout=REQUEST_TIMEOUT_S)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    wanted, found = set(step["names"]), {}
    try:
        samples = [s for fam in text_string_to_metric_families(r.text) for s in fam.samples]
    except ValueError as exc:
        out["error"] = f"unreadable metrics on {step['metrics']}: {exc}"
        return out
    for sample in samples:
        if sample.name in wanted:
            found[sample.name] = found.get(sample.name, 0.0) + sample.value
    out["metrics"] = found
    return out


def run_step(step: dict[str, Any],
             start: threading.Barrier | None = None) -> list[dict[str, Any]]:
    if "parallel" in step:
        subs = step["parallel"]
        together = sum(1 for s in subs if not {"parallel", "stats", "metrics"} & set(s))
        barrier = threading.Barrier(together) if together > 1 else None
        with ThreadPoolExecutor(max(1, len(subs))) as pool:
            return [r for rs in pool.map(lambda s: run_step(s, barrier), subs) for r in rs]
    if "stats" in step:
        return [_stats(step)]
    return [_metrics(step) if "metrics" in step else _http(step, start)]


def wait_healthy(urls: Sequence[str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        try:
            if httpx.get(f"{pending[0].rstrip('/')}/health", timeout=2.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return not pending


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.pd_client",
                                 description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    wait = sub.add_parser("wait", help="wait until every URL's /health answers 200")
    wait.add_argument("urls", nargs="+")
    wait.add_argument("--timeout", type=float, default=240.0)
    sub.add_parser("run", help="run the plan on stdin, print one result line per step")
    args = ap.parse_args(argv)
    if args.cmd == "wait":
        return 0 if wait_healthy(args.urls, args.timeout) else 1
    for line in sys.stdin:
        if line.strip():
            for result in run_step(json.loads(line)):
                sys.stdout.write(json.dumps(result) + "\n")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
