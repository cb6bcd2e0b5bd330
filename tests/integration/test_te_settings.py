"""``te_protocol`` and ``te_devices`` reach TE, on the server and on the client.

Real processes and real engines. The server's proof is its log: TE itself (at
``MC_LOG_LEVEL=INFO``) says which protocol it was given and that TCP was forced, and
the Transport logs the exact ``initialize()`` call. The client's proof is its real
Transport's recorded ``init_args`` after a real insert + drop_select over TE.

This machine has no RDMA NIC, so "rdma" is tested only as a refusal: one line, at
once, exit 2. Where RDMA devices exist those tests are skipped; nothing here runs RDMA.
"""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest

from kvstore.client.client import KVStoreClient
from kvstore.core.config import load_config
from kvstore.core.errors import ConfigError
from kvstore.transport.env import rdma_devices
from kvstore.transport.te import TeInit
from tests.integration.conftest import LAYOUT, REPO, free_port, make_kv, server_argv, server_env

pytestmark = pytest.mark.timeout(120)
no_rdma_here = pytest.mark.skipif(bool(rdma_devices()),
                                  reason="this machine has RDMA devices: rdma would start")
DEVICES = "mlx5_0,mlx5_1"


def test_settings_reach_te_on_server_and_client(server_factory, tmp_path):
    # Each layer names something else; the flags must win (TOML < env < flag).
    config = tmp_path / "kvstore.toml"
    config.write_text('[server]\nte_protocol = "rdma"\nte_devices = "mlx5_7"\n')
    server = server_factory(
        env={"MC_LOG_LEVEL": "INFO", "KVSTORE_SERVER_TE_DEVICES": "mlx5_8"},
        extra=("--config", str(config), "--te-protocol", "tcp", "--te-devices", "mlx5_0, mlx5_1"))
    log = server.log()
    assert f"initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '{DEVICES}')" in log, log
    # TE's own lines: the protocol it was handed, and TCP forced without NIC discovery.
    assert "Using default malloc/free for protocol: tcp" in log, log
    assert "MC_FORCE_TCP is set, using TCP transport only" in log, log
    assert "Auto-discovering topology" not in log, log
    assert "mlx5_7" not in log and "mlx5_8" not in log

    forced_before = os.environ.get("MC_FORCE_TCP")
    cfg = load_config(env={"KVSTORE_CLIENT_TE_PROTOCOL": "tcp",
                           "KVSTORE_CLIENT_TE_DEVICES": DEVICES}).client
    with KVStoreClient(server.address, layout=LAYOUT, config=cfg, same_node=False,
                       staging_bytes=1 << 20, timeout_s=10.0) as client:
        tokens = list(range(100, 137))
        kv = make_kv(len(tokens), seed=7)
        assert client.insert(tokens, kv).new_blocks == len(LAYOUT.entry_sizes(len(tokens)))
        got = client.drop_select(tokens)
        assert got.matched_tokens == len(tokens) and np.array_equal(got.kv.numpy(), kv)
        transport = client._data.engine.transport
        assert transport is not None and transport.protocol == "tcp"
        assert transport.init_args == TeInit("127.0.0.1", "P2PHANDSHAKE", "tcp", DEVICES)
        assert client.stats()["entries"] == 0
    assert os.environ.get("MC_FORCE_TCP") == forced_before  # set for initialize() only


def _start_refused(tmp_path, *extra: str, env: dict[str, str] | None = None):
    data_dir = tmp_path / "data"
    argv = server_argv(free_port(), data_dir, extra=extra)
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env={**server_env(), **(env or {})}, cwd=REPO)
    seconds = time.monotonic() - start
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("kvstore-server: "), proc.stderr
    assert not data_dir.exists(), "refused before the store opened anything"
    return lines[0], seconds


