"""Real vLLM engines around real kvstore-servers, for the connector's end-to-end tests.

Fixtures (scopes chosen so each engine starts once: a start costs ~3 - 20 s here,
forked from a zygote that imported vLLM once, tools/engine_fork.py):

* ``engine_config`` (module, parametrized over ``ENGINE_CONFIGS`` by
  ``pytest_generate_tests``): the tiny model (``spec``) and vLLM process layout a round
  of engines runs; pytest groups the tests by it, so only one config's engines are
  alive at a time.
* ``model_dir(spec)`` — ``tools.tiny_models.build`` under a session temp dir.
* ``cluster`` (session) — two emulated nodes (``tools.netns.make_cluster(2)``): network
  namespaces where allowed, else loopback; ``cluster.kind`` says which, and every test
  using it records it (``node_emulation`` property and a log line).
* ``references`` (session) — ``references.tokens(spec)``: ``{prompt tuple: tokens}`` of one
  plain engine (no connector) per config, over every prompt in ``ALL_PROMPTS``, computed
  once per session in one batch; the plain engine is stopped as soon as it answered.
* ``disagg(spec)`` (module) — a ``Disagg``: kvstore-server A on node 0 and B on node 1
  (fresh per config), a prefill engine (``kv_producer``, saves to A) and a decode engine
  (``kv_consumer``, loads from A, same node: shared-memory path) on node 0, and a decode
  engine on node 1 whose own server is B and which may also load from A (over TE). All
  engines start together (with the config's plain engine); at teardown each is shut down
  and must leave no process behind.

Prompts are pure functions of (phase, length): random tokens from a seed per phase, so
phases never share a prefix and each phase's KV is where that phase put it.
"""

from __future__ import annotations

import logging
import math
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.integration.conftest import REPO, ServerFactory, ServerProc, server_env
from tools.engine_proc import Completion, EngineProc, start_all, stop_all
from tools.netns import make_cluster, namespaces
from tools.tiny_models import VOCAB, ModelSpec, build

log = logging.getLogger(__name__)



class EngineConfig(NamedTuple):
    """What one round of engines runs: a model and vLLM's process layout."""

    spec: ModelSpec
    in_process: bool  # engine core inside the driver (fast start) or vLLM's own layout

    @property
    def name(self) -> str:
        return f"{self.spec.arch}-{self.spec.dtype}-{'inproc' if self.in_process else 'mp'}"


# Each config's engines run in one process each (~3x faster to start). vLLM's own
# multi-process layout, where the connector's metadata and the requests'
# kv_transfer_params cross processes as deployed, is what the HTTP tests run
# (tests/engine/test_pd_http.py, the `make run` test, and the OpenAI server of
# tests/engine/test_openai_server_events.py), and the TP = 2 test puts each
# rank's worker in a process of its own; an offline config in that layout cost ~55 s
# of the suite (its four engines took 95 s to start, against ~40 s) and covered
# nothing those do not. Each architecture and each dtype runs; Qwen2 in bf16 (their
# fourth pairing, ~75 s) was dropped: the connector's paths depend on the dtype's
# size and the cache's layout, which these three cover.
ENGINE_CONFIGS = [EngineConfig(ModelSpec("llama", "float32"), in_process=True),
                  EngineConfig(ModelSpec("llama", "bfloat16"), in_process=True),
                  EngineConfig(ModelSpec("qwen2", "float32"), in_process=True)]
BLOCK = 32  # engine block size (CPU attention needs a multiple of 32) = entry block
PROMPT_LENS = (1, 31, 32, 33, 37, 300, 2050)
DECODE_TOKENS = 48  # long enough that a wrong KV shows (the tiny models drift late)
PHASE_LENS = {"same_node": PROMPT_LENS, "te": PROMPT_LENS, "salt": (37, 300),
              "rogue": (37, 300), "one_token": (1,)}
