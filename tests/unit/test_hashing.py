"""Properties of the token-prefix key chain (kvstore/core/hashing.py)."""

from __future__ import annotations

import array
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.client.shm import PROMPT_KEYS
from kvstore.core import hashing
from kvstore.core.errors import InvalidRequestError
from kvstore.core.hashing import (
    KEY_BYTES,
    block_keys,
    block_token_bytes,
    checksum,
    hidden_key,
    namespace_of,
    prompt_blocks,
    tokens_to_array,
)
from kvstore.core.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=4)
NS = namespace_of("org/model", LAYOUT)
BT = LAYOUT.block_tokens

token_ids = st.integers(min_value=0, max_value=2**31 - 1)
prompts = st.lists(token_ids, min_size=1, max_size=6 * BT + 3)


def keys_of(tokens, ns=NS, bt=BT, include_partial=True):
    return block_keys(ns, tokens, bt, include_partial).keys


# ------------------------------------------------------------------ chain
@given(prompts, st.data())
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens, data):
    cut = data.draw(st.integers(min_value=1, max_value=len(tokens)))
    full_blocks = cut // BT
    whole, prefix = block_keys(NS, tokens, BT), block_keys(NS, tokens[:cut], BT)
    assert prefix.keys[:full_blocks] == whole.keys[:full_blocks]
    assert prefix.token_counts[:full_blocks] == [BT] * full_blocks
    assert prefix.ntokens == cut
    # Equal prompts, equal keys.
    assert block_keys(NS, list(tokens), BT) == whole


@given(prompts, st.data())
def test_changing_a_token_changes_its_block_and_every_later_key_only(tokens, data):
    pos = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    new = data.draw(token_ids.filter(lambda t: t != tokens[pos]))
    changed = tokens[:pos] + [new] + tokens[pos + 1:]
    before, after = keys_of(tokens), keys_of(changed)
    block = pos // BT
    assert before[:block] == after[:block]
    assert all(b != a for b, a in zip(before[block:], after[block:]))


@given(prompts)
def test_keys_are_distinct_16_byte_strings(tokens):
    keys = keys_of(tokens)
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == len(keys)


# ------------------------------------------------------------------ namespace
def _namespace_variants() -> dict[str, bytes]:
    base = {"model_id": "org/model", "layout": LAYOUT, "tp_rank": 0, "tp_size": 1, "salt": b""}
    variants = {"base": namespace_of(**base)}
    variants["model"] = namespace_of(**{**base, "model_id": "org/model2"})
    for name, value in [("num_layers", 5), ("kv_heads", 3), ("head_dim", 16),
                        ("dtype", "float16"), ("block_tokens", 8)]:
        layout = dataclasses.replace(LAYOUT, **{name: value})
        variants[f"layout.{name}"] = namespace_of(**{**base, "layout": layout})
    variants["tp_size"] = namespace_of(**{**base, "tp_size": 2})
    variants["tp_rank"] = namespace_of(**{**base, "tp_rank": 1, "tp_size": 2})
    variants["salt"] = namespace_of(**{**base, "salt": b"tenant-a"})
    variants["salt_str"] = namespace_of(**{**base, "salt": "tenant-b"})
    # Length prefixes: moving bytes from the model id into the salt is a new namespace.
    variants["shifted"] = namespace_of(**{**base, "model_id": "org/mode", "salt": b"l"})
    return variants


def test_every_namespace_field_changes_the_namespace():
    variants = _namespace_variants()
    assert len(set(variants.values())) == len(variants), variants
    assert namespace_of("org/model", LAYOUT, salt="x") == namespace_of("org/model", LAYOUT,
                                                                       salt=b"x")


@settings(max_examples=30)
@given(prompts)
def test_a_namespace_change_changes_every_key(tokens):
    base = keys_of(tokens)
    for name, ns in _namespace_variants().items():
        if name == "base":
            continue
        assert not set(keys_of(tokens, ns=ns)) & set(base), name


@pytest.mark.parametrize("rank,size", [(-1, 1), (1, 1), (2, 2), (0, 0)])
def test_bad_tp_rank_is_refused(rank, size):
    with pytest.raises(InvalidRequestError):
        namespace_of("m", LAYOUT, tp_rank=rank, tp_size=size)


