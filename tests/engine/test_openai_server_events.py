"""What KVStoreConnectorV1 tells an operator from inside a real vLLM OpenAI server:
/metrics, the "KV Transfer metrics" log line and vLLM's KV event stream, against a
real kvstore-server. (The same counts and events without an engine, step by step:
tests/integration/test_vllm_v1_observability.py.)
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")

from kvstore.connector.v1_stats import MEDIUM  # noqa: E402
from tests.integration.conftest import free_port, server_factory  # noqa: E402, F401 - a fixture

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(400)]


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _get(url: str, timeout: float = 10.0) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def _metric(text: str, name: str) -> float:
    """The value of an unlabelled-by-us sample (vLLM adds model_name and engine)."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_real_openai_server_shows_stats_in_metrics_and_log_and_publishes_events(
        server_factory, tmp_path):
    """A vLLM OpenAI server (kv_both, keep mode, vLLM's prefix cache on) with KV events
    published over ZeroMQ: a first prompt misses and is saved, the same prompt again
    hits (vLLM holds its 3 full blocks, the store gives the partial one). /metrics, the
    "KV Transfer metrics" log line and the event stream must show exactly that, and the
    store's BlockStored names the hashes vLLM's own GPU events give those blocks."""
    import json
    import random
    import subprocess

    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    from tools.engine_proc import rpc_dir
    from tools.pd_cluster import SERVED_NAME, _env, _stop_group, engine_argv
    from tools.tiny_models import VOCAB, ModelSpec, build

    block = 32
    store = server_factory(dram="64MiB", nvme="64MiB", block_tokens=block)
    spec = ModelSpec("llama", "float32")
    model = build(spec, tmp_path / "models")
    from zmq.utils.monitor import recv_monitor_message

    # vLLM's publisher binds (an ipc:// endpoint is bound; it only connects to a
    # tcp://host:port, and then published nothing here); we connect, as routers do.
    endpoint = f"ipc://{tmp_path}/kv-events"
    ctx = zmq.Context()  # our own: nothing else's sockets hold up its end
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)  # retried by ZeroMQ until the server has bound it
    port = free_port()
    argv = engine_argv(model, "float32", "127.0.0.1", port, {
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"server": store.address, "model_id": "tiny"}})
    argv += ["--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})]
    log_path = tmp_path / "vllm.log"
    # vLLM leaves its socket files and a vllm_dist_* file in its TMPDIR even after a
    # clean exit: both go to dirs of this test's (as tools/pd_cluster.py does).
    scratch, rpc = tmp_path / "tmp", rpc_dir()
    scratch.mkdir()
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=_env("127.0.0.1", {"VLLM_LOG_STATS_INTERVAL": "1",
                                                       "TMPDIR": str(scratch),
                                                       "VLLM_RPC_BASE_PATH": str(rpc)}))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "vLLM server not up in 300 s"
            try:
                _get(url + "/health")
                break
            except OSError:
                time.sleep(1)

        # A PUB drops what it sends before our subscription reached it: wait until
        # we are connected to vLLM's publisher before the first event can happen.
        assert monitor.poll(60_000), "never connected to vLLM's KV event publisher"
        recv_monitor_message(monitor)
        time.sleep(0.5)  # the subscription travels after the handshake

        prompt = [random.Random(3).randrange(VOCAB) for _ in range(100)]  # 99 stored
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}

        def metrics_when(name: str, want: float) -> str:
            until = time.monotonic() + 30
            while True:
                text = _get(url + "/metrics")
                if _metric(text, name) >= want or time.monotonic() > until:
                    return text
                time.sleep(0.5)

        _post(url + "/v1/completions", body)
        metrics_when("vllm:kvstore_saves_total", 1)  # no next request needed
        _post(url + "/v1/completions", body)
        text = metrics_when("vllm:kvstore_saves_total", 2)
        got = {name: _metric(text, f"vllm:kvstore_{name}_total") for name in
               ("saves", "saved_tokens", "misses", "hits", "loads", "loaded_tokens",
                "load_failures", "save_failures", "rejected_servers")}
        assert got == {"saves": 2, "saved_tokens": 198, "misses": 1, "hits": 1, "loads": 1,
                       "loaded_tokens": 3, "load_failures": 0, "save_failures": 0,
                       "rejected_servers": 0}, got
        nbytes = spec.layers * 2 * spec.kv_heads * (spec.hidden // 4) * 4  # K+V, fp32
        # The second save's lookup found all 99 tokens stored: it sends no byte.
        assert _metric(text, "vllm:kvstore_saved_bytes_total") == 99 * nbytes
        assert _metric(text, "vllm:kvstore_load_seconds_count") == 1

        until = time.monotonic() + 20
        while "KV Transfer metrics:" not in log_path.read_text() and time.monotonic() < until:
            time.sleep(0.5)
        lines = [ln for ln in log_path.read_text().splitlines() if "KV Transfer metrics:" in ln]
        assert lines and any("Misses=1" in ln for ln in lines), lines

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events = []
        while sub.poll(2000):
            _topic, _seq, payload = sub.recv_multipart()
            events.extend(decoder.decode(payload).events)
        ours = [e for e in events if getattr(e, "medium", None) == MEDIUM]
        gpu = [h for e in events if type(e).__name__ == "BlockStored" and e.medium != MEDIUM
               for h in e.block_hashes]  # vLLM's own prefix cache's
        assert [type(e).__name__ for e in ours] == ["BlockStored", "BlockStored"], \
            [(type(e).__name__, getattr(e, "medium", None)) for e in events]
        assert ours[0].block_hashes == ours[1].block_hashes == gpu[:3]
        assert ours[0].token_ids == prompt[:96] and ours[0].block_size == block
    finally:
        _stop_group(proc)
        shutil.rmtree(rpc, ignore_errors=True)
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)
        ctx.term()