# A patient server: these tests check what engines decode, not how a server pushes back
# (tests/integration/test_busy.py does). Leases as in production (30 s), and ``busy``
# only past 20 s (default 2 s; still below the connectors' 30 s timeouts): on 2 cores
# shared with engines that compute, a server process has gone without the CPU for
# 2 - 4 s (its log: "answered busy ... the serving thread is on a lookup for 4.4 s"),
# failed a load, and left its entries behind.
PATIENT = dict(reservation_lease=30.0, read_lease=30.0, extra=("--busy-after", "20"))
SERVER_OPTS = dict(dram="64MiB", nvme="64MiB", block_tokens=BLOCK, **PATIENT)


def prompts(phase: str) -> list[list[int]]:
    seed = sorted(PHASE_LENS).index(phase) + 1
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in PHASE_LENS[phase]]


ALL_PROMPTS = [p for phase in PHASE_LENS for p in prompts(phase)]


def stored_blocks(prompt_lens) -> int:
    """Entries a producer leaves for these prompts: the loadable prompt_len - 1 tokens,
    one entry per block, the last one partial."""
    return sum(math.ceil((n - 1) / BLOCK) for n in prompt_lens)


def pytest_generate_tests(metafunc):
    if "engine_config" in metafunc.fixturenames:
        metafunc.parametrize("engine_config", ENGINE_CONFIGS,
                             ids=[c.name for c in ENGINE_CONFIGS], scope="module",
                             indirect=True)


@pytest.fixture(scope="module")
def engine_config(request) -> EngineConfig:
    return request.param


@pytest.fixture(scope="module")
def spec(engine_config) -> ModelSpec:
    return engine_config.spec


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def model_dir(spec, models_root) -> Path:
    return build(spec, models_root)


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


# ------------------------------------------------------------------ nodes
@pytest.fixture(scope="session")
def cluster():
    with make_cluster(2) as c:
        log.warning("engine tests run on %s nodes", c.kind)
        yield c
    assert not [ns for ns in namespaces() if ns.startswith(tuple(getattr(c, "names", ())))]


@pytest.fixture
def node_emulation(cluster, record_property) -> str:
    """Which node emulation this test ran on: "netns" or "loopback" (also recorded)."""
    record_property("node_emulation", cluster.kind)
    log.warning("this test runs on %s nodes", cluster.kind)
    return cluster.kind


def node_prefix(cluster, node) -> tuple[str, ...]:
    return ("ip", "netns", "exec", node.netns) if cluster.kind == "netns" else ()


# ------------------------------------------------------------- reference
class References:
    """Plain-engine tokens per model config, computed once per session."""

    def __init__(self, log_dir: Path, models_root: Path) -> None:
        self.log_dir, self.models_root = log_dir, models_root
        self._engines: dict[ModelSpec, EngineProc] = {}
        self._tokens: dict[ModelSpec, dict[tuple[int, ...], list[int]]] = {}

    def engine(self, spec: ModelSpec) -> EngineProc | None:
        """The (not yet started) plain engine for ``spec``; None once its tokens exist."""
        if spec in self._tokens:
            return None
        if spec not in self._engines:
            self._engines[spec] = EngineProc(build(spec, self.models_root), spec.dtype,
                                             log_path=self.log_dir / f"{spec.name}-plain.log",
                                             in_process=True, name=f"{spec.name}-plain")
        return self._engines[spec]

    def tokens(self, spec: ModelSpec) -> dict[tuple[int, ...], list[int]]:
        if spec not in self._tokens:
            eng = self.engine(spec)
            if eng.proc is None:
                eng.start()
            # bf16: the two most likely tokens at each position too, to tell a near-tie
            # from a wrong KV (prompt_report).
            top = 2 if spec.dtype == "bfloat16" else None
            try:
                outs = eng.generate(ALL_PROMPTS, DECODE_TOKENS, logprobs=top)
            finally:
                self._stop(spec)
            self._tokens[spec] = {tuple(p): RefTokens(o.token_ids, o.top_logprobs)
                                  for p, o in zip(ALL_PROMPTS, outs)}
        return self._tokens[spec]

    def _stop(self, spec: ModelSpec) -> None:
        eng = self._engines.pop(spec)
        eng.shutdown()
        assert not eng.leftover_pids(), f"{eng} left processes {eng.leftover_pids()}"

    def close(self) -> None:
        for spec in list(self._engines):
            self._stop(spec)


