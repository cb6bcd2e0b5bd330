"""Prefill engine -> kvstore-server -> decode engine, both real vLLM (offline ``LLM``).

The plain engine (no connector) is the judge: a decode engine that loaded a prompt's
KV from the store must generate exactly its tokens, greedy. The store's stats and the
decode engine's ``num_cached_tokens`` prove the KV came from the store: vLLM computes
only the last prompt token itself, so a full load is prompt_len - 1 cached tokens, and
the decode took (drop) every entry the prefill left.

Prompt lengths cover the block edges (block size 32): 1 (nothing loadable), 31, 32
(one partial block loaded), 33 (one full block), 37, 300, 2050; all in one batch, so
several requests are in flight in each engine, and all engines are alive at once.
Runs per engine config (Llama in fp32 and bf16, Qwen2 in fp32: conftest
``ENGINE_CONFIGS``).
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import (
    DECODE_TOKENS,
    Listener,
    RefTokens,
    maps_arena_of,
    prompt_report,
    prompts,
    settle,
    stored_blocks,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(600)]


def expected_cached(prompt: list[int]) -> int:
    return len(prompt) - 1  # 0 for the 1-token prompt


def _delta(after: dict, before: dict, key: str) -> int:
    return after[key] - before[key]


def prefill_then_decode(producer, consumer, stats, phase: str, reference,
                        wait_for_saves: bool):
    """Prefill the phase's prompts, then decode them with the prefill's params; checks
    tokens, cached-token counts and the source server's stats (``stats()``), and
    reports every finding at once (which prompts, which tokens, what the store saw).

    The producer's saves finish in the background: ``wait_for_saves`` lets them land
    before the decode starts (and checks what they left); else the decode starts at
    once and must wait for them itself.
    """
    ps = prompts(phase)
    blocks = stored_blocks(map(len, ps))
    problems = []
    before = stats()
    prefill = producer.generate(ps, max_tokens=1)
    saved = settle(stats, before["entries"] + blocks) if wait_for_saves else None
    if saved is not None and _delta(saved, before, "entries") != blocks:
        problems.append(f"the prefill left {_delta(saved, before, 'entries')} entries, "
                        f"want {blocks} (prompt_len - 1 tokens each)")
    decode = consumer.generate(ps, DECODE_TOKENS, [o.kv_transfer_params for o in prefill])
    after = settle(stats)

    problems += prompt_report(ps, decode, reference)
    cached = {len(p): o.num_cached_tokens for p, o in zip(ps, decode)}
    if cached != {len(p): expected_cached(p) for p in ps}:
        problems.append(f"num_cached_tokens by prompt length {cached}: not all KV came from "
                        f"the store (want prompt_len - 1)")
    if [o.token_ids[0] for o in prefill] != [reference[tuple(p)][0] for p in ps]:
        problems.append("the prefill engine's first token differs from the plain engine's")
    # The decode took every entry (drop), each one found, none missed.
    if after["entries"] != before["entries"]:
        problems.append(f"{after['entries'] - before['entries']} entries left after decode")
    if (_delta(after, before, "hits"), _delta(after, before, "misses")) != (blocks, 0):
        problems.append(f"decode: {_delta(after, before, 'hits')} hits, "
                        f"{_delta(after, before, 'misses')} misses; want {blocks} hits, 0 misses")
    assert not problems, "\n".join(problems) + _stats_lines(before, saved, after)
    return prefill, decode


def _stats_lines(before: dict, saved: dict | None, after: dict) -> str:
    keys = ("entries", "hits", "misses", "commits", "dropped", "bytes_in", "bytes_out")
    return "".join(f"\nserver stats {name}: " + str({k: st.get(k) for k in keys})
                   for name, st in (("before", before), ("after prefill", saved),
                                    ("after decode", after)) if st is not None)


def test_same_node_decode_matches_plain_engine(disagg, node_emulation):
    """(a) One server; prefill and decode engine on its node: the shared-memory path."""
    prefill, _ = prefill_then_decode(disagg.producer, disagg.consumer_a, disagg.stats_a,
                                     "same_node", disagg.reference, wait_for_saves=True)
    # (The 1-token prompt has nothing to load: its params, if any, do not matter.)
    assert all(o.kv_transfer_params["kvstore_server"] == disagg.server_a.address
               for p, o in zip(prompts("same_node"), prefill) if len(p) > 1)
    for eng in (disagg.producer, disagg.consumer_a):
        assert maps_arena_of(eng, disagg.server_a), f"{eng} did not take the same-node path"


def test_cross_node_te_decode_matches_plain_engine(disagg, node_emulation):
    """(b) Prefill engine + server A on node 0, decode engine + server B on node 1: the
    decode loads from A (named in kv_transfer_params, listed in its allowed_servers)
    over TE, starting while the prefill's saves may still be in flight; nothing lands
    on or is read from B."""
    before_b = disagg.stats_b()
    prefill_then_decode(disagg.producer, disagg.consumer_b, disagg.stats_a, "te",
                        disagg.reference, wait_for_saves=False)
    after_b = disagg.stats_b()
    assert not maps_arena_of(disagg.consumer_b, disagg.server_a), "B mapped A's arena: not TE"
    assert after_b["entries"] == 0 and after_b["commits"] == before_b["commits"]
    assert after_b["hits"] == before_b["hits"] and after_b["misses"] == before_b["misses"]


def test_one_token_prompt_leaves_no_entries(disagg, node_emulation):
    """Issue 10 item 5: nothing of a 1-token prompt is loadable, so nothing is saved."""
    before = disagg.stats_a()
    prefill = disagg.producer.generate(prompts("one_token"), max_tokens=1)
    after = settle(disagg.stats_a, quiet=2.0)  # a save, if any, would land by then
    assert prefill[0].token_ids[0] == disagg.reference[tuple(prompts("one_token")[0])][0]
    assert after["entries"] == before["entries"], (before, after)
    assert after["commits"] == before["commits"], (before, after)


def test_cache_salt_separates_and_matches(disagg, node_emulation):
    """Issue 10 item 3: vLLM's cache_salt is part of the key: the same tokens under
    another salt miss (the decode recomputes, still right), under the same salt hit."""
    ps, ref = prompts("salt"), disagg.reference
    before = disagg.stats_a()
    prefill = disagg.producer.generate(ps, max_tokens=1, cache_salts=["tenant-a"] * len(ps))
    params = [o.kv_transfer_params for o in prefill]
    # Saved before the other salt asks: its miss is the salt's doing, not a late save.
    saved = settle(disagg.stats_a, before["entries"] + stored_blocks(map(len, ps)))
    assert _delta(saved, before, "entries") == stored_blocks(map(len, ps))

    other = disagg.consumer_a.generate(ps, DECODE_TOKENS, params, ["tenant-b"] * len(ps))
    missed = disagg.stats_a()
    assert not prompt_report(ps, other, ref), prompt_report(ps, other, ref)
    assert [o.num_cached_tokens for o in other] == [0] * len(ps), "another salt hit the store"
    assert missed["entries"] == saved["entries"] and missed["hits"] == saved["hits"]

    same = disagg.consumer_a.generate(ps, DECODE_TOKENS, params, ["tenant-a"] * len(ps))
    after = settle(disagg.stats_a)
    assert [o.num_cached_tokens for o in same] == [len(p) - 1 for p in ps], "same salt missed"
    assert after["entries"] == before["entries"]
    assert _delta(after, missed, "hits") == stored_blocks(map(len, ps))
    if disagg.spec.dtype == "float32":
        assert not prompt_report(ps, same, ref), prompt_report(ps, same, ref)
        return
    # bf16: the decode engine computes the last prompt token as a 1-token query over
    # loaded KV, the plain engine inside its full prefill; the two round differently,
    # and this phase's 300-token prompt (Llama bf16) reaches a near-tie at output 6.
    # The same-node and TE tests hold bf16 loads to the plain engine; here the judge
    # of "same salt, same KV" is the same load without any salt. Two bf16 decodes of
    # the same bytes on this CPU engine are not always bit-identical either (CI saw
    # them split at that output 6), so a split at a near-tie of the unsalted load's
    # own logits is allowed, as prompt_report allows it against the plain engine.
    unsalted = disagg.producer.generate(ps, max_tokens=1)
    settle(disagg.stats_a, after["entries"] + stored_blocks(map(len, ps)))
    plain_load = disagg.consumer_a.generate(ps, DECODE_TOKENS,
                                            [o.kv_transfer_params for o in unsalted],
                                            logprobs=2)
    assert [o.num_cached_tokens for o in plain_load] == [len(p) - 1 for p in ps]
    judge = {tuple(p): RefTokens(o.token_ids, o.top_logprobs) for p, o in zip(ps, plain_load)}
    assert not prompt_report(ps, same, judge), prompt_report(ps, same, judge)
    assert settle(disagg.stats_a)["entries"] == before["entries"]


def test_unconfigured_server_in_params_is_never_contacted(disagg, cluster, node_emulation):
    """Issue 10 item 4: kv_transfer_params come from the request; an address the
    operator did not configure is ignored (no connection at all) and the decode
    recomputes, with the plain engine's tokens."""
    ps, ref = prompts("rogue"), disagg.reference
    rogue = Listener(cluster, cluster.nodes[0])  # reachable from decode-a's node
    before = disagg.stats_a()
    try:
        params = [{"kvstore_server": rogue.address, "kvstore_tokens": len(p)} for p in ps]
        out = disagg.consumer_a.generate(ps, DECODE_TOKENS, params)
    finally:
        accepted = rogue.stop()
    after = disagg.stats_a()
    assert accepted == [], f"the decode engine connected to {rogue.address}: {accepted}"
    assert not prompt_report(ps, out, ref), prompt_report(ps, out, ref)
    assert [o.num_cached_tokens for o in out] == [0] * len(ps)
    assert after["entries"] == before["entries"] and after["hits"] == before["hits"]
