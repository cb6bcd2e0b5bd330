"""What TE needs from its surroundings before an engine starts: its timeout
environment, a host it can bind, a free port; and a cheap liveness check of a
P2P peer. No mooncake import here (kvstore/transport/te.py is the only one).
"""

from __future__ import annotations

import math
import os
import socket

from kvstore.core.errors import ConfigError

_TE_MIN_TIMEOUT_S = 5


def check_host(host: str) -> None:
    """TE accepts any string as its host and then is unreachable: bind to prove it."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except OSError as exc:
        raise ConfigError(f"TE host {host!r} is not an address of this machine: {exc}") from exc


def set_timeouts(timeout_s: float) -> None:
    """TE reads these at initialize(): they bound every sync call of that engine."""
    seconds = max(1, math.ceil(timeout_s))
    os.environ["MC_TRANSFER_TIMEOUT"] = str(max(_TE_MIN_TIMEOUT_S, seconds))
    os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(seconds)
    os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = str(seconds)


def bound_from_env() -> float:
    """A stall fails a sync call after the first of TE's two bounds to expire."""
    try:
        return float(min(int(os.environ["MC_TRANSFER_TIMEOUT"]),
                         int(os.environ.get("MC_TCP_PROGRESS_TIMEOUT_SEC", "30"))))
    except ValueError as exc:
        raise ConfigError(f"MC_TRANSFER_TIMEOUT / MC_TCP_PROGRESS_TIMEOUT_SEC: {exc}") from exc


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_open(segment: str, timeout_s: float = 0.5) -> bool | None:
    """Whether a P2P segment's handshake port accepts TCP; None if not host:port."""
    host, _, port = segment.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False
