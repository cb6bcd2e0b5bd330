"""A disaggregated prefill/decode proxy in front of two vLLM OpenAI servers.

For each ``POST /v1/completions`` it sends the request to the prefill server with
``max_tokens=1`` (the prefill engine, a ``kv_producer``, saves the prompt's KV into its
kvstore-server and answers with ``kv_transfer_params`` naming that server), then sends
the original request plus those ``kv_transfer_params`` to the decode server (a
``kv_consumer``, which loads the KV from the store instead of computing the prompt) and
returns the decode server's answer, streamed if the request asked for a stream.

If the prefill call fails or returns no ``kv_transfer_params``, the request still goes
to the decode server without them: the decode engine then computes the whole prompt.

    python -m tools.pd_proxy --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 \\
        --host 0.0.0.0 --port 8000

``GET /proxy/stats`` counts requests, hand-offs (decode got the prefill's params) and
prefill failures.
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("tools.pd_proxy")

# Request fields that cannot stand beside max_tokens=1 / stream=False on the prefill side.
_PREFILL_DROPS = ("stream_options", "min_tokens")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request: the same prompt and sampling, one token, no stream."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out.update(max_tokens=1, stream=False)
    out.pop("kv_transfer_params", None)  # a client's params never reach the producer
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode request: the client's own, with the prefill's params (or none)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params:
        out["kv_transfer_params"] = params
    return out


def make_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    counts: Counter[str] = Counter()
    http: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        http["client"] = httpx.AsyncClient(timeout=timeout_s, limits=limits)
        try:
            yield
        finally:
            await http.pop("client").aclose()

    app = FastAPI(lifespan=lifespan)

    async def prefill(body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            r = await http["client"].post(f"{prefill_url}/v1/completions",
                                          json=prefill_body(body))
        except httpx.HTTPError as exc:
            counts["prefill_failures"] += 1
            log.warning("prefill %s unreachable (%s): decode computes the prompt", prefill_url, exc)
            return None
        if r.status_code != 200:
            counts["prefill_failures"] += 1
            log.warning("prefill answered %s (%s): decode computes the prompt", r.status_code,
                        r.text[:200])
            return None
        params = r.json().get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        counts["requests"] += 1
        params = await prefill(body)
        counts["handoffs" if params else "without_params"] += 1
        decode = decode_body(body, params)
        client = http["client"]
        url = f"{decode_url}/v1/completions"
        if not body.get("stream"):
            r = await client.post(url, json=decode)
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        upstream = await client.send(client.build_request("POST", url, json=decode), stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    @app.get("/proxy/stats")
    async def stats() -> JSONResponse:
        return JSONResponse({k: counts[k] for k in
                             ("requests", "handoffs", "without_params", "prefill_failures")})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.pd_proxy",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="prefill server, http://host:port")
    ap.add_argument("--decode", required=True, help="decode server, http://host:port")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import uvicorn

    uvicorn.run(make_app(args.prefill, args.decode, args.timeout), host=args.host,
                port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
