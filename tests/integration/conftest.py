"""Fixtures that run real ``kvstore-server`` processes for integration tests.

* ``server_factory(**opts) -> ServerProc``: starts ``python -m kvstore.server`` on a
  free loopback port with its own temp data dir (small arenas, short leases), waits
  for its "listening" log line, and at teardown stops it by PID (TERM, then KILL)
  and removes any shared-memory arena a killed server left behind.
* ``client_factory(server, **opts) -> KVStoreClient`` with the small test layout
  ``LAYOUT``; closed at teardown.
* ``free_port()``, ``LAYOUT``, ``make_kv(ntokens, seed)`` helpers.

Every wait is bounded; a server that dies during start-up fails the test with its log.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvstore.core.layout import KVLayout

REPO = Path(__file__).resolve().parents[2]
# 2 layers x 2 heads x 8 dim x fp16 = 128 bytes per token, 512 bytes per 4-token block.
LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def record_ops(client) -> list[str]:
    """The op of every request ``client`` sends through ``_call`` from now on (it
    still sends them): which round trips an insert made."""
    seen: list[str] = []
    call = client._call

    def counted(req, *args, **kw):
        seen.append(req.OP)
        return call(req, *args, **kw)

    client._call = counted
    return seen


def make_kv(ntokens: int, seed: int = 0, layout: KVLayout = LAYOUT) -> np.ndarray:
    """Random entry bytes for ``ntokens`` tokens (reproducible by seed)."""
    return np.random.default_rng(seed).integers(0, 256, layout.nbytes(ntokens), dtype=np.uint8)


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["MC_LOG_LEVEL"] = "ERROR"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class ServerProc:
    """One running kvstore-server process."""

    host: str
    port: int
    data_dir: Path
    log_path: Path
    argv: list[str]
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", ns]
    env: dict[str, str] = field(default_factory=dict)  # added to server_env()
    proc: subprocess.Popen | None = None
    _log_start: int = 0

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self, wait: bool = True) -> "ServerProc":
        self._log_start = len(self.log())  # a restart appends; wait for the new line
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*self.prefix, *self.argv], stdout=log,
                                         stderr=subprocess.STDOUT, env={**server_env(), **self.env},
                                         cwd=REPO)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        marker = f"listening on tcp://{self.host}:{self.port}"
        while time.monotonic() < deadline:
            if marker in self.log()[self._log_start:]:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore-server exited {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise RuntimeError(f"kvstore-server not ready after {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Signal the server and wait for it (SIGKILL after ``timeout``); its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)
        _remove_arena_of(self.proc.pid)
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> "ServerProc":
        self.stop()
        return self.start()


def _remove_arena_of(pid: int) -> None:
    # A SIGKILLed server cannot unlink its shared DRAM arena (named ...-<pid>), nor
    # its same-node socket beside it.
    for path in [*glob.glob(f"/dev/shm/kvstore-*-{pid}"), *glob.glob(f"/dev/shm/kvstore-*-{pid}.sock")]:
        try:
            os.unlink(path)
        except OSError:
            pass


def server_argv(port: int, data_dir: Path, host: str = "127.0.0.1", dram: str | None = "4MiB",
                nvme: str | None = "8MiB", block_tokens: int = LAYOUT.block_tokens,
                reservation_lease: float = 2.0, read_lease: float = 5.0,
                extra: tuple[str, ...] = ()) -> list[str]:
    """Small arenas and short leases; an option given as None is left to config/env."""
    opts = {"--host": host, "--port": port, "--data-dir": data_dir, "--dram": dram,
            "--nvme": nvme, "--nvme-fsync": "never", "--block-tokens": block_tokens,
            "--reservation-lease": reservation_lease, "--read-lease": read_lease,
            "--log-level": "INFO"}
    argv = [sys.executable, "-m", "kvstore.server"]
    for flag, value in opts.items():
        if value is not None:
            argv += [flag, str(value)]
    return [*argv, *extra]


class ServerFactory:
    """Starts servers under ``base_dir``; ``stop_all`` stops them by PID."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.started: list[ServerProc] = []

    def __call__(self, host: str = "127.0.0.1", port: int | None = None,
                 data_dir: Path | None = None, prefix: tuple[str, ...] = (), wait: bool = True,
                 env: dict[str, str] | None = None, **opts) -> ServerProc:
        n = len(self.started)
        port = port or free_port(host if not prefix else "127.0.0.1")
        data_dir = data_dir or self.base_dir / f"server{n}"
        srv = ServerProc(host, port, Path(data_dir), self.base_dir / f"server{n}.log",
                         server_argv(port, Path(data_dir), host=host, **opts), list(prefix),
                         dict(env or {}))
        self.started.append(srv)
        return srv.start(wait=wait)

    def stop_all(self) -> None:
        for srv in reversed(self.started):
            srv.stop()


