"""``kvstore stats --json --watch S`` against real kvstore-server processes: JSON Lines,
one compact JSON document per refresh on one line, flushed as it is printed, so
``kvstore stats --json --watch 1 | jq -c .`` (or a reader line by line) works. Without
--watch the output stays one pretty-printed document.

The CLI runs as a real subprocess (the installed console script, else
``python -m kvstore.cli``), as an operator's pipe would run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.cluster.etcd import EtcdClient
from kvstore.cluster.membership import NodeInfo, Registration

pytestmark = pytest.mark.timeout(120)


def _argv() -> list[str]:
    exe = Path(sys.executable).with_name("kvstore")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kvstore.cli"]


def _kvstore(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*_argv(), *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ), check=False)


def _json_lines(stdout: str) -> list:
    lines = stdout.splitlines()
    assert stdout.endswith("\n") and all(line.strip() for line in lines), stdout
    return [json.loads(line) for line in lines]


def test_stats_json_watch_prints_one_json_line_per_refresh(server_factory):
    a, b = server_factory(), server_factory()
    proc = _kvstore("stats", "--server", a.address, "--json", "--watch", "0.1", "--count", "3")
    assert proc.returncode == 0, proc.stderr
    docs = _json_lines(proc.stdout)
    assert len(docs) == 3, proc.stdout
    for doc in docs:  # each line: the same list as without --watch, one object per server
        assert [node["server"] for node in doc] == [a.address]
        assert "tiers" in doc[0] and "entries" in doc[0]
    # two servers: still one line per refresh, both nodes in it
    proc = _kvstore("stats", "--server", a.address, "--server", b.address, "--json",
                    "--watch", "0.1", "--count", "2")
    assert proc.returncode == 0, proc.stderr
    docs = _json_lines(proc.stdout)
    assert [[node["server"] for node in doc] for doc in docs] == [[a.address, b.address]] * 2


def test_stats_json_without_watch_is_one_pretty_document(server):
    proc = _kvstore("stats", "--server", server.address, "--json")
    assert proc.returncode == 0, proc.stderr
    [node] = json.loads(proc.stdout)
    assert node["server"] == server.address
    assert proc.stdout.count("\n") > 3 and proc.stdout.startswith("[\n  {")  # indented, as before


def test_stats_json_watch_lines_arrive_while_it_runs(server):
    """Each refresh is flushed: a reader of the pipe gets every line as it is printed,
    not when a buffer fills or the command ends."""
    proc = subprocess.Popen([*_argv(), "stats", "--server", server.address, "--json",
                             "--watch", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        start = time.monotonic()
        for _ in range(2):
            [node] = json.loads(proc.stdout.readline())
            assert node["server"] == server.address
        assert time.monotonic() - start < 30
        assert proc.poll() is None  # still watching
    finally:
        proc.kill()
        proc.wait(10)


def test_cluster_stats_json_watch_prints_json_lines(server):
    from tools.etcd_proc import start_etcd

    prefix = "/cli-args/"
    info = NodeInfo("solo", server.address, "127.0.0.1:1", {"dram": 4 << 20}, time.time())
    with start_etcd() as etcd:
        reg = Registration(EtcdClient(etcd.url), prefix, info, ttl_s=30)
        try:
            proc = _kvstore("stats", "--cluster", "--etcd", etcd.url, "--prefix", prefix,
                            "--json", "--watch", "0.1", "--count", "3")
        finally:
            reg.close()
    assert proc.returncode == 0, proc.stderr
    docs = _json_lines(proc.stdout)
    assert len(docs) == 3, proc.stdout
    for total, node in docs:
        assert total["server"].startswith("cluster total (1 nodes)") and total["nodes"] == 1
        assert node["server"] == server.address
