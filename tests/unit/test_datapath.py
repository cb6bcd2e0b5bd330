"""How the client lays entries out in its staging buffer so TE transfers coalesce."""

import platform
import re
import signal
import socket
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvstore.client.datapath import _mirror
from kvstore.client.rpc import Incoming
from kvstore.client.shm import PIECE_BYTES, RUN_BYTES, copy_in, copy_out
from kvstore.core.hashing import checksum

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


_SIZES = st.sampled_from([65536, 4096, 100, 5000])
_GAPS = st.sampled_from([0, 0, 0, 96, 4096])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["dram", "dram", "nvme"]), _SIZES, _GAPS),
                min_size=1, max_size=12),
       st.sampled_from([0, 7 * 4096, 1 << 40]), st.booleans(), st.randoms())
def test_back_to_back_entries_take_the_array_path_to_the_loops_layout(
        spec, start, shuffled, rnd):
    """``_mirror``'s fast path (one tier, entries back to back: a stored prompt) must
    give exactly what its loop gives, and step aside for every other layout."""
    import kvstore.client.datapath as dp

    items, addr = [], start
    for tier, nbytes, gap in spec:
        items.append([tier, 0, nbytes, addr])
        addr += nbytes + gap
    if shuffled:
        rnd.shuffle(items)
    for writing in (False, True):
        fast = dp._mirror(items, writing)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dp, "_back_to_back", lambda items: None)
            assert fast == dp._mirror(items, writing)
    contiguous = all(b[3] == a[3] + a[2] and b[0] == a[0] for a, b in zip(items, items[1:]))
    assert (dp._back_to_back(items) is not None) == contiguous


def test_an_entry_without_an_address_is_still_refused_by_name():
    from kvstore.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="no TE address for a nvme entry"):
        _mirror([pl("dram", 0, 4096), ["nvme", 4096, 4096, None]], writing=False)


def test_shm_copies_merge_neighbours_and_hash_every_entry_from_the_callers_side():
    rng = np.random.default_rng(3)
    shm = np.zeros(8 << 20, np.uint8)
    data = rng.integers(0, 256, 5 << 20, dtype=np.uint8)
    # 40 x 64 KiB back to back (merged in runs of RUN_BYTES), then a gap, a 2 MiB
    # entry (a run of its own) and a buffer that is not the packed array's neighbour.
    sizes = [64 << 10] * 40 + [2 << 20]
    bufs = [data[i * (64 << 10):(i + 1) * (64 << 10)] for i in range(40)]
    bufs.append(data[(40 << 16):(40 << 16) + (2 << 20)])
    bufs.append(rng.integers(0, 256, 5000, dtype=np.uint8))
    sizes.append(5000)
    offsets = [i * (64 << 10) for i in range(40)] + [(40 << 16) + 4096, 5 << 20]
    placements = [["dram", off, n, None] for off, n in zip(offsets, sizes)]
    assert RUN_BYTES < sum(sizes[:40])  # the small ones really span several runs
    assert copy_in(shm, bufs, placements) == [checksum(b) for b in bufs]
    for buf, (_, off, n, _) in zip(bufs, placements):
        assert np.array_equal(shm[off:off + n], buf)

    entries = [[t, off, n, None, checksum(b), 1, None]
               for (t, off, n, _), b in zip(placements, bufs)]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    out = np.zeros(sum(sizes), np.uint8)
    assert copy_out(shm, out, list(zip(starts, entries)), verify=True) is None
    assert np.array_equal(out, np.concatenate(bufs))

    shm[offsets[7] + 100] ^= 0xFF  # inside the first run
    assert copy_out(shm, out, list(zip(starts, entries)), verify=True) == 7
    assert copy_out(shm, out, list(zip(starts, entries)), verify=False) is None
    shm[offsets[7] + 100] ^= 0xFF
    shm[offsets[40] + (2 << 20) - 1] ^= 0xFF  # the last piece of the large entry
    assert copy_out(shm, out, list(zip(starts, entries)), verify=True) == 40


@pytest.mark.parametrize("nbytes", [PIECE_BYTES + 1, 3 * PIECE_BYTES - 123])
def test_large_entries_copy_and_hash_piece_by_piece_to_the_same_digest(nbytes):
    rng = np.random.default_rng(nbytes)
    buf = rng.integers(0, 256, nbytes, dtype=np.uint8)
    shm = np.zeros(4 * PIECE_BYTES, np.uint8)
    assert copy_in(shm, [buf], [["dram", 4096, nbytes, None]]) == [checksum(buf)]
    assert np.array_equal(shm[4096:4096 + nbytes], buf)
    out = np.zeros(nbytes, np.uint8)
    entry = ["dram", 4096, nbytes, None, checksum(buf), 1, None]
    assert copy_out(shm, out, [(0, entry)], verify=True) is None
    assert np.array_equal(out, buf)
    shm[4096 + nbytes - 1] ^= 1
    assert copy_out(shm, out, [(0, entry)], verify=True) == 0


