"""Choosing TE's transport: the ``te_protocol`` / ``te_devices`` keys, their layers
(TOML -> ``KVSTORE_*`` -> overrides), and the start-up checks of kvstore/transport/env.py.

The RDMA checks read sysfs; here a directory laid out like ``/sys/class/infiniband``
stands in for machines this one is not (it has no RDMA NIC). TE itself is not
involved: tests/integration/test_te_settings.py starts real engines.
"""

from __future__ import annotations

import os

import pytest

from kvstore.connector.v1_config import ConnectorSettings
from kvstore.core.config import ClientConfig, ServerConfig, load_config, parse_te_devices
from kvstore.core.errors import ConfigError
from kvstore.transport.env import check_protocol, protocol_env, rdma_devices


def _sysfs(root, **ports: list[str]):
    """``mlx5_0=["4: ACTIVE"]`` -> root/mlx5_0/ports/1/state holding that line."""
    for device, states in ports.items():
        for number, state in enumerate(states, 1):
            port = root / device / "ports" / str(number)
            port.mkdir(parents=True)
            (port / "state").write_text(state + "\n")
    return root


# ------------------------------------------------------------------ the keys
def test_defaults_are_tcp_on_every_nic():
    for section in (ServerConfig(), ClientConfig()):
        assert (section.te_protocol, section.te_devices) == ("tcp", "")


