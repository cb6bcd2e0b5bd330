"""Properties of cluster placement (kvstore/cluster/placement.py): which key sends a
token list to a node, for the producer that stores it and every reader of it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.cluster.membership import rendezvous_order
from kvstore.cluster.placement import neighbour_depths, placement_depth, placement_keys
from kvstore.core.config import ClusterConfig
from tools.bench.spread import imbalance, loads, new_spread, old_spread, workload

BT = 4
NS = xxhash.xxh3_128_digest(b"test-placement")
NODES = ["a", "b", "c"]

prompts = st.lists(st.integers(0, 50_000), min_size=3, max_size=12 * BT).map(
    lambda t: np.array(t, dtype="<i4"))
depth_caps = st.integers(1, 8)


def own_key(tokens: np.ndarray, p: int) -> bytes:
    return placement_keys(NS, tokens, BT, p)[0]


@settings(max_examples=200, deadline=None)
@given(prompts, depth_caps)
def test_every_reader_one_token_off_asks_the_producers_home(prompt, p):
    # The producer stores all but the last token; a decode side may ask for the
    # whole prompt, for the stored part, or for one token fewer.
    stored = prompt[:-1]
    for asked in (prompt, stored, prompt[:-2]):
        assert own_key(stored, p) in placement_keys(NS, asked, BT, p)


@settings(max_examples=200, deadline=None)
@given(prompts, depth_caps, st.integers(0, 50_000))
def test_the_last_token_never_moves_a_list(prompt, p, last):
    # The placement block is the one before the block holding the last token.
    other = prompt.copy()
    other[-1] = last
    assert own_key(prompt, p) == own_key(other, p)


@settings(max_examples=100, deadline=None)
@given(prompts, depth_caps, st.data())
def test_lists_longer_than_p_blocks_agree_whatever_their_lengths(prompt, p, data):
    longest = prompt.size
    if longest < p * BT + 1:
        return
    a, b = (data.draw(st.integers(p * BT + 1, longest)) for _ in range(2))
    assert own_key(prompt[:a], p) == own_key(prompt[:b], p)


def test_depths_and_their_neighbours():
    # 9 tokens, block 4: keys [0..3][4..7][8]; placed by block 1 (the one before [8]).
    assert placement_depth(9, BT, 8) == 2 and placement_depth(9, BT, 1) == 1
    assert neighbour_depths(9, BT, 8) == [1]  # 8 tokens: placed by block 0
    assert neighbour_depths(8, BT, 8) == [2]  # 9 tokens
    assert neighbour_depths(10, BT, 8) == []  # 9 and 11 tokens: as 10
    assert placement_depth(4, BT, 8) == 0  # within one block: the namespace
    assert placement_keys(NS, np.arange(3, dtype="<i4"), BT, 8) == [NS]


def test_placement_is_the_same_in_another_process_and_for_any_node_order():
    tokens = np.arange(40, dtype="<i4")
    here = own_key(tokens, 4)
    code = ("import numpy as np, xxhash; from kvstore.cluster.placement import placement_keys;"
            "print(placement_keys(xxhash.xxh3_128_digest(b'test-placement'),"
            " np.arange(40, dtype='<i4'), 4, 4)[0].hex())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert there == here.hex()
    assert rendezvous_order(here, NODES) == rendezvous_order(here, NODES[::-1])


def test_a_dead_node_passes_its_lists_to_the_next_in_order():
    for n in range(5, 400, 7):
        key = own_key(np.arange(n, dtype="<i4"), 8)
        order = rendezvous_order(key, NODES)
        assert rendezvous_order(key, order[1:]) == order[1:]


def test_a_shared_template_spreads_by_the_tails():
    """1,500 prompts of a 512-token template and 16..2000-token tails on 3 nodes
    (tools/bench/spread.py, block 16): the first block put every one on one node;
    the default placement keeps the busiest node within 10 % of the mean."""
    lists = workload(1_500)
    tokens = lambda x: x.stored.size  # noqa: E731 - a prompt's load: its tokens
    before = old_spread(lists, NODES, 1)
    assert imbalance(loads(before, lists, NODES, tokens))[0] == 3.0
    after = new_spread(lists, NODES, ClusterConfig().placement_blocks)
    peak, cv = imbalance(loads(after, lists, NODES, tokens))
    assert peak <= 1.1 and cv <= 0.06
    assert after.agree_longer == after.agree_shorter == 1.0
