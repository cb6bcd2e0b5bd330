"""tools/pd_client.py against a real local HTTP server: a parallel group's requests
are sent together (each thread makes its client first), nested groups do not wait
for each other, and every answer comes back with its send and answer times."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools.pd_client import run_step

HOLD_S = 0.3  # each answer's delay: the requests overlap only if sent within it


class _Slow(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(HOLD_S)
        out = json.dumps({"echo": json.loads(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    server.shutdown()
    server.server_close()


def test_a_parallel_groups_requests_are_in_flight_together(url):
    steps = [{"id": f"r{i}", "post": url, "body": {"i": i}} for i in range(8)]
    out = run_step({"parallel": [*steps, {"parallel": steps[:2]}]})
    assert [r["id"] for r in out] == [*(f"r{i}" for i in range(8)), "r0", "r1"]
    assert all(r["status"] == 200 for r in out), out
    assert [r["json"]["echo"]["i"] for r in out] == [*range(8), 0, 1]
    first = out[:8]
    assert max(r["t0"] for r in first) < min(r["t1"] for r in first)
    assert all(r["t1"] - r["t0"] >= HOLD_S for r in out)


def test_a_step_that_fails_reports_its_error(url):
    dead = url.rsplit(":", 1)[0] + ":1/v1/completions"  # nothing listens on port 1
    (out,) = run_step({"id": "x", "post": dead, "body": {}})
    assert out["id"] == "x" and "ConnectError" in out["error"] and out["t1"] >= out["t0"]


PAGE = b"""# HELP vllm:kvstore_load_seconds Time of a load.
# TYPE vllm:kvstore_load_seconds histogram
vllm:kvstore_load_seconds_sum{engine="0",model_name="m"} 0.25
vllm:kvstore_load_seconds_sum{engine="1",model_name="m"} 0.5
vllm:kvstore_load_seconds_count{engine="0",model_name="m"} 3.0
vllm:kvstore_load_seconds_created{engine="0",model_name="m"} 1.7e9
vllm:kvstore_loads_total 2.0 1700000000000
"""


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args) -> None:
        pass


def test_a_metrics_step_sums_each_named_sample_over_its_labels():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (out,) = run_step({"id": "m", "metrics": f"http://127.0.0.1:{server.server_address[1]}"
                           "/metrics", "names": ["vllm:kvstore_load_seconds_sum",
                                                 "vllm:kvstore_load_seconds_count",
                                                 "vllm:kvstore_loads_total", "vllm:absent"]})
    finally:
        server.shutdown()
        server.server_close()
    assert out == {"id": "m", "metrics": {"vllm:kvstore_load_seconds_sum": 0.75,
                                          "vllm:kvstore_load_seconds_count": 3.0,
                                          "vllm:kvstore_loads_total": 2.0}}
