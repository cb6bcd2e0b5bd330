"""The cap on queued saves (``save_queue_bytes``) inside real vLLM engines.

A prefill engine whose cap holds one prompt's KV prefills a batch while its server is
frozen (SIGSTOP): the engine answers at once, one save waits on the transfer thread
and the others are not ordered (counted in vLLM's metrics, one warning), so their
requests finish without kv_transfer_params. A decode engine then gets what each
prompt's prefill gave: the saved prompt loads, the others are computed at once (no
load ordered, so none waits ``load_wait_s`` and none fails); every answer is the
plain engine's.

One kvstore-server (loopback) and three engines of the tiny Llama (fp32): the plain
engine (the judge, stopped once its tokens are known), the prefill engine and the
decode engine (``kv_load_failure_policy: "recompute"``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from kvstore.client.client import KVStoreClient
from kvstore.core.layout import KVLayout
from tests.engine.conftest import assert_no_leftovers, connector_config, prompt_report, settle
from tests.engine.test_engine_faults import PAUSE_S, blocks_of, counter, no_leftovers, paused
from tests.integration.conftest import ServerFactory, ServerProc
from tools.engine_proc import EngineProc, start_all, stop_all
from tools.tiny_models import VOCAB, ModelSpec, build

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(600)]

SPEC = ModelSpec("llama", "float32")
BLOCK = 32
LAYOUT = KVLayout(num_layers=SPEC.layers, kv_heads=SPEC.kv_heads, head_dim=SPEC.hidden // 4,
                  dtype=SPEC.dtype, block_tokens=BLOCK)
PROMPT_TOKENS, BATCH = 300, 4
DECODE_TOKENS = 48
LEASE_S = 3.0
TIMEOUTS = dict(timeout_s=8.0, load_wait_s=2.0, down_s=1.0)  # PAUSE_S < timeout_s


def prompts() -> list[list[int]]:
    rng = random.Random(4242)
    return [[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(BATCH)]


class Rig:
    def __init__(self, server: ServerProc, producer: EngineProc, decode: EngineProc) -> None:
        self.server, self.producer, self.decode = server, producer, decode
        self.reference: dict[tuple[int, ...], list[int]] = {}

    def stats(self) -> dict:
        with KVStoreClient(self.server.address, layout=LAYOUT, model_id=SPEC.name,
                           timeout_s=10.0) as c:
            return c.stats()


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("save-queue")
    model = build(SPEC, tmp / "models")
    (tmp / "servers").mkdir()
    factory = ServerFactory(tmp / "servers")
    engines: list[EngineProc] = []
    try:
        server = factory(dram="64MiB", nvme="64MiB", block_tokens=BLOCK,
                         reservation_lease=LEASE_S, read_lease=LEASE_S)

        def engine(name: str, role: str | None = None, **extra) -> EngineProc:
            eng = EngineProc(model, SPEC.dtype, role=role,
                             connector=connector_config(SPEC, server, "127.0.0.1",
                                                        **TIMEOUTS, **extra)
                             if role else None,
                             log_path=tmp / f"{name}.log", in_process=True, name=name,
                             max_model_len=1024, engine_args={"disable_log_stats": False})
            engines.append(eng)
            return eng

        plain = engine("plain")
        # Room for one prompt's KV: a second save waits for it to be sent.
        rig = Rig(server, engine("prefill", "kv_producer",
                                 save_queue_bytes=LAYOUT.nbytes(PROMPT_TOKENS - 1)),
                  engine("decode", "kv_consumer"))
        start_all(engines)
        outs = plain.generate(prompts(), DECODE_TOKENS)
        rig.reference = {tuple(p): o.token_ids for p, o in zip(prompts(), outs)}
        plain.shutdown()
        yield rig
    finally:
        stop_all(engines)
        factory.stop_all()
    assert_no_leftovers(engines)


def test_saves_past_the_cap_are_not_made_and_their_decodes_recompute(rig):
    ps = prompts()
    before = rig.stats()
    mark = len(rig.producer.log())
    with paused(rig.server, PAUSE_S) as frozen:
        start = time.monotonic()
        outs = rig.producer.generate(ps, max_tokens=1)
        assert frozen(), f"the prefills took {time.monotonic() - start:.1f} s"
    # params only for the save that was ordered: a decode never waits for the others
    assert sum(bool(o.kv_transfer_params) for o in outs) == 1, outs
    saved = settle(rig.stats, before["entries"] + blocks_of(ps[:1]))
    assert saved["entries"] - before["entries"] == blocks_of(ps[:1]), saved
    assert counter(rig.producer, "vllm:kvstore_saves_skipped") == BATCH - 1
    assert counter(rig.producer, "vllm:kvstore_saves") == 1
    log = rig.producer.log()[mark:]
    assert log.count("not made, and the request gets no kv_transfer_params") == 1, \
        log[-3000:]  # rate-limited, from the scheduler (the worker's guard never skipped)
    assert "not made: saves holding" not in log, log[-3000:]

    decoded = rig.decode.generate(ps, DECODE_TOKENS, [o.kv_transfer_params for o in outs])
    assert sorted(o.num_cached_tokens for o in decoded) == \
        [0] * (BATCH - 1) + [PROMPT_TOKENS - 1], decoded
    wrong = prompt_report(ps, decoded, rig.reference)
    assert not wrong, wrong
    assert counter(rig.decode, "vllm:kvstore_loads") == 1
    assert counter(rig.decode, "vllm:kvstore_load_failures") == 0  # none waited in vain
    after = no_leftovers(rig.stats)
    assert (after["leases"], after["reservations"]) == (0, 0), after
    assert after["entries"] == before["entries"], after  # the decode took the one saved
