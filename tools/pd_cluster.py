"""Disaggregated vLLM serving on emulated nodes, as docs/vllm.md deploys it on real ones.

Three nodes (network namespaces where allowed, else loopback ports; tools/netns.py):

* **A**, the prefill node: a kvstore-server and a vLLM OpenAI server whose
  ``KVStoreConnectorV1`` is a ``kv_producer`` saving into A's server;
* **B**, the decode node: a kvstore-server and a vLLM OpenAI server whose connector is
  a ``kv_consumer`` (its own server is B's; A's is in ``allowed_servers``, so it loads
  what the prefill's ``kv_transfer_params`` point at);
* **C**, the front node: the proxy (tools/pd_proxy.py), a plain vLLM server (no
  connector: the single engine answers are compared with) and the clients
  (tools/pd_client.py, which runs every request and store query from inside C).

    with PDCluster(model_dir, workdir) as pd:      # starts all, waits until all serve
        pd.run_plan([{"id": "x", "post": pd.proxy.url + "/v1/completions", "body": ...}])
        pd.store_stats()                           # {"A": stats, "B": stats}

Every process is started in a session of its own; ``close`` (context exit, also on
Ctrl-C) stops each whole process group (TERM, then KILL, bounded) before the cluster
deletes its namespaces; ``leftover_pids()`` and ``leftover_namespaces()`` say whether
anything survived.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, NamedTuple

from tools.engine_proc import _group_members, rpc_dir, shm_files, unlink_all
from tools.netns import ClusterError, Node, make_cluster, namespaces

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32  # CPU attention needs a multiple of 32
START_TIMEOUT_S = 300.0  # three engines starting at once on 2 cores
# TERM to KILL. A vLLM server that is up exits in under a second; one still starting
# (Ctrl-C while `make run` starts its engines) ignores the TERM and waits this out.
STOP_TIMEOUT_S = 8.0
# The kvstore-servers' (they exit in milliseconds; one KILLed leaves its arena file).
STORE_STOP_TIMEOUT_S = 15.0
SERVED_NAME = "tiny"  # the name clients put in "model"; also the connector's model_id
CONNECTOR = {"kv_connector": "KVStoreConnectorV1",
             "kv_connector_module_path": "kvstore.connector.vllm_v1",
             "kv_load_failure_policy": "recompute"}


class Service(NamedTuple):
    name: str
    node: Node
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{self.node.host}:{self.port}"

    @property
    def address(self) -> str:  # a kvstore-server's control address
        return f"tcp://{self.node.host}:{self.port}"

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-nbytes:]
        except OSError:
            return ""


class PDError(RuntimeError):
    """A service did not come up, died, or a client step failed; carries its log's tail."""


def _env(host: str, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (CPU build)
        # Three engines share the machine's cores: pinning each one's OpenMP threads to
        # all of them buys nothing, and sched_setaffinity calls of starting engines were
        # seen stuck in the kernel (unkillable) on an overloaded 2-core VM.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_HOST_IP": host,  # vLLM's own sockets stay on the node's address
        "VLLM_NO_USAGE_STATS": "1",
        "MC_LOG_LEVEL": "ERROR",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
    })
    env.update(extra or {})
    return env


