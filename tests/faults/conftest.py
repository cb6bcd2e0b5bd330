"""The fault suite: real faults injected into real ``kvstore-server`` processes.

* ``small_fs(size)``: a tmpfs of ``size`` mounted on a fresh directory (root only),
  unmounted at teardown; ``fill(path)`` writes a file until the file system is full.
* ``server_factory`` / ``client_factory``: as in tests/integration (servers stopped
  by PID at teardown, their /dev/shm arenas removed).
* ``fault_log``: each test records ``(fault, tries, survived, bytes_lost)`` rows;
  they are appended as JSON lines to ``$KVSTORE_FAULT_LOG`` when it is set, which is
  how ``tools/fault_table.py`` builds the table in docs/operations.md.

Every mount, namespace, process and /dev/shm file a test makes is gone when it ends.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import LAYOUT, ServerFactory, make_kv  # noqa: F401

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="mounts file systems: needs root")


def mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                   check=True, capture_output=True)


def umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy: detach


def fill(directory: Path, name: str = "filler") -> Path:
    """Write ``directory/name`` until the file system says ENOSPC; the file."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    chunk = b"\0" * (64 << 10)
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)
    return path


@pytest.fixture
def small_fs(tmp_path):
    """``mount(size="16m") -> Path``: a fresh tmpfs; all unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size: str = "16m") -> Path:
        path = tmp_path / f"fs{len(mounted)}"
        mount_tmpfs(path, size)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        umount(path)


@pytest.fixture
def server_factory(tmp_path) -> ServerFactory:
    factory = ServerFactory(tmp_path)
    yield factory
    factory.stop_all()


@pytest.fixture
def client_factory():
    from kvstore.client.client import KVStoreClient
    from kvstore.core.config import ClientConfig

    clients = []

    def make(server, **opts) -> KVStoreClient:
        opts.setdefault("layout", LAYOUT)
        opts.setdefault("timeout_s", 10.0)
        opts.setdefault("staging_bytes", 1 << 20)
        # A client off the server's node reads over TE here, as these tests expect:
        # tests/integration/test_inline.py covers bytes sent in the acquire's reply.
        opts.setdefault("config", ClientConfig(inline_max_bytes=0))
        client = KVStoreClient(server if isinstance(server, str) else server.address, **opts)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def fault_log(request):
    """``record(fault, tries, survived, bytes_lost)`` for the fault table."""
    rows: list[dict] = []

    def record(fault: str, tries: int, survived: int, bytes_lost: int) -> None:
        rows.append({"fault": fault, "tries": tries, "survived": survived,
                     "bytes_lost": bytes_lost, "test": request.node.nodeid})

    yield record
    target = os.environ.get("KVSTORE_FAULT_LOG")
    if target and rows:
        with open(target, "a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")


def shm_files(data_dir: Path | None = None) -> set[str]:
    """The shared DRAM arenas in /dev/shm: of ``data_dir``'s servers, or all."""
    if data_dir is None:
        return set(glob.glob("/dev/shm/kvstore-*"))
    from kvstore.store.setup import _arena_prefix

    return set(glob.glob(f"/dev/shm/{_arena_prefix(data_dir)}*"))
