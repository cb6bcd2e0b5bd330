"""Cluster mode end to end: real etcd, three real kvstore-server nodes, clients that
know only the etcd address.

Nodes are network namespaces (tools.netns) where the machine allows it, else
loopback ports (``make_cluster`` picks; the test prints which). A process in a
namespace cannot reach the root namespace's 127.0.0.1, so etcd and the client
processes run on a fourth node: etcd listens on that node's bridge address, which
every namespace reaches. The clients are long-lived workers
(tests/integration/cluster_worker.py) driven over stdin/stdout, so a node can be
killed while they still list it.
"""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import time

import pytest

from tests.integration.conftest import REPO, ServerFactory, server_env
from tools.etcd_proc import etcd_argv
from tools.netns import make_cluster

pytestmark = [pytest.mark.timeout(150), pytest.mark.netns, pytest.mark.slow]

TTL_S = 2
CLIENT_TIMEOUT_S = 2.0  # cluster_worker.TIMEOUT_S
MISS_BOUND_S = 2 * CLIENT_TIMEOUT_S + 1.0  # a read of a dead node: one timeout, then a miss


class Worker:
    """A cluster_worker process: one JSON job per line, every reply bounded in time."""

    def __init__(self, node, etcd_url: str, log_path) -> None:
        self._log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the worker
        self.proc = node.popen([sys.executable, "-m", "tests.integration.cluster_worker",
                                etcd_url, node.host], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=self._log, env=server_env(),
                               cwd=REPO)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.log_path = log_path

    def reply(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._sel.select(timeout=0.1):
                line = self.proc.stdout.readline()
                if not line:
                    break
                return json.loads(line)
            if self.proc.poll() is not None:
                break
        log = self.log_path.read_text(errors="replace")[-3000:]
        raise AssertionError(f"worker gave no reply in {timeout}s:\n{log}")

    def send(self, op: str, **job) -> Worker:
        """Start a job without waiting: several workers then run at once."""
        self.proc.stdin.write((json.dumps({"op": op, **job}) + "\n").encode())
        self.proc.stdin.flush()
        return self

    def __call__(self, op: str, timeout: float = 60.0, **job) -> dict:
        return self.send(op, **job).reply(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self._sel.close()
        self._log.close()


@pytest.fixture
def world(tmp_path):
    """(cluster, etcd_url, [3 ServerProc], [2 producer Workers], [2 consumer Workers])."""
    with make_cluster(4) as cluster:
        print(f"cluster kind: {cluster.kind}")
        hub = cluster.nodes[3]
        cport, pport = hub.free_port(), hub.free_port()
        etcd = hub.popen(etcd_argv(hub.host, cport, pport, str(tmp_path / "etcd")),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        hub.wait_port(hub.host, cport, timeout=20, proc=etcd)
        url = f"etcd://{hub.host}:{cport}"
        factory = ServerFactory(tmp_path)
        extra = ("--cluster", url, "--cluster-ttl", str(TTL_S))
        # No background writeback: the kill below counts what a restart must serve
        # (the entries on NVMe), and a writeback round finishing between that count
        # and the kill would give some DRAM entries NVMe copies that survive it too.
        # A writeback copy surviving a restart has its own test (test_store_writeback.py).
        quiet = {"KVSTORE_POLICY_BACKGROUND_WRITEBACK": "false"}
        servers = [factory(host=n.host, port=n.free_port(), wait=False,
                           prefix=_prefix(n), dram="64KiB", nvme="8MiB", extra=extra,
                           env=quiet)
                   for n in cluster.nodes[:3]]
        workers = []
        try:
            workers = [Worker(hub, url, tmp_path / f"worker{i}.log") for i in range(4)]
            for srv in servers:
                srv.wait_ready()
            for w in workers:
                assert w.reply()["ready"]
            yield cluster, url, servers, workers[:2], workers[2:]
        finally:
            for w in workers:
                w.close()
            factory.stop_all()


def _prefix(node) -> tuple[str, ...]:
    netns = getattr(node, "netns", None)  # loopback nodes run processes as they are
    return ("ip", "netns", "exec", netns) if netns else ()


def _ids(reply: dict) -> dict[int, dict]:
    return {int(k): v for k, v in reply.items()}


def _wait_nodes(worker: Worker, expect, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got = worker("nodes")
        if expect(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _together(jobs: list[tuple[Worker, str, dict]]) -> list[dict]:
    """Run jobs on several workers at once; their replies in order."""
    for worker, op, job in jobs:
        worker.send(op, **job)
    return [worker.reply() for worker, _, _ in jobs]


def _gone(worker: Worker, ids: list[int], timeout: float = 10.0) -> dict[int, dict]:
    """``worker``'s get (non-destructive) of each of ``ids``, repeated until none is
    found or ``timeout``: another worker's drop_select ends with a one-way release,
    applied before that worker's next request, not necessarily before this one's."""
    deadline = time.monotonic() + timeout
    while True:
        got = _ids(worker("select", ids=ids, drop=False))
        if all(r["matched"] == 0 for r in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _entries(worker: Worker) -> dict[str, dict]:
    return worker("entries")  # node id -> {"entries", "nvme"}, from each node's own stats


def test_cluster_places_fails_over_and_recovers(world):
    cluster, url, servers, producers, consumers = world
    producer, consumer = producers[0], consumers[0]
    node_ids = {f"{s.host}:{s.port}" for s in servers}
    for worker in (*producers, *consumers):  # each watches etcd; registrations just happened
        assert set(_wait_nodes(worker, lambda n: set(n["live"]) == node_ids, 10)["live"]) \
            == node_ids

    # Two producers insert at once; every node holds exactly the prompts placed on it.
    ids, kept = list(range(60)), list(range(45, 60))  # kept: for the node kill below
    placed = {}
    for reply in _together([(producers[0], "insert", {"ids": ids[0::2]}),
                            (producers[1], "insert", {"ids": ids[1::2]})]):
        placed.update(_ids(reply))
    assert all("node" in r and r["new"] == 4 for r in placed.values()), placed
    homes = {pid: r["node"] for pid, r in placed.items()}
    held = _entries(producer)
    assert set(held) == node_ids
    for node_id in node_ids:  # spread: what each server says it holds, not placement
        expect = 4 * sum(h == node_id for h in homes.values())
        assert held[node_id]["entries"] == expect > 0, (node_id, held, expect)

    # Two consumers race over the same 45 prompts (opposite orders): each is
    # drop_selected exactly once, by one of them, with the inserted bytes.
    race = ids[:45]
    got = [_ids(r) for r in _together([(consumers[0], "select", {"ids": race}),
                                       (consumers[1], "select", {"ids": race[::-1]})])]
    for pid in race:
        wins = [g[pid] for g in got if g[pid]["matched"]]
        assert len(wins) == 1 and wins[0]["matched"] == 16 and wins[0]["bytes_ok"], (pid, got)
    again = _gone(producer, race)
    assert all(r["matched"] == 0 for r in again.values()), "drop_select left an entry behind"
    assert sum(v["entries"] for v in _entries(producer).values()) == 4 * len(kept)

    # The CLI's cluster view sees the three nodes alive and the entries on them.
    cli = cluster.nodes[3].run([sys.executable, "-m", "kvstore.cli", "nodes", "--etcd", url,
                                "--json", "--timeout", "5"], timeout=60, env=server_env(), cwd=REPO)
    assert cli.returncode == 0, cli.stderr
    rows = json.loads(cli.stdout)
    assert {r["node_id"] for r in rows} == node_ids and all(r["alive"] for r in rows)
    assert sum(r["entries"] for r in rows) == 4 * len(kept)
    cli = cluster.nodes[3].run([sys.executable, "-m", "kvstore.cli", "stats", "--cluster",
                                "--etcd", url, "--json"], timeout=60, env=server_env(), cwd=REPO)
    assert cli.returncode == 0, cli.stderr
    total, *per_node = json.loads(cli.stdout)
    assert total["nodes"] == 3 and total["entries"] == 4 * len(kept)
    assert {r["server"] for r in per_node} == {s.address for s in servers}

    # Kill a node that holds kept prompts; take note of what its NVMe tier holds.
    victim = next(s for s in servers  # one exists: 15 prompts on 3 nodes
                  if sum(homes[p] == f"{s.host}:{s.port}" for p in kept) >= 3)
    victim_id = f"{victim.host}:{victim.port}"
    theirs = [p for p in kept if homes[p] == victim_id]
    on_nvme = {int(k): v for k, v in producer("nvme_prefix", address=victim.address,
                                              ids=theirs).items()}
    assert sum(on_nvme.values()) > 0, "tiny DRAM should have pushed entries to NVMe"
    nvme_before = _entries(producer)[victim_id]["nvme"]
    victim.kill()

    # Reads of its prompts are misses within a bound (the consumer still lists it);
    # new inserts go to the live nodes and are read back, once.
    lost = _ids(consumer("select", ids=theirs, drop=False))
    assert all(r["matched"] == 0 for r in lost.values()), lost
    assert max(r["seconds"] for r in lost.values()) < MISS_BOUND_S, lost
    fresh = _ids(producer("insert", ids=list(range(100, 130))))
    assert all(r.get("node") in node_ids - {victim_id} for r in fresh.values()), fresh
    got = _ids(consumer("select", ids=list(range(100, 130))))
    assert all(r["matched"] == 16 and r["bytes_ok"] for r in got.values()), got

    # Its lease expires: etcd forgets it.
    gone = _wait_nodes(consumer, lambda n: victim_id not in n["registered"], 5 * TTL_S)
    assert victim_id not in gone["registered"]

    # Back on the same data dir: it registers anew, wins its prompts back, and every
    # entry that was on NVMe is served again (DRAM ones were lost with the process).
    victim.start()
    for worker in (*producers, *consumers):  # each refreshes its own view of etcd
        assert victim_id in _wait_nodes(worker, lambda n: victim_id in n["live"], 30)["live"]
    assert _entries(consumer)[victim_id]["entries"] == nvme_before
    served = _ids(consumers[1]("select", ids=theirs))
    assert all(r["bytes_ok"] for r in served.values()), served
    assert {p: r["matched"] // 4 for p, r in served.items()} == on_nvme

    # The kept prompts of the other nodes are consumed once too; then every store is
    # empty but for the victim's NVMe blocks behind a block it lost with its DRAM.
    rest = _ids(consumer("select", ids=[p for p in kept if p not in theirs]))
    assert all(r["matched"] == 16 and r["bytes_ok"] for r in rest.values()), rest
    assert all(r["matched"] == 0 for r in _ids(producer("select", ids=ids)).values())
    want = {n: nvme_before - sum(on_nvme.values()) if n == victim_id else 0 for n in node_ids}
    # Polled: the consumers' last drop_selects ended with one-way releases, which a node
    # may apply after the producer's admin connection asks.
    deadline = time.monotonic() + 10
    while (left := {n: v["entries"] for n, v in _entries(producer).items()}) != want \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == want