def test_namespace_must_be_a_key():
    with pytest.raises(InvalidRequestError):
        block_keys(b"short", [1, 2, 3], BT)


# ------------------------------------------------------------------ partial block
@given(prompts)
def test_partial_and_full_keys_never_collide(tokens):
    """Every prefix length of the same tokens: partial keys and full keys are disjoint."""
    full_keys, partial_keys = set(), set()
    for n in range(1, len(tokens) + 1):
        bk = block_keys(NS, tokens[:n], BT)
        if bk.partial:
            partial_keys.add(bk.keys[-1])
            full_keys.update(bk.keys[:-1])
        else:
            full_keys.update(bk.keys)
    assert not full_keys & partial_keys


@given(prompts)
def test_partial_block_flags_and_counts(tokens):
    full, rest = divmod(len(tokens), BT)
    bk = block_keys(NS, tokens, BT)
    assert bk.partial == bool(rest)
    assert bk.token_counts == [BT] * full + ([rest] if rest else [])
    without = block_keys(NS, tokens, BT, include_partial=False)
    assert without.keys == bk.keys[:full] and not without.partial


def test_chain_matches_the_documented_formula():
    tokens = list(range(100, 100 + 2 * BT + 1))
    raw = np.asarray(tokens, dtype="<i4").tobytes()
    k0 = xxhash.xxh3_128_digest(NS + raw[:4 * BT])
    k1 = xxhash.xxh3_128_digest(k0 + raw[4 * BT:8 * BT])
    keys = keys_of(tokens)
    assert keys[:2] == [k0, k1]
    assert keys[2] != xxhash.xxh3_128_digest(k1 + raw[8 * BT:])  # partial uses its own seed


# ------------------------------------------------------------------ input forms
@given(prompts)
def test_list_numpy_and_torch_tokens_give_the_same_keys(tokens):
    expected = block_keys(NS, tokens, BT)
    for form in (np.asarray(tokens, dtype=np.int64), np.asarray(tokens, dtype=np.int32),
                 np.asarray(tokens, dtype=np.uint32), torch.tensor(tokens, dtype=torch.int64),
                 torch.tensor(tokens, dtype=torch.int32), tuple(tokens)):
        assert block_keys(NS, form, BT) == expected


@pytest.mark.parametrize("bad", [
    [-1], [1, 2**31], np.array([2**40]), [[1, 2], [3, 4]], [[1, 2], [3]], [1.0, 2.0],
    np.array([1.5]), torch.tensor([0.5]), np.array([True, False]), ["a"], 7, np.array(3),
    (1, -2), [2**63], [1, None],
])
def test_invalid_tokens_raise(bad):
    with pytest.raises(InvalidRequestError):
        block_keys(NS, bad, BT)
    with pytest.raises(InvalidRequestError):
        tokens_to_array(bad)


@pytest.mark.parametrize("dtype", ["i1", "i2", "<i4", ">i4", "<i8", ">i8", "u1", "u2", "<u4",
                                   "<u8", ">u8"])
def test_every_integer_dtype_is_checked_for_range(dtype):
    """A negative id, or one past int32, is refused from an array of any integer dtype
    (signed ones of 4 bytes and more are checked read as unsigned: one pass)."""
    info = np.iinfo(dtype)
    good = np.array([0, 5, min(info.max, 2**31 - 1)], dtype=dtype)
    assert tokens_to_array(good).tolist() == good.astype(np.int64).tolist()
    assert tokens_to_array(good[::2]).tolist() == good[::2].astype(np.int64).tolist()
    bad = [v for v in (-1, info.min, 2**31, info.max) if info.min <= v <= info.max
           and not 0 <= v <= 2**31 - 1]
    for value in bad:
        with pytest.raises(InvalidRequestError):
            tokens_to_array(np.array([3, value, 4], dtype=dtype))
        with pytest.raises(InvalidRequestError):
            tokens_to_array(np.array([value, 3, 4], dtype=dtype)[::2])
    assert bad or dtype in ("u1", "u2")  # (those two cannot hold a bad id)


def test_empty_prompt_has_no_keys():
    assert block_keys(NS, [], BT) == ([], [], False)


@given(prompts, st.sampled_from([list, tuple, np.array]))
def test_prompt_blocks_is_the_keys_and_token_bytes_at_once(tokens, form):
    assert prompt_blocks(NS, form(tokens), BT) == (block_keys(NS, tokens, BT),
                                                   block_token_bytes(tokens, BT), len(tokens))


