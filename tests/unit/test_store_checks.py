"""A prompt's keys and token blocks as the store checks them (kvstore.store.types):
the fast path for the usual lists and the per-item path agree on what they accept,
whatever the container."""

import pytest

from kvstore.core.errors import InvalidRequestError
from kvstore.store.types import KEY_BYTES, check_keys, check_tokens

KEY = bytes(range(KEY_BYTES))


@pytest.mark.parametrize("make", [list, tuple, iter, lambda xs: (x for x in xs)],
                         ids=["list", "tuple", "iterator", "generator"])
def test_good_keys_and_tokens_come_back_as_lists_of_bytes(make):
    keys = check_keys(make([KEY, bytearray(KEY)]))
    assert keys == [KEY, KEY] and all(type(k) is bytes for k in keys)
    toks = check_tokens(make([b"\x01\x00\x00\x00", bytearray(8)]), 2)
    assert toks == [b"\x01\x00\x00\x00", bytes(8)] and all(type(t) is bytes for t in toks)
    assert check_keys(make([])) == [] and check_tokens(make([]), 0) == []


@pytest.mark.parametrize("make", [list, lambda xs: (x for x in xs)], ids=["list", "generator"])
@pytest.mark.parametrize("bad", [b"short", KEY + b"x", "s" * KEY_BYTES, 7, None])
def test_a_bad_key_anywhere_is_refused(make, bad):
    with pytest.raises(InvalidRequestError, match="keys must be"):
        check_keys(make([KEY, bad, KEY]))


@pytest.mark.parametrize("make", [list, lambda xs: (x for x in xs)], ids=["list", "generator"])
@pytest.mark.parametrize("bad", [b"", b"abc", b"12345", "abcd", 4])
def test_a_bad_token_block_anywhere_is_refused(make, bad):
    with pytest.raises(InvalidRequestError, match="token block"):
        check_tokens(make([bytes(4), bad]), 2)
    with pytest.raises(InvalidRequestError, match="token blocks"):
        check_tokens(make([bytes(4)]), 2)