def test_toml_then_env_then_overrides(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text('[server]\nte_protocol = "rdma"\nte_devices = "mlx5_0"\n'
                    '[client]\nte_protocol = "rdma"\nte_devices = "mlx5_2"\n')
    toml_only = load_config(path, env={})
    assert (toml_only.server.te_protocol, toml_only.server.te_devices) == ("rdma", "mlx5_0")
    env = {"KVSTORE_SERVER_TE_DEVICES": "mlx5_0, mlx5_1", "KVSTORE_CLIENT_TE_PROTOCOL": "tcp"}
    with_env = load_config(path, env=env)
    assert (with_env.server.te_protocol, with_env.server.te_devices) == ("rdma", "mlx5_0,mlx5_1")
    assert (with_env.client.te_protocol, with_env.client.te_devices) == ("tcp", "mlx5_2")
    flags = load_config(path, env=env, overrides={"server": {"te_protocol": "tcp",
                                                             "te_devices": None}})
    assert (flags.server.te_protocol, flags.server.te_devices) == ("tcp", "mlx5_0,mlx5_1")


@pytest.mark.parametrize("source", ["toml", "env", "override"])
def test_unknown_protocol_is_one_line_naming_the_allowed(tmp_path, source):
    path = tmp_path / "kvstore.toml"
    path.write_text('[server]\nte_protocol = "udp"\n' if source == "toml" else "")
    env = {"KVSTORE_SERVER_TE_PROTOCOL": "udp"} if source == "env" else {}
    overrides = {"server": {"te_protocol": "udp"}} if source == "override" else None
    with pytest.raises(ConfigError) as err:
        load_config(path, env=env, overrides=overrides)
    assert str(err.value) == "server.te_protocol: 'udp' is not a TE protocol; use one of tcp, rdma"


def test_protocol_names_are_exact():
    # TE compares protocol names case-sensitively; "RDMA" would be no protocol at all.
    with pytest.raises(ConfigError, match="client.te_protocol: 'RDMA'"):
        ClientConfig(te_protocol="RDMA")


def test_device_lists():
    assert parse_te_devices("d", " mlx5_0 ,mlx5_1,, ") == ("mlx5_0", "mlx5_1")
    assert parse_te_devices("d", ["erdma_0", "rocep1s0f0"]) == ("erdma_0", "rocep1s0f0")
    assert parse_te_devices("d", "") == ()
    assert ServerConfig(te_devices="mlx5_0, mlx5_1").te_devices == "mlx5_0,mlx5_1"
    # A TOML array reaches a str option as its repr: say what to write instead.
    with pytest.raises(ConfigError, match="comma-separated string such as 'mlx5_0,mlx5_1'"):
        ServerConfig(te_devices="['mlx5_0', 'mlx5_1']")
    with pytest.raises(ConfigError, match="not a device list"):
        parse_te_devices("d", 3)


def test_connector_settings_carry_them():
    extra = {"te_protocol": "tcp", "te_devices": ["mlx5_0", "mlx5_1"]}
    settings = ConnectorSettings.from_extra("kv_both", extra, "m")
    assert (settings.te_protocol, settings.te_devices) == ("tcp", "mlx5_0,mlx5_1")
    assert ConnectorSettings.from_extra("kv_both", {}, "m").te_protocol == "tcp"
    with pytest.raises(ConfigError, match="te_protocol: 'ib' is not a TE protocol"):
        ConnectorSettings.from_extra("kv_both", {"te_protocol": "ib"}, "m")


def test_connector_settings_carry_the_inline_limit():
    assert ConnectorSettings.from_extra("kv_both", {}, "m").inline_max_bytes == 4 << 30
    settings = ConnectorSettings.from_extra("kv_both", {"inline_max_bytes": "1MiB"}, "m")
    assert settings.inline_max_bytes == 1 << 20
    assert ConnectorSettings.from_extra("kv_both", {"inline_max_bytes": 0}, "m") \
        .inline_max_bytes == 0
    with pytest.raises(ConfigError, match="inline_max_bytes"):
        ConnectorSettings.from_extra("kv_both", {"inline_max_bytes": "2TiB"}, "m")


def test_an_rdma_client_never_asks_for_bytes_in_the_reply():
    """RDMA reads beat the control socket at any size: the client leaves ``inline`` out
    (checked without a NIC: the client is made with a shared engine claiming rdma)."""
    from kvstore.client.client import KVStoreClient
    from kvstore.client.datapath import TeEngine

    engine = TeEngine.__new__(TeEngine)  # as a real one on an RDMA node would say
    engine.__dict__.update(TeEngine("127.0.0.1", 1 << 20).__dict__, protocol="rdma",
                           devices="")
    client = KVStoreClient("tcp://127.0.0.1:1", te_engine=engine, te_protocol="rdma")
    assert client._inline_max == 0
    tcp = KVStoreClient("tcp://127.0.0.1:1")
    assert tcp._inline_max == 4 << 30
    client.close()
    tcp.close()


# ------------------------------------------------------------------ RDMA present?
def test_tcp_needs_no_nic(tmp_path):
    assert check_protocol("tcp", "mlx5_0,mlx5_1", sysfs=tmp_path / "absent") == \
        ("mlx5_0", "mlx5_1")


@pytest.mark.parametrize("make", [lambda root: root / "absent", lambda root: root])
def test_rdma_without_any_device(tmp_path, make):
    with pytest.raises(ConfigError) as err:
        check_protocol("rdma", "", sysfs=make(tmp_path), section="server.")
    assert "server.te_protocol is 'rdma' but this machine has no RDMA device" in str(err.value)
    assert "\n" not in str(err.value)


def test_rdma_names_a_device_the_machine_lacks(tmp_path):
    root = _sysfs(tmp_path, mlx5_0=["4: ACTIVE"], mlx5_1=["4: ACTIVE"])
    with pytest.raises(ConfigError, match=r"te_devices names mlx5_7: not an RDMA device of "
                                          r"this machine \(it has mlx5_0, mlx5_1\)"):
        check_protocol("rdma", "mlx5_0,mlx5_7", sysfs=root)


def test_rdma_without_an_active_port(tmp_path):
    root = _sysfs(tmp_path, mlx5_0=["1: DOWN", "2: INIT"], mlx5_1=["4: ACTIVE"])
    assert rdma_devices(root) == {"mlx5_0": False, "mlx5_1": True}
    with pytest.raises(ConfigError, match="no port of mlx5_0 is ACTIVE"):
        check_protocol("rdma", "mlx5_0", sysfs=root)
    # Auto-discovery (no list) is fine while any device has a live port.
    assert check_protocol("rdma", "", sysfs=root) == ()
    assert check_protocol("rdma", "mlx5_1", sysfs=root) == ("mlx5_1",)


# ------------------------------------------------------------------ environment
def test_tcp_forces_tcp_only_for_the_call(monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    with protocol_env("tcp"):
        assert os.environ["MC_FORCE_TCP"] == "1"
    assert "MC_FORCE_TCP" not in os.environ
    with protocol_env("rdma"):
        assert "MC_FORCE_TCP" not in os.environ


def test_rdma_refuses_a_forced_tcp_environment(monkeypatch):
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    with pytest.raises(ConfigError, match="MC_FORCE_TCP is set"):
        with protocol_env("rdma"):
            pass
    with protocol_env("tcp"):
        pass
    assert os.environ["MC_FORCE_TCP"] == "1"  # the user's value is left as it was


# ------------------------------------------------------------------ shared engines
def test_a_client_on_a_shared_engine_cannot_ask_for_other_settings():
    from kvstore.client.client import KVStoreClient
    from kvstore.client.datapath import TeEngine

    engine = TeEngine("127.0.0.1", 1 << 20, protocol="tcp", devices="mlx5_0, mlx5_1")
    assert (engine.protocol, engine.devices) == ("tcp", "mlx5_0,mlx5_1")
    address = "tcp://127.0.0.1:1"  # never contacted: nothing here sends a request
    with pytest.raises(ConfigError, match="te_protocol 'rdma' asked for, but the shared "
                                          "te_engine runs 'tcp'"):
        KVStoreClient(address, te_engine=engine, te_protocol="rdma")
    with pytest.raises(ConfigError, match="te_devices 'mlx5_2'"):
        KVStoreClient(address, te_engine=engine, te_devices="mlx5_2")
    same = KVStoreClient(address, te_engine=engine, te_protocol="tcp",
                         te_devices="mlx5_0,mlx5_1")
    same.close()
    assert engine.transport is None  # no TE engine was started for any of this
