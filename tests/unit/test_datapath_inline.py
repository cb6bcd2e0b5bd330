"""Copying an acquire's inline bytes out (``DataPath.take_inline``, ``take_parts``):
every entry lands at its place in the caller's buffer, verified, whatever the blocks
skipped and however the bytes were cut; anything else is a clear error."""

import numpy as np
import pytest
import xxhash

from kvstore.client.datapath import DataPath
from kvstore.client.rpc import Incoming
from kvstore.core.errors import ChecksumError, InvalidRequestError

SIZES = [4096, 512, 8192, 4096, 100, 4096]  # (a sub-page entry, an odd one)


def entries_of(data: np.ndarray) -> list[list]:
    out, at = [], 0
    for n in SIZES:
        out.append(["dram", (1 << 20) + at, n, 0, xxhash.xxh3_64_intdigest(data[at:at + n])])
        at += n
    return out


@pytest.fixture
def path():
    dp = DataPath("127.0.0.1", 1 << 20, same_node=False)  # its TE engine never starts
    yield dp
    dp.close()


def data_and_entries(seed: int = 0):
    data = np.random.default_rng(seed).integers(0, 256, sum(SIZES), dtype=np.uint8)
    return data, entries_of(data)


@pytest.mark.parametrize("skip", range(len(SIZES) + 1))
@pytest.mark.parametrize("reuse", [False, True])
def test_take_inline_lands_each_entry_but_the_skipped_in_place(path, skip, reuse):
    data, entries = data_and_entries()
    acq = {"entries": entries, "inline": data.size, "inline_data": memoryview(data)}
    into = np.full(data.size + 64, 7, np.uint8) if reuse else None
    out = path.take_inline(acq, skip, into)
    start = sum(SIZES[:skip])
    assert out.tobytes() == data[start:].tobytes()
    if reuse:
        assert out.ctypes.data == into.ctypes.data
        assert (into[out.size:] == 7).all()  # nothing beyond what was asked


@pytest.mark.parametrize("cuts", [[2], [1, 3, 5], [1, 2, 3, 4, 5], [5]])
def test_take_parts_lands_every_entry_in_place_whatever_the_cuts(path, cuts):
    data, entries = data_and_entries(1)
    bounds = [0, *[sum(SIZES[:c]) for c in cuts], data.size]
    parts = [memoryview(data[a:b]) for a, b in zip(bounds, bounds[1:])]
    into = np.zeros(data.size + 64, np.uint8)
    out = path.take_parts({"entries": entries, "inline": data.size}, iter(parts), into)
    assert out.tobytes() == data.tobytes() and (into[data.size:] == 0).all()


def test_take_parts_refuses_parts_that_split_an_entry_or_miss_some(path):
    data, entries = data_and_entries(2)
    acq = {"entries": entries, "inline": data.size}
    for parts in ([data[:4000], data[4000:]],  # inside the first entry
                  [data[:4096]],  # the rest never came
                  [data[:4096], data[4096:4096]],  # an empty part
                  [data, data[:512]]):  # more than the entries
        with pytest.raises(InvalidRequestError, match="malformed reply"):
            path.take_parts(acq, iter(memoryview(p) for p in parts))


@pytest.mark.parametrize("bad", [0, 2, 5])
def test_a_bad_entry_in_any_part_is_named_by_its_position(path, bad):
    data, entries = data_and_entries(3)
    entries[bad][4] ^= 1  # its stored checksum no longer matches its bytes
    bounds = [0, sum(SIZES[:3]), data.size]
    parts = [memoryview(data[a:b]) for a, b in zip(bounds, bounds[1:])]
    with pytest.raises(ChecksumError) as err:
        path.take_parts({"entries": entries, "inline": data.size}, iter(parts))
    assert err.value.position == bad
    acq = {"entries": entries, "inline": data.size, "inline_data": memoryview(data)}
    for skip in range(bad + 1):  # counted from the first entry moved
        with pytest.raises(ChecksumError) as err:
            path.take_inline(acq, skip)
        assert err.value.position == bad - skip


class Trickle(Incoming):
    """The stream door's ``Incoming`` with its reads cut where the test says (``cuts``
    bytes each, then the rest): a socket gives what has come, which a test over a
    real one cannot choose (tests/integration/test_stream_door.py reads real ones)."""

    def __init__(self, data: np.ndarray, cuts: list[int]) -> None:
        self.data, self.cuts = data.tobytes(), list(cuts)
        self.nbytes = self.left = len(self.data)

    def read_some(self, view: memoryview) -> int:
        n = min(len(view), self.left, self.cuts.pop(0) if self.cuts else self.left)
        at = self.nbytes - self.left
        view[:n] = self.data[at:at + n]
        self.left -= n
        return n


@pytest.mark.parametrize("cuts", [[], [1], [4095, 4097, 1], [100] * 300, [4096, 512, 8192]])
@pytest.mark.parametrize("bad", [None, 0, 3, 5])
def test_stream_bytes_land_and_a_bad_entry_is_named_however_the_reads_fall(path, cuts, bad):
    # Entries are hashed as reads complete them (``_take_stream``): a read that ends
    # inside an entry, or completes several, must not lose or misplace one.
    data, entries = data_and_entries(4)
    if bad is not None:
        entries[bad][4] ^= 1
    incoming = Trickle(data, cuts)
    into = np.zeros(data.size + 64, np.uint8)
    acq = {"entries": entries, "inline": data.size}
    if bad is None:
        out = path.take_parts(acq, incoming, into)
        assert out.tobytes() == data.tobytes() and (into[data.size:] == 0).all()
    else:
        with pytest.raises(ChecksumError) as err:
            path.take_parts(acq, incoming, into)
        assert err.value.position == bad
    assert incoming.left == 0  # every byte read: the connection stays in step
