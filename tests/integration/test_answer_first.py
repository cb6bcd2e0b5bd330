"""Answer first, against a real kvstore-server: a writer's insert is answered before
the server has made its entries visible in memory (``store.answer_first``), and a
reader on another connection that asks right after the answer still finds every
entry, byte for byte: the server finishes before it serves anything else. The work
after the reply is counted in the server's ``kvstore_after_reply_seconds``
histogram; ``--no-answer-first`` does it all before answering."""

from __future__ import annotations

import pytest

from tests.integration.conftest import LAYOUT, free_port, make_kv
from tests.integration.test_metrics import scrape

pytestmark = pytest.mark.timeout(180)

PROMPTS = 16
BLOCKS = 300  # ~1 ms of book-keeping after each answer: a reader racing it would miss


def after_reply_count(samples: dict) -> dict[str, float]:
    return {dict(labels)["op"]: v for (name, labels), v in samples.items()
            if name == "kvstore_after_reply_seconds_count"}


@pytest.mark.parametrize("answer_first", [True, False])
def test_a_reader_right_after_the_answer_finds_every_entry(server_factory, client_factory,
                                                           answer_first):
    mport = free_port()
    srv = server_factory(dram="32MiB", nvme="0", extra=(
        "--metrics-port", str(mport), "--answer-first" if answer_first else "--no-answer-first"))
    writer = client_factory(srv)  # same node: a room, then one put per insert
    reader = client_factory(srv, same_node=False, staging_bytes=4 << 20)  # over TE
    ntokens = BLOCKS * LAYOUT.block_tokens
    for i in range(PROMPTS):
        tokens = list(range(i * 100_000, i * 100_000 + ntokens))
        kv = make_kv(ntokens, seed=i)
        assert writer.insert(tokens, kv).new_blocks == BLOCKS
        got = reader.drop_select(tokens)
        assert got.matched_tokens == ntokens, f"prompt {i}: a miss right after the answer"
        assert bytes(got.kv.numpy()) == kv.tobytes()
    reader.lookup([0])  # a round trip behind the last one-way release, before the scrape
    samples = scrape(mport)
    booked_after = after_reply_count(samples)
    if answer_first:
        assert sum(booked_after.values()) == PROMPTS
        assert set(booked_after) <= {"put", "commit"} and booked_after.get("put", 0) > 0
    else:
        assert sum(booked_after.values()) == 0
    assert samples[("kvstore_entries", ())] == 0  # each dropped by its one reader
