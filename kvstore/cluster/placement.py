"""Which chained key places a token list on a node (rendezvous hashing: membership.py).

A list of ``n`` tokens has ``m = ceil(n / B)`` chained block keys (the last one may be
partial). It is placed by its *placement depth*

    d(n) = min(P, m - 1)

that is, by the key of its last block *before the block holding its last token*
(``keys[d - 1]``), or by the namespace when ``d == 0`` (a list within one block).
Since a key names the whole prefix up to its block, every list that shares those
``d`` blocks has the same home; with a shared system prompt of ``t`` blocks, lists
longer than ``t + 1`` blocks are placed by their own tails, so they spread.

Why not the last block: it is partial for most lengths, and its key changes with
every token, so a producer storing ``n - 1`` tokens and a decode side asking for
``n`` would never agree. Why not a fixed depth: a depth no longer than the shared
prefix puts the whole template on one node (P = 1 is the extreme), and a
depth beyond a list's end must fall back to something that changes with the length.

No rule that spreads can make every pair of lengths agree: lists one token apart
agree unless that token opens a new block (``n % B == 0`` for ``n`` vs ``n + 1``).
So a reader of ``n`` tokens also knows the depths of the lists one token shorter and
one token longer (``neighbour_depths``); both are at most ``m`` blocks deep and end
on a full block, so it can compute their keys from its own tokens. Lists of at
least ``P + 1`` blocks all have depth ``P``: any two such lists of one prompt
agree, whatever their lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.core.hashing import block_keys


def nkeys(ntokens: int, block_tokens: int) -> int:
    """Chained keys of a list of ``ntokens`` tokens (full blocks and a partial one)."""
    return -(-ntokens // block_tokens)


def placement_depth(ntokens: int, block_tokens: int, placement_blocks: int) -> int:
    """Blocks whose chain places a list of ``ntokens`` tokens (0: the namespace)."""
    if ntokens < 1:
        raise ValueError("an empty list has no placement")
    return min(placement_blocks, nkeys(ntokens, block_tokens) - 1)


def neighbour_depths(ntokens: int, block_tokens: int, placement_blocks: int) -> list[int]:
    """Depths of the lists one token shorter and one longer, where they differ from
    this list's own, deepest first. Each is at most this list's ``nkeys``, and the
    longer list is one block deeper only when this list's last block is full, so
    every neighbour's key is one of this list's own."""
    own = placement_depth(ntokens, block_tokens, placement_blocks)
    near = [placement_depth(n, block_tokens, placement_blocks)
            for n in (ntokens - 1, ntokens + 1) if n >= 1]
    return sorted({d for d in near if d != own}, reverse=True)


def key_at(depth: int, keys: Sequence[bytes], namespace: bytes) -> bytes:
    """The placement key of ``depth`` from a list's chained ``keys``."""
    return keys[depth - 1] if depth else namespace


def placement_keys(namespace: bytes, tokens: np.ndarray, block_tokens: int,
                   placement_blocks: int) -> list[bytes]:
    """The placement key of ``tokens`` (int32 ids, as ``tokens_to_array`` makes
    them), then its neighbours' where their depth differs: what a reader asks.
    Only the blocks up to the deepest are hashed."""
    depths = [placement_depth(tokens.size, block_tokens, placement_blocks),
              *neighbour_depths(tokens.size, block_tokens, placement_blocks)]
    keys = block_keys(namespace, tokens[:max(depths) * block_tokens], block_tokens).keys
    return [key_at(d, keys, namespace) for d in depths]
