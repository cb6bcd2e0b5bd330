"""The client of one kvstore-server: ``KVStoreClient`` (insert, drop_select, get,
lookup, admin), its control channel (``rpc``), its data path over TE or the
same-node shared arena (``datapath``, ``shm``).

``from kvstore.client import KVStoreClient`` is the public name. It resolves on
first use, so the CLI can import ``kvstore.client.rpc`` without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.client.client import KVStoreClient, SelectResult

__all__ = ["KVStoreClient", "SelectResult"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvstore.client import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvstore.client' has no attribute {name!r}")
