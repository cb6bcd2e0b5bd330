"""Emulated nodes for multi-node tests and the demo.

``NetnsCluster(n)`` gives each node its own network namespace with its own address
(``10.213.0.<i+1>/24``); the nodes are joined by a bridge that lives in a private
"hub" namespace, so nothing is created or changed in the root namespace.
``LoopbackCluster(n)`` is the fallback where namespaces are not allowed: every node
is 127.0.0.1 and nodes differ by port. Both offer the same interface::

    with make_cluster(2) as cluster:          # cluster.kind: "netns" | "loopback"
        a, b = cluster.nodes
        port = a.free_port()
        server = a.popen([...server argv, "--host", a.host, "--port", str(port)])
        a.wait_port(a.host, port, timeout=10)
        b.run([...client argv that talks to a.host:port...], timeout=30)

Invariant: every participant runs in some node's namespace. A process in a
namespace cannot reach the root namespace's 127.0.0.1, so clients run through
``node.popen`` / ``node.run`` too, never in the caller's own process.

On exit the cluster kills the processes it started (by PID, TERM then KILL, bounded)
and deletes its namespaces; deleting the hub deletes the bridge and every veth pair.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

SUBNET_PREFIX = "10.213.0."  # used only inside namespaces this module creates
NETNS_PREFIX = "kvsnet-"
_IP_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0
_seq = itertools.count()
_PR_SET_PDEATHSIG = 1
_netns_ok: bool | None = None

_PROBE = """
import socket, sys, time
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        sys.exit(0)
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.05)
"""


class ClusterError(RuntimeError):
    """The emulated cluster could not be set up, or a node did not come up in time."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S,
                          check=False)
    if check and proc.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def netns_available() -> bool:
    """Root, ``ip`` present, and ``ip netns add`` actually permitted (probed once)."""
    global _netns_ok
    if _netns_ok is None:
        _netns_ok = False
        if os.geteuid() == 0 and shutil.which("ip"):
            probe = f"{NETNS_PREFIX}{os.getpid()}-probe"
            try:
                _netns_ok = _ip("netns", "add", probe, check=False).returncode == 0
                if _netns_ok:
                    _ip("netns", "del", probe, check=False)
            except (OSError, subprocess.TimeoutExpired):
                _netns_ok = False
    return _netns_ok