def engine_argv(model: str | Path, dtype: str, host: str, port: int,
                kv_transfer: dict[str, Any] | None = None) -> list[str]:
    """A vLLM OpenAI server's command line (``vllm serve`` fails under vllm-cpu)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED_NAME, "--host", host, "--port", str(port),
            "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--dtype", dtype,
            # usage.prompt_tokens_details.cached_tokens: prompt tokens the engine did
            # not compute; "metrics": the engine's own timings (queue, TTFT from scheduled).
            "--enable-prompt-tokens-details", "--enable-per-request-metrics",
            "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    if kv_transfer is not None:
        argv += ["--kv-transfer-config", json.dumps({**CONNECTOR, **kv_transfer})]
    return argv


class PDCluster:
    def __init__(self, model: str | Path, workdir: str | Path, dtype: str = "float32",
                 prefer_netns: bool = True, env: dict[str, str] | None = None,
                 consumer_extra: dict[str, Any] | None = None,
                 progress: Callable[[str], None] = lambda msg: None,
                 stop: threading.Event | None = None) -> None:
        """``env``: added to every process's environment; ``consumer_extra``: replaces
        keys of the decode connector's ``kv_connector_extra_config`` (None drops one);
        ``progress`` hears each start-up step; ``stop``: set by the caller's signal
        handler. Every wait here checks it and raises ``KeyboardInterrupt``: a handler's
        own exception is lost when the signal lands in a fork hook of ``subprocess``."""
        self.model, self.dtype = Path(model), dtype
        self.workdir = Path(workdir)
        self.extra_env = env
        self.consumer_extra = consumer_extra or {}
        self.progress = progress
        self.stop = stop or threading.Event()
        self.cluster = make_cluster(3, prefer_netns=prefer_netns)
        # vLLM leaves ZMQ socket files, vllm_dist_* and torchinductor dirs in its TMPDIR
        # even after a clean exit: give every process a scratch TMPDIR that close()
        # removes. Socket paths must stay under 108 bytes, so those get a short one.
        self.scratch = self.workdir / "tmp"
        self.rpc_dir: Path | None = None  # made by start()
        self.services: list[Service] = []
        self._groups: list[int] = []
        self._shm: set[str] = set()  # vLLM's /dev/shm files its processes mapped
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> PDCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def kind(self) -> str:
        return self.cluster.kind

    def start(self) -> None:
        progress = self.progress
        self.rpc_dir = rpc_dir()
        self.cluster.start()
        a, b, c = self.cluster.nodes
        self.node_a, self.node_b, self.node_c = a, b, c
        self.store_a = self._kvstore_server(a, "store-a")
        self.store_b = self._kvstore_server(b, "store-b")
        for store in (self.store_a, self.store_b):
            try:
                store.node.wait_port(store.node.host, store.port, timeout=60, proc=store.proc)
            except ClusterError as exc:
                raise PDError(f"{exc}\n{store.log_tail()}") from None
        self._check_stop()
        progress(f"kvstore-servers up: A {self.store_a.address}, B {self.store_b.address}")
        self.prefill = self._engine(a, "prefill", {
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"server": self.store_a.address, "te_host": a.host,
                                          "model_id": SERVED_NAME}})
        consumer = {"server": self.store_b.address, "te_host": b.host,
                    "model_id": SERVED_NAME, "allowed_servers": [self.store_a.address],
                    **self.consumer_extra}
        self.decode = self._engine(b, "decode", {
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {k: v for k, v in consumer.items() if v is not None}})
        self.plain = self._engine(c, "plain", None)
        progress("starting 3 vLLM engines (prefill on A, decode on B, plain on C)")
        self._wait_healthy([self.prefill, self.decode, self.plain], START_TIMEOUT_S)
        self.proxy = self._start(c, "proxy", [
            sys.executable, "-m", "tools.pd_proxy", "--prefill", self.prefill.url,
            "--decode", self.decode.url, "--host", c.host, "--port", str(c.free_port())])
        self._wait_healthy([self.proxy], 60)
        progress(f"engines and proxy up: proxy {self.proxy.url}")

    def close(self) -> None:
        """Stop every process group (proxy and engines first, stores last), remove the
        vLLM shared-memory files they mapped (``shm_left``), then the cluster (its
        namespaces). Idempotent; ignores Ctrl-C and SIGTERM meanwhile
        (in the main thread), so an impatient second signal cannot strand anything."""
        if self._closed:
            return
        self._closed = True
        main = threading.current_thread() is threading.main_thread()
        shielded = (signal.SIGINT, signal.SIGTERM) if main else ()
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in shielded}
        try:
            # The engines and the proxy together, then the stores together: one at a
            # time, their waits add up (a vLLM server still starting ignores the TERM
            # until the KILL, STOP_TIMEOUT_S later).
            engines = [s for s in self.services if not s.name.startswith("store-")]
            stores = [s for s in self.services if s.name.startswith("store-")]
            self._stop_together(engines, STOP_TIMEOUT_S)
            self._stop_together(stores, STORE_STOP_TIMEOUT_S)
            if not self.leftover_pids():  # nobody of this cluster maps them any more
                unlink_all(self.shm_left())
            self.cluster.close()
            shutil.rmtree(self.scratch, ignore_errors=True)
            if self.rpc_dir is not None:
                shutil.rmtree(self.rpc_dir, ignore_errors=True)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop_together(self, services: list[Service], timeout: float) -> None:
        """Stop these services' process groups at once (``_stop_group``, one thread
        each), noting each group's files just before it stops, the group frozen
        meanwhile: an engine still starting makes new ones until it is stopped. The
        first error of any of them is raised once all have ended."""
        lock = threading.Lock()
        errors: list[BaseException] = []

        def note(pids: list[int]) -> None:
            found = shm_files(pids)
            with lock:
                self._shm.update(found)

        def stop(proc: subprocess.Popen) -> None:
            try:
                _stop_group(proc, timeout=timeout, noting=note)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                with lock:
                    errors.append(exc)

        threads = [threading.Thread(target=stop, args=(s.proc,), name=f"stop-{s.name}")
                   for s in services]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _check_stop(self) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt("stop requested")

    def leftover_namespaces(self) -> list[str]:
        """This cluster's network namespaces that still exist (empty after close)."""
        own = {*getattr(self.cluster, "names", ()), getattr(self.cluster, "hub", None)}
        return [ns for ns in namespaces() if ns in own] if self.kind == "netns" else []

    def shm_left(self) -> list[str]:
        """vLLM's shared-memory files this cluster's processes mapped that still exist
        (vLLM leaves some when a process is killed before it unlinks them; ``close``
        removes them once every process is gone)."""
        return sorted(p for p in self._shm if os.path.exists(p))

    def leftover_pids(self) -> list[int]:
        """Live processes still in a group this cluster started (empty after close)."""
        return [pid for pgid in self._groups for pid in _group_members(pgid)]

    # --------------------------------------------------------------- starts
    def _start(self, node: Node, name: str, argv: list[str]) -> Service:
        log_path = self.workdir / f"{name}.log"
        self.scratch.mkdir(parents=True, exist_ok=True)
        port = int(argv[argv.index("--port") + 1])
        with open(log_path, "wb") as logf:
            proc = node.popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                              stderr=subprocess.STDOUT, cwd=REPO, env=self._env(node),
                              start_new_session=True)
        self._groups.append(proc.pid)
        service = Service(name, node, port, proc, log_path)
        self.services.append(service)
        return service

    def _env(self, node: Node) -> dict[str, str]:
        return _env(node.host, {"TMPDIR": str(self.scratch),
                                "VLLM_RPC_BASE_PATH": str(self.rpc_dir),
                                **(self.extra_env or {})})

    def _kvstore_server(self, node: Node, name: str) -> Service:
        return self._start(node, name, [
            sys.executable, "-m", "kvstore.server", "--host", node.host,
            "--port", str(node.free_port()), "--te-host", node.host,
            "--data-dir", str(self.workdir / name), "--dram", "256MiB", "--nvme", "0",
            "--block-tokens", str(BLOCK_SIZE), "--log-level", "WARNING"])

    def _engine(self, node: Node, name: str, kv_transfer: dict[str, Any] | None) -> Service:
        return self._start(node, name, engine_argv(self.model, self.dtype, node.host,
                                                   node.free_port(), kv_transfer))

    def _wait_healthy(self, services: list[Service], timeout: float) -> None:
        """Until each answers GET /health with 200 (asked from node C); fails at once
        if one of them exits."""
        waiter = self.node_c.popen(
            [sys.executable, "-m", "tools.pd_client", "wait", "--timeout", str(timeout),
             *(s.url for s in services)], cwd=REPO, env=self._env(self.node_c),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while waiter.poll() is None:
                self._check_stop()
                for s in services:
                    if s.proc.poll() is not None:
                        raise PDError(f"{s.name} exited ({s.proc.returncode}) before serving:"
                                      f"\n{s.log_tail()}")
                time.sleep(0.5)
        finally:
            _stop_group(waiter, timeout=2)
        if waiter.returncode != 0:
            tails = "\n".join(f"--- {s.name}\n{s.log_tail(1500)}" for s in services)
            raise PDError(f"not serving after {timeout:.0f}s: "
                          f"{[s.name for s in services]}\n{tails}")

    # -------------------------------------------------------------- clients
    def run_plan(self, steps: list[dict[str, Any]], timeout: float = 600.0
                 ) -> list[dict[str, Any]]:
        """Run a tools.pd_client plan on node C; one result per (sub)step, in order."""
        # From a file: Popen.communicate cannot be retried (to check ``stop``) while
        # it still has input to send.
        plan = self.scratch / f"plan-{time.monotonic_ns()}.jsonl"
        plan.write_text("".join(json.dumps(s) + "\n" for s in steps))
        with open(plan) as stdin:
            client = self.node_c.popen([sys.executable, "-m", "tools.pd_client", "run"],
                                       stdin=stdin, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, cwd=REPO,
                                       env=self._env(self.node_c), start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._check_stop()
                try:
                    out, err = client.communicate(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        raise PDError(f"client still running after {timeout:.0f}s") from None
        finally:
            _stop_group(client, timeout=2)
            plan.unlink(missing_ok=True)
        if client.returncode != 0:
            raise PDError(f"client failed ({client.returncode}):\n{err[-3000:]}")
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def store_stats(self) -> dict[str, dict[str, Any]]:
        """Both kvstore-servers' stats: {"A": ..., "B": ...}."""
        addresses = {"A": self.store_a.address, "B": self.store_b.address}
        (res,) = self.run_plan([{"id": "stats", "stats": list(addresses.values())}])
        if "error" in res:
            raise PDError(f"store stats: {res['error']}")
        return {name: res["stats"][addr] for name, addr in addresses.items()}




def _stop_group(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S,
                noting: Callable[[list[int]], None] | None = None) -> None:
    """TERM the process's group (it leads one: start_new_session), KILL after
    ``timeout``; waits for the leader. ``noting(pids)`` first sees the group's members
    while the group is stopped (SIGSTOP): nothing in it can start anything new until
    the TERM; then again every 0.1 s until they are gone (one that does not act on
    the TERM at once may still make files)."""
    if noting is not None and (proc.poll() is None or _group_members(proc.pid)):
        try:
            os.killpg(proc.pid, signal.SIGSTOP)
            noting(_group_members(proc.pid))
        except ProcessLookupError:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None and not _group_members(proc.pid):
            return
        try:
            os.killpg(proc.pid, sig)
            if noting is not None:
                os.killpg(proc.pid, signal.SIGCONT)  # a stopped process acts on TERM now
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc.poll()
            members = _group_members(proc.pid)
            if proc.returncode is not None and not members:
                return
            if noting is not None and members:
                # Again while they stop: a process still starting (an engine core
                # that has not yet acted on the TERM) may make a new file meanwhile.
                noting(members)
            time.sleep(0.1)
    log.error("process group %s survived SIGKILL", proc.pid)