def test_write_refuses_a_buffer_whose_size_is_not_its_placements():
    """numpy would broadcast a 1-byte buffer over the whole extent and the commit
    would then fail on a checksum; a wrong size is the caller's error, said so."""
    import pytest

    from kvstore.client.datapath import DataPath, Segment
    from kvstore.core.errors import InvalidRequestError

    shm = np.zeros(4 * 4096, np.uint8)
    path = DataPath("127.0.0.1", 1 << 20, same_node=True)
    seg = Segment("unused:0", shm)
    with pytest.raises(InvalidRequestError, match="1 bytes, its placement 4096"):
        path.write(seg, [np.ones(1, np.uint8)], [pl("dram", 0, 4096)])
    assert not shm.any()
    assert path.write(seg, [np.ones(4096, np.uint8)], [pl("dram", 0, 4096)]) == [
        checksum(np.ones(4096, np.uint8))]
    path.close()


# ------------------------------------------------------------ TE pieces

from kvstore.client import shm as shm_mod  # noqa: E402
from kvstore.client.datapath import DataPath  # noqa: E402
from kvstore.core.errors import ConfigError  # noqa: E402
from kvstore.transport.ranges import split, stream_piece  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(1, 1 << 22)), max_size=12),
       st.integers(0, 1 << 21))
def test_split_moves_every_byte_once_in_pieces_no_longer_than_asked(ranges, piece):
    # (At most 4096 pieces a range: a 4 MiB range cut into bytes is the same case as
    # a 4 KiB one, and checking it piece by piece took seconds an example.)
    ranges = [(at, min(n, max(1, piece) << 12)) for at, n in ranges]
    loc = np.array([r[0] for r in ranges], dtype=np.int64)
    rem = loc * 3 + 7
    ln = np.array([r[1] for r in ranges], dtype=np.int64)
    sl, sr, sn = split(loc, rem, ln, piece)
    if piece == 0:
        assert np.array_equal(sn, ln)
    # In order, each range's pieces follow one another from its start to its end,
    # on both sides, none longer than ``piece``.
    k = 0
    for a, r, n in zip(loc.tolist(), rem.tolist(), ln.tolist()):
        at = 0
        while at < n:
            assert (sl[k], sr[k]) == (a + at, r + at)
            assert 0 < sn[k] <= (piece or n)
            at += int(sn[k])
            k += 1
        assert at == n
    assert k == len(sn)


def test_pieces_follow_the_wait_unless_asked():
    run = ([0, 1 << 30], [1 << 40, 1 << 41], [8 << 20, 3 << 20])
    spin = DataPath("127.0.0.1", 1 << 20, same_node=False, wait="spin")
    assert spin._pieces(*run)[2].tolist() == [8 << 20, 3 << 20]  # whole runs
    streamed = DataPath("127.0.0.1", 1 << 20, same_node=False)  # te_wait "sleep"
    piece = stream_piece(11 << 20)  # a quarter of the move, page-rounded
    assert piece % 4096 == 0 and 11 << 18 <= piece < (11 << 18) + 4096
    lengths = streamed._pieces(*run)[2].tolist()
    assert max(lengths) == piece and sum(lengths) == 11 << 20 and len(lengths) == 5
    assert stream_piece(1 << 30) == 4 << 20 and stream_piece(100_000) == 256 << 10
    for wait in ("spin", "yield", "sleep"):
        cut = DataPath("127.0.0.1", 1 << 20, same_node=False, piece_bytes=2 << 20, wait=wait)
        local, remote, lengths = cut._pieces(*run)
        assert lengths.tolist() == [2 << 20] * 4 + [2 << 20, 1 << 20]
        assert remote.tolist()[:2] == [1 << 40, (1 << 40) + (2 << 20)]
        cut.close()
    spin.close()
    streamed.close()
    with pytest.raises(ConfigError, match="te_wait"):
        DataPath("127.0.0.1", 1 << 20, same_node=False, wait="busy")


