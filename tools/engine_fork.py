"""Engines forked from one process that imported vLLM once (the tests' fast start).

``from vllm import LLM`` takes ~10 - 20 s of CPU in every engine process here, most of
an in-process engine's start (the model itself, a tiny one, loads in ~3 s). The
engine tests start ~25 such engines, two or three at a time on 2 cores. A *zygote*
(``python -m tools.engine_fork FD``, one per test process, started on first use)
imports vLLM, torch and the connector once, then forks each engine on request:

* the request (over a ``SOCK_SEQPACKET`` pair made before the zygote started) carries
  the engine's config and environment, and the descriptors the child runs on: its
  stdin and stdout (the driver protocol's pipes, as ``subprocess.Popen`` would make
  them), its log file as stderr, a status pipe, and the network namespace of the
  node it runs on (``ip netns exec NAME`` in a prefix becomes ``setns`` on
  ``/run/netns/NAME``);
* the child writes to its log from its first step (what fails before the driver
  runs is in the engine's log), leaves the zygote's session (``setsid``: its own
  process group, as ``start_new_session`` gives a driver), dies with the zygote
  (``PR_SET_PDEATHSIG``), takes the engine's environment (plus what the zygote's
  imports set in theirs, as the driver's own imports would) and vLLM's logging
  config from it, and runs the driver (``tools.engine_proc.drive``) as
  ``python -m tools.engine_proc`` would; at the end it joins its threads, runs the
  exit handlers and leaves without the interpreter's teardown (the zygote's modules
  are not its own);
* the zygote reaps it (a pidfd per child says when) and writes its exit status
  into the status pipe: ``Forked`` is what ``EngineProc`` holds instead of a
  ``Popen`` (``pid``, ``stdin``, ``stdout``, ``poll``, ``wait``, ``returncode``);
* each request carries an id its answer echoes: an answer that comes after its
  caller gave up is not taken for the next one's (that orphaned engine is killed);
* the zygote ends when its socket does (the test process exited, however), TERMing
  its children's groups first. (Not ``PR_SET_PDEATHSIG``: that fires when the
  *thread* that started it ends.)

Only engines in one process (``in_process``) are forked: vLLM's own layout starts its
engine core and workers with ``spawn``, a fresh interpreter each, whatever started the
driver. ``KVSTORE_ENGINE_FORK=0`` starts every engine with ``Popen`` as before. The
zygote has the torch and vLLM threads that their imports start (two, idle on a
futex); nothing else runs in it when it forks.

What still differs from a fresh driver: what is read once per interpreter or library
load (``PYTHON*`` variables, ``tempfile.tempdir``, libgomp's ``OMP_*``) is the
zygote's, whose environment is ``engine_env``'s without a node or layout;
``/proc/PID/cmdline`` and ``environ`` show the zygote's; the child enters only the
node's network namespace, not the mount namespace ``ip netns exec`` makes (with its
own ``/sys`` and ``/etc/netns/NAME``), which nothing in an engine reads here; and a
crash in C++ exit handlers after ``os._exit`` would go unseen. None of it is what the
engine tests test; ``tests/engine/test_engine_fork.py`` holds a forked engine's tokens
to a fresh one's.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_CLONE_NEWNET = 0x40000000
_MAX_MESSAGE = 1 << 20
_NETNS_DIR = "/run/netns"
START_TIMEOUT_S = 180.0


def enabled() -> bool:
    return os.environ.get("KVSTORE_ENGINE_FORK", "1") != "0"


def netns_of(prefix: Sequence[str]) -> str | None | bool:
    """The network namespace a command prefix runs in: None for no prefix, its name
    for ``ip netns exec NAME``; False for any other prefix (not forkable)."""
    if not prefix:
        return None
    if len(prefix) == 4 and list(prefix[:3]) == ["ip", "netns", "exec"]:
        return prefix[3]
    return False


# ============================================================ the test process's side
class Forked:
    """An engine driver the zygote forked: what ``EngineProc`` uses of a ``Popen``."""

    def __init__(self, pid: int, stdin_fd: int, stdout_fd: int, status_fd: int) -> None:
        self.pid = pid
        self.stdin = os.fdopen(stdin_fd, "w")
        self.stdout = os.fdopen(stdout_fd, "r")
        self._status = status_fd
        self._data = b""
        self._lock = threading.Lock()  # (Popen's poll and wait are thread-safe too)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._check(0.0)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            code = self._check(0.1 if left is None else min(left, 0.1))
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"engine pid {self.pid}", timeout or 0.0)

    def _check(self, timeout: float) -> int | None:
        """The exit status once the zygote has written it, waiting up to ``timeout``."""
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            poller = select.poll()
            poller.register(self._status, select.POLLIN | select.POLLHUP)
            if not poller.poll(timeout * 1000):
                return None
            chunk = os.read(self._status, 64)
            if chunk:
                self._data += chunk
                if not self._data.endswith(b"\n"):
                    return None
                self.returncode = int(self._data)
            else:  # the zygote died without a word; its children got SIGTERM
                self.returncode = -signal.SIGTERM
            os.close(self._status)
            return self.returncode


class Zygote:
    """The zygote process and the pipe to it; ``spawn`` forks one engine."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        from tools.engine_proc import engine_env

        env = engine_env("127.0.0.1")
        env.pop("VLLM_LOGGING_CONFIG_PATH", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.engine_fork", str(theirs.fileno())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None,
            # No PR_SET_PDEATHSIG: it fires when the *thread* that started the zygote
            # ends. The end of its socket (this process gone, however) ends it.
            pass_fds=[theirs.fileno()], cwd=REPO, env=env, start_new_session=True)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self._ready = False
        self._ids = iter(range(1, 1 << 62))

    def _wait_ready(self) -> None:
        if self._ready:
            return
        ready, _, _ = select.select([self.sock], [], [], START_TIMEOUT_S)
        msg = self.sock.recv(_MAX_MESSAGE) if ready else b""
        if json.loads(msg or b"{}").get("event") != "ready":
            self.close()
            raise RuntimeError(f"the engine zygote did not start ({msg!r}, "
                               f"exit {self.proc.poll()})")
        self._ready = True

    def spawn(self, config: dict, env: dict[str, str], log_path: Path | None,
              netns: str | None) -> Forked:
        """Fork one driver running ``config`` (``tools.engine_proc``'s) in ``env``.
        OSError when its log or its node's namespace cannot be opened, RuntimeError
        when the zygote does not fork it; nothing is left open either way."""
        theirs: list[int] = []  # the child's ends, ours to close once sent
        ours: list[int] = []  # stdin's write end, stdout's read end, the status's
        reply: dict[str, Any] = {}
        try:
            r, w = os.pipe()  # the driver's stdin
            theirs.append(r)
            ours.append(w)
            for _ in range(2):  # its stdout, and the exit status the zygote writes
                r, w = os.pipe()
                ours.append(r)
                theirs.append(w)
            child_in, child_out, status_w = theirs
            theirs = [child_in, child_out,
                      os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                      if log_path else os.open(os.devnull, os.O_WRONLY), status_w]
            if netns:
                theirs.append(os.open(f"{_NETNS_DIR}/{netns}", os.O_RDONLY))
            with self.lock:
                self._wait_ready()
                rid = next(self._ids)
                body = json.dumps({"id": rid, "config": config, "env": env,
                                   "netns": bool(netns)}).encode()
                socket.send_fds(self.sock, [body], theirs)
                reply = self._reply(rid, time.monotonic() + 60.0)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        if "pid" not in reply:
            for fd in ours:
                os.close(fd)
            raise RuntimeError(f"the engine zygote did not fork: {reply.get('error', reply)}")
        return Forked(reply["pid"], *ours)

    def _reply(self, rid: int, deadline: float) -> dict[str, Any]:
        """The zygote's answer to request ``rid``. An answer to an earlier request
        whose caller gave up waiting is dropped, and the engine it forked, which no
        one holds, is killed."""
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.sock], [], [], max(left, 0.0))
            if not ready:
                return {"error": "no answer from the engine zygote within 60 s"}
            msg = self.sock.recv(_MAX_MESSAGE)
            if not msg:
                return {"error": f"the engine zygote exited ({self.proc.poll()})"}
            reply = json.loads(msg)
            if reply.get("id") == rid:
                return reply
            if "pid" in reply:
                try:
                    os.killpg(reply["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        """End the zygote: the end of its socket makes it TERM its children's groups
        and exit."""
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started on first use and ended at exit."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = Zygote()
            atexit.register(_zygote.close)
        return _zygote


def _term_with_parent() -> None:
    from tools.netns import _term_with_parent as pdeathsig

    pdeathsig()


def _import_env_changes(before: dict[str, str]) -> dict[str, str]:
    """The variables the zygote's imports set or changed (torch and vLLM set some at
    import, e.g. ``TORCHINDUCTOR_COMPILE_THREADS``): a fresh driver's imports would
    set them over its own environment too."""
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


# ==================================================================== the zygote
def _serve(ctl: socket.socket) -> None:
    # As the driver does: the protocol keeps its own descriptor, anything printed
    # goes to stderr; vLLM's logging (configured at its import) writes there too.
    sys.stdout = sys.stderr
    before = dict(os.environ)
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import vllm.config  # noqa: F401
    import vllm.inputs  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import kvstore.connector  # noqa: F401
    import tools.engine_proc  # noqa: F401

    imported = _import_env_changes(before)
    # pid -> (its status pipe's write end, a pidfd: readable once the child exits)
    children: dict[int, tuple[int, int]] = {}
    ctl.send(json.dumps({"event": "ready"}).encode())
    try:
        while True:
            exits = {fd: pid for pid, (_, fd) in children.items()}
            ready, _, _ = select.select([ctl, *exits], [], [])
            for fd in ready:
                if fd in exits:
                    _reap(exits[fd], children)
            if ctl in ready:
                try:
                    body, fds, _, _ = socket.recv_fds(ctl, _MAX_MESSAGE, 8)
                except OSError:
                    return
                if not body:
                    for fd in fds:
                        os.close(fd)
                    return  # the test process is gone
                rid = None
                try:
                    req = json.loads(body)
                    rid = req.get("id")
                    pid = _fork(req, fds, ctl, children, imported)
                except Exception as exc:  # noqa: BLE001 - reported to the test process
                    if len(fds) > 3:
                        os.close(fds[3])  # (no child holds this status pipe)
                    ctl.send(json.dumps({"id": rid,
                                         "error": f"{type(exc).__name__}: {exc}"}).encode())
                else:
                    children[pid] = (fds[3], os.pidfd_open(pid))
                    ctl.send(json.dumps({"id": rid, "pid": pid}).encode())
                finally:
                    for fd in fds[:3] + fds[4:]:
                        os.close(fd)
    finally:
        for pid in list(children):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _reap(pid: int, children: dict[int, tuple[int, int]]) -> None:
    """Child ``pid`` exited (its pidfd says so): reap it and write its exit status."""
    _, status = os.waitpid(pid, 0)
    status_w, pidfd = children.pop(pid)
    os.close(pidfd)
    try:
        os.write(status_w, f"{os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:  # (its reader gave up on it: nobody to tell)
        pass
    finally:
        os.close(status_w)


def _fork(req: dict, fds: list[int], ctl: socket.socket,
          children: dict[int, tuple[int, int]], imported: dict[str, str]) -> int:
    if len(fds) != 4 + bool(req.get("netns")):
        raise ValueError(f"{len(fds)} descriptors for a request that needs "
                         f"{4 + bool(req.get('netns'))}")
    zygote_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _become_engine(req, fds, ctl, children, imported, zygote_pid)
        from tools import engine_proc

        engine_proc.drive(req["config"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - into the engine's log, then exit
        traceback.print_exc()
    finally:
        _leave(code)
    return 0  # (never reached)


def _become_engine(req: dict, fds: list[int], ctl: socket.socket,
                   children: dict[int, tuple[int, int]], imported: dict[str, str],
                   zygote_pid: int) -> None:
    """In the forked child: what ``Popen`` of a driver would have set up."""
    stdin_fd, stdout_fd, log_fd, status_w = fds[:4]
    os.dup2(log_fd, 2)  # first: whatever fails from here is in the engine's log
    os.setsid()
    _term_with_parent()  # the zygote's end is this engine's
    if os.getppid() != zygote_pid:
        raise SystemExit(1)  # it ended before the line above took effect
    ctl.close()
    for fd in (status_w, *(fd for pair in children.values() for fd in pair)):
        os.close(fd)
    if req.get("netns"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fds[4], _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns: {os.strerror(err)}")
        os.close(fds[4])
    for src, dst in ((stdin_fd, 0), (stdout_fd, 1)):
        os.dup2(src, dst)
        os.close(src)
    os.close(log_fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 is the driver's for good
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdout = sys.stderr  # (fd 1 stays the protocol's: ``engine_proc.drive``)
    os.environ.clear()
    os.environ.update(req["env"])
    for key, value in imported.items():  # as this engine's own imports would have
        os.environ.setdefault(key, value)
    import faulthandler

    faulthandler.enable(sys.stderr)
    import vllm.logger

    vllm.logger._configure_vllm_root_logger()  # with this engine's VLLM_LOGGING_CONFIG_PATH


def _leave(code: int) -> None:
    """The end of a forked engine: the driver's threads joined and its exit handlers
    run, as at the end of a fresh interpreter; then out, without tearing down the
    modules it shares with the zygote's image."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main() -> None:
    ctl = socket.socket(fileno=int(sys.argv[1]))
    try:
        _serve(ctl)
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
    os._exit(0)


if __name__ == "__main__":
    main()
