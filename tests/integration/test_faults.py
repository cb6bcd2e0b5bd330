"""Faults: a server killed or stalled under a client, a client killed mid-insert."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvstore.errors import KVTimeoutError, MissError
from tests.integration.client_worker import prompt_kv, prompt_tokens
from tests.integration.conftest import REPO, server_env

pytestmark = pytest.mark.timeout(150)


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_server_killed_mid_transfer_then_restarted_serves_nvme(server_factory, client_factory):
    # Tiny DRAM and low watermarks: the reaper demotes older entries to NVMe.
    srv = server_factory(dram="2MiB", nvme="32MiB",
                         extra=("--high-watermark", "0.5", "--low-watermark", "0.2"))
    client = client_factory(srv, same_node=False, timeout_s=3.0)
    ids, n = range(6), 2048  # 6 x 256 KiB
    for pid in ids:
        client.insert(prompt_tokens(pid, n), prompt_kv(pid, n))
    on_nvme = _wait(lambda: client.stats()["tiers"]["nvme"]["entries"], 15, "demotion to NVMe")
    assert on_nvme >= 4 * (n // 4)
    assert len(client.ls(tier="nvme")) >= on_nvme

    errors: list[tuple[BaseException, float]] = []
    stop = threading.Event()

    def traffic():  # TE-heavy loop: most of its time is spent in transfers
        pid = 100
        while not stop.is_set():
            try:
                client.insert(prompt_tokens(pid, n), prompt_kv(pid, n))
                client.drop_select(prompt_tokens(pid, n), timeout=3.0)
            except BaseException as exc:  # noqa: BLE001 - recorded and checked below
                errors.append((exc, time.monotonic()))
                return
            pid += 1

    worker = threading.Thread(target=traffic)
    worker.start()
    time.sleep(1.0)
    killed_at = time.monotonic()
    srv.kill()
    worker.join(timeout=20)
    stop.set()
    assert not worker.is_alive(), "client call hung after the server died"
    assert errors, "no error after the server was killed"
    exc, when = errors[0]
    assert isinstance(exc, MissError), f"undocumented error {exc!r}"
    assert when - killed_at < 3.0 + 5.0

    srv.start()  # same data dir: committed NVMe entries come back
    for pid in ids[:2]:
        got = client.drop_select(prompt_tokens(pid, n))  # same client: says hello again
        assert got.matched_tokens == n and np.array_equal(got.kv.numpy(), prompt_kv(pid, n))


def test_client_killed_mid_insert_leaves_nothing_visible(server, client_factory):
    admin = client_factory(server)
    job = {"job": "hang_after_reserve", "servers": [server.address], "pid": 7, "ntokens": 40}
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.client_worker",
                             json.dumps(job)], stdout=subprocess.PIPE, text=True,
                            env=server_env(), cwd=REPO)
    try:
        line = _wait(lambda: proc.stdout.readline(), 30, "the worker's reservation")
        assert json.loads(line) == {"reserved": 10}
        assert admin.stats()["reservations"] == 1
        assert admin.stats()["tiers"]["dram"]["used"] > 0
        assert admin.lookup(prompt_tokens(7, 40)).matched_tokens == 0  # invisible
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    # lease 2 s + reaper tick
    _wait(lambda: admin.stats()["reservations"] == 0, 10, "the lease to be reaped")
    stats = admin.stats()
    assert stats["reservations_expired"] == 1 and stats["tiers"]["dram"]["used"] == 0
    assert admin.lookup(prompt_tokens(7, 40)).matched_tokens == 0
    assert admin.insert(prompt_tokens(7, 40), prompt_kv(7, 40)).new_blocks == 10
    assert admin.health(deep=True)["status"] == "ok"


def test_stalled_server_times_out_then_recovers(server, client_factory):
    client = client_factory(server, timeout_s=1.0)
    client.insert(prompt_tokens(3, 8), prompt_kv(3, 8))
    os.kill(server.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(KVTimeoutError):
            client.lookup(prompt_tokens(3, 8))
        assert time.monotonic() - start < 2.5
    finally:
        os.kill(server.pid, signal.SIGCONT)
    # The abandoned request's late reply must not be taken for this call's.
    assert client.lookup(prompt_tokens(3, 8)).matched_tokens == 8
    got = client.drop_select(prompt_tokens(3, 8))
    assert np.array_equal(got.kv.numpy(), prompt_kv(3, 8))
