"""The configuration tree: sizes, TOML -> env -> overrides, validation (kvstore/core/config.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvstore.core.config import (
    ClientConfig,
    KVStoreConfig,
    PolicyConfig,
    StoreConfig,
    TiersConfig,
    client_config_from_env,
    describe_options,
    format_size,
    load_config,
    parse_size,
    resolve_data_path,
)
from kvstore.core.errors import ConfigError


# ------------------------------------------------------------------ sizes
@pytest.mark.parametrize("text,expected", [
    ("64GiB", 64 * 2**30), ("1.5GB", 1_500_000_000), ("1.5 gib", 3 * 2**29),
    ("512MiB", 512 * 2**20), ("0.5KB", 500), ("4k", 4000), ("4KiB", 4096), ("1TiB", 2**40), ("7", 7),
    (" 10 mb ", 10**7), ("0", 0), (12, 12), (0, 0),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1", "1e3", "GiB", "", "64 XB", "1.5", "1.0001KB", None,
                                 True, -5, 1.5, "ten"])
def test_parse_size_refuses(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


@pytest.mark.parametrize("n,text", [(0, "0B"), (1023, "1023B"), (2048, "2.0KiB"),
                                    (3 * 2**29, "1.5GiB"), (2**40, "1.0TiB")])
def test_format_size(n, text):
    assert format_size(n) == text


# ------------------------------------------------------------------ precedence
def _write(tmp_path, text: str):
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    return path


def test_defaults_without_any_source():
    cfg = load_config(env={})
    assert cfg == KVStoreConfig()
    assert cfg.store.block_tokens == 16 and cfg.tiers.dram_bytes == 1 << 30


def test_toml_then_env_then_overrides(tmp_path):
    path = _write(tmp_path, """