def cleanup_stale() -> list[str]:
    """Delete namespaces this module created in processes that no longer exist."""
    try:
        listing = _ip("netns", "list", check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    removed = []
    for name in re.findall(rf"^({re.escape(NETNS_PREFIX)}(\d+)-\S+)", listing, re.MULTILINE):
        ns, pid = name[0], int(name[1])
        if not _pid_alive(pid):
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    if removed:
        log.info("removed stale namespaces %s", removed)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process(proc: subprocess.Popen, timeout: float = _STOP_TIMEOUT_S) -> int | None:
    """TERM, then KILL after ``timeout``; returns the exit code (None if it would not die)."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.error("process %s did not die after SIGKILL", proc.pid)
            return None
    return proc.returncode


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl).

    Survives ``ip netns exec``'s own exec: ``ip`` is not set-uid.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: only the normal cleanup applies


# -------------------------------------------------------------------- nodes
class Node:
    """One emulated machine: an address, free ports, and a way to run processes there."""

    def __init__(self, cluster: _Cluster, index: int, host: str) -> None:
        self.cluster = cluster
        self.index = index
        self.host = host

    def _wrap(self, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def free_port(self) -> int:
        raise NotImplementedError

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this node; the cluster stops it on exit.

        The child also gets SIGTERM if this process dies without cleaning up
        (SIGKILL, a crash), so a server never outlives the run that started it.
        The kernel ties that to the calling *thread*: start long-lived processes
        from a thread that lives as long as they should (normally the main one).
        """
        kwargs.setdefault("preexec_fn", _term_with_parent)
        proc = subprocess.Popen(self._wrap(argv), **kwargs)
        self.cluster.processes.append(proc)
        log.debug("node %s: started pid %s: %s", self.index, proc.pid, argv)
        return proc

    def run(self, argv: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on this node to completion (bounded by ``timeout``)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("check", False)
        return subprocess.run(self._wrap(argv), timeout=timeout, **kwargs)  # noqa: PLW1510

    def wait_port(self, host: str, port: int, timeout: float = 15.0,
                  proc: subprocess.Popen | None = None) -> None:
        """Wait until ``host:port`` accepts TCP connections as seen from this node.

        ``proc``: the server being waited for; if it exits first, fail at once.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise ClusterError(f"process {proc.pid} exited ({proc.returncode}) "
                                   f"before {host}:{port} was listening")
            if self._probe(host, port, min(1.0, max(0.1, deadline - time.monotonic()))):
                return
        raise ClusterError(f"{host}:{port} not listening after {timeout:.0f}s (node {self.index})")

    def _probe(self, host: str, port: int, timeout: float) -> bool:
        res = self.run([sys.executable, "-c", _PROBE, host, str(port), str(timeout)],
                       timeout=timeout + 10)
        return res.returncode == 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.index}, {self.host})"


class LoopbackNode(Node):
    def free_port(self) -> int:
        # The OS picks a port no one holds now; never the same one twice per cluster
        # (all nodes share 127.0.0.1). A race with another binder on the machine is
        # possible but rare, and the server then fails loudly instead of sharing it.
        given = self.cluster.ports_given
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((self.host, 0))
                port = s.getsockname()[1]
            if port not in given:
                given.add(port)
                return port
        raise ClusterError("no free loopback port found")

    def _probe(self, host: str, port: int, timeout: float) -> bool:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return True
        except OSError:
            time.sleep(0.05)
            return False


class NetnsNode(Node):
    def __init__(self, cluster: _Cluster, index: int, host: str, netns: str) -> None:
        super().__init__(cluster, index, host)
        self.netns = netns
        self._ports = itertools.count(20000)  # the namespace is new: every port is free

    def _wrap(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def free_port(self) -> int:
        return next(self._ports)


# ----------------------------------------------------------------- clusters
class _Cluster:
    kind = ""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("a cluster needs at least one node")
        self.n = n
        self.nodes: list[Node] = []
        self.processes: list[subprocess.Popen] = []
        self.ports_given: set[int] = set()
        self._closed = False

    def __enter__(self) -> _Cluster:  # noqa: PYI034 - Self needs 3.11; we support 3.10
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop every process started on the nodes, then tear the network down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # A second Ctrl-C must not cut the teardown short and strand namespaces.
        shield = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if shield else None
        try:
            for proc in reversed(self.processes):
                stop_process(proc)
            self._teardown()
        finally:
            if shield:
                signal.signal(signal.SIGINT, previous)

    def _teardown(self) -> None:
        pass


class LoopbackCluster(_Cluster):
    kind = "loopback"

    def start(self) -> None:
        self.nodes = [LoopbackNode(self, i, "127.0.0.1") for i in range(self.n)]


class NetnsCluster(_Cluster):
    """n namespaces on one bridge in a hub namespace; needs root and ``ip netns``."""

    kind = "netns"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        if n > 250:
            raise ValueError("at most 250 nodes in one /24")
        tag = f"{NETNS_PREFIX}{os.getpid()}-{next(_seq)}"
        self.hub = f"{tag}-hub"
        self.names = [f"{tag}-n{i}" for i in range(n)]
        self._created: list[str] = []

    def start(self) -> None:
        cleanup_stale()
        try:
            self._add_netns(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                self.nodes.append(self._add_node(i, ns))
        except BaseException:
            self.close()
            raise
        log.info("netns cluster up: %s", [(n.netns, n.host) for n in self.nodes])

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def _add_node(self, i: int, ns: str) -> NetnsNode:
        host = f"{SUBNET_PREFIX}{i + 1}"
        self._add_netns(ns)
        # Both veth ends are created away from the root namespace: hub end "h<i>",
        # node end "eth0" (names are per-namespace, so they never clash).
        _ip("-n", self.hub, "link", "add", f"h{i}", "type", "veth",
            "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0")
        _ip("-n", self.hub, "link", "set", f"h{i}", "up")
        _ip("-n", ns, "addr", "add", f"{host}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return NetnsNode(self, i, host, ns)

    def _teardown(self) -> None:
        for ns in reversed(self._created):
            self._kill_leftovers(ns)
            res = _ip("netns", "del", ns, check=False)
            if res.returncode != 0:
                log.warning("could not delete namespace %s: %s", ns, res.stderr.strip())
        self._created.clear()

    def _kill_leftovers(self, ns: str) -> None:
        # Anything still inside our namespace descends from a process we started there
        # (e.g. a server's child); without this the namespace would outlive its name.
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in map(int, pids):
            log.warning("killing leftover pid %s in %s", pid, ns)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def make_cluster(n: int, prefer_netns: bool = True) -> _Cluster:
    """A ``NetnsCluster`` where namespaces are allowed and preferred, else loopback."""
    if prefer_netns and netns_available():
        return NetnsCluster(n)
    if prefer_netns:
        log.info("network namespaces unavailable (need root and `ip netns`); using loopback")
    return LoopbackCluster(n)


def namespaces() -> list[str]:
    """Names of this module's namespaces that exist now (for leak checks)."""
    listing = _ip("netns", "list", check=False).stdout
    return re.findall(rf"^({re.escape(NETNS_PREFIX)}\S+)", listing, re.MULTILINE)
