"""Starts that fail, or that must not: a bad CURVE key, a data-dir lock that cannot
be written, a data dir whose file system is full, a ``--max-message-bytes`` too small
to carry any request.

A refused start prints one ``kvstore-server:`` line, exits 2 at once (never hangs,
never a traceback) and leaves nothing behind: no /dev/shm arena, no ``kvstore.lock``.
Real server processes, real files; the full file system is a real tmpfs (root only,
unmounted at the end).
"""

from __future__ import annotations

import errno
import glob
import os
import resource
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from kvstore.core import protocol as p
from kvstore.core.config import MIN_MESSAGE_BYTES, KVStoreConfig, load_config
from kvstore.core.errors import ConfigError
from kvstore.store.setup import LOCK_NAME, _arena_prefix
from tests.faults.conftest import fill, mount_tmpfs, needs_root, umount
from tests.integration.conftest import REPO, free_port, server_argv, server_env

pytestmark = pytest.mark.timeout(180)

# A refused start takes a second or two (the store opens first); one still running
# after this long has hung (or started when it should not have).
REFUSE_WITHIN_S = 30.0


def _arenas(data_dir: Path) -> list[str]:
    """This data dir's /dev/shm arenas and same-node sockets, any process."""
    return glob.glob(f"/dev/shm/{_arena_prefix(data_dir)}*")


def _remove_arenas(data_dir: Path) -> None:
    for path in _arenas(data_dir):
        try:
            os.unlink(path)
        except OSError:
            pass


def _refused(argv: list[str], data_dir: Path, *words: str, preexec_fn=None) -> str:
    """Run a server start that must be refused: exit 2 within REFUSE_WITHIN_S, one
    ``kvstore-server:`` line naming ``words``, no traceback, nothing left behind. A
    server still running by then is killed (by its PID) and fails the test."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=server_env(), cwd=REPO, preexec_fn=preexec_fn)
    try:
        _, err = proc.communicate(timeout=REFUSE_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        _remove_arenas(data_dir)
        pytest.fail(f"kvstore-server still running {REFUSE_WITHIN_S:.0f}s after a start it "
                    f"must refuse (hung?); its stderr:\n{err}")
    try:
        lines = [ln for ln in err.splitlines() if ln.startswith("kvstore-server:")]
        assert proc.returncode == 2, (proc.returncode, err)
        assert len(lines) == 1 and "Traceback" not in err, err
        for word in words:
            assert word in lines[0], lines[0]
        assert _arenas(data_dir) == [], "a /dev/shm arena was left behind"
        assert not (data_dir / LOCK_NAME).exists(), "kvstore.lock was left behind"
    finally:
        _remove_arenas(data_dir)
    return lines[0]


# --------------------------------------------------------------- CURVE key mistakes
@pytest.fixture
def keys(tmp_path) -> dict[str, Path]:
    """A server key pair and a directory holding one client's public key."""
    import zmq.auth

    keydir = tmp_path / "keys"
    clients = keydir / "clients"
    clients.mkdir(parents=True)
    public, secret = zmq.auth.create_certificates(str(keydir), "server")
    zmq.auth.create_certificates(str(clients), "client")
    os.unlink(clients / "client.key_secret")
    return {"public": Path(public), "secret": Path(secret), "clients": clients}


@pytest.mark.parametrize("case", ["missing key alone", "missing key", "public key given"])
def test_a_curve_key_mistake_is_one_line_and_exit_2_not_a_hang(tmp_path, keys, case):
    """The key is loaded after the store opened and the ROUTER socket was made: that
    socket must be closed before the ZeroMQ context is terminated, or termination
    waits for it forever (the start hung with no message, its arena and lock left)."""
    missing = str(tmp_path / "no-such-key")
    extra, words = {
        "missing key alone": (("--curve-secret-key", missing), ("curve_authorized_keys",)),
        "missing key": (("--curve-secret-key", missing,
                         "--curve-authorized-keys", str(keys["clients"])),
                        ("cannot load CURVE key", missing)),
        "public key given": (("--curve-secret-key", str(keys["public"]),
                              "--curve-authorized-keys", str(keys["clients"])),
                             ("holds no secret key",)),
    }[case]
    data = tmp_path / "data"
    _refused(server_argv(free_port(), data, nvme="0", extra=extra), data, *words)


class _Store:
    """Just what ``Server.__init__`` asks of a store."""

    dram_shared_path = None

    def regions(self) -> dict:
        return {}


class _FailingTransport:
    def register_many(self, regions) -> None:
        raise RuntimeError("registration failed")


