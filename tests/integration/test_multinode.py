"""Several nodes: kvstore-server processes on emulated machines, clients on others.

Nodes are network namespaces joined by a veth bridge (tools.netns) where the machine
allows it (root and ``ip netns``), else separate loopback ports; each test records
which in its ``node_emulation`` property and its log. Across namespaces the data
moves over TE (different host identity); a producer in the server's own namespace
takes the same-node shared-memory path. On loopback, consumers force TE
(``same_node=False``) so the cross-node path is still the one tested.

Every participant runs inside some node (a namespace cannot reach the root
namespace's 127.0.0.1), so checks go through client_worker processes.
"""

import json
import logging
import subprocess
import sys
import time

import pytest

from tests.integration.client_worker import digest, prompt_kv
from tests.integration.conftest import REPO, ServerFactory, server_env
from tools.netns import make_cluster

pytestmark = [pytest.mark.timeout(240), pytest.mark.netns]
log = logging.getLogger(__name__)
WORKER = [sys.executable, "-m", "tests.integration.client_worker"]


@pytest.fixture
def cluster(record_property):
    with make_cluster(2) as c:
        record_property("node_emulation", c.kind)
        log.warning("multi-node test runs on %s nodes", c.kind)
        yield c


@pytest.fixture
def node_servers(cluster, tmp_path):
    factory = ServerFactory(tmp_path)

    def start(node, **opts):
        prefix = ("ip", "netns", "exec", node.netns) if cluster.kind == "netns" else ()
        return factory(host=node.host, port=node.free_port(), prefix=prefix, **opts)

    yield start
    factory.stop_all()


def _job(cluster, node, **job) -> dict:
    """Run one client_worker job on ``node``; its JSON result."""
    job.setdefault("te_host", node.host)
    if cluster.kind == "loopback" and node.index > 0:  # node 0 is the server's
        job.setdefault("same_node", False)
    res = node.run([*WORKER, json.dumps(job)], timeout=120, env=server_env(), cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _spawn(cluster, node, **job) -> subprocess.Popen:
    job.setdefault("te_host", node.host)
    if cluster.kind == "loopback" and job["job"] == "consume":
        job.setdefault("same_node", False)
    return node.popen([*WORKER, json.dumps(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True, env=server_env(), cwd=REPO)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_b_drop_selects_from_a_including_nvme_and_shared_prefix(cluster, node_servers):
    a, b = cluster.nodes
    # Tiny DRAM, low watermarks: A's reaper demotes older entries to its NVMe tier,
    # large enough that the six prompts (512 entries of one 4 KiB page each: 12 MiB)
    # stay under the mark past which it evicts ahead (0.35 here).
    srv = node_servers(a, dram="2MiB", nvme="64MiB",
                       extra=("--high-watermark", "0.5", "--low-watermark", "0.2"))
    n, ids = 2048, list(range(6))  # 256 KiB per prompt
    _, again = _job(cluster, a, job="seq", servers=[srv.address], ntokens=n, steps=[
        {"job": "insert", "ids": ids}, {"job": "insert", "ids": [0]}])["steps"]
    assert again["inserted"] == [[0, 0, n // 4]]  # dedup: a second consumer is expected

    tiers, got, stats = _job(cluster, b, job="seq", servers=[srv.address], ntokens=n, steps=[
        {"job": "wait_nvme", "min_entries": n // 4},
        {"job": "select", "ids": ids + [0, 0]}, {"job": "stats"}])["steps"]
    assert "timeout" not in tiers and tiers["tiers"]["nvme"]["entries"] >= n // 4
    expected = {pid: digest(prompt_kv(pid, n)) for pid in ids}
    sel = got["selected"]
    assert [(p, m, d) for p, m, d in sel[:6]] == [(p, n, expected[p]) for p in ids]
    assert sel[6] == [0, n, expected[0]]  # the second consumer of the shared prompt
    assert sel[7] == [0, 0, None]  # then it is gone
    stats = stats["stats"][0]
    assert stats["entries"] == 0 and stats["leases"] == 0 and stats["reservations"] == 0
    assert stats["stagings"] > 0  # some came from NVMe


def test_producers_and_consumers_lose_and_duplicate_nothing(cluster, node_servers, tmp_path):
    a, b = cluster.nodes
    servers = [node_servers(a, dram="8MiB", nvme="16MiB").address,
               node_servers(b, dram="8MiB", nvme="16MiB").address]
    n, producers, consumers, per = 64, 2, 3, 8
    ids = list(range(producers * per))  # prompt id % 2 picks its server
    taken = tmp_path / "taken"
    taken.mkdir()
    procs = [_spawn(cluster, a, job="insert", servers=servers, ntokens=n,
                    ids=ids[p * per:(p + 1) * per]) for p in range(producers)]
    procs += [_spawn(cluster, b, job="consume", servers=servers, ntokens=n, ids=ids,
                     taken_dir=str(taken), deadline_s=90) for _ in range(consumers)]
    results = [_result(p) for p in procs]

    got = [item for r in results[producers:] for item in r["got"]]
    assert sorted(pid for pid, _ in got) == ids, "a prompt was lost or duplicated"
    assert all(d == digest(prompt_kv(pid, n)) for pid, d in got)
    assert all(not r["partial"] and not r["unfinished"] for r in results[producers:])
    # Polled: each consumer's last drop_select ended with a one-way release, which a
    # server may apply after this (later, other) process's stats request.
    deadline = time.monotonic() + 30
    while True:
        left = [(s["entries"], s["leases"], s["reservations"])
                for s in _job(cluster, a, job="stats", servers=servers)["stats"]]
        if left == [(0, 0, 0)] * len(servers) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == [(0, 0, 0)] * len(servers)