def test_only_copies_of_large_entries_go_parallel():
    """Hashing an entry below ~256 KiB holds the GIL: a second thread would wait.
    The extension's loops hold no GIL: there, small entries go parallel too."""
    groups = shm_mod._groups
    assert groups([64 << 10] * 512, 2) == [(0, 512)]  # 32 MiB of 64 KiB blocks: one
    assert groups([64 << 10] * 512, 2, native=True) == [(0, 256), (256, 512)]
    assert groups([64 << 10] * 32, 2, native=True) == [(0, 32)]  # below PARALLEL_MIN_BYTES
    assert groups([2 << 20] * 16, 2) == [(0, 8), (8, 16)]  # 32 MiB of 2 MiB blocks: two
    assert groups([2 << 20], 2) == [(0, 1)]  # below PARALLEL_MIN_BYTES
    assert groups([2 << 20] * 16, 1) == [(0, 16)]


def test_parallel_copies_land_and_hash_like_one_thread(monkeypatch):
    monkeypatch.setattr(shm_mod, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(shm_mod, "PARALLEL_MIN_ENTRY_BYTES", 1)
    rng = np.random.default_rng(5)
    arena = np.zeros(64 * 8192, dtype=np.uint8)
    bufs = [rng.integers(0, 256, 8192, dtype=np.uint8) for _ in range(40)]
    placements = [["dram", (i * 3 % 64) * 8192, 8192] for i in range(40)]
    assert copy_in(arena, bufs, placements, threads=2) == [checksum(b) for b in bufs]
    for b, pl in zip(bufs, placements):
        assert np.array_equal(arena[pl[1]:pl[1] + 8192], b)
    entries = [["dram", pl[1], 8192, 0, checksum(b)] for b, pl in zip(bufs, placements)]
    items = list(zip(range(0, 40 * 8192, 8192), entries))
    out = np.empty(40 * 8192, dtype=np.uint8)
    assert copy_out(arena, out, items, verify=True, threads=2) is None
    assert np.array_equal(out, np.concatenate(bufs))
    arena[placements[30][1]] ^= 1  # entry 30 (the second thread's share) goes bad
    arena[placements[33][1]] ^= 1
    assert copy_out(arena, out, items, verify=True, threads=2) == 30


def _copy_in_parallel() -> list[int]:
    arena = np.zeros(8 << 20, dtype=np.uint8)
    bufs = [np.full(2 << 20, i, dtype=np.uint8) for i in range(4)]
    return copy_in(arena, bufs, [["dram", i * (2 << 20), 2 << 20] for i in range(4)], threads=2)


def test_a_forked_child_still_copies_on_two_threads():
    """vLLM forks workers: the parent's copy pool has no threads in the child, and
    work handed to it would wait forever. The child starts its own."""
    import multiprocessing

    want = _copy_in_parallel()  # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=lambda: queue.put(_copy_in_parallel()))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, "the forked child hung or died copying"
    assert queue.get(timeout=5) == want


def test_layer_writes_group_a_prompts_blocks_into_strided_runs():
    from kvstore.client.client import _strided_runs

    n = 3 * 4096 + 512  # page-rounded in the arena: entries 16 KiB apart
    blocks = [(i * n, n, 1 << 20 | i * 16384) for i in range(4)]
    assert _strided_runs(blocks) == [(0, n, 1 << 20, 16384, 4)]
    # A block already stored (not written: a gap in data), a smaller last block, and an
    # arena jump each start a new run; nothing is ever grouped out of order.
    mixed = [(0, n, 0), (n, n, 16384), (3 * n, n, 32768), (4 * n, 512, 49152),
             (4 * n + 512, 512, 1 << 30)]
    assert _strided_runs(mixed) == [(0, n, 0, 16384, 2), (3 * n, n, 32768, n, 1),
                                    (4 * n, 512, 49152, (1 << 30) - 49152, 2)]


@pytest.mark.parametrize("sizes", [[65536] * 32, [65536] * 7 + [4096], [8192, 4096, 12288],
                                   [65536] * 3 + [1000], [1, 4097, 8192], [4096]])
@pytest.mark.parametrize("address", [1 << 30, None])
def test_a_rooms_layout_is_whole_pages_back_to_back(sizes, address):
    """An insert's entries in its room: each at the page after the one before, its
    placement the room's tier, offset and address plus that; ``_need`` is the room
    they take."""
    from kvstore.client.client import _need, _Room, _room_layout

    room = _Room(7, "dram", 3 << 20, 4 << 20, address, 4096, 0.0, 0.0, None)
    offsets, placements = _room_layout(room, sizes)
    at = 0
    for n, off, pl in zip(sizes, offsets, placements):
        assert off == at
        assert pl == ["dram", room.offset + at, n, None if address is None else address + at]
        at += -(-n // 4096) * 4096
    assert len(offsets) == len(placements) == len(sizes)
    assert _need(sizes) == at == sum(-(-n // 4096) * 4096 for n in sizes)


# ------------------------------------------------------------ non-temporal copies
def test_the_streaming_copy_is_built_here():
    """pyproject builds kvstore.client._ntcopy (optional: a machine without a C
    compiler installs without it and copies with numpy). The Makefile installs gcc,
    so where the tests run it must exist, or the copies below test numpy twice."""
    assert shm_mod.STREAM is not None, "kvstore.client._ntcopy was not built"


def test_the_streaming_copy_refuses_what_it_cannot_do_safely():
    copy = shm_mod.STREAM
    if copy is None:
        pytest.skip("kvstore.client._ntcopy not built")
    with pytest.raises(ValueError, match="destination of 10 bytes, source of 11"):
        copy(np.zeros(10, np.uint8), np.zeros(11, np.uint8))
    with pytest.raises((TypeError, BufferError)):
        copy(b"read-only!", np.zeros(10, np.uint8))
    with pytest.raises((TypeError, BufferError, ValueError)):
        copy(np.zeros(10, np.uint8), np.zeros(20, np.uint8)[::2])


# ------------------------------------------------------ copying and hashing in C
needs_loops = pytest.mark.skipif(
    shm_mod.SCATTER is None, reason="kvstore.client._ntcopy built without xxhash.h")


def native_isas() -> list[str]:
    """Every build of the extension's copy-and-hash loop this CPU can run."""
    native = shm_mod._NATIVE
    try:
        was = native.use_isa("avx2")
    except ValueError:  # not built (not GCC on x86-64) or not on this CPU
        return ["baseline"]
    native.use_isa(was)
    return ["baseline", "avx2"]


def test_the_copy_and_hash_loops_are_built_here():
    """The Makefile installs libxxhash-dev: where the tests run, the extension has its
    hashing loops (else every test below would compare Python's loops with
    themselves), and where GCC built it for an x86-64 CPU with AVX2 it runs the AVX2
    loop (the baseline one hashes at half the speed)."""
    assert None not in (shm_mod.SCATTER, shm_mod.GATHER, shm_mod.RECV_HASHED,
                        shm_mod.SCATTER_RUN, getattr(shm_mod._NATIVE, "prompt_keys", None)), \
        "kvstore.client._ntcopy was built without xxhash.h (0.8 or later)"
    isa = shm_mod._NATIVE.HASH_ISA
    assert isa in ("baseline", "avx2")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    gcc = "gcc" in (sysconfig.get_config_var("CC") or "")
    if platform.machine() == "x86_64" and gcc and re.search(r"^flags\s*:.*\bavx2\b", flags, re.M):
        assert isa == "avx2"


@given(lead=st.integers(0, 70),
       sizes=st.lists(st.one_of(st.integers(0, 40 << 10), st.sampled_from(
           [1, 2047, 2048, 2049, 16383, 16384, 16385, 3 * PIECE_BYTES // 2])),
           min_size=1, max_size=7),
       gaps=st.lists(st.integers(0, 200), min_size=7, max_size=7),
       bad=st.integers(-1, 6))
@settings(max_examples=60, deadline=None)
@needs_loops
def test_the_extensions_loops_land_and_hash_like_pythons(lead, sizes, gaps, bad):
    """Entries of any size (none, under, at and over the 2 KiB and 16 KiB chunks, over a
    piece) at any alignment (a head before the first 16-byte boundary, a tail after
    the last whole 64-byte line), on each build of the loop and with Python's loops,
    streamed or not: the same bytes in the arena and nothing beside them, the same
    checksums, and reading them back the same output and the same first bad entry."""
    rng = np.random.default_rng(sum(sizes) + lead)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    offsets, at = [], lead
    for n, gap in zip(sizes, gaps):
        offsets.append(at)
        at += n + gap
    placements = [["dram", off, n, None] for off, n in zip(offsets, sizes)]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()

    def run(stream: bool) -> tuple:
        arena = np.full(at + 64, 0xA5, np.uint8)
        sums = copy_in(arena, bufs, placements, stream=stream)
        entries = [["dram", off, n, None, c] for off, n, c in zip(offsets, sizes, sums)]
        if 0 <= bad < len(sizes) and sizes[bad]:
            arena[offsets[bad] + sizes[bad] // 2] ^= 0x10
        out = np.full(sum(sizes), 0x5A, np.uint8)
        first_bad = copy_out(arena, out, list(zip(starts, entries)), verify=True)
        return arena, sums, out, first_bad

    with shm_mod.python_loops():
        want = run(False)
        streamed = run(True)  # Python's loops with the extension's streamed copy
    assert want[1] == [checksum(b) for b in bufs]
    for have, expect in zip(streamed, want):
        assert (np.array_equal(have, expect) if isinstance(expect, np.ndarray)
                else have == expect)
    native = shm_mod._NATIVE
    was = native.use_isa("baseline")
    try:
        for isa in native_isas():
            native.use_isa(isa)
            for stream in (True, False):
                got = run(stream)
                assert np.array_equal(got[0], want[0]), (isa, stream)
                assert got[1] == want[1], (isa, stream)
                assert got[3] == want[3], (isa, stream)
                if want[3] is None:
                    assert np.array_equal(got[2], want[2]), (isa, stream)
    finally:
        native.use_isa(was)


@needs_loops
def test_the_extensions_loops_refuse_bad_input_and_change_nothing():
    native = shm_mod._NATIVE
    scatter, gather = shm_mod.SCATTER, shm_mod.GATHER
    arena = np.zeros(1 << 16, np.uint8)
    src = np.full(4096, 7, np.uint8)
    n = src.size
    # The second entry would end past the arena: refused before the first is copied.
    with pytest.raises(ValueError, match="entry 1 .* outside the destination's 65536"):
        scatter(arena, [0, (1 << 16) - 100], [n, n], [src, src], True)
    with pytest.raises(ValueError, match="source 1 has 4096 bytes, its entry 4000"):
        scatter(arena, [0, 8192], [n, 4000], [src, src], True)
    with pytest.raises(ValueError, match="negative"):
        scatter(arena, [0, -1], [n, n], [src, src], True)
    with pytest.raises(ValueError, match="2 items for 1 entries"):
        scatter(arena, [0, 4096], [n], [src], True)
    with pytest.raises(OverflowError):
        scatter(arena, [1 << 70], [n], [src], True)
    with pytest.raises(TypeError):
        scatter(arena, ["0"], [n], [src], True)
    with pytest.raises((BufferError, ValueError)):  # not contiguous
        scatter(arena, [0], [4096], [np.zeros(8192, np.uint8)[::2]], True)
    with pytest.raises((TypeError, BufferError)):  # read-only destination
        scatter(bytes(1 << 16), [0], [n], [src], True)
    with pytest.raises(ValueError, match="source 0 overlaps"):
        scatter(arena, [0], [n], [arena[8192:8192 + n]], True)
    assert not arena.any()
    out = np.zeros(8192, np.uint8)
    arena[:] = 3
    with pytest.raises(ValueError, match="entry 1 .* outside"):
        gather(out, [0, 4096], arena, [0, (1 << 16) - 10], [4096, 4096])
    with pytest.raises(ValueError, match="entry 0 .* outside"):
        gather(out, [8000], arena, [0], [4096])
    with pytest.raises(ValueError, match="3 items for 2 entries"):
        gather(out, [0, 1, 2], arena, [0, 1], [1, 1])
    with pytest.raises(ValueError, match="negative"):
        gather(out, [0], arena, [0], [-5])
    with pytest.raises(ValueError, match="source overlaps the destination"):
        gather(arena[:4096], [0], arena[2048:], [0], [1024])
    assert not out.any()
    with pytest.raises(ValueError, match="neon is not built"):
        native.use_isa("neon")
    assert scatter(arena, [], [], [], True) == [] and gather(out, [], arena, [], []) == []


@needs_loops
def test_a_refused_copy_lets_go_of_every_buffer():
    """After each refusal, the buffers it looked at can be resized again: none is left
    exported (a leaked view would pin them for good)."""
    scatter, gather = shm_mod.SCATTER, shm_mod.GATHER
    dst, a, b = bytearray(1 << 12), bytearray(b"x" * 64), bytearray(b"y" * 64)
    refusals = [
        lambda: scatter(dst, [0, 1 << 12], [64, 64], [a, b], True),  # fails at entry 1
        lambda: scatter(dst, [0, 64], [64, 63], [a, b], True),
        lambda: scatter(dst, [0, 64], [64, 64], [a, 5], True),  # not a buffer
        lambda: gather(dst, [0], a, [0], [65]),
        lambda: gather(dst, [0, "x"], a, [0, 0], [1, 1]),
    ]
    for refuse in refusals:
        with pytest.raises((ValueError, TypeError)):
            refuse()
        for buf in (dst, a, b):
            buf.extend(b"z")
            del buf[-1:]
    assert scatter(dst, [0, 64], [64, 64], [a, b], False) == [checksum(a), checksum(b)]
    assert bytes(dst[:128]) == bytes(a + b)


@given(sizes=st.lists(st.one_of(st.integers(0, 20 << 10), st.sampled_from(
           [1, 2047, 2048, 4095, 4096, 4097, 16385, 3 * PIECE_BYTES // 2])),
           min_size=1, max_size=9),
       page=st.sampled_from([1, 512, 4096, 8192]),
       lead=st.integers(0, 3),
       threads=st.sampled_from([1, 2]))
@settings(max_examples=60, deadline=None)
@needs_loops
def test_a_rooms_run_lands_and_hashes_like_its_entries_copied_one_by_one(
        sizes, page, lead, threads):
    """``copy_run`` (one call for a prompt's flat bytes, on one thread or split between
    two) puts each entry where ``_room_layout`` places it and nothing beside, with the
    checksums and offsets an entry-by-entry ``copy_in`` gives, on each build of the
    loop, streamed or not."""
    from kvstore.client.client import _Room, _room_layout, _split

    rng = np.random.default_rng(sum(sizes) + page)
    data = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    start = lead * page
    room = _Room(1, "dram", start, 1 << 30, None, page, 0.0, 0.0, None)
    offsets, placements = _room_layout(room, sizes)
    end = start + sum(-(-n // page) * page for n in sizes)
    want = np.full(end + 64, 0xA5, np.uint8)
    with shm_mod.python_loops():
        want_sums = copy_in(want, _split(data, sizes), placements)
    assert want_sums == [checksum(b) for b in _split(data, sizes)]
    native = shm_mod._NATIVE
    was, least = native.use_isa("baseline"), shm_mod.PARALLEL_MIN_BYTES
    shm_mod.PARALLEL_MIN_BYTES = 1 if threads == 2 else 1 << 40  # split, or never
    try:
        for isa in native_isas():
            native.use_isa(isa)
            for stream in (True, False):
                arena = np.full(end + 64, 0xA5, np.uint8)
                got = shm_mod.copy_run(arena, start, data, page, sizes, threads, stream)
                assert got == (offsets, want_sums), (isa, stream)
                assert np.array_equal(arena, want), (isa, stream)
    finally:
        native.use_isa(was)
        shm_mod.PARALLEL_MIN_BYTES = least


@needs_loops
def test_a_rooms_run_refuses_bad_input_and_changes_nothing():
    run = shm_mod.SCATTER_RUN
    arena = np.zeros(1 << 16, np.uint8)
    src = np.full(8192, 7, np.uint8)
    with pytest.raises(ValueError, match="entries of more than the source's 8192"):
        run(arena, 0, src, 4096, [4096, 4097], True)
    with pytest.raises(ValueError, match="entries of 4096 bytes, a source of 8192"):
        run(arena, 0, src, 4096, [4096], True)
    # The second entry would end past the arena: refused before the first is copied.
    with pytest.raises(ValueError, match="entry 1 .* outside the destination's 65536"):
        run(arena, (1 << 16) - 8192, src, 8192, [4096, 4096], True)
    with pytest.raises(ValueError, match="entry 0 .* outside"):
        run(arena, 1 << 16, src, 4096, [8192], True)
    with pytest.raises(ValueError, match="must be >= 0 and >= 1"):
        run(arena, -4096, src, 4096, [8192], True)
    with pytest.raises(ValueError, match="must be >= 0 and >= 1"):
        run(arena, 0, src, 0, [8192], True)
    with pytest.raises(ValueError, match="negative"):
        run(arena, 0, src, 4096, [8193, -1], True)
    with pytest.raises(OverflowError):
        run(arena, 0, src, 4096, [1 << 70], True)
    with pytest.raises(TypeError):
        run(arena, 0, src, 4096, ["8192"], True)
    with pytest.raises((BufferError, ValueError, TypeError)):  # not contiguous
        run(arena, 0, np.zeros(16384, np.uint8)[::2], 4096, [8192], True)
    with pytest.raises((TypeError, BufferError)):  # read-only destination
        run(bytes(1 << 16), 0, src, 4096, [8192], True)
    arena[32768:32768 + 8192] = 9  # a source inside the destination
    with pytest.raises(ValueError, match="the source overlaps the destination"):
        run(arena, 0, arena[32768:32768 + 8192], 4096, [8192], True)
    assert not arena[:32768].any() and (arena[32768:32768 + 8192] == 9).all()
    arena[32768:32768 + 8192] = 0
    # An entry after one whose padding leaves the destination: refused at its would-be
    # offset, before anything is copied.
    with pytest.raises(ValueError, match=r"entry 1 \(0 bytes at 69632\) is outside"):
        run(arena, (1 << 16) - 4096, src[:4096], 8192, [4096, 0], True)
    with pytest.raises(ValueError, match=r"entry 2 \(4096 bytes at 65536\) is outside"):
        run(arena, (1 << 16) - 8192, src, 8192, [4096, 0, 4096], True)
    assert not arena.any()
    with pytest.raises(ValueError, match="needs their bytes as one uint8 run"):
        shm_mod.copy_run(arena, 0, src.view(np.uint16), 4096, [8192])
    with pytest.raises(ValueError, match="needs their bytes as one uint8 run"):
        shm_mod.copy_run(arena, 0, src, 4096, [4096])  # bytes left over
    with pytest.raises(ValueError, match="needs their bytes as one uint8 run"):
        shm_mod.copy_run(arena, 0, src.reshape(2, 4096), 4096, [8192])
    assert not arena.any()
    dst, raw = bytearray(1 << 13), bytearray(b"x" * 8192)
    for bad in ([4096, 4097], [1 << 13], [4096, "x"]):  # each lets go of both buffers
        with pytest.raises((ValueError, TypeError)):
            run(dst, 4096, raw, 4096, bad, True)
        for buf in (dst, raw):
            buf.extend(b"z")
            del buf[-1:]
    assert run(arena, 0, src[:0], 4096, [], True) == ([], [])
    assert run(arena, 0, src, 4096, [0, 8192, 0], False) == \
        ([0, 0, 8192], [checksum(b""), checksum(src), checksum(b"")])


@needs_loops
def test_a_rooms_run_never_writes_outside_its_room():
    """``write_run`` copies into the room's own bytes of the arena: entries that would
    leave the room (a client that laid them out wrong), a room outside the arena, or
    KV of another size than the entries are refused, and nothing is written."""
    from kvstore.client.datapath import DataPath, Segment
    from kvstore.core.errors import InvalidRequestError

    arena = np.zeros(8 * 4096, np.uint8)
    path = DataPath("127.0.0.1", 1 << 20, same_node=True)
    seg = Segment("unused:0", arena)
    data = np.full(3 * 4096, 5, np.uint8)
    with pytest.raises(ValueError, match="entry 2 .* outside the destination's 8192"):
        path.write_run(seg, data, [4096] * 3, 4096, 2 * 4096, 4096)  # a room of 2 pages
    with pytest.raises(InvalidRequestError, match="outside the 32768-byte arena"):
        path.write_run(seg, data, [4096] * 3, 6 * 4096, 3 * 4096, 4096)
    with pytest.raises(InvalidRequestError, match="12288 bytes of KV for entries of 8192"):
        path.write_run(seg, data, [4096] * 2, 0, 3 * 4096, 4096)
    assert not arena.any()
    assert path.write_run(seg, data, [4096, 100, 4096 * 2 - 100], 4096, 4 * 4096, 4096) == (
        [0, 4096, 8192], [checksum(data[:4096]), checksum(data[4096:4196]),
                          checksum(data[4196:])])
    want = np.zeros_like(arena)  # each entry at the page after the one before; no padding
    want[4096:8192], want[8192:8292], want[12288:12288 + 8092] = 5, 5, 5  # written
    assert np.array_equal(arena, want)
    path.close()


# ------------------------------------------- a door reply hashed as it arrives
def _send_in_pieces(sock: socket.socket, data: bytes, pieces: list[int],
                    close: bool = False) -> threading.Thread:
    """A thread that sends ``data`` over ``sock`` in ``pieces`` (byte counts), with a
    pause between them, so the reader's receives see the bytes come a piece at a time;
    then closes ``sock`` if asked."""
    def run() -> None:
        at = 0
        # (No empty piece: with nothing left to send, the reader is done at once and
        # closes ``sock`` under a late ``sendall`` of nothing, which fails.)
        for n in filter(None, pieces):
            sock.sendall(data[at:at + n])
            at += n
            time.sleep(0.01)
        if close:
            sock.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@given(sizes=st.lists(st.one_of(st.integers(0, 3000), st.sampled_from([1, 4096, 70000])),
                      min_size=1, max_size=6),
       start=st.integers(0, 100), chunk=st.sampled_from([1, 1000, 4096, 1 << 20]),
       cuts=st.lists(st.integers(1, 50000), max_size=4))
@settings(max_examples=40, deadline=None)
@needs_loops
def test_a_reply_received_and_hashed_as_it_lands_gives_each_entrys_checksum(
        sizes, start, chunk, cuts):
    """Entries of any size (none included), some already in (read past the reply), the
    rest arriving in arbitrary pieces and taken in any chunk: the bytes land where they
    belong and each entry's checksum is the one its bytes have, on each build of the
    loop."""
    total = sum(sizes)
    start = min(start, total)
    data = np.random.default_rng(total + start).integers(0, 256, total, np.uint8).tobytes()
    bounds = np.cumsum([0, *sizes]).tolist()
    want = [checksum(data[a:b]) for a, b in zip(bounds, bounds[1:])]
    native = shm_mod._NATIVE
    was = native.use_isa("baseline")
    try:
        for isa in native_isas():
            native.use_isa(isa)
            out = bytearray(total)
            out[:start] = data[:start]
            a, b = socket.socketpair()
            with a, b:
                rest = data[start:]
                pieces = [c for c in sorted(set(cuts)) if c < len(rest)]
                _send_in_pieces(b, rest, [y - x for x, y in zip([0, *pieces],
                                                                [*pieces, len(rest)])])
                got, sums, why = shm_mod.RECV_HASHED(a.fileno(), out, start, sizes, chunk,
                                                     time.monotonic() + 10)
            assert (got, sums, why) == (total, want, ""), isa
            assert bytes(out) == data
    finally:
        native.use_isa(was)


@needs_loops
def test_a_reply_cut_short_says_why_and_how_far_it_came():
    recv = shm_mod.RECV_HASHED
    data = bytes(range(256)) * 64  # 16 KiB: entries of 4 KiB
    sizes = [4096] * 4
    a, b = socket.socketpair()
    with a, b:  # the peer closes after 6 KiB: one entry whole, and half the next
        _send_in_pieces(b, data[:6144], [6144], close=True).join()
        got, sums, why = recv(a.fileno(), bytearray(len(data)), 0, sizes, 1024,
                              time.monotonic() + 10)
    assert (got, sums, why) == (6144, [checksum(data[:4096])], "closed")
    a, b = socket.socketpair()
    with a, b:  # the peer stops sending, and stays: the deadline ends the wait
        b.sendall(data[:100])
        began = time.monotonic()
        got, sums, why = recv(a.fileno(), bytearray(len(data)), 0, sizes, 1 << 20,
                              began + 0.3)
        assert 0.25 < time.monotonic() - began < 5
    assert (got, sums, why) == (100, [], "timeout")
    a, b = socket.socketpair()
    with a, b:  # a deadline already past: nothing is waited for
        got, sums, why = recv(a.fileno(), bytearray(8), 0, [8], 4, time.monotonic() - 1)
    assert (got, sums, why) == (0, [], "timeout")
    with pytest.raises(ValueError, match="entries of more bytes than a buffer of 8"):
        recv(0, bytearray(8), 0, [4, 6], 4, 0.0)
    with pytest.raises(ValueError, match="more bytes"):  # (they would wrap around to 8)
        recv(0, bytearray(8), 0, [4, 2**63 - 1, 2**63 - 1, 6], 4, 0.0)
    with pytest.raises(ValueError, match="entries of fewer bytes"):
        recv(0, bytearray(8), 0, [4, 2], 4, 0.0)
    with pytest.raises(ValueError, match="9 of 8 bytes in"):
        recv(0, bytearray(8), 9, [8], 4, 0.0)
    with pytest.raises(ValueError, match="chunks of 0"):
        recv(0, bytearray(8), 0, [8], 0, 0.0)
    with pytest.raises((TypeError, BufferError)):
        recv(0, b"read-only", 0, [9], 4, 0.0)
    got, sums, why = recv(-1, bytearray(8), 0, [8], 4, time.monotonic() + 1)
    assert (got, sums) == (0, []) and why  # a bad descriptor: its error, named


@needs_loops
def test_a_signal_during_a_reply_runs_its_handler_at_once():
    """Ctrl-C (here SIGALRM's handler raising) while the reply's bytes trickle in
    stops the read then, not at its deadline: with some bytes of the piece in, and
    with none."""
    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    old = signal.signal(signal.SIGALRM, stop)
    try:
        for pending in (100, 0):
            a, b = socket.socketpair()
            with a, b:
                b.sendall(b"x" * pending)
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                began = time.monotonic()
                with pytest.raises(Stop):
                    shm_mod.RECV_HASHED(a.fileno(), bytearray(4096), 0, [4096], 4096,
                                        began + 30)
                assert time.monotonic() - began < 10, pending
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_pythons_read_of_a_reply_hashes_like_the_extensions():
    """``Incoming.read_hashed`` (where the extension is not built) gives the same
    checksums, reading with ``read_some``."""
    data = np.random.default_rng(5).integers(0, 256, 50000, np.uint8).tobytes()
    sizes = [0, 7, 20000, 0, 29993]

    class Pieces(Incoming):
        def __init__(self) -> None:
            self.nbytes = self.left = len(data)

        def read_some(self, view: memoryview) -> int:
            n = min(len(view), self.left, 3000)
            at = self.nbytes - self.left
            view[:n] = data[at:at + n]
            self.left -= n
            return n

    out = bytearray(len(data))
    bounds = np.cumsum([0, *sizes]).tolist()
    assert Pieces().read_hashed(memoryview(out), sizes) == \
        [checksum(data[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert bytes(out) == data
