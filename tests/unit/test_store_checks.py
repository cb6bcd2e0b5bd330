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


def test_ids_are_the_os_random_bytes_and_a_forked_child_draws_its_own():
    """Ids come from a pool of the OS's random bytes (not a seeded generator, whose
    ids a client could predict): positive 63-bit, never repeated in practice, and
    a child forked with the parent's pool half used does not hand out the parent's
    next ids."""
    import os

    from kvstore.store.types import new_id

    ids = [new_id() for _ in range(3000)]  # (past several refills of the pool)
    assert len(set(ids)) == len(ids) and all(0 < i < 2**63 for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, b",".join(str(new_id()).encode() for _ in range(8)))
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        child = [int(x) for x in f.read().split(b",")]
    parent = [new_id() for _ in range(8)]
    assert len(child) == 8 and not set(child) & set(parent)