[tiers]
dram_bytes = "2GiB"
nvme_bytes = "8GiB"
nvme_fsync = "always"
[store]
block_tokens = 32
""")
    env = {"KVSTORE_TIERS_NVME_BYTES": "16GiB", "KVSTORE_STORE_BLOCK_TOKENS": "64",
           "KVSTORE_POLICY_STAGE_NVME_HITS": "off", "UNRELATED": "x"}
    cfg = load_config(path, env=env, overrides={"store": {"block_tokens": 128,
                                                          "data_dir": None}})
    assert cfg.tiers.dram_bytes == 2 << 30  # TOML only
    assert cfg.tiers.nvme_fsync == "always"
    assert cfg.tiers.nvme_bytes == 16 << 30  # env beats TOML
    assert cfg.policy.stage_nvme_hits is False
    assert cfg.store.block_tokens == 128  # override beats env and TOML
    assert cfg.store.data_dir == "kvstore-data"  # None override leaves the value alone


def test_env_defaults_to_the_process_environment(monkeypatch):
    monkeypatch.setenv("KVSTORE_SERVER_PORT", "7811")
    assert load_config().server.port == 7811


def test_sections_read_only_their_own_variables():
    env = {"KVSTORE_SERVER_PORT": "not-a-port", "KVSTORE_CLIENT_TIMEOUT_S": "3",
           "KVSTORE_CLUSTER_PLACEMENT_BLOCKS": "4"}
    cfg = load_config(env=env, sections=("client", "cluster"))
    assert cfg.client.timeout_s == 3 and cfg.cluster.placement_blocks == 4
    assert cfg.server.port == KVStoreConfig().server.port
    with pytest.raises(ConfigError, match="server.port"):
        load_config(env=env)  # every section: the server's own start refuses it
    assert client_config_from_env(env).timeout_s == 3


def test_sections_read_only_their_own_part_of_the_file(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text("[server]\nport = 0\n[client]\ntimeout_s = 3\n")
    assert load_config(path, sections=("client",)).client.timeout_s == 3
    with pytest.raises(ConfigError, match="ports must be"):
        load_config(path)  # every section: the server's own start refuses it
    # A name that is no section at all is still refused: a typo must not pass.
    path.write_text('[clinet]\nserver = "tcp://10.0.0.5:7700"\n')
    with pytest.raises(ConfigError, match=r"unknown config section \[clinet\]"):
        load_config(path, sections=("client",))


def test_curve_keys_may_come_from_different_places(tmp_path):
    """The authorized-keys directory in the node's file, the server's secret key from
    the environment (or a flag): valid, as is a client reading that file. Only the
    server's start refuses the directory without the key (kvstore.server.cli,
    tests/faults/test_start_refusals.py), once everything is merged."""
    path = tmp_path / "node.toml"
    path.write_text('[server]\ncurve_authorized_keys = "/etc/kvstore/clients"\n')
    cfg = load_config(path, env={"KVSTORE_SERVER_CURVE_SECRET_KEY": "/etc/kvstore/s.key"})
    assert cfg.server.curve_secret_key and cfg.server.curve_authorized_keys
    # a client reading that file is not refused (it reads its own sections only)
    assert load_config(path, env={}, sections=("client",)).client == ClientConfig()
    cfg = load_config(path, env={}, overrides={"server": {"curve_secret_key": "/k"}})
    assert cfg.server.curve_secret_key == "/k"


def test_replace_returns_a_new_tree():
    base = KVStoreConfig()
    new = base.replace(store={"block_tokens": 32}, tiers={"dram_bytes": "1MiB"})
    assert new.store.block_tokens == 32 and new.tiers.dram_bytes == 1 << 20
    assert base.store.block_tokens == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.store.block_tokens = 8  # frozen


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("toml,field", [
    ("[bogus]\nx = 1\n", "bogus"),
    ("[store]\nbogus = 1\n", "store.bogus"),
    ("store = 5\n", "store"),
    ("[store]\nblock_tokens = \"many\"\n", "store.block_tokens"),
    ("[store]\nblock_tokens = 0\n", "block_tokens"),
    ("[store]\nblock_tokens = 1.5\n", "store.block_tokens"),
    ("[store]\nblock_tokens = true\n", "store.block_tokens"),
    ("[store]\nread_lease_s = nan\n", "read_lease_s"),
    ("[tiers]\ndram_bytes = \"lots\"\n", "dram_bytes"),
    ("[tiers]\ndram_bytes = -1\n", "dram_bytes"),
    ("[tiers]\nnvme_direct = \"maybe\"\n", "nvme_direct"),
    ("[tiers]\nnvme_fsync = \"sometimes\"\n", "nvme_fsync"),
    ("[tiers]\ndram_shared = \"perhaps\"\n", "dram_shared"),
    ("[server]\nport = 70000\n", "port"),
    ("[server]\ngc_young = -1\n", "gc_young"),
    ("[server]\ngc_young = true\n", "gc_young"),
    ("[server]\ngc_young = 1099511627776\n", "gc_young"),  # past a C int: refused here
    ("[server]\ninline_max_bytes = \"2TiB\"\n", "inline_max_bytes"),
    ("[server]\npeer_timeout_s = -1\n", "peer_timeout_s"),
    ("[server]\npeer_timeout_s = \"soon\"\n", "peer_timeout_s"),
    ("[client]\ninline_max_bytes = -1\n", "inline_max_bytes"),
    ("[client]\ninline_part_bytes = \"4KiB\"\n", "inline_part_bytes"),
    ("[client]\ninline_part_bytes = \"65MiB\"\n", "inline_part_bytes"),
    ("[cluster]\nttl_s = \"x\"\n", "cluster.ttl_s"),
    ("[policy]\nhigh_watermark = \"high\"\n", "policy.high_watermark"),
    ("not toml [", "cannot read config"),
])
def test_bad_toml_is_a_config_error_naming_the_field(tmp_path, toml, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.").replace("[", r"\[")):
        load_config(_write(tmp_path, toml), env={})


@pytest.mark.parametrize("name,value,field", [
    ("KVSTORE_STORE_BLOCK_TOKENS", "1.5", "store.block_tokens"),
    ("KVSTORE_TIERS_DRAM_BYTES", "abc", "tiers.dram_bytes"),
    ("KVSTORE_SERVER_PORT", "0", "port"),
    ("KVSTORE_SERVER_GC_YOUNG", "-5", "gc_young"),
    ("KVSTORE_CLIENT_INLINE_MAX_BYTES", "2TiB", "inline_max_bytes"),
    ("KVSTORE_CLIENT_INLINE_PART_BYTES", "-1", "inline_part_bytes"),
    ("KVSTORE_CLIENT_TIMEOUT_S", "-1", "timeout_s"),
    ("KVSTORE_CLIENT_TIMEOUT_S", "inf", "timeout_s"),
    # Size suffixes only where the option is a size: "5m" is not five minutes.
    ("KVSTORE_CLUSTER_TTL_S", "5m", "cluster.ttl_s"),
    ("KVSTORE_STORE_BLOCK_TOKENS", "16k", "store.block_tokens"),
    ("KVSTORE_SERVER_PORT", "7k", "server.port"),
    ("KVSTORE_SERVER_STREAM_PORT", "7700.0", "server.stream_port"),
])
def test_bad_env_is_a_config_error_naming_the_field(name, value, field):
    with pytest.raises(ConfigError, match=field):
        load_config(env={name: value})


def test_a_misspelled_env_variable_is_warned_about_once(caplog):
    """An unknown KVSTORE_<SECTION>_* name would leave its option at the default
    without a word: a warning (once per name) suggests the option it resembles.
    Other KVSTORE_* names (KVSTORE_CONFIG, tools' own) are none of its business."""
    env = {"KVSTORE_TIERS_DRAM_BYTESS": "1GiB", "KVSTORE_CONFIG": "/etc/kvstore.toml",
           "KVSTORE_BENCH_TIMELINE": "/tmp/x"}
    with caplog.at_level("WARNING", logger="kvstore.core.config"):
        cfg = load_config(env=env)
        load_config(env=env)
    assert cfg.tiers.dram_bytes == load_config(env={}).tiers.dram_bytes
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["environment variable KVSTORE_TIERS_DRAM_BYTESS names no kvstore "
                      "option; ignored (did you mean KVSTORE_TIERS_DRAM_BYTES?)"], warned


def test_bad_overrides():
    with pytest.raises(ConfigError, match="unknown config section"):
        load_config(env={}, overrides={"nope": {"x": 1}})
    with pytest.raises(ConfigError, match="overrides"):
        load_config(env={}, overrides={"store": 5})
    with pytest.raises(ConfigError, match="tiers.dram_bytes"):
        load_config(env={}, overrides={"tiers": {"dram_bytes": 1.5}})


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.toml", env={})


# ------------------------------------------------------------------ watermarks
@pytest.mark.parametrize("low,high", [(0.5, 0.9), (0.9, 0.9), (0.01, 1.0)])
def test_valid_watermarks(low, high):
    assert PolicyConfig(high_watermark=high, low_watermark=low).low_watermark == low


@pytest.mark.parametrize("low,high", [(0.9, 0.5), (0.0, 0.5), (0.5, 1.1), (-0.1, 0.5),
                                      (math.nan, 0.9), (0.5, math.nan)])
def test_invalid_watermarks(low, high):
    with pytest.raises(ConfigError, match="watermark"):
        PolicyConfig(high_watermark=high, low_watermark=low)
    with pytest.raises(ConfigError, match="watermark"):
        load_config(env={}, overrides={"policy": {"high_watermark": high,
                                                  "low_watermark": low}})


def test_direct_construction_validates_too():
    assert TiersConfig(dram_bytes="2MiB").dram_bytes == 2 << 20
    with pytest.raises(ConfigError, match="dram_bytes"):
        TiersConfig(dram_bytes="abc")
    with pytest.raises(ConfigError, match="block_tokens"):
        StoreConfig(block_tokens="16")


# ------------------------------------------------------------------ helpers
def test_describe_options_lists_every_field_with_its_env_name():
    rows = describe_options()
    keys = {r[0] for r in rows}
    assert {"tiers.dram_bytes", "store.block_tokens", "policy.high_watermark",
            "server.port", "client.timeout_s", "cluster.etcd"} <= keys
    for key, env, _type, _default in rows:
        section, name = key.split(".")
        assert env == f"KVSTORE_{section.upper()}_{name.upper()}"
    assert len(keys) == len(rows)


def test_resolve_data_path(tmp_path):
    assert resolve_data_path(str(tmp_path), "", "nvme.slab") == tmp_path / "nvme.slab"
    assert resolve_data_path(str(tmp_path), "/dev/nvme0n1", "nvme.slab").as_posix() == \
        "/dev/nvme0n1"


@pytest.mark.parametrize("name,value,words", [
    ("nvme_bytes", "100", "tiers.nvme_bytes: 100 bytes is less than one 4KiB page"),
    ("dram_bytes", 4095, "tiers.dram_bytes: 4095 bytes is less than one 4KiB page"),
    ("dram_bytes", "-1GiB", "tiers.dram_bytes: must be >= 0, got '-1GiB'"),
    ("nvme_bytes", "-5", "tiers.nvme_bytes: must be >= 0, got '-5'"),
])
def test_tier_size_messages_say_what_is_wrong(name, value, words):
    # Were "nvme capacity 0 is smaller than one page" and "cannot use '-1GiB' as int".
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides={"tiers": {name: value}})
    assert words in str(err.value)


def test_a_tier_of_one_page_or_zero_is_fine():
    cfg = load_config(env={}, overrides={"tiers": {"nvme_bytes": "4KiB", "gpu_bytes": 0}})
    assert cfg.tiers.nvme_bytes == 4096 and cfg.tiers.gpu_bytes == 0


def test_tune_gc_freezes_start_up_and_raises_the_young_threshold():
    """In a fresh interpreter (this one's collector is left alone): 0 changes
    nothing, N freezes what exists and sets the young threshold to N."""
    import subprocess
    import sys

    code = ("import gc; from kvstore.server.loop import tune_gc; t = gc.get_threshold(); "
            "tune_gc(0); assert gc.get_threshold() == t and gc.get_freeze_count() == 0; "
            "tune_gc(50000); assert gc.get_threshold() == (50000, t[1], t[2]); "
            "assert gc.get_freeze_count() > 1000; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