SEED = hashing._PARTIAL_SEED


def _with_c(*args):
    """prompt_blocks as the client calls it: with the extension's ``prompt_keys``."""
    return prompt_blocks(*args, native=PROMPT_KEYS)


def _pythons_prompt_blocks(tokens, bt=BT):
    """prompt_blocks without the C extension's loop."""
    raw = tokens_to_array(tokens).tobytes()
    return (hashing._chained_keys(NS, raw, bt, True), hashing._per_block(raw, bt),
            len(raw) // 4)


class _Id(int):
    """An int subclass (an IntEnum's members are ints too)."""


_INT_FORMS = [list, tuple, lambda t: array.array("i", t), lambda t: array.array("q", t),
              lambda t: array.array("l", t), lambda t: [_Id(x) for x in t],
              *(lambda t, d=d: np.asarray(t, dtype=d)
                for d in ("<i4", "<i8", "<u4", "<u8", "=i4", "=i8")),
              lambda t: memoryview(np.asarray(t, dtype=np.int32))]


@settings(max_examples=300)
@given(st.lists(token_ids, max_size=300), st.one_of(st.integers(1, 70), st.integers(71, 400)),
       st.sampled_from(range(len(_INT_FORMS))))
def test_prompt_blocks_in_c_gives_pythons_keys_and_bytes(tokens, bt, form):
    """The client extension's ``prompt_keys`` (kvstore/client/_ntcopy.c), which the
    client hands ``prompt_blocks``, gives the Python path's keys, counts and token bytes for
    prompts of any length (none, shorter than a block, a partial last block) in every
    block size and each form an engine or a caller passes."""
    native = PROMPT_KEYS
    assert native is not None, "kvstore.client._ntcopy was built without prompt_keys"
    given_tokens = _INT_FORMS[form](tokens)
    want = _pythons_prompt_blocks(tokens, bt)
    keys, blocks, n = native(NS, given_tokens, bt, SEED)
    assert (keys, blocks, n) == (want[0].keys, want[1], want[2])
    assert _with_c(NS, given_tokens, bt) == want


@given(st.sampled_from(["i1", "u1", "<i2", "<u2"]), st.data())
def test_prompt_blocks_in_c_reads_small_integer_arrays_like_numpy(dtype, data):
    """Every value of the small integer dtypes: the ids are read as signed or unsigned
    as the dtype says (a negative one goes to Python's path, which refuses it)."""
    info = np.iinfo(dtype)
    tokens = data.draw(st.lists(st.integers(int(info.min), int(info.max)), max_size=40))
    arr = np.asarray(tokens, dtype=dtype)
    if min(tokens, default=0) < 0:
        assert PROMPT_KEYS(NS, arr, BT, SEED) is None
        with pytest.raises(InvalidRequestError):
            _with_c(NS, arr, BT)
        return
    assert PROMPT_KEYS(NS, arr, BT, SEED) is not None
    assert _with_c(NS, arr, BT) == _pythons_prompt_blocks(tokens)
    if dtype == "u1":
        assert _with_c(NS, bytearray(tokens), BT) == _pythons_prompt_blocks(tokens)


def test_bools_are_ids_0_and_1_in_both_paths():
    assert _with_c(NS, [True, False, True], BT) == _pythons_prompt_blocks([1, 0, 1])


@pytest.mark.parametrize("odd", [
    np.arange(8, dtype=">i4"), np.arange(8, dtype=">i8"), np.arange(16)[::2],
    torch.arange(8), [np.int64(3), 4]])
def test_tokens_the_c_loop_does_not_take_go_to_pythons_path(odd):
    """Valid ids in a form the C loop does not read (another byte order, a stride,
    a tensor, numpy scalars in a list): it says None and Python's path gives the keys."""
    assert PROMPT_KEYS(NS, odd, BT, SEED) is None
    want = [int(x) for x in odd]
    assert _with_c(NS, odd, BT) == _pythons_prompt_blocks(want)


@pytest.mark.parametrize("bad", [
    [-1], [1, 2**31], np.array([2**40]), [[1, 2], [3, 4]], [1.0, 2.0], np.array([1.5]),
    np.array([True, False]), ["a"], 7, np.array(3), (1, -2), [2**63], [1, None], b"abc",
    np.array([-3], dtype="i1"), np.array([-1], dtype="<i2"), np.array([2**31], dtype="<u4"),
    np.array([2**63], dtype="<u8"), np.array([[1, 2]], dtype=np.int32)])
def test_bad_tokens_are_refused_the_same_with_the_c_loop(bad):
    """Whatever the C loop refuses (None) goes to Python's path, which names it."""
    assert PROMPT_KEYS(NS, bad, BT, SEED) is None
    with pytest.raises(InvalidRequestError):
        _with_c(NS, bad, BT)


def test_a_bad_namespace_or_block_size_goes_to_pythons_path():
    """As before the C loop: a namespace not of 16 bytes is refused, one that is not
    bytes fails as Python's concatenation does, a block size below 1 fails."""
    native, seed = PROMPT_KEYS, SEED
    for ns in (b"short", "x" * 16, memoryview(NS), bytearray(NS), np.frombuffer(NS, np.uint8)):
        assert native(ns, [1, 2], BT, seed) is None
    assert native(NS, [1, 2], 0, seed) is None
    with pytest.raises(InvalidRequestError):
        _with_c(b"short", [1, 2], BT)
    with pytest.raises(TypeError):
        _with_c(memoryview(NS), [1, 2], BT)
    assert _with_c("x" * 16, [], BT) == (([], [], False), [], 0)
    with pytest.raises(ZeroDivisionError):
        _with_c(NS, [1, 2], 0)
    with pytest.raises(TypeError):
        native(NS, [1, 2], BT)  # (its own arguments are checked as any function's)


@pytest.mark.parametrize("bt", [7, 8, 9, 2**31 - 1, 2**40, 2**62, 2**63 - 1])
def test_a_block_longer_than_the_prompt_is_its_one_partial_block(bt):
    """However long a block, the C loop reads and hashes only the prompt's bytes."""
    tokens = list(range(3, 11))
    keys, blocks, n = PROMPT_KEYS(NS, tokens, bt, SEED)
    want = _pythons_prompt_blocks(tokens, bt)
    assert (keys, blocks, n) == (want[0].keys, want[1], want[2])
    assert _with_c(NS, tokens, bt) == want


@given(prompts)
def test_block_token_bytes_split_like_the_keys(tokens):
    parts = block_token_bytes(tokens, BT)
    assert [len(p) // 4 for p in parts] == block_keys(NS, tokens, BT).token_counts
    assert b"".join(parts) == np.asarray(tokens, dtype="<i4").tobytes()


# ------------------------------------------------------------------ other keys
@given(prompts)
def test_hidden_key_differs_from_every_block_key(tokens):
    keys = keys_of(tokens)
    hidden = {hidden_key(k) for k in keys}
    assert len(hidden) == len(keys) and not hidden & set(keys)
    assert all(len(h) == KEY_BYTES for h in hidden)


def test_checksum_is_xxh3_64_of_any_buffer():
    data = bytes(range(256)) * 3
    expected = xxhash.xxh3_64_intdigest(data)
    assert checksum(data) == checksum(memoryview(data)) == expected
    assert checksum(np.frombuffer(data, dtype=np.uint8)) == expected
    assert checksum(data[:-1] + b"\x00") != expected


# ------------------------------------------------------------------ determinism
_CHILD = """
import sys
from kvstore.core.hashing import block_keys, namespace_of
from kvstore.core.layout import KVLayout
layout = KVLayout(num_layers=4, kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=4)
ns = namespace_of("org/model", layout, tp_rank=1, tp_size=2, salt="t")
tokens = [int(t) for t in sys.argv[1].split(",")]
print(",".join(k.hex() for k in block_keys(ns, tokens, 4).keys))
"""


@pytest.mark.timeout(60)
def test_keys_agree_across_processes():
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, 2**31 - 1, size=4 * BT + 3)]
    ns = namespace_of("org/model", LAYOUT, tp_rank=1, tp_size=2, salt="t")
    out = subprocess.run([sys.executable, "-c", _CHILD, ",".join(map(str, tokens))],
                         capture_output=True, text=True, timeout=50, check=False,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=_repo_root())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(",") == [k.hex() for k in keys_of(tokens, ns=ns)]


def _repo_root() -> str:
    import pathlib

    return str(pathlib.Path(__file__).resolve().parents[2])
