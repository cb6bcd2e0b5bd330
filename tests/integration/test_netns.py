"""The emulated-node harness: nodes reach each other over TCP, and nothing outlives it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.netns import (
    ClusterError,
    LoopbackCluster,
    NetnsCluster,
    make_cluster,
    namespaces,
    netns_available,
)

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]

# Serves "<its own host>" to every connection until killed.
_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
while True:
    c, _ = s.accept()
    c.sendall(("hello from " + sys.argv[1]).encode())
    c.close()
"""
_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
print(c.recv(100).decode())
"""

KINDS = [pytest.param("netns", marks=pytest.mark.netns), "loopback"]


def _cluster(kind: str, n: int):
    if kind == "netns":
        if not netns_available():
            pytest.skip("network namespaces need root and `ip netns`")
        return NetnsCluster(n)
    return LoopbackCluster(n)


def _serve(node):
    port = node.free_port()
    proc = node.popen([sys.executable, "-c", _SERVER, node.host, str(port)])
    node.wait_port(node.host, port, timeout=15, proc=proc)
    return proc, port


@pytest.mark.parametrize("kind", KINDS)
def test_nodes_reach_each_other_over_tcp(kind):
    with _cluster(kind, 3) as cluster:
        assert cluster.kind == kind
        a, b, c = cluster.nodes
        server, port = _serve(a)
        for client in (b, c):
            res = client.run([sys.executable, "-c", _CLIENT, a.host, str(port)], timeout=20)
            assert res.returncode == 0, res.stderr
            assert res.stdout.strip() == f"hello from {a.host}"
        assert server.poll() is None
    assert server.returncode is not None  # stopped by the cluster


@pytest.mark.netns
def test_netns_nodes_are_isolated_machines():
    """Distinct addresses; a node's 127.0.0.1 is its own, not another node's."""
    with _cluster("netns", 2) as cluster:
        a, b = cluster.nodes
        assert a.host != b.host and a.host.startswith("10.213.0.")
        _, port = _serve(a)
        res = b.run([sys.executable, "-c", _CLIENT, "127.0.0.1", str(port)], timeout=20)
        assert res.returncode != 0 and "ConnectionRefused" in res.stderr


@pytest.mark.netns
def test_netns_cleanup_leaves_nothing_behind():
    with _cluster("netns", 2) as cluster:
        names = {cluster.hub, *cluster.names}
        assert names <= set(namespaces())
        procs = [_serve(node)[0] for node in cluster.nodes]
    assert all(p.poll() is not None for p in procs)
    # Other sessions, and this one's session-wide clusters (tests/engine), may have
    # namespaces of their own: look at this cluster's only.
    assert names.isdisjoint(namespaces())
    for name in names:
        gone = subprocess.run(["ip", "netns", "pids", name], capture_output=True, check=False)
        assert gone.returncode != 0


@pytest.mark.parametrize("kind", KINDS)
def test_cleanup_on_error_inside_the_block(kind):
    with pytest.raises(RuntimeError, match="boom"), _cluster(kind, 2) as cluster:
        proc, _ = _serve(cluster.nodes[1])
        raise RuntimeError("boom")
    assert proc.poll() is not None
    if kind == "netns":
        assert cluster.hub not in namespaces()


@pytest.mark.parametrize("kind", KINDS)
def test_wait_port_fails_fast_when_the_server_dies(kind):
    with _cluster(kind, 1) as cluster:
        node = cluster.nodes[0]
        dead = node.popen([sys.executable, "-c", "raise SystemExit(3)"])
        with pytest.raises(ClusterError, match="exited"):
            node.wait_port(node.host, node.free_port(), timeout=30, proc=dead)
        with pytest.raises(ClusterError, match="not listening"):
            node.wait_port(node.host, node.free_port(), timeout=1)


def test_make_cluster_falls_back_to_loopback():
    cluster = make_cluster(2, prefer_netns=False)
    assert cluster.kind == "loopback"
    with cluster:
        assert [n.host for n in cluster.nodes] == ["127.0.0.1", "127.0.0.1"]
        ports = [node.free_port() for node in cluster.nodes for _ in range(20)]
        assert len(set(ports)) == len(ports) and 0 not in ports
    preferred = make_cluster(2)
    assert preferred.kind == ("netns" if netns_available() else "loopback")


def test_close_is_idempotent():
    cluster = LoopbackCluster(1)
    with cluster:
        pass
    cluster.close()


def test_make_cluster_uses_loopback_where_namespaces_are_refused(monkeypatch):
    from tools import netns

    monkeypatch.setattr(netns, "_netns_ok", False)  # as on a machine without root
    cluster = make_cluster(2)
    assert isinstance(cluster, LoopbackCluster) and cluster.kind == "loopback"


@pytest.mark.parametrize("kind", KINDS)
def test_node_processes_die_with_the_process_that_started_them(kind, tmp_path):
    """Even a SIGKILLed parent (no cleanup at all) leaves no server running."""
    if kind == "netns" and not netns_available():
        pytest.skip("network namespaces need root and `ip netns`")
    pidfile = tmp_path / "pid"
    parent = f"""
import sys, time
from tools.netns import {'NetnsCluster' if kind == 'netns' else 'LoopbackCluster'} as C
c = C(1); c.start()
p = c.nodes[0].popen([sys.executable, "-c", "import time; time.sleep(120)"])
open({str(pidfile)!r}, "w").write(str(p.pid))
time.sleep(120)
"""
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pidfile.read_text())
        os.kill(child, 0)  # alive while its parent is
    finally:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    if kind == "netns":  # the namespaces themselves go at the next cluster's start
        with NetnsCluster(1):
            pass
        assert not [ns for ns in namespaces() if ns.startswith(f"kvsnet-{proc.pid}-")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except OSError:
        return False
