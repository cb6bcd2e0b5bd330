"""What TE needs from its surroundings before an engine starts: its timeout
environment, a host it can bind, a free port, the transport it is to use; and a
cheap liveness check of a P2P peer. No mooncake import here
(kvstore/transport/te.py is the only one).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvstore.core.config import check_te_protocol, parse_te_devices
from kvstore.core.errors import ConfigError

_TE_MIN_TIMEOUT_S = 5
RDMA_SYSFS = Path("/sys/class/infiniband")  # one directory per RDMA device (verbs)
_ENV_LOCK = threading.Lock()  # TE reads the environment inside initialize()


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


# ------------------------------------------------------------------ protocol
def check_protocol(protocol: str, devices: str | Sequence[str] = "",
                   sysfs: Path = RDMA_SYSFS, section: str = "") -> tuple[str, ...]:
    """The device names TE is to be given, once ``protocol`` can run on this machine.

    TE does not refuse RDMA without a NIC: it finds none and quietly runs TCP. So
    "rdma" is checked here, in one line: the machine has RDMA devices, the
    ``devices`` named are among them, and at least one of those has an ACTIVE port.
    ``section`` ("server." / "client.") prefixes the option names in the errors.
    """
    key = f"{section}te_protocol"
    check_te_protocol(key, protocol)
    names = parse_te_devices(f"{section}te_devices", devices)
    if protocol != "rdma":
        return names
    present = rdma_devices(sysfs)
    if not present:
        raise ConfigError(f"{key} is 'rdma' but this machine has no RDMA device "
                          f"({sysfs} is empty or missing); use 'tcp' here")
    missing = [d for d in names if d not in present]
    if missing:
        raise ConfigError(f"{section}te_devices names {', '.join(missing)}: not an RDMA "
                          f"device of this machine (it has {', '.join(sorted(present))})")
    candidates = list(names) or sorted(present)
    if not any(present[d] for d in candidates):
        raise ConfigError(f"{key} is 'rdma' but no port of {', '.join(candidates)} is "
                          f"ACTIVE (see {sysfs}/<device>/ports/*/state)")
    return names


def rdma_devices(sysfs: Path = RDMA_SYSFS) -> dict[str, bool]:
    """This machine's RDMA devices -> whether any of its ports is ACTIVE."""
    try:
        entries = sorted(sysfs.iterdir())
    except OSError:
        return {}
    out = {}
    for device in entries:
        out[device.name] = any(_port_active(state) for state in device.glob("ports/*/state"))
    return out


def _port_active(state: Path) -> bool:
    try:  # e.g. "4: ACTIVE", "1: DOWN"
        return state.read_text().partition(":")[2].strip().startswith("ACTIVE")
    except OSError:
        return False


@contextlib.contextmanager
def protocol_env(protocol: str) -> Iterator[None]:
    """Around ``initialize()``: TE picks its transport itself there, RDMA whenever
    it discovers a NIC, whatever its protocol argument says. ``MC_FORCE_TCP`` is how
    "tcp" gets TCP on a machine with NICs; it is set only for the call, so an
    "rdma" engine later in the same process is not forced too."""
    with _ENV_LOCK:
        before = os.environ.get("MC_FORCE_TCP")
        if protocol == "rdma" and before is not None:
            raise ConfigError("te_protocol is 'rdma' but MC_FORCE_TCP is set in the "
                              "environment (TE would run TCP): unset it")
        if protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("MC_FORCE_TCP", None)
            else:
                os.environ["MC_FORCE_TCP"] = before
