"""``count`` / ``uncount``: the per-key counters behind holds, claims and prompt
ends. Their C-level passes for the usual lease (each key once) must agree with the
key-by-key loop whatever the counts, and leave only positive counts."""

import random

import pytest

from kvstore.store.holds import count, uncount


def by_loop(counts: dict, keys: list, step: int) -> dict:
    out = dict(counts)
    for key in keys:
        out[key] = out.get(key, 0) + step
        if not out[key]:
            del out[key]
    return out


@pytest.mark.parametrize("seed", range(40))
def test_count_then_uncount_agrees_with_the_loop(seed):
    rng = random.Random(seed)
    pool = [bytes([i]) * 16 for i in range(12)]
    counts = {k: rng.randint(1, 3) for k in rng.sample(pool, rng.randint(0, 12))}
    # each key once (the fast paths) or with repeats (the loop), short and long
    keys = rng.sample(pool, rng.randint(1, 12)) if seed % 2 else \
        [rng.choice(pool) for _ in range(rng.randint(1, 12))]
    want = by_loop(counts, keys, +1)
    count(counts, keys)
    assert counts == want
    want = by_loop(counts, keys, -1)
    uncount(counts, keys)
    assert counts == want and all(v > 0 for v in counts.values())


def test_uncount_of_keys_held_once_twice_or_mixed():
    keys = [bytes([i]) * 16 for i in range(8)]
    ones = dict.fromkeys(keys, 1)
    uncount(ones, keys)
    assert ones == {}
    twos = dict.fromkeys(keys, 2)
    uncount(twos, keys)
    assert twos == dict.fromkeys(keys, 1)
    mixed = {**dict.fromkeys(keys[:4], 1), **dict.fromkeys(keys[4:], 3)}
    uncount(mixed, keys)
    assert mixed == dict.fromkeys(keys[4:], 2)


def test_uncount_of_a_key_not_counted_raises():
    keys = [bytes([i]) * 16 for i in range(8)]
    counts = dict.fromkeys(keys[1:], 1)
    with pytest.raises(KeyError):
        uncount(counts, keys)
