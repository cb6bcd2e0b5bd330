"""How the client lays entries out in its staging buffer so TE transfers coalesce."""

import numpy as np

from kvstore.datapath import _copy_hashed, _mirror
from kvstore.hashing import checksum

BASE = 1 << 30


def pl(tier: str, offset: int, nbytes: int) -> list:
    return [tier, offset, nbytes, BASE + offset]


def test_sub_page_dram_entries_bridge_their_padding_into_one_transfer():
    items = [pl("dram", 0, 2048), pl("dram", 4096, 2048), pl("dram", 8192, 100)]
    for writing in (True, False):
        offsets, local, remote, lengths = _mirror(items, writing)
        assert offsets == [0, 4096, 8192]
        assert (local, remote, lengths) == ([0], [BASE], [8192 + 100])


def test_writes_never_bridge_a_gap_that_is_not_the_entrys_own_padding():
    # 1024 bytes after the first entry end, the next one starts off a page boundary:
    # the gap may be someone else's bytes.
    items = [pl("dram", 0, 1024), pl("dram", 2048, 1024)]
    assert _mirror(items, writing=True)[3] == [1024, 1024]
    assert _mirror(items, writing=False)[3] == [3072]  # reading it is harmless
    gpu = [pl("gpu", 0, 2048), pl("gpu", 4096, 2048)]
    assert _mirror(gpu, writing=True)[3] == [2048, 2048]


def test_gaps_of_a_page_or_more_and_tier_changes_split_transfers():
    items = [pl("dram", 0, 4096), pl("dram", 12288, 4096), pl("gpu", 16384, 4096)]
    offsets, local, remote, lengths = _mirror(items, writing=False)
    assert lengths == [4096, 4096, 4096] and offsets == local == [0, 4096, 8192]


def test_out_of_order_entries_land_at_their_own_offsets():
    items = [pl("dram", 4096, 4096), pl("dram", 0, 4096)]
    offsets, local, remote, lengths = _mirror(items, writing=True)
    assert offsets == [4096, 0] and (local, remote, lengths) == ([0], [BASE], [8192])


def test_copy_hashed_copies_and_equals_the_checksum_of_the_source():
    rng = np.random.default_rng(3)
    for n in (0, 1, 4096, (2 << 20) + 17):
        src = rng.integers(0, 256, n, dtype=np.uint8)
        for hash_dst in (False, True):
            dst = np.zeros(n, np.uint8)
            assert _copy_hashed(dst, src, hash_dst) == checksum(src)
            assert np.array_equal(dst, src)