@pytest.fixture(scope="session")
def references(engine_logs, models_root):
    refs = References(engine_logs, models_root)
    yield refs
    refs.close()


# ---------------------------------------------------------- disaggregated
@dataclass
class Disagg:
    """One model config's engines and servers (see the module docstring)."""

    spec: ModelSpec
    kind: str  # node emulation: "netns" | "loopback"
    server_a: ServerProc
    server_b: ServerProc
    producer: EngineProc  # node 0, saves to A
    consumer_a: EngineProc  # node 0, loads from A (same node)
    consumer_b: EngineProc  # node 1, own server B, may load from A (TE)
    reference: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def stats_a(self) -> dict[str, Any]:
        return self.producer.stats(self.server_a.address)  # asked from A's node

    def stats_b(self) -> dict[str, Any]:
        return self.consumer_b.stats(self.server_b.address)

    def engines(self) -> list[EngineProc]:
        return [self.producer, self.consumer_a, self.consumer_b]


def connector_config(spec: ModelSpec, server: ServerProc, te_host: str, **extra) -> dict:
    # A lookup's budget is 0.25 s by default; these engines share 2 cores, and a lookup
    # that overruns it marks the server down: tests of what a lookup finds get 5 s.
    return {"server": server.address, "te_host": te_host, "model_id": spec.name,
            "same_node": "auto", "timeout_s": 10.0, "staging_bytes": "32MiB",
            "lookup_timeout_s": 5.0, **extra}


@pytest.fixture(scope="module")
def disagg(engine_config, spec, model_dir, cluster, references, engine_logs, tmp_path_factory):
    a, b = cluster.nodes
    factory = ServerFactory(tmp_path_factory.mktemp(f"servers-{spec.name}"))
    engines: list[EngineProc] = []
    try:
        srv_a = factory(host=a.host, port=a.free_port(), prefix=node_prefix(cluster, a),
                        **SERVER_OPTS)
        srv_b = factory(host=b.host, port=b.free_port(), prefix=node_prefix(cluster, b),
                        **SERVER_OPTS)
        # On loopback both "nodes" share one host id: only same_node=False keeps B on TE.
        b_extra = {"allowed_servers": [srv_a.address]}
        if cluster.kind == "loopback":
            b_extra["same_node"] = False

        def engine(node, role, server, name, **extra) -> EngineProc:
            eng = EngineProc(model_dir, spec.dtype, role=role,
                             connector=connector_config(spec, server, node.host, **extra),
                             host_ip=node.host, prefix=node_prefix(cluster, node),
                             log_path=engine_logs / f"{engine_config.name}-{name}.log",
                             in_process=engine_config.in_process,
                             name=f"{engine_config.name}-{name}")
            engines.append(eng)
            return eng

        d = Disagg(spec, cluster.kind, srv_a, srv_b,
                   engine(a, "kv_producer", srv_a, "prefill-a"),
                   engine(a, "kv_consumer", srv_a, "decode-a"),
                   engine(b, "kv_consumer", srv_b, "decode-b", **b_extra))
        plain = references.engine(spec)
        start_all([e for e in (plain, *engines) if e is not None and e.proc is None])
        d.reference = references.tokens(spec)
        yield d
    finally:
        stop_all(engines)
        factory.stop_all()
    assert_no_leftovers(engines)


def assert_no_leftovers(engines) -> None:
    """After ``stop_all``: no engine left a process of its own behind."""
    leaked = {str(e): e.leftover_pids() for e in engines if e.leftover_pids()}
    assert not leaked, f"engines left processes behind: {leaked}"


# ------------------------------------------------------------- listener
_LISTEN = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16)
print("listening", flush=True)
while True:
    conn, peer = s.accept()
    print("accepted", peer, flush=True)
