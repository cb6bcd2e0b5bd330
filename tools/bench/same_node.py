"""What the same-node insert tools share (tools.bench.put_split, tools.bench.room_run):
a writer beside a fresh kvstore-server on loopback, a new prompt for each insert, and
the check that it was stored whole before it is evicted again."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvstore.core.layout import KVLayout
from tests.integration.conftest import ServerFactory

if TYPE_CHECKING:
    from kvstore.client.client import InsertResult, KVStoreClient

MiB = 1 << 20
SWEEP = 64 * MiB  # more than this machine's last-level cache: an "idle" pass over it


@contextlib.contextmanager
def writer_beside_a_server(layout: KVLayout, nbytes: int,
                           prefix: str) -> Iterator[KVStoreClient]:
    """A ``KVStoreClient`` on the same node as a kvstore-server of its own (DRAM only,
    8 prompts of ``nbytes`` or 64 MiB, leases of a minute), both gone afterwards with
    the server's directory. Evict each prompt after its insert: the arena never fills."""
    from kvstore.client.client import KVStoreClient

    base = Path(tempfile.mkdtemp(prefix=prefix))
    servers = ServerFactory(base)
    try:
        srv = servers(dram=str(max(64 * MiB, 8 * nbytes)), nvme="0",
                      block_tokens=layout.block_tokens, reservation_lease=60, read_lease=60)
        with KVStoreClient(srv.address, layout=layout, timeout_s=60) as writer:
            yield writer
    finally:
        servers.stop_all()
        shutil.rmtree(base, ignore_errors=True)


def new_prompt(kv: np.ndarray, ntokens: int, serial: int) -> np.ndarray:
    """Prompt ``serial``'s tokens (none shares a block with another's); ``kv``'s first
    bytes are changed for it, as a producer's KV is new for each prompt."""
    kv[:8] = serial % 256
    return (np.arange(ntokens) + serial * ntokens) % 50_000


def evict_whole(writer: KVStoreClient, tokens: np.ndarray, res: InsertResult,
                serial: int) -> None:
    """``RuntimeError`` unless the insert's result ``res`` stored every block of
    ``tokens``; then the prompt is evicted."""
    keys = writer.keys_for(tokens)
    if res.new_blocks != len(keys):
        raise RuntimeError(f"prompt {serial} was not stored whole: {res}")
    writer.evict(keys=keys)