@no_rdma_here
@pytest.mark.parametrize("source", ["flag", "env", "toml"])
def test_rdma_without_a_nic_is_refused_at_start(tmp_path, source):
    config = tmp_path / "kvstore.toml"
    config.write_text('[server]\nte_protocol = "rdma"\n')
    extra = {"flag": ("--te-protocol", "rdma"), "env": (),
             "toml": ("--config", str(config))}[source]
    env = {"KVSTORE_SERVER_TE_PROTOCOL": "rdma"} if source == "env" else None
    line, seconds = _start_refused(tmp_path, *extra, env=env)
    assert line == ("kvstore-server: server.te_protocol is 'rdma' but this machine has no "
                    "RDMA device (/sys/class/infiniband is empty or missing); use 'tcp' here")
    assert seconds < 15, f"took {seconds:.1f}s to refuse"


def test_unknown_protocol_is_refused_at_start(tmp_path):
    line, _ = _start_refused(tmp_path, "--te-protocol", "ib")
    assert line == ("kvstore-server: server.te_protocol: 'ib' is not a TE protocol; "
                    "use one of tcp, rdma")


@no_rdma_here
def test_client_with_rdma_and_no_nic_is_refused_when_made():
    # Refused at construction: no server is needed, and no TE engine starts.
    with pytest.raises(ConfigError) as err:
        KVStoreClient(f"tcp://127.0.0.1:{free_port()}", layout=LAYOUT, te_protocol="rdma")
    assert str(err.value).startswith("client.te_protocol is 'rdma' but this machine has no "
                                     "RDMA device")
    with pytest.raises(ConfigError, match="client.te_protocol: 'udp' is not a TE protocol"):
        KVStoreClient(f"tcp://127.0.0.1:{free_port()}", layout=LAYOUT, te_protocol="udp")


def test_client_options_from_the_environment_reach_library_and_connector_clients(
        server_factory, monkeypatch):
    """KVSTORE_CLIENT_* configure a client made without a config (a library user's;
    the connector's for how bytes move, which its extra config does not set), as
    docs/operations.md says; a config handed in wins. Other sections' variables (a
    server's, bad here) are not read by clients; CURVE keys not by the connector.
    Seen through a real insert + drop_select over TE."""
    from kvstore.connector.v1_config import ConnectorSettings
    from kvstore.connector.v1_stores import StoreClients

    server = server_factory()
    monkeypatch.setenv("KVSTORE_CLIENT_SERVER", server.address)
    monkeypatch.setenv("KVSTORE_CLIENT_TE_WAIT", "spin")
    monkeypatch.setenv("KVSTORE_CLIENT_TE_PIECE_BYTES", "1MiB")
    monkeypatch.setenv("KVSTORE_CLIENT_PREFAULT_ARENA", "false")
    monkeypatch.setenv("KVSTORE_CLIENT_TIMEOUT_S", "7")
    monkeypatch.setenv("KVSTORE_SERVER_MAX_MESSAGE_BYTES", "1")  # a server's, refused there
    with KVStoreClient(layout=LAYOUT, same_node=False, staging_bytes=1 << 20) as client:
        assert (client.server, client.timeout_s) == (server.address, 7.0)
        engine = client._data.engine
        assert (engine.wait, engine.piece_bytes, client._data.prefault) == ("spin", 1 << 20,
                                                                           False)
        tokens = list(range(300, 337))
        kv = make_kv(len(tokens), seed=9)
        client.insert(tokens, kv)
        assert np.array_equal(client.drop_select(tokens).kv.numpy(), kv)
    with KVStoreClient(config=load_config(env={}).client, layout=LAYOUT) as given:
        assert given.server != server.address and given._data.engine.wait == "sleep"
    monkeypatch.setenv("KVSTORE_CLIENT_CURVE_SECRET_KEY", "/nonexistent/client.key_secret")
    settings = ConnectorSettings.from_extra("kv_consumer", {"server": server.address,
                                                             "inline_max_bytes": 0}, "m")
    stores = StoreClients(settings, LAYOUT, 0, 1, worker=True)
    try:
        client = stores.client(server.address)
        assert (stores._engine.wait, stores._engine.piece_bytes) == ("spin", 1 << 20)
        assert client._data.prefault is False and client._inline_max == 0
        assert client.hello()["segment"]  # no CURVE: the server answers
    finally:
        stores.close()
    monkeypatch.setenv("KVSTORE_CLIENT_TE_WAIT", "nap")
    with pytest.raises(ConfigError, match="te_wait"):
        KVStoreClient(layout=LAYOUT)