@pytest.fixture
def server_factory(tmp_path) -> ServerFactory:
    """``start(host=..., port=None, data_dir=None, prefix=(), wait=True, **server_argv opts)``:
    a started ``ServerProc``; every one is stopped at teardown."""
    factory = ServerFactory(tmp_path)
    yield factory
    factory.stop_all()


@pytest.fixture
def server(server_factory) -> ServerProc:
    """A fresh server for this test alone."""
    return server_factory()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory) -> ServerProc:
    """One server for a whole module (start-up costs seconds); tests must not rely on
    it being empty: use ``clean_server``."""
    factory = ServerFactory(tmp_path_factory.mktemp("shared"))
    yield factory()
    factory.stop_all()


@pytest.fixture
def clean_server(shared_server) -> ServerProc:
    """The module's shared server, emptied (``clear``) before the test."""
    from kvstore.client.client import KVStoreClient

    with KVStoreClient(shared_server.address, timeout_s=10.0) as admin:
        admin.clear()
        assert admin.stats()["reservations"] == 0, "a previous test left a reservation open"
    return shared_server


@pytest.fixture
def client_factory():
    from kvstore.client.client import KVStoreClient
    from kvstore.core.config import ClientConfig

    clients = []

    def make(server: ServerProc | str, **opts) -> KVStoreClient:
        opts.setdefault("layout", LAYOUT)
        opts.setdefault("timeout_s", 10.0)
        opts.setdefault("staging_bytes", 1 << 20)
        # A client off the server's node reads over TE here, as these tests expect:
        # tests/integration/test_inline.py covers bytes sent in the acquire's reply.
        opts.setdefault("config", ClientConfig(inline_max_bytes=0))
        address = server if isinstance(server, str) else server.address
        client = KVStoreClient(address, **opts)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def transports_made(monkeypatch) -> list:
    """Every ``kvstore.transport.te.Transport`` (one TE engine each) created in the test."""
    import kvstore.transport.te

    made: list = []

    class CountedTransport(kvstore.transport.te.Transport):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)

    monkeypatch.setattr(kvstore.transport.te, "Transport", CountedTransport)
    return made


def damage_at_rest(client, keys) -> None:
    """Flip a byte of each of ``keys``' entries in the server's shared DRAM arena,
    behind the store's back (a stray writer), once the server's own check of them is
    done (``wait_checked``)."""
    from kvstore.client.shm import map_shared

    wait_checked(client)
    dram = client.hello()["dram"]
    arena = map_shared(dram["path"], dram["nbytes"])
    where = {e["key"]: e["offset"] for e in client.ls()}
    for key in keys:
        arena[where[key]] ^= 0xFF


def wait_for(cond, timeout: float, what: str):
    """``cond()``'s first true value, polled every 0.1 s; AssertionError naming
    ``what`` if none came within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def wait_checked(client, timeout_s: float = 30.0) -> None:
    """Until the server's scrub has hashed every entry committed unhashed
    (``store.verify_commits = "background"`` checks entries once they are a second
    old): what a test then does to the arena happens to bytes at rest."""
    deadline = time.monotonic() + timeout_s
    while client.stats()["unchecked_entries"]:
        assert time.monotonic() < deadline, "the server's scrub never ran"
        time.sleep(0.02)
