"""Which node is this process on, for the same-node fast path.

Two processes share a node, and so can share the server's DRAM arena file, when
they see the same machine id, hostname and network namespace. The network namespace
is part of the identity on purpose: tests (and some deployments) emulate separate
nodes with network namespaces on one machine, and those must talk over TE.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache

import xxhash


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@lru_cache(maxsize=1)
def host_id() -> str:
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    parts = (_read("/etc/machine-id") or _read("/var/lib/dbus/machine-id"),
             socket.gethostname(), netns)
    return xxhash.xxh3_128_hexdigest("\0".join(parts).encode())
