"""Real faults under real vLLM engines: loads that fail, aborts, preemption; and
what loads and saves move when part of a prompt is already where it goes.

One kvstore-server (loopback) and five engines of the tiny Llama (fp32) share
this module: a plain engine (the judge, stopped once its tokens are known), a
prefill engine, a decode engine with ``kv_load_failure_policy: "recompute"``, a
decode engine with "fail" and a prefix-cache engine (``kv_both``). The prefill
engine and the recompute engine get a KV cache of ``SMALL_CACHE_BLOCKS`` blocks,
small enough that a batch of long requests preempts.

The faults are real, nothing is mocked: entries whose bytes are flipped at rest in
the server's DRAM arena (the reader's checksum catches them), and a server stopped
with SIGSTOP while a load or a save is on its way (its calls time out; when it goes
on it still executes what was queued, so its leases and reservations must drain).
What vLLM 0.32's scheduler does with a failed load (``_handle_invalid_blocks``):
"recompute" rewinds the request to the failed blocks and computes them itself;
"fail" finishes the request with ``FINISHED_ERROR`` (finish_reason "error", no
tokens), the others in the batch unaffected. Every test ends with the server holding
no lease and no reservation, and every decode the plain engine's tokens.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvstore.client.client import KVStoreClient
from kvstore.core.layout import KVLayout
from tests.engine.conftest import assert_no_leftovers, connector_config, prompt_report, settle
from tests.integration.conftest import ServerFactory, ServerProc
from tools.engine_proc import Abort, EngineProc, start_all, stop_all
from tools.tiny_models import VOCAB, ModelSpec, build

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]

SPEC = ModelSpec("llama", "float32")
BLOCK = 32
LAYOUT = KVLayout(num_layers=SPEC.layers, kv_heads=SPEC.kv_heads, head_dim=SPEC.hidden // 4,
                  dtype=SPEC.dtype, block_tokens=BLOCK)
DECODE_TOKENS = 48
PREEMPT_TOKENS = 64  # 300 + 64 tokens need 12 blocks
LONG_TOKENS = 200  # a request that is still running when it is aborted
# 32 usable blocks (one is vLLM's null block): three 300-token requests are admitted,
# and preempted as they grow.
SMALL_CACHE_BLOCKS = 33
LEASE_S = 3.0  # the server's reservation and read leases: orphans drain fast
# Short bounds, so a stopped server costs seconds; down_s short, so the test after a
# fault finds the server tried again.
TIMEOUTS = dict(timeout_s=8.0, load_wait_s=2.0, down_s=1.0, lookup_timeout_s=0.25)
PHASE_LENS = {"corrupt_recompute": (100, 300), "corrupt_fail": (100, 300),
              "stopped_load": (100, 300), "stopped_save": (300, 100),
              "late_load": (300,), "late_save": (300,), "reuse_load": (300,) * 3,
              "reuse_save": (300,) * 3, "local_hit": (300,), "head": (200,), "tail": (100,),
              "preempt": (300,) * 6, "poison": (300,), "poison_tail": (100,)}
# A paused server goes on when the test's block ends, or after this at the most, so
# that every call it holds up ends within timeout_s, with room for a loaded machine.
PAUSE_S = 6.0


def prompts(phase: str) -> list[list[int]]:
    rng = random.Random(f"faults-{phase}")
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in PHASE_LENS[phase]]


def extended() -> list[int]:
    """A 300-token prompt whose first 200 are the "head" prompt."""
    return prompts("head")[0] + prompts("tail")[0]


def poisoned() -> list[int]:
    """A 400-token prompt whose first 300 are the "poison" prompt."""
    return prompts("poison")[0] + prompts("poison_tail")[0]


def blocks_of(ps: list[list[int]]) -> int:
    """Entries a producer leaves: the prompt but its last token, one per block."""
    return sum(math.ceil((len(p) - 1) / BLOCK) for p in ps)


class Rig:
    def __init__(self, server: ServerProc, producer: EngineProc, recompute: EngineProc,
                 fail: EngineProc, both: EngineProc,
                 reference: dict[tuple[int, ...], list[int]]) -> None:
        self.server, self.producer = server, producer
        self.recompute, self.fail = recompute, fail
        self.both = both  # kv_both: a prefix cache over the same server
        self.reference = reference

    def client(self) -> KVStoreClient:
        return KVStoreClient(self.server.address, layout=LAYOUT, model_id=SPEC.name,
                             timeout_s=10.0)

    def stats(self) -> dict:
        with self.client() as c:
            return c.stats()

    def wrong_tokens(self, ps: list[list[int]], outs) -> list[str]:
        want = {tuple(p): self.reference[tuple(p)][:len(o.token_ids)] for p, o in zip(ps, outs)}
        return prompt_report(ps, outs, want)

    def prefill(self, ps: list[list[int]]) -> list[dict]:
        """Prefill ``ps``, wait until their entries landed; their kv_transfer_params."""
        before = self.stats()["entries"]
        outs = self.producer.generate(ps, max_tokens=1)
        saved = settle(self.stats, before + blocks_of(ps))
        assert saved["entries"] == before + blocks_of(ps), saved
        return [o.kv_transfer_params for o in outs]


def no_leftovers(stats_fn, timeout: float = 3 * LEASE_S + 10) -> dict:
    """The server's stats once it holds no lease and no reservation (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = stats_fn()
        if (stats["leases"], stats["reservations"]) == (0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


@contextlib.contextmanager
def stopped(server: ServerProc) -> Iterator[None]:
    """The server frozen (SIGSTOP) for the block: it answers nothing until it goes
    on (SIGCONT), then works off what was queued."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


@contextlib.contextmanager
def paused(server: ServerProc, seconds: float) -> Iterator[Callable[[], bool]]:
    """The server frozen from now until the block ends, or for ``seconds`` if the
    block runs longer (so every call it holds up ends within timeout_s); the block
    gets a function saying whether it is still frozen. Leaves once it goes on."""
    resumed = threading.Timer(seconds, os.kill, (server.pid, signal.SIGCONT))
    os.kill(server.pid, signal.SIGSTOP)
    resumed.start()
    try:
        yield resumed.is_alive
    finally:
        resumed.cancel()
        resumed.join()
        os.kill(server.pid, signal.SIGCONT)  # (again, if the timer did: harmless)


def corrupt_at_rest(rig: Rig, tokens: list[int], block: int) -> None:
    """Flip one byte of the stored entry of ``tokens``' block ``block`` in the server's
    DRAM arena, behind the server's back (a stray writer, a bad DIMM)."""
    from kvstore.client.shm import map_shared

    with rig.client() as c:
        # At rest: after the server's scrub checked the commit (verify_commits =
        # "background" hashes entries a second after they are stored), so the
        # reader is the one that finds it.
        deadline = time.monotonic() + 30
        while c.stats()["unchecked_entries"]:
            assert time.monotonic() < deadline, "the server's scrub never ran"
            time.sleep(0.05)
        key = c.keys_for(tokens[:-1])[block]
        dram = c.hello()["dram"]
        offsets = {e["key"]: e["offset"] for e in c.ls()}
    arena = map_shared(dram["path"], dram["nbytes"])
    arena[offsets[key] + 17] ^= 0xFF


def counter(engine: EngineProc, name: str) -> float:
    """A vLLM metric once the connector's stats are all in: a worker hands its stats
    to vLLM at its next step, and a save records them after it committed, so
    one-token steps (nothing to save or load) run until the value holds."""
    value = None
    for _ in range(50):
        engine.generate([[7]], max_tokens=1)
        now = engine.metrics()[name]
        if now == value:
            return now
        value = now
        time.sleep(0.05)
    return value


def log_since(engine: EngineProc, mark: int) -> str:
    return engine.log()[mark:]


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("faults")
    model = build(SPEC, tmp / "models")
    factory = ServerFactory(tmp / "servers")
    (tmp / "servers").mkdir()
    engines: list[EngineProc] = []
    try:
        server = factory(dram="64MiB", nvme="64MiB", block_tokens=BLOCK,
                         reservation_lease=LEASE_S, read_lease=LEASE_S)

        def engine(name: str, role: str | None = None, small: bool = False,
                   **kw) -> EngineProc:
            args = {"disable_log_stats": False}  # vLLM's metrics: its preemption count
            if small:
                args["num_gpu_blocks_override"] = SMALL_CACHE_BLOCKS
            eng = EngineProc(model, SPEC.dtype, role=role,
                             connector=connector_config(SPEC, server, "127.0.0.1", **TIMEOUTS)
                             if role else None,
                             log_path=tmp / f"{name}.log", in_process=True, name=name,
                             max_model_len=1024, engine_args=args, **kw)
            engines.append(eng)
            return eng

        plain = engine("plain")
        rig = Rig(server, engine("prefill", "kv_producer", small=True),
                  engine("decode-recompute", "kv_consumer", small=True),
                  engine("decode-fail", "kv_consumer", failure_policy="fail"),
                  engine("prefix-cache", "kv_both"), {})
        start_all(engines)
        every = [p for phase in PHASE_LENS for p in prompts(phase)] + [extended(), poisoned()]
        outs = plain.generate(every, LONG_TOKENS)
        rig.reference = {tuple(p): o.token_ids for p, o in zip(every, outs)}
        plain.shutdown()
        yield rig
    finally:
        stop_all(engines)
        factory.stop_all()
    assert_no_leftovers(engines)


# ------------------------------------------------------------------ failed loads
def test_corrupt_entry_is_recomputed_with_recompute_policy(rig):
    """Block 3 of the 300-token prompt is corrupt at rest. The load fails its
    checksum, the connector names the request's blocks in
    get_block_ids_with_load_errors, and vLLM (policy "recompute") says it recovered
    and recomputes: the plain engine's tokens. The 100-token prompt in the same batch
    loads whole. The server drops the bad entry; vLLM's retry of the request asks
    the connector again, whose lookup finds the good blocks before it and loads
    them (96 tokens not computed); no lease is left."""
    ps = prompts("corrupt_recompute")
    before = rig.stats()
    params = rig.prefill(ps)
    corrupt_at_rest(rig, ps[1], block=3)
    mark = len(rig.recompute.log())
    outs = rig.recompute.generate(ps, DECODE_TOKENS, params)
    after = no_leftovers(rig.stats)
    log = log_since(rig.recompute, mark)

    assert not rig.wrong_tokens(ps, outs), rig.wrong_tokens(ps, outs)
    assert outs[0].num_cached_tokens == len(ps[0]) - 1
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in log, log[-3000:]
    assert after["checksum_failures"] - before["checksum_failures"] == 1
    assert (after["leases"], after["reservations"]) == (0, 0), after
    # What a lookup still reaches (blocks 0-2) was loaded on the retry.
    assert outs[1].num_cached_tokens == 3 * BLOCK, outs[1]
    # The store drops a prompt's entries only for a drop_select that reaches its
    # end (issue 13): with block 3 gone, its other 9 stay until evicted.
    left = after["entries"] - before["entries"]
    assert left == blocks_of(ps[1:]) - 1, f"{left} entries left behind"


def test_a_prefix_cache_engine_saves_nothing_over_a_load_that_failed(rig):
    """The prefill engine saves a 300-token prompt; block 3 is corrupt at rest. The
    prefix-cache engine (kv_both) computes a 400-token prompt starting with it: its
    lookup finds 9 blocks, the same-step load fails at block 3, and in that same step
    the engine computes the other 112 tokens on top of blocks 3-8, which hold no KV
    of this prompt. vLLM recomputes them; the step's save of the prompt must not
    store any of it (block 3's entry would be every later reader's wrong KV). A
    decode engine then loads the 300-token prompt as the prefill left it, but block 3
    (dropped as corrupt), and gives the plain engine's tokens."""
    head, whole = prompts("poison"), [poisoned()]
    before = rig.stats()
    params = rig.prefill(head)
    corrupt_at_rest(rig, head[0], block=3)
    mark = len(rig.both.log())
    computed = rig.both.generate(whole, DECODE_TOKENS)
    log = log_since(rig.both, mark)
    decoded = rig.recompute.generate(head, DECODE_TOKENS, params)
    assert not rig.wrong_tokens(whole, computed), rig.wrong_tokens(whole, computed)
    assert not rig.wrong_tokens(head, decoded), rig.wrong_tokens(head, decoded)
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in log, log[-3000:]
    assert "not made: a load into its blocks failed in this step" in log, log[-3000:]
    after = no_leftovers(rig.stats)
    assert after["checksum_failures"] - before["checksum_failures"] == 1, after
    assert (after["leases"], after["reservations"]) == (0, 0), after


def test_corrupt_entry_fails_the_request_with_fail_policy(rig):
    """The same fault under "fail": vLLM finishes that request with an error (no
    tokens) and serves the rest of the batch; the server holds no lease."""
    ps = prompts("corrupt_fail")
    before = rig.stats()
    params = rig.prefill(ps)
    corrupt_at_rest(rig, ps[1], block=3)
    mark = len(rig.fail.log())
    outs = rig.fail.generate(ps, DECODE_TOKENS, params)
    after = no_leftovers(rig.stats)
    log = log_since(rig.fail, mark)

    assert outs[1].finish_reason == "error" and outs[1].token_ids == [], outs[1]
    assert "Failing 1 request(s) due to KV load failure" in log, log[-3000:]
    assert outs[0].finish_reason == "length" and not rig.wrong_tokens(ps[:1], outs[:1])
    assert outs[0].num_cached_tokens == len(ps[0]) - 1
    assert after["checksum_failures"] - before["checksum_failures"] == 1
    assert (after["leases"], after["reservations"]) == (0, 0), after
    # The failed request's other entries stay stored (nobody took them).
    assert after["entries"] - before["entries"] == blocks_of(ps[1:]) - 1
    # The engine goes on: the next batch is served.
    again = rig.fail.generate(ps[:1], DECODE_TOKENS)
    assert again[0].finish_reason == "length" and not rig.wrong_tokens(ps[:1], again)


# ------------------------------------------------------- a server that stops
def test_server_stopped_during_load_and_an_abort_of_the_load(rig):
    """The server freezes after the prefill saved: the decode engine was promised
    the KV (kv_transfer_params) and its loads hang. The first request is aborted
    while its load is stuck, the second's load fails (timeouts, the server is
    remembered as down for down_s) and vLLM recomputes it: the plain engine's tokens.
    Once the server goes on, the acquisitions it received late expire (no lease is
    left) and its entries are intact: the same requests sent again load them."""
    ps = prompts("stopped_load")
    params = rig.prefill(ps)
    stored = rig.stats()
    with stopped(rig.server):
        outs = rig.recompute.generate(ps, DECODE_TOKENS, params, aborts={0: 1.0})
    assert outs[0].finish_reason == "abort", outs[0]
    assert outs[1].finish_reason == "length" and outs[1].num_cached_tokens == 0, outs[1]
    assert not rig.wrong_tokens(ps, outs), rig.wrong_tokens(ps, outs)

    after = no_leftovers(rig.stats)
    assert (after["leases"], after["reservations"]) == (0, 0), after
    assert after["entries"] == stored["entries"], (stored, after)
    time.sleep(TIMEOUTS["down_s"])  # the server is tried again after down_s
    again = rig.recompute.generate(ps, DECODE_TOKENS, params)
    assert [o.num_cached_tokens for o in again] == [len(p) - 1 for p in ps], again
    assert not rig.wrong_tokens(ps, again), rig.wrong_tokens(ps, again)
    done = no_leftovers(rig.stats)
    assert done["entries"] == stored["entries"] - blocks_of(ps), done


def test_server_stopped_during_save_and_an_abort_while_it_is_on_its_way(rig):
    """The server freezes; the prefill engine computes a prompt, whose save then
    hangs on the transfer thread, and the request is aborted meanwhile (its blocks
    freed at once: the bytes are on the host). The save fails after its timeout;
    once the server goes on, the save's reserve (or put) reaches it after the
    writer's deadline and is refused: nothing is stored, no reservation left. The
    engine goes on saving, the same prompt too (a late reservation left holding its
    keys would have it dedup onto that and lose them): the next prefills are stored
    and decode to the plain engine's tokens."""
    ps = prompts("stopped_save")
    before = rig.stats()
    with stopped(rig.server):
        outs = rig.producer.generate(ps[:1], LONG_TOKENS, aborts={0: Abort(after_tokens=2)})
        assert outs[0].finish_reason == "abort" and 0 < len(outs[0].token_ids) < LONG_TOKENS
        # The save gives up before the server goes on: a same-node write waits
        # timeout_s and the client's second of deadline slack; one more for a slow host.
        time.sleep(TIMEOUTS["timeout_s"] + 2)
    after = no_leftovers(rig.stats)
    assert (after["leases"], after["reservations"]) == (0, 0), after
    assert after["entries"] == before["entries"] and after["commits"] == before["commits"]
    assert not rig.wrong_tokens(ps[:1], outs)

    time.sleep(TIMEOUTS["down_s"])
    params = rig.prefill(ps)
    decoded = rig.recompute.generate(ps, DECODE_TOKENS, params)
    assert [o.num_cached_tokens for o in decoded] == [len(p) - 1 for p in ps], decoded
    assert not rig.wrong_tokens(ps, decoded), rig.wrong_tokens(ps, decoded)
    done = no_leftovers(rig.stats)
    assert done["entries"] == before["entries"]
    # No reservation was left to run out: the late one was refused, not kept.
    assert done["reservations_expired"] == before["reservations_expired"], (before, done)


def test_load_that_lands_after_its_abort_writes_only_blocks_vllm_still_holds(rig):
    """The server pauses (until the block ends, PAUSE_S at the most: within every
    timeout); a decode request whose load is hanging is aborted, and three requests
    fill the decode engine's small cache meanwhile. The load then lands: vLLM kept
    the aborted request's blocks until the connector reported the load
    (get_finished), so the three, which got the other blocks, decode the plain
    engine's tokens; the aborted request's entries were taken, and no lease is
    left."""
    late, reuse = prompts("late_load"), prompts("reuse_load")
    params = rig.prefill(late)
    stored = rig.stats()
    with paused(rig.server, PAUSE_S) as frozen:
        aborted = rig.recompute.generate(late, DECODE_TOKENS, params, aborts={0: 0.3})
        others = rig.recompute.generate(reuse, DECODE_TOKENS)
        assert frozen(), "too slow: the load may have landed before the others ran"
    assert aborted[0].finish_reason == "abort" and aborted[0].token_ids == [], aborted
    assert not rig.wrong_tokens(reuse, others), rig.wrong_tokens(reuse, others)
    after = no_leftovers(lambda: settle(rig.stats))
    assert (after["leases"], after["reservations"]) == (0, 0), after
    assert stored["entries"] - after["entries"] == blocks_of(late), (stored, after)
    again = rig.recompute.generate(reuse, DECODE_TOKENS)  # the engine is healthy
    assert not rig.wrong_tokens(reuse, again), rig.wrong_tokens(reuse, again)


def test_save_that_lands_after_its_abort_holds_the_aborted_requests_kv(rig):
    """The server pauses (until the block ends, PAUSE_S at the most: within every
    timeout); a prefill request is computed, its save hangs on the transfer thread,
    the request is aborted and its blocks go to three requests prefilled meanwhile.
    The save then lands: it holds the aborted request's KV (its bytes left the
    blocks in the step that computed them), so a decode engine loading it gives the
    plain engine's tokens."""
    late, reuse = prompts("late_save"), prompts("reuse_save")
    before = rig.stats()
    with paused(rig.server, PAUSE_S) as frozen:
        aborted = rig.producer.generate(late, LONG_TOKENS, aborts={0: Abort(after_tokens=2)})
        others = rig.producer.generate(reuse, max_tokens=1)
        assert frozen(), "too slow: the save may have landed before its blocks were reused"
    assert aborted[0].finish_reason == "abort", aborted
    assert not rig.wrong_tokens(reuse, others), rig.wrong_tokens(reuse, others)
    saved = no_leftovers(lambda: settle(rig.stats, before["entries"]
                                        + blocks_of(late) + blocks_of(reuse)))
    assert saved["entries"] - before["entries"] == blocks_of(late) + blocks_of(reuse), saved
    assert (saved["leases"], saved["reservations"]) == (0, 0), saved
    params = [{"kvstore_server": rig.server.address, "kvstore_tokens": len(late[0]) - 1}]
    decoded = rig.recompute.generate(late + reuse, DECODE_TOKENS,
                                     params + [o.kv_transfer_params for o in others])
    assert [o.num_cached_tokens for o in decoded] == [len(p) - 1 for p in late + reuse]
    assert not rig.wrong_tokens(late + reuse, decoded), rig.wrong_tokens(late + reuse, decoded)
    assert no_leftovers(rig.stats)["entries"] == before["entries"]


# ---------------------------------------------------------------- what moves
def test_a_load_moves_only_the_blocks_vllm_does_not_hold(rig):
    """A decode engine that decoded a prompt before holds its first 9 blocks in its
    own prefix cache (the fail-policy engine: a cache large enough that nothing is
    evicted). The prefill engine saves the prompt again; the decode takes all 10
    entries (none is left behind) but moves only the last one, 11 tokens: the
    connector's loaded-bytes counter in vLLM's metrics says so."""
    ps = prompts("local_hit")
    first = rig.fail.generate(ps, DECODE_TOKENS, rig.prefill(ps))
    empty = no_leftovers(rig.stats)["entries"]
    params = rig.prefill(ps)
    loaded = counter(rig.fail, "vllm:kvstore_loaded_bytes")
    again = rig.fail.generate(ps, DECODE_TOKENS, params)
    moved = counter(rig.fail, "vllm:kvstore_loaded_bytes") - loaded
    after = no_leftovers(rig.stats)

    assert not rig.wrong_tokens(ps, first + again), rig.wrong_tokens(ps, first + again)
    assert [o.num_cached_tokens for o in first + again] == [len(ps[0]) - 1] * 2
    local = (len(ps[0]) - 1) // BLOCK * BLOCK
    assert moved == LAYOUT.nbytes(len(ps[0]) - 1 - local), (moved, LAYOUT.nbytes(local))
    assert after["entries"] == empty, (empty, after)


def test_a_save_sends_only_the_blocks_the_server_lacks(rig):
    """A prefix-cache engine (kv_both) saves a 200-token prompt, then computes a
    300-token prompt that starts with it. Its lookup finds the first 6 blocks
    stored (the 7th, partial, is a different block), so the save copies and sends
    only blocks 6-9 (107 tokens): the connector's saved-bytes counter says so, and
    the server gains those 4 entries. A decode engine loading the 300-token prompt
    from the store gives the plain engine's tokens: the halves fit together."""
    head, whole = prompts("head"), [extended()]
    before = rig.stats()
    first = rig.both.generate(head, max_tokens=1)
    settle(rig.stats, before["entries"] + blocks_of(head))
    saved = counter(rig.both, "vllm:kvstore_saved_bytes")
    second = rig.both.generate(whole, max_tokens=1)
    after = settle(rig.stats, before["entries"] + blocks_of(head) + 4)
    sent = counter(rig.both, "vllm:kvstore_saved_bytes") - saved

    assert [o.token_ids[0] for o in first + second] == \
        [rig.reference[tuple(p)][0] for p in head + whole]
    assert sent == LAYOUT.nbytes(len(whole[0]) - 1 - 6 * BLOCK), sent
    assert after["entries"] - before["entries"] == blocks_of(head) + 4, after
    params = [{"kvstore_server": rig.server.address, "kvstore_tokens": len(whole[0]) - 1}]
    decoded = rig.recompute.generate(whole, DECODE_TOKENS, params)
    assert decoded[0].num_cached_tokens == len(whole[0]) - 1, decoded
    assert not rig.wrong_tokens(whole, decoded), rig.wrong_tokens(whole, decoded)
    done = no_leftovers(rig.stats)
    assert done["entries"] - before["entries"] == blocks_of(head), done  # the head's own


# ------------------------------------------------------------------ preemption
def test_preemption_on_both_sides_leaks_nothing_and_keeps_tokens(rig):
    """Six 300-token requests decoding 64 tokens; the prefill and the recompute
    engine have 32 usable blocks: three are admitted (vLLM admits a request only if
    its prompt fits) and preempted as they grow past 10 blocks each. The prefill
    engine preempts requests whose saves it already ordered (their blocks go to the
    next requests at once); the decode engine preempts requests it loaded, while the
    others wait for room to load theirs, and a preempted decode comes back to
    entries it already took: it recomputes. Both engines must preempt (vLLM's own
    counter), every request must give the plain engine's tokens, every entry must be
    taken once and the server hold no lease or reservation."""
    ps = prompts("preempt")
    before = rig.stats()
    preempted = {e: e.metrics().get("vllm:num_preemptions", 0)
                 for e in (rig.producer, rig.recompute)}
    prefilled = rig.producer.generate(ps, PREEMPT_TOKENS)
    saved = no_leftovers(lambda: settle(rig.stats, before["entries"] + blocks_of(ps)))
    assert not rig.wrong_tokens(ps, prefilled), rig.wrong_tokens(ps, prefilled)
    assert saved["entries"] - before["entries"] == blocks_of(ps), saved
    assert (saved["leases"], saved["reservations"]) == (0, 0), saved

    decoded = rig.recompute.generate(ps, PREEMPT_TOKENS,
                                     [o.kv_transfer_params for o in prefilled])
    after = no_leftovers(rig.stats)
    assert not rig.wrong_tokens(ps, decoded), rig.wrong_tokens(ps, decoded)
    assert after["entries"] == before["entries"], after
    assert after["hits"] - saved["hits"] == blocks_of(ps), after
    assert (after["leases"], after["reservations"]) == (0, 0), after
    for eng, count in preempted.items():
        m = eng.metrics()
        assert m["vllm:num_preemptions"] > count, f"{eng} never preempted: {m}"
