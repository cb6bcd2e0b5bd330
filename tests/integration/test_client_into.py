"""drop_select/get ``into=``: the bytes land in a buffer the caller reuses (TE writes
straight into it; same-node copies into it), ``kv`` is a view of it, and a buffer
that is too small or not writable is refused before anything is dropped."""

import numpy as np
import pytest
import torch

from kvstore.core.errors import InvalidRequestError
from tests.integration.conftest import LAYOUT, make_kv

pytestmark = pytest.mark.timeout(120)
PATHS = pytest.mark.parametrize("same_node", ["auto", False], ids=["shm", "te"])


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(5000 + seed).integers(0, 50_000, n).tolist()


@PATHS
def test_drop_select_into_a_reused_buffer(clean_server, client_factory, same_node):
    client = client_factory(clean_server, same_node=same_node)
    buf = np.zeros(LAYOUT.nbytes(64) + 4096, np.uint8)
    for seed, n in enumerate([64, 5, 37]):  # each smaller prompt reuses the same buffer
        kv = make_kv(n, seed)
        client.insert(prompt(n, seed), kv)
        got = client.drop_select(prompt(n, seed), into=buf)
        assert got.matched_tokens == n
        assert np.array_equal(got.kv.numpy(), kv)
        assert got.kv.numpy().ctypes.data == buf.ctypes.data  # a view, not a copy
    assert client.stats()["entries"] == 0


class _PollCounter:
    """The TE engine, with its async polls that answered "pending" counted."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.pending = 0

    def transfer_check_status(self, batch_id):
        status = self._engine.transfer_check_status(batch_id)
        self.pending += status in (0, -2)
        return status

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.parametrize("wait", ["sleep", "yield", "spin"])
def test_every_te_wait_moves_and_verifies_the_same_bytes(server_factory, client_factory, wait,
                                                         monkeypatch):
    """``client.te_wait``: each way of waiting for TE (sleeping or yielding between
    polls of streamed pieces, or TE's spinning sync call) writes and reads the exact
    bytes, into a reused buffer and into new memory, and catches no false corruption.
    The yielding first millisecond is cut to nothing, so that "sleep" naps once at
    each poll TE answers "pending" (counted), and only "sleep" naps. Whether a poll
    finds a small move still in flight depends on the machine, so the moves include
    one of 4 MiB, and that one is repeated (at most 5 times) until a poll has."""
    import time

    import kvstore.transport.te as te_mod
    from kvstore.core.config import ClientConfig

    naps: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(te_mod, "STREAM_YIELD_S", 0.0)
    monkeypatch.setattr(te_mod.time, "sleep", lambda s: (naps.append(s), real_sleep(s)))
    server = server_factory(dram="64MiB")  # 4 MiB of 512-byte blocks, a page each
    client = client_factory(server, same_node=False, staging_bytes=16 << 20,
                            config=ClientConfig(te_wait=wait, inline_max_bytes=0))
    assert client._data.engine.wait == wait
    transport = client._data.engine.te()
    polls = transport._te = _PollCounter(transport._te)
    big = (4 << 20) // LAYOUT.nbytes(1)
    buf = np.zeros(LAYOUT.nbytes(96) + 4096, np.uint8)
    sizes = [96, 17, big] + [big] * 4
    for seed, n in enumerate(sizes):
        if seed > 2 and (polls.pending or wait == "spin"):
            break
        kv = make_kv(n, 40 + seed)
        client.insert(prompt(n, 40 + seed), kv)  # a TE write (not on the server's node)
        got = client.drop_select(prompt(n, 40 + seed), into=buf if seed == 0 else None)
        assert got.matched_tokens == n
        assert np.array_equal(got.kv.numpy(), kv)
    assert client.stats()["entries"] == 0
    te_naps = [s for s in naps if s == te_mod.STREAM_NAP_S]
    if wait == "spin":  # TE's sync calls: no async polls at all
        assert polls.pending == 0 and not te_naps, (polls.pending, naps[:5])
    else:
        assert polls.pending > 0  # a move was in flight at a poll
        assert len(te_naps) == (polls.pending if wait == "sleep" else 0), \
            (wait, polls.pending, naps[:5])


def test_get_into_a_torch_tensor_keeps_the_entries(clean_server, client_factory):
    client = client_factory(clean_server, same_node=False)
    kv = make_kv(40, 7)
    client.insert(prompt(40, 7), kv)
    out = torch.zeros(LAYOUT.nbytes(40), dtype=torch.uint8)
    got = client.get(prompt(40, 7), into=out)
    assert torch.equal(out, torch.from_numpy(kv)) and got.matched_tokens == 40
    assert client.drop_select(prompt(40, 7)).matched_tokens == 40  # get left them stored


@pytest.mark.parametrize("bad", [np.zeros(10, np.uint8), np.zeros(10**6, np.uint8)[::2],
                                 "not a buffer"], ids=["small", "strided", "str"])
def test_bad_into_is_refused_and_the_prompt_stays(clean_server, client_factory, bad):
    client = client_factory(clean_server, same_node=False)
    kv = make_kv(16, 3)
    client.insert(prompt(16, 3), kv)
    with pytest.raises(InvalidRequestError):
        client.drop_select(prompt(16, 3), into=bad)
    got = client.drop_select(prompt(16, 3))
    assert got.matched_tokens == 16 and np.array_equal(got.kv.numpy(), kv)


@PATHS
def test_skipped_blocks_are_taken_but_not_moved(clean_server, client_factory, same_node):
    """A reader that already holds a prompt's first blocks (an engine's own prefix
    cache) skips them: they count in matched_tokens and are dropped with the rest,
    but no byte of them moves, so ``into`` there is untouched and ``kv`` starts at
    the first block it did not skip."""
    client = client_factory(clean_server, same_node=same_node)
    bt = LAYOUT.block_tokens
    n, skip = 3 * bt + 2, 2
    kv = make_kv(n, 11)
    client.insert(prompt(n, 11), kv)
    head = LAYOUT.nbytes(skip * bt)
    buf = np.full(LAYOUT.nbytes(n), 0xAB, np.uint8)
    got = client.drop_select(prompt(n, 11), into=buf[head:], skip_blocks=skip)
    assert got.matched_tokens == n
    assert np.array_equal(got.kv.numpy(), kv[head:]) and np.array_equal(buf[head:], kv[head:])
    assert (buf[:head] == 0xAB).all()
    assert client.stats()["entries"] == 0  # the skipped blocks were taken too

    client.insert(prompt(n, 12), make_kv(n, 12))  # skipping them all moves nothing
    got = client.get(prompt(n, 12), skip_blocks=10)
    assert got.matched_tokens == n and got.kv.numel() == 0
    assert client.stats()["leases"] == 0