"""


class Listener:
    """A bare TCP listener on a node: counts who connects (nobody should)."""

    def __init__(self, cluster, node) -> None:
        self.address = f"tcp://{node.host}:{node.free_port()}"
        host, port = self.address[len("tcp://"):].rsplit(":", 1)
        self.proc = node.popen([sys.executable, "-c", _LISTEN, host, port],
                               stdout=subprocess.PIPE, text=True, env=server_env(), cwd=REPO)
        assert self.proc.stdout.readline().strip() == "listening"

    def stop(self) -> list[str]:
        """Stop it; the connections it accepted."""
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        return [line for line in out.splitlines() if line.startswith("accepted")]


def settle(stats: Callable[[], dict], want_entries: int | None = None, timeout: float = 30.0,
           quiet: float = 1.0) -> dict:
    """A server's stats once a producer's saves have landed (they finish in the
    background, after ``generate`` returned): ``want_entries`` reached (if given), no
    reservation open, and nothing changed for ``quiet`` seconds; else, after
    ``timeout``, the last stats seen (the caller's assertion then says what is off)."""
    deadline = time.monotonic() + timeout
    last, since = stats(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        cur = stats()
        if _counts(cur) != _counts(last):
            last, since = cur, time.monotonic()
        elif (cur["reservations"] == 0 and time.monotonic() - since >= quiet
              and (want_entries is None or cur["entries"] >= want_entries)):
            return cur
    return last


def _counts(stats: dict) -> tuple:
    return tuple(stats.get(k) for k in ("entries", "reservations", "commits", "aborts", "hits",
                                        "misses", "dropped", "bytes_in", "bytes_out"))


def maps_arena_of(engine: EngineProc, server: ServerProc) -> bool:
    """Whether the engine's connector took the same-node path to ``server``: mapped its
    shared DRAM arena (``/dev/shm/kvstore-<dir hash>-<server pid>``), as its log says."""
    arenas = re.findall(r"same-node fast path: mapped (\S+)", engine.log())
    return any(path.endswith(f"-{server.pid}") for path in arenas)


class RefTokens(list):
    """A plain engine's tokens for one prompt; ``top``: with bf16 models, the two most
    likely tokens and their logprobs at each position (None for fp32)."""

    def __init__(self, tokens: list[int], top: list[list[tuple[int, float]]] | None) -> None:
        super().__init__(tokens)
        self.top = top


# bf16 logits carry about 3 significant digits: two candidates this close are a tie
# that another batch shape of the same (correct) KV may break the other way. A wrong
# KV diverges early and far from any tie.
TIE_NATS = 0.05


def near_tie(want: list[int], first: int, got: list[int]) -> bool:
    """Whether the first difference ``got[first] != want[first]`` is a bf16 near-tie in
    the plain engine itself: ``got``'s token was its runner-up within TIE_NATS."""
    top = getattr(want, "top", None)
    if top is None or first >= len(top) or first >= len(got) or len(top[first]) < 2:
        return False
    (best, lp1), (second, lp2) = top[first][0], top[first][1]
    return best == want[first] and second == got[first] and lp1 - lp2 <= TIE_NATS


def prompt_report(prompts_: list[list[int]], got: list[Completion],
                  reference: dict[tuple[int, ...], list[int]]) -> list[str]:
    """One line per prompt whose tokens differ from the plain engine's: where and how.
    A bf16 prompt whose first difference is a near-tie of the plain engine's own
    (``near_tie``) is not one: the tokens up to it are identical."""
    bad = []
    for p, out in zip(prompts_, got):
        want = reference[tuple(p)]
        if out.token_ids != want:
            first = next((i for i, (x, y) in enumerate(zip(out.token_ids, want)) if x != y),
                         min(len(out.token_ids), len(want)))
            if near_tie(want, first, out.token_ids):
                continue
            bad.append(f"prompt of {len(p)} tokens (num_cached_tokens "
                       f"{out.num_cached_tokens}): first difference at output {first}: "
                       f"got {out.token_ids} want {want}")
    return bad