def _port_free(port: int) -> bool:
    """Whether ``port`` can be bound the way libzmq binds it (SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE, exc
            return False
    return True


def test_a_start_failing_after_the_bind_closes_the_socket_and_the_context():
    """Any step of ``Server.__init__`` after the bind that fails (here: registering
    the arenas with TE) closes the bound socket and terminates the context: the error
    comes back at once and the port is free again. (Real ZeroMQ socket and port; the
    store and transport are stand-ins, as no real one fails at that step on demand.)"""
    from kvstore.server.loop import Server

    port = free_port()
    cfg = KVStoreConfig().replace(server={"port": port, "local_socket": False})
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            Server(cfg, _Store(), _FailingTransport())  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(REFUSE_WITHIN_S)
    assert not thread.is_alive(), "Server.__init__ hung after a failed step"
    assert len(outcome) == 1 and "registration failed" in str(outcome[0]), outcome
    assert _port_free(port), "the failed start left its ROUTER socket bound"


# --------------------------------------------------------------- the data-dir lock
def _no_file_growth() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def test_a_lock_file_that_cannot_be_written_is_one_line_and_exit_2(tmp_path):
    """An OSError writing the lock file other than a full disk (here EFBIG: the
    process may not grow files, RLIMIT_FSIZE 0; the lock file is the first file the
    start writes) is one line and exit 2, never a traceback; the lock is let go."""
    data = tmp_path / "data"
    _refused(server_argv(free_port(), data, nvme="0"), data, "lock", str(data),
             preexec_fn=_no_file_growth)


@needs_root
def test_a_restart_on_a_full_file_system_is_served(tmp_path, server_factory, client_factory):
    """docs/operations.md: a restart with the data dir's file system still full is
    served. The PID in kvstore.lock is only informational (the flock is the lock):
    no room for it is logged, not a crash."""
    mnt = tmp_path / "fs"
    mount_tmpfs(mnt, "16m")
    try:
        assert os.path.ismount(mnt)
        srv = server_factory(data_dir=mnt / "data", dram="4MiB", nvme="8MiB")
        assert srv.stop() == 0
        assert not (mnt / "data" / LOCK_NAME).exists()  # a clean stop removes it
        fill(mnt)
        assert os.statvfs(mnt).f_bavail == 0
        srv.start()  # fails with the server's log if it exits instead
        out = srv.log()[srv._log_start:]
        assert "Traceback" not in out, out
        assert f"cannot write this process's PID into {mnt / 'data' / LOCK_NAME}" in out, out
        client = client_factory(srv)
        assert client.health()["status"] == "ok"
        assert client.hello()["dram"]["nbytes"] == 4 << 20
        assert srv.stop() == 0
        assert _arenas(mnt / "data") == []
    finally:
        for started in server_factory.started:
            started.stop()
        umount(mnt)


# --------------------------------------------------------------- --max-message-bytes
@pytest.mark.parametrize("value", ["0", "1", str(MIN_MESSAGE_BYTES - 1)])
def test_a_max_message_bytes_too_small_for_any_request_is_refused(tmp_path, value):
    """Under the floor the server could not read even a hello's id: it answered
    nothing at all. Refused at start, naming the option."""
    data = tmp_path / "data"
    line = _refused(server_argv(free_port(), data, nvme="0",
                                extra=("--max-message-bytes", value)),
                    data, "max_message_bytes", "--max-message-bytes", str(MIN_MESSAGE_BYTES))
    assert f" {value} " in line, line


def test_the_smallest_requests_fit_the_floor():
    """The floor's reason (kvstore/core/config.py): requests without keys and a
    one-block insert with the full caller meta fit in MIN_MESSAGE_BYTES."""
    with pytest.raises(ConfigError, match="max_message_bytes"):
        load_config(env={}, overrides={"server": {"max_message_bytes": "4095"}})
    assert load_config(env={}, overrides={"server": {"max_message_bytes": "4KiB"}}) \
        .server.max_message_bytes == MIN_MESSAGE_BYTES
    big = p.MAX_ID
    key, size, tokens = (b"k" * p.KEY_BYTES,), (p.MAX_ENTRY_BYTES,), (b"t" * 64,)
    meta: tuple[bytes | None, ...] = (b"m" * p.MAX_META_BYTES,)
    namespace = b"n" * p.NAMESPACE_BYTES
    for req in (p.Hello(), p.Health(deep=True), p.Stats(), p.Clear(),
                p.Release(aid=big, drop=True, xfer_s=1.0, xfer_bytes=big, corrupt=(1, 2)),
                p.Reserve(keys=key, sizes=size, tokens=tokens, meta=meta, lease_s=30.0,
                          namespace=namespace, deadline=1.7e9),
                p.Put(room=big, keys=key, sizes=size, tokens=tokens, offsets=(big,),
                      checksums=(big,), meta=meta, namespace=namespace, skip=0, pin=True,
                      next_room=1 << 30, deadline=1.7e9)):
        assert len(p.encode_request(big, req)) < MIN_MESSAGE_BYTES // 2, req.OP


def test_a_server_at_the_floor_answers(tmp_path, server_factory, client_factory):
    """A server started with the smallest limit says hello and answers health (the
    floor is not set above what a server needs)."""
    srv = server_factory(nvme="0", extra=("--max-message-bytes", str(MIN_MESSAGE_BYTES)))
    client = client_factory(srv)
    assert client.hello()["max_message_bytes"] == MIN_MESSAGE_BYTES
    assert client.health()["status"] == "ok"
