"""kvstore-server as a process: start-up, bad input, shutdown, refusal, CURVE, metrics."""

import os
import signal
import subprocess
import sys
import time
import urllib.request

import msgpack
import pytest
import zmq

from kvstore.core.errors import AuthError, PeerUnavailableError
from kvstore.server.cli import generate_keys
from tests.integration.conftest import (
    REPO,
    ServerProc,
    free_port,
    make_kv,
    server_argv,
    server_env,
)

pytestmark = pytest.mark.timeout(120)


def raw_call(address: str, frames: list[bytes], timeout_s: float = 5.0) -> dict:
    """Send ``frames`` on a fresh DEALER and decode the single reply frame."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        assert sock.poll(int(timeout_s * 1000)), "no reply"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)
        ctx.term()


def req(**fields) -> bytes:
    return msgpack.packb({"v": 1, "id": 11, **fields}, use_bin_type=True)


def test_starts_logs_one_line_and_says_hello(shared_server):
    server = shared_server
    lines = [l for l in server.log().splitlines() if "listening on" in l]
    assert len(lines) == 1
    assert "dram 4.0MiB" in lines[0] and "nvme 8.0MiB" in lines[0] and "TE segment" in lines[0]
    hello = raw_call(server.address, [req(op="hello")])
    assert hello["ok"] is True and hello["version"] == 1 and hello["id"] == 11
    assert hello["segment"].startswith("127.0.0.1:")
    assert hello["dram"]["nbytes"] == 4 << 20 and os.path.exists(hello["dram"]["path"])


@pytest.mark.parametrize("frames, code, words", [
    ([b"\xc1garbage"], "invalid", "msgpack"),
    ([msgpack.packb({"v": 2, "id": 1, "op": "hello"})], "invalid", "version"),
    ([req(op="format_disk")], "invalid", "unknown op"),
    ([req(op="pin", keys=[b"short"])], "invalid", "16 bytes"),
    ([req(op="release", aid=5, drop=True)], "not_found", "acquisition"),
    ([req(op="commit", rid=5, checksums=[1])], "not_found", "reservation"),
    ([req(op="hello"), req(op="hello")], "invalid", "one frame"),
])
def test_bad_requests_get_typed_errors_and_change_nothing(clean_server, frames, code, words):
    server = clean_server
    before = raw_call(server.address, [req(op="stats")])["stats"]
    reply = raw_call(server.address, frames)
    assert reply["ok"] is False and reply["code"] == code and words in reply["message"]
    after = raw_call(server.address, [req(op="stats")])["stats"]
    assert after["entries"] == before["entries"] == 0
    assert after["errors"] == before["errors"] + 1
    assert raw_call(server.address, [req(op="health", deep=True)])["ok"] is True


def test_oversized_message_is_refused_with_a_reply(shared_server):
    # Over max_message_bytes (16 MiB) but under libzmq's hard cap: a typed reply.
    reply = raw_call(shared_server.address, [req(op="hello", pad=b"x" * (17 << 20))])
    assert reply["ok"] is False and reply["code"] == "invalid" and "exceeds" in reply["message"]
    assert raw_call(shared_server.address, [req(op="hello")])["ok"] is True


def test_sigterm_closes_cleanly_and_releases_everything(server_factory, client_factory):
    srv = server_factory()
    arena = raw_call(srv.address, [req(op="hello")])["dram"]["path"]
    client_factory(srv).insert(list(range(10)), make_kv(10))
    assert srv.stop(signal.SIGTERM) == 0
    assert "kvstore-server stopping" in srv.log()
    assert not os.path.exists(arena), "shared DRAM arena left behind"
    srv.start()  # same data dir and port: the lock and the port were released
    assert raw_call(srv.address, [req(op="health")])["status"] == "ok"


# A server whose serving thread waits up to 10 minutes for a request and whose
# staging thread waits as long for work: only the stop's wake-ups can end it sooner.
# With MASKED, the main thread blocks SIGTERM and SIGINT once its other threads have
# started (at tune_gc, just before it serves), so the signal lands on one of those
# (ZeroMQ's, TE's): only the interpreter's wakeup fd can wake the poll then.
_SLOW_POLLS = (
    "import os, runpy, signal, sys\n"
    "from kvstore.server import loop\n"
    "loop.POLL_MS = 600_000\n"
    "loop._reap_interval = lambda config: 600.0\n"
    "tune = loop.tune_gc\n"
    "def masked(young):\n"
    "    if os.environ.get('MASKED'):\n"
    "        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})\n"
    "    tune(young)\n"
    "loop.tune_gc = masked\n"
    "sys.argv[0] = 'kvstore-server'\n"
    "runpy.run_module('kvstore.server', run_name='__main__')\n")


@pytest.mark.parametrize(("sig", "masked"), [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGTERM-serving-thread", "SIGINT-another-thread"])
def test_a_signal_wakes_an_idle_server_at_once(server_factory, client_factory, tmp_path,
                                               sig, masked):
    """An idle server used to notice a stop only when its poll timed out (0.1 s),
    then its staging thread's wait: the signal now wakes the serving thread's poll,
    through ``stop()``'s write when the signal interrupts that thread, through the
    interpreter's wakeup fd when it lands on another, and the staging thread's
    wait. With both waits made 10 minutes long, the server still exits at once
    (within the 60 s asked)."""
    port = free_port()
    srv = ServerProc("127.0.0.1", port, tmp_path / "slow", tmp_path / "slow.log",
                     server_argv(port, tmp_path / "slow"), env={"MASKED": "1"} if masked else {})
    srv.argv[1:3] = ["-c", _SLOW_POLLS]
    server_factory.started.append(srv)  # stopped at teardown if it is not
    srv.start()
    client_factory(srv).insert(list(range(10)), make_kv(10))  # its threads have run
    time.sleep(0.2)  # idle in its poll
    os.kill(srv.pid, sig)
    assert srv.proc.wait(timeout=60) == 0
    assert "kvstore-server stopping" in srv.log()


def _refused(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=server_env(),
                          cwd=REPO)


def test_port_taken_is_a_clear_refusal(shared_server, tmp_path):
    server = shared_server
    res = _refused([sys.executable, "-m", "kvstore.server", "--port", str(server.port),
                    "--data-dir", str(tmp_path / "other"), "--dram", "1MiB", "--nvme", "1MiB"])
    assert res.returncode != 0
    assert f"cannot listen on 127.0.0.1:{server.port}: port in use" in res.stderr


def test_data_dir_taken_is_a_clear_refusal(shared_server):
    server = shared_server
    res = _refused([sys.executable, "-m", "kvstore.server", "--port", str(free_port()),
                    "--data-dir", str(server.data_dir), "--dram", "1MiB", "--nvme", "1MiB"])
    assert res.returncode != 0 and "is in use" in res.stderr
    assert raw_call(server.address, [req(op="health")])["ok"] is True


def test_help_documents_the_options():
    res = _refused([sys.executable, "-m", "kvstore.server", "--help"])
    assert res.returncode == 0
    for flag in ("--config", "--host", "--port", "--data-dir", "--dram", "--nvme", "--nvme-path",
                 "--gpu", "--te-host", "--metrics-port", "--curve-secret-key",
                 "--curve-authorized-keys", "--gen-keys", "--log-level"):
        assert flag in res.stdout


def test_config_file_env_and_metrics_endpoint(server_factory, client_factory, tmp_path):
    cfg = tmp_path / "kv.toml"
    port = free_port()
    cfg.write_text(f'[tiers]\ndram_bytes = "2MiB"\n[server]\nmetrics_port = {port}\n')
    srv = server_factory(dram=None, nvme=None, extra=("--config", str(cfg)),
                         env={"KVSTORE_TIERS_NVME_BYTES": "3MiB"})
    assert raw_call(srv.address, [req(op="hello")])["dram"]["nbytes"] == 2 << 20
    tiers = raw_call(srv.address, [req(op="stats")])["stats"]["tiers"]
    assert tiers["nvme"]["capacity"] == 3 << 20

    client = client_factory(srv)
    client.insert([5, 6, 7, 8, 9], make_kv(5))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvstore_request_duration_seconds_count{kind="insert",op="reserve"} 1.0' in text
    assert "kvstore_entries 2.0" in text


@pytest.fixture
def curve_keys(tmp_path):
    authorized = tmp_path / "authorized"
    server_pub, server_secret = generate_keys(str(tmp_path / "server"), "server")
    good_pub, good_secret = generate_keys(str(tmp_path / "good"), "client")
    _, bad_secret = generate_keys(str(tmp_path / "bad"), "client")
    authorized.mkdir()
    (authorized / "client.key").write_bytes(open(good_pub, "rb").read())
    return {"server_pub": server_pub, "server_secret": server_secret, "good": good_secret,
            "bad": bad_secret, "authorized": str(authorized)}


def test_curve_admits_authorized_and_rejects_others(server_factory, client_factory, curve_keys):
    srv = server_factory(extra=("--curve-secret-key", curve_keys["server_secret"],
                                "--curve-authorized-keys", curve_keys["authorized"]))
    good = client_factory(srv, curve_secret_key=curve_keys["good"],
                          curve_server_public_key=curve_keys["server_pub"])
    good.insert([1, 2, 3], make_kv(3))
    assert good.lookup([1, 2, 3]).matched_tokens == 3

    start = time.monotonic()
    bad = client_factory(srv, timeout_s=3.0, curve_secret_key=curve_keys["bad"],
                         curve_server_public_key=curve_keys["server_pub"])
    with pytest.raises(AuthError, match="CURVE"):
        bad.stats()
    plain = client_factory(srv, timeout_s=2.0)
    with pytest.raises((PeerUnavailableError, AuthError), match="CURVE"):
        plain.stats()
    assert time.monotonic() - start < 8
    assert good.stats()["entries"] == 1  # nothing the rejected clients sent got through


def test_gen_keys_flag_writes_a_keypair(tmp_path):
    res = _refused([sys.executable, "-m", "kvstore.server", "--gen-keys", str(tmp_path / "k")])
    assert res.returncode == 0
    assert (tmp_path / "k" / "server.key").exists() and (tmp_path / "k" / "server.key_secret").exists()


def test_a_req_socket_works_too(shared_server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(shared_server.address)
        sock.send(req(op="health"))
        assert sock.poll(5000)
        assert msgpack.unpackb(sock.recv())["status"] == "ok"
    finally:
        sock.close(0)
        ctx.term()
