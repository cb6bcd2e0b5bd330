"""The connector in real vLLM engines running the model shapes users run beyond a plain
decoder: a hybrid sliding-window model, MLA, and tensor parallelism.

Each test starts a plain engine (the judge), a prefill engine (``kv_producer``) and a
decode engine (``kv_consumer``) on one kvstore-server, and checks that the decode,
loading every prompt's KV from the store, generates exactly the plain engine's
tokens (fp32, greedy) and computed only each prompt's last token itself.

* **Gemma 2** (``tools.tiny_models`` arch "gemma2"): layers alternate a 64-token
  sliding window and full attention. The connector supports vLLM's hybrid KV cache
  manager (``SupportsHMA``), so the engines keep it: two KV cache groups, each with
  its own block table, the sliding one freed behind the window (checked in the
  engines' logs). Prefill chunks of 256 tokens make the 300- and 1000-token prompts'
  prefills free window blocks before their last chunk, which the per-chunk saves
  must beat; the decode's sliding group gets null blocks for the window's past.
  tests/integration/test_kv_groups.py tests the same paths piece by piece, against
  the CPU backend's cache writes.
* **DeepSeek-V2 attention** (arch "deepseek2", MLA: one 576-wide latent per token and
  layer, block size 16, vLLM's CPU_MLA backend). Its engines run one sequence at a
  time (``max_num_seqs=1``): with several, what the CPU MLA kernels compute for one
  sequence depends on what it is batched with, and the decode engine's batches follow
  when each prompt's KV arrives. Under load a 1-token prompt, which loads nothing,
  generated a different 10th token (a greedy near-tie), also before this stop's
  changes (23d7ce2); one at a time, every run under the same load passed.
* **TP = 2** (Llama; a worker process per rank, one per core, under vLLM's
  multiprocess executor): each rank saves and loads its own KV heads; the store
  then holds one entry per block per rank. Prompts decoded without the producer's
  params go through the scheduler's lookup, which counts a token only where every
  rank's part is stored. The engine core, with the connector's scheduler side, runs
  in the driver (``in_process``): its metadata still crosses to each rank's
  process, and each engine starts vLLM twice instead of three times (~40 s of the
  suite; the HTTP tests run the engine core in its own process, as deployed).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from kvstore.client.client import KVStoreClient
from tests.engine.conftest import PATIENT
from tests.integration.conftest import ServerFactory
from tools.engine_proc import EngineProc, start_all, stop_all
from tools.tiny_models import SLIDING_WINDOW, VOCAB, ModelSpec, build

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]

DECODE_TOKENS = 32


def _prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]


def _blocks(ps: list[list[int]], block: int) -> int:
    return sum(math.ceil((len(p) - 1) / block) for p in ps)


def _settle(stats, want: int | None, timeout: float = 30.0) -> dict:
    """The server's stats once it holds ``want`` entries (saves land in the background);
    ``want`` None: once no read lease is open (a load's drop_select ends with a one-way
    release, which this connection's stats request may overtake)."""
    deadline = time.monotonic() + timeout
    while True:
        now = stats()
        done = now["leases"] == 0 if want is None else now["entries"] >= want
        if done or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


class Trio:
    """A plain, a prefill and a decode engine of one model on one fresh server."""

    def __init__(self, tmp: Path, spec: ModelSpec, block: int, *, in_process: bool = True,
                 engine_args: dict | None = None, env: dict | None = None) -> None:
        self.block = block
        model = build(spec, tmp / "models")
        (tmp / "servers").mkdir()
        self.servers = ServerFactory(tmp / "servers")
        # Patient, as in the other engine tests (PATIENT): under load the harness's
        # short leases ran out mid-save, and a starved server answered a load busy.
        self.server = self.servers(dram="256MiB", nvme="64MiB", block_tokens=block, **PATIENT)
        # lookup_timeout_s: these tests check what a lookup finds, not its budget (0.25 s
        # by default): on 2 cores busy with TP engines a first lookup has overrun it,
        # marked the server down and made every prompt a recompute.
        conn = {"server": self.server.address, "model_id": spec.name, "timeout_s": 30.0,
                "lookup_timeout_s": 5.0}
        kw = dict(max_model_len=1100, block_size=block, in_process=in_process,
                  engine_args=engine_args, env=env)
        self.plain = EngineProc(model, spec.dtype, log_path=tmp / "plain.log", name="plain",
                                **kw)
        self.prefill = EngineProc(model, spec.dtype, role="kv_producer", connector=conn,
                                  log_path=tmp / "prefill.log", name="prefill", **kw)
        self.decode = EngineProc(model, spec.dtype, role="kv_consumer", connector=conn,
                                 log_path=tmp / "decode.log", name="decode", **kw)
        self.model = model

    def engines(self) -> list[EngineProc]:
        return [self.plain, self.prefill, self.decode]

    def stats(self) -> dict:
        with KVStoreClient(self.server.address, timeout_s=60.0) as admin:
            return admin.stats()

    def check(self, ps: list[list[int]], with_params: bool = True,
              entries_per_block: int = 1) -> list[str]:
        """Prefill ``ps``, decode them from the store; what differed (empty: nothing)."""
        want = self.plain.generate(ps, DECODE_TOKENS)
        before = self.stats()["entries"]
        pre = self.prefill.generate(ps, 1)
        blocks = entries_per_block * _blocks(ps, self.block)
        saved = _settle(self.stats, before + blocks)
        problems = []
        if saved["entries"] - before != blocks:
            problems.append(f"prefill left {saved['entries'] - before} entries, want {blocks}")
        params = [o.kv_transfer_params for o in pre] if with_params else None
        got = self.decode.generate(ps, DECODE_TOKENS, params)
        for p, w, g in zip(ps, want, got):
            if g.token_ids != w.token_ids:
                problems.append(f"{len(p)}-token prompt: decode {g.token_ids[:12]} != "
                                f"plain {w.token_ids[:12]}")
            if g.num_cached_tokens != len(p) - 1:
                problems.append(f"{len(p)}-token prompt: {g.num_cached_tokens} tokens from "
                                f"the store, want {len(p) - 1}")
        left = _settle(self.stats, None)["entries"]  # the decode's releases applied
        if left != before:
            problems.append(f"{left - before} entries left after the decode took them; "
                            f"stored (pending, pins, ends, state): {self.held()}")
        if problems:  # what the logs say, for a failure seen only in CI
            problems.append(self.warnings())
        return problems

    def held(self) -> dict:
        """How many stored entries have each (pending, pins, ends, state)."""
        with KVStoreClient(self.server.address, timeout_s=60.0) as admin:
            rows = admin.ls()
        return dict(Counter((r.get("pending"), r.get("pins"), r.get("ends"), r.get("state"))
                            for r in rows))

    def warnings(self, most: int = 30) -> str:
        """The last ``most`` warning and error lines of the server's and the engines'
        logs (one string: a failed check's last problem)."""
        out = []
        for name, text in [("server", self.server.log()),
                           *((e.name, e.log()) for e in self.engines())]:
            lines = [ln for ln in text.splitlines()
                     if any(w in ln for w in ("WARNING", "ERROR", "Traceback"))
                     and (name == "server" or "kvstore" in ln)]  # not vLLM's own
            out += [f"{name}: {ln}" for ln in lines[-most:]]
        return "\n".join(out) or "(no warnings logged)"


@pytest.fixture
def trio_factory(tmp_path):
    made: list[Trio] = []

    def make(*args, one_at_a_time: bool = False, **kwargs) -> Trio:
        trio = Trio(tmp_path, *args, **kwargs)
        made.append(trio)
        if one_at_a_time:  # (each TP engine is 3 processes: overlapping 9 starts on
            for engine in trio.engines():  # 2 cores has left one hanging in its init)
                start_all([engine])
        else:
            start_all(trio.engines())
        return trio

    yield make
    for trio in made:
        try:
            stop_all(trio.engines())
            assert not [pid for e in trio.engines() for pid in e.leftover_pids()]
        finally:
            trio.servers.stop_all()


def test_hybrid_sliding_window_model_decodes_exactly(trio_factory):
    trio = trio_factory(ModelSpec("gemma2", "float32", layers=2, max_len=1100), 32,
                        engine_args={"max_num_batched_tokens": 256})
    config = json.loads((trio.model / "config.json").read_text())
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"}
    assert config["sliding_window"] == SLIDING_WINDOW
    for engine in (trio.prefill, trio.decode):  # vLLM's hybrid manager is on: 2 groups
        assert "kv cache group sizes (32, 32)" in engine.log(), engine.name
    ps = _prompts(11, (1, 31, 33, SLIDING_WINDOW + 6, 300, 1000))
    assert trio.check(ps) == []


def test_mla_model_decodes_exactly(trio_factory):
    trio = trio_factory(ModelSpec("deepseek2", "float32", layers=2, max_len=1100), 16,
                        engine_args={"attention_config": {"backend": "CPU_MLA"},
                                     "max_num_seqs": 1})
    config = json.loads((trio.model / "config.json").read_text())
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    ps = _prompts(12, (1, 15, 16, 17, 70, 300, 1000))
    assert trio.check(ps) == []
    assert "CPU_MLA" in trio.decode.log()


def test_tensor_parallel_two_ranks_decode_exactly(trio_factory):
    trio = trio_factory(ModelSpec("llama", "float32", layers=2, max_len=1100), 32,
                        in_process=True, engine_args={"tensor_parallel_size": 2},
                        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, one_at_a_time=True)
    # The producer's params: each decode rank waits for and takes its own rank's entries.
    assert trio.check(_prompts(13, (1, 33, 300, 1000)), entries_per_block=2) == []
    # No params: the scheduler's lookup finds both ranks' entries, the load is same-step.
    assert trio.check(_prompts(14, (37, 300)), with_params=False, entries_per_block=2) == []
    # Each TP engine's ranks share buffers in /dev/shm that vLLM leaves at exit; the
    # harness removes those its engines mapped once they are gone, and the dir of the
    # ZeroMQ socket files vLLM also leaves (in /tmp without it).
    assert all(e.shm_left() for e in trio.engines())
    rpc = [e.rpc_dir for e in trio.engines()]
    assert all(d is not None and any(d.iterdir()) for d in rpc), rpc
    stop_all(trio.engines())
    assert not [path for e in trio.engines() for path in e.shm_left()]
    assert not [d for d in rpc if d.exists()]
