"""The ``kvstore`` admin CLI against real kvstore-server processes.

Commands run in-process through click's CliRunner (fast), except the console-script
checks, which run the installed ``kvstore`` as a subprocess. Data is put in with the
real client (TE / shared-arena writes), so every listing and count is of real entries.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore.core import protocol as p
from kvstore.cli.main import cli
from kvstore.core.hashing import block_keys, namespace_of
from kvstore.client.rpc import Channel
from tests.integration.conftest import LAYOUT, ServerProc, free_port, make_kv, server_argv

pytestmark = pytest.mark.timeout(120)

MODEL = ["--model-id", "cli-test", "--layers", str(LAYOUT.num_layers), "--kv-heads",
         str(LAYOUT.kv_heads), "--head-dim", str(LAYOUT.head_dim), "--dtype", LAYOUT.dtype,
         "--block-tokens", str(LAYOUT.block_tokens)]
PROMPT_A = list(range(100, 112))  # 3 blocks of 4 tokens
PROMPT_B = list(range(500, 510))  # 2 full blocks + a partial one


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False,
                              prog_name="kvstore")


def run_json(*args: str):
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def keys_of(tokens: list[int]) -> list[bytes]:
    ns = namespace_of("cli-test", LAYOUT)
    return block_keys(ns, tokens, LAYOUT.block_tokens).keys


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One real server for the module (starting one per test would triple its time)."""
    base = tmp_path_factory.mktemp("cli")
    port = free_port()
    srv = ServerProc("127.0.0.1", port, base / "data", base / "server.log",
                     server_argv(port, base / "data"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def writer(node):
    from kvstore.client.client import KVStoreClient

    client = KVStoreClient(node.address, layout=LAYOUT, model_id="cli-test", timeout_s=10.0,
                           staging_bytes=1 << 20)
    yield client
    client.close()


@pytest.fixture
def filled(node, writer):
    """The server holding exactly PROMPT_A and PROMPT_B (6 entries), inserted by a real
    client after clearing whatever the previous test left.

    Cleared through the writer: a previous test's last ``writer.get`` ended with a
    one-way release, applied before the writer's next request but not necessarily
    before another connection's (a clear that came first would skip the leased
    entries)."""
    writer.clear()
    assert writer.stats()["entries"] == 0
    writer.insert(PROMPT_A, make_kv(len(PROMPT_A), seed=1))
    writer.insert(PROMPT_B, make_kv(len(PROMPT_B), seed=2))
    return node


def total_entries(address: str) -> int:
    return run_json("stats", "--server", address)[0]["entries"]


# ------------------------------------------------------------------ stats / health
def test_stats_table_and_json(filled):
    result = run("stats", "--server", filled.address)
    assert result.exit_code == 0, result.output
    for word in ("TIER", "dram", "nvme", "total", "hits / misses", "open leases",
                 "checksum failures", "busy / late writes / reads:", filled.address):
        assert word in result.stdout
    [node] = run_json("stats", "--server", filled.address)
    assert node["server"] == filled.address and node["entries"] == 6
    assert node["tiers"]["dram"]["entries"] == 6 and node["bytes_in"] > 0


def test_stats_watch_refreshes(filled):
    result = run("stats", "--server", filled.address, "--watch", "0.1", "--count", "3")
    assert result.exit_code == 0, result.output
    assert result.stdout.count(filled.address) == 3


def test_stats_of_two_nodes_reports_the_dead_one(filled):
    dead = f"tcp://127.0.0.1:{free_port()}"
    result = run("stats", "--server", filled.address, "--server", dead, "--timeout", "1")
    assert result.exit_code == 1
    assert "dram" in result.stdout  # the live node is still shown
    assert result.stderr.strip().count("\n") == 0 and dead in result.stderr


def test_health(filled):
    assert run("health", "--server", filled.address).exit_code == 0
    assert run("health", "--server", filled.address, "--deep").exit_code == 0
    [node] = run_json("health", "--server", filled.address)
    assert node["status"] == "ok"


def test_the_servers_variables_do_not_stop_the_cli(filled):
    """The node's environment is the server's too: a bad KVSTORE_SERVER_* or
    KVSTORE_STORE_* (which only kvstore-server reads) must not stop the admin CLI."""
    bad = {"KVSTORE_SERVER_PORT": "not-a-port", "KVSTORE_STORE_BLOCK_TOKENS": "many",
           "KVSTORE_CLIENT_SERVER": filled.address}
    proc = _kvstore("health", "--json", env=bad)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["status"] == "ok"
    # the client's own variables are still read, and a bad one is still refused: one
    # line, exit 2 (this machine's setup; exit 1 is kept for a server that failed)
    proc = _kvstore("health", env={**bad, "KVSTORE_CLIENT_TE_PROTOCOL": "pigeon"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("kvstore health: bad configuration: client.te_protocol: "
                                   "'pigeon' is not a TE protocol; use one of tcp, rdma")


def test_the_servers_sections_of_a_shared_config_file_do_not_stop_the_cli(filled, tmp_path):
    """A node's one config file has the server's sections too; the CLI reads its own
    ([client], [cluster]), so a bad [server] does not fail a health probe. A bad
    [client] is a usage error (exit 2), not an unhealthy server (exit 1)."""
    shared = tmp_path / "kvstore.toml"
    shared.write_text(f'[server]\nport = 0\n[client]\nserver = "{filled.address}"\n')
    proc = _kvstore("health", "--config", str(shared))
    assert proc.returncode == 0, proc.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[client]\ntimeout_s = "soon"\n')
    proc = _kvstore("health", "--server", filled.address, "--config", str(bad))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "bad configuration: client.timeout_s" in proc.stderr


def test_unreachable_server_fails_fast_with_one_line():
    dead = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    result = run("health", "--server", dead, "--timeout", "1")
    assert time.monotonic() - start < 10  # bounded; never hangs
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not reachable" in lines[0]


@pytest.mark.parametrize("given,missing", [("--curve-server-key", "--curve-secret-key"),
                                           ("--curve-secret-key", "--curve-server-key")])
def test_half_a_curve_key_pair_is_a_usage_error(tmp_path, given, missing):
    # Was exit 1 ("Error: CURVE needs both"); the docs say bad arguments exit 2.
    key = tmp_path / "half.key"
    key.write_text("x")
    result = run("stats", "--server", f"tcp://127.0.0.1:{free_port()}", given, str(key))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [f"kvstore stats: {missing}: missing (CURVE needs both "
                     f"--curve-secret-key and --curve-server-key)"]


# ------------------------------------------------------------------ ls
def test_ls_lists_every_entry(filled):
    result = run("ls", "--server", filled.address)
    assert result.exit_code == 0, result.output
    assert "6 of 6 entries" in result.stdout and "PENDING" in result.stdout
    [node] = run_json("ls", "--server", filled.address)
    assert node["total"] == 6
    listed = {e["key"] for e in node["entries"]}
    assert listed == {k.hex() for k in keys_of(PROMPT_A) + keys_of(PROMPT_B)}
    assert all(e["tier"] == "dram" and e["pending"] == 1 for e in node["entries"])


def test_ls_filters_sort_and_pages(filled):
    addr = filled.address
    assert run_json("ls", "--server", addr, "--tier", "nvme")[0]["total"] == 0
    assert run_json("ls", "--server", addr, "--older-than", "1h")[0]["total"] == 0
    assert run_json("ls", "--server", addr, "--newer-than", "1h")[0]["total"] == 6
    assert run_json("ls", "--server", addr, "--pinned")[0]["total"] == 0
    by_size = run_json("ls", "--server", addr, "--sort", "size")[0]["entries"]
    sizes = [e["nbytes"] for e in by_size]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]  # the partial block is smallest
    page = run_json("ls", "--server", addr, "--sort", "key", "--limit", "2", "--offset", "3")
    everything = run_json("ls", "--server", addr, "--sort", "key")[0]["entries"]
    assert [e["key"] for e in page[0]["entries"]] == [e["key"] for e in everything[3:5]]


def test_ls_by_prompt_tokens(filled, tmp_path):
    want = [k.hex() for k in keys_of(PROMPT_B)]
    node = run_json("ls", "--server", filled.address, "--tokens",
                    ",".join(map(str, PROMPT_B)), *MODEL)[0]
    assert [e["key"] for e in node["entries"]] == want  # prompt order
    prompt_file = tmp_path / "prompt.json"
    prompt_file.write_text(json.dumps(PROMPT_B[:8]))
    node = run_json("ls", "--server", filled.address, "--prompt-file", str(prompt_file), *MODEL)[0]
    assert [e["key"] for e in node["entries"]] == want[:2]
    ns_file = tmp_path / "ns.toml"
    ns_file.write_text(f'[namespace]\nmodel_id = "cli-test"\nnum_layers = {LAYOUT.num_layers}\n'
                       f'kv_heads = {LAYOUT.kv_heads}\nhead_dim = {LAYOUT.head_dim}\n'
                       f'dtype = "{LAYOUT.dtype}"\nblock_tokens = {LAYOUT.block_tokens}\n')
    bare = filled.address.removeprefix("tcp://")  # the scheme is optional
    node = run_json("ls", "--server", bare, "--tokens", ",".join(map(str, PROMPT_B)),
                    "--namespace-config", str(ns_file))[0]
    assert [e["key"] for e in node["entries"]] == want
    assert node["prompt_blocks"] == 3 and node["stored_prefix_blocks"] == 3
    other_model = run_json("ls", "--server", bare, "--tokens", ",".join(map(str, PROMPT_B)),
                           "--namespace-config", str(ns_file), "--model-id", "other")[0]
    assert other_model["total"] == 0  # a flag overrides the file; other keys, nothing stored
    text = run("ls", "--server", filled.address, "--tokens", "1,2,3,4,5", *MODEL)
    assert text.exit_code == 0 and "0 of 0 entries" in text.stdout
    assert "the first 0 stored" in text.stdout


# ------------------------------------------------------------------ evict / pin / clear
def test_evict_dry_run_changes_nothing(filled):
    [node] = run_json("evict", "--server", filled.address, "--all", "--dry-run")
    assert node["count"] == 6 and node["dry_run"] is True and len(node["keys"]) == 6
    assert total_entries(filled.address) == 6
    text = run("evict", "--server", filled.address, "--fraction", "0.5", "--dry-run")
    assert text.exit_code == 0 and "would evict" in text.stdout


def _tiers_of(address: str) -> dict[str, str]:
    return {e["key"]: e["tier"] for e in run_json("ls", "--server", address, "--limit", "0")[0]
            ["entries"]}


def test_demote_moves_entries_down_instead_of_removing_them(filled, writer):
    address = filled.address
    assert set(_tiers_of(address).values()) == {"dram"}
    dry = run("demote", "--server", address, "--all", "--dry-run")
    assert dry.exit_code == 0 and "would demote 6 entries" in dry.stdout, dry.output
    assert set(_tiers_of(address).values()) == {"dram"}  # a dry run moves nothing
    key = keys_of(PROMPT_A)[0].hex()
    one = run("demote", "--server", address, "--key", key)
    assert one.exit_code == 0 and "demoted 1 entries" in one.stdout, one.output
    assert _tiers_of(address)[key] == "nvme"
    half = run_json("demote", "--server", address, "--tier", "dram", "--fraction", "0.5")
    assert half[0]["demoted"] >= 1 and half[0]["evicted"] == 0
    rest = run("demote", "--server", address, "--prefix", ",".join(map(str, PROMPT_B)),
               *MODEL)
    assert rest.exit_code == 0, rest.output
    every = run_json("demote", "--server", address, "--all")[0]
    assert set(_tiers_of(address).values()) == {"nvme"} and every["evicted"] == 0
    assert total_entries(address) == 6  # nothing removed: the bytes are all still served
    got = writer.get(PROMPT_A)
    assert got.matched_tokens == len(PROMPT_A)
    assert (got.kv.numpy() == make_kv(len(PROMPT_A), seed=1)).all()
    bad = run("demote", "--server", address, "--tier", "nvme", "--all")
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_evict_by_key_prefix_bytes_and_all(filled):
    addr = filled.address
    a_keys = keys_of(PROMPT_A)
    [node] = run_json("evict", "--server", addr, "--key", a_keys[0].hex())
    assert node["keys"] == [a_keys[0].hex()]
    [node] = run_json("evict", "--server", addr, "--prefix",
                      ",".join(map(str, PROMPT_B)), *MODEL)
    assert node["count"] == 3
    assert total_entries(addr) == 2
    [node] = run_json("evict", "--server", addr, "--bytes", "1")
    assert node["count"] == 1 and node["nbytes"] >= LAYOUT.block_nbytes
    result = run("evict", "--server", addr, "--all")
    assert result.exit_code == 0 and "evicted 1 entries" in result.stdout
    assert total_entries(addr) == 0
    # Named entries none of which is stored: said so, exit 1 (a script's
    # ``evict --key K || ...`` learns K was not there); nothing named, no such rule.
    gone = run("evict", "--server", addr, "--key", a_keys[0].hex(), "--key", a_keys[1].hex())
    assert gone.exit_code == 1 and "evicted 0 entries" in gone.stdout, gone.output
    assert gone.stderr.strip() == f"kvstore evict: none of the 2 entries named is stored on " \
        f"{addr}"
    assert run("evict", "--server", addr, "--all").exit_code == 0
    elsewhere = run("evict", "--server", addr, "--tier", "nvme", "--key", a_keys[0].hex())
    assert elsewhere.exit_code == 1 and elsewhere.stderr.strip() == \
        f"kvstore evict: none of the 1 entries named is stored in the nvme tier of {addr}"


def test_prompt_selection_includes_its_hidden_state_entry(filled, writer):
    import torch

    tokens = list(range(700, 708))
    writer.insert(tokens, make_kv(len(tokens), seed=5), hidden=torch.arange(6.0))
    args = ["--server", filled.address, *MODEL]
    listed = run_json("ls", *args, "--tokens", ",".join(map(str, tokens)))[0]
    assert listed["total"] == 3 and listed["stored_prefix_blocks"] == 2  # 2 blocks + hidden
    [node] = run_json("evict", *args, "--prefix", ",".join(map(str, tokens)))
    assert node["count"] == 3
    assert total_entries(filled.address) == 6  # PROMPT_A and PROMPT_B untouched


def test_pin_protects_from_evict_then_unpin(filled):
    addr = filled.address
    tokens = ["--tokens", ",".join(map(str, PROMPT_A)), *MODEL]
    result = run("pin", "--server", addr, *tokens)
    assert result.exit_code == 0 and "pinned 3 entries" in result.stdout
    assert run_json("ls", "--server", addr, "--pinned")[0]["total"] == 3
    [evicted] = run_json("evict", "--server", addr, "--all")
    assert evicted["count"] == 3 and evicted["skipped"] == 3  # only B's go
    assert total_entries(addr) == 3
    assert run("unpin", "--server", addr, "--key", keys_of(PROMPT_A)[0].hex()).exit_code == 0
    assert run_json("ls", "--server", addr, "--pinned")[0]["total"] == 2


def test_pin_unpin_verify_json(filled):
    addr = filled.address
    tokens = ["--tokens", ",".join(map(str, PROMPT_A)), *MODEL]
    [pinned] = run_json("pin", "--server", addr, *tokens)
    assert pinned == {"server": addr, "count": 3}
    [unpinned] = run_json("unpin", "--server", addr, "--key", keys_of(PROMPT_A)[0].hex())
    assert unpinned == {"server": addr, "count": 1}
    assert run_json("ls", "--server", addr, "--pinned")[0]["total"] == 2
    [checked] = run_json("verify", "--server", addr)
    assert checked == {"server": addr, "checked": 6, "bad": []}


def test_evict_fraction_of_a_tier_really_evicts_least_recently_used_first(filled, writer):
    addr = filled.address
    a_keys, b_keys = keys_of(PROMPT_A), keys_of(PROMPT_B)
    listed = run_json("ls", "--server", addr, "--tier", "dram")[0]
    assert listed["total"] == 6
    # Read A (kept: get): B, inserted later, is now the least recently used.
    assert writer.get(PROMPT_A).matched_tokens == len(PROMPT_A)
    [node] = run_json("evict", "--server", addr, "--tier", "dram", "--fraction", "0.5")
    # Half the tier's (page-rounded) bytes is B's 3 pages: B goes, though A is older.
    assert node["dry_run"] is False and node["count"] == 3
    assert set(node["keys"]) == {k.hex() for k in b_keys}
    assert node["nbytes"] == LAYOUT.nbytes(len(PROMPT_B))
    left = {e["key"] for e in run_json("ls", "--server", addr)[0]["entries"]}
    assert left == {k.hex() for k in a_keys}  # really gone from the server


def test_ls_filters_by_namespace(filled):
    from kvstore.client.client import KVStoreClient

    addr = filled.address
    other = KVStoreClient(addr, layout=LAYOUT, model_id="other-model", timeout_s=10.0,
                          staging_bytes=1 << 20)
    try:
        other.insert(PROMPT_A, make_kv(len(PROMPT_A), seed=9))  # same tokens, other model
    finally:
        other.close()
    ours = namespace_of("cli-test", LAYOUT)[:8].hex()
    theirs = namespace_of("other-model", LAYOUT)[:8].hex()
    assert run_json("ls", "--server", addr)[0]["total"] == 9
    mine = run_json("ls", "--server", addr, "--namespace", ours)[0]
    assert mine["total"] == 6 and {e["namespace"] for e in mine["entries"]} == {ours}
    # The full 16-byte fingerprint works too, and so do the model options alone.
    full = namespace_of("other-model", LAYOUT).hex()
    assert run_json("ls", "--server", addr, "--namespace", full)[0]["total"] == 3
    assert run_json("ls", "--server", addr, "--namespace", theirs[:4])[0]["total"] == 3
    assert run_json("ls", "--server", addr, *MODEL)[0]["total"] == 6
    table = run("ls", "--server", addr, "--namespace", theirs)
    assert table.exit_code == 0 and "NS" in table.stdout
    assert table.stdout.count(theirs[:8]) == 3 and ours[:8] not in table.stdout


def test_stats_shows_per_tier_traffic(filled, writer):
    assert writer.get(PROMPT_A).matched_tokens == len(PROMPT_A)
    [node] = run_json("stats", "--server", filled.address)
    dram = node["tiers"]["dram"]
    a_bytes, b_bytes = LAYOUT.nbytes(len(PROMPT_A)), LAYOUT.nbytes(len(PROMPT_B))
    assert dram["bytes_in"] >= a_bytes + b_bytes and dram["bytes_out"] >= a_bytes
    text = run("stats", "--server", filled.address).stdout
    assert " IN " in text and " OUT" in text


def test_clear_asks_unless_yes(filled):
    result = run("clear", "--server", filled.address, input="n\n")
    assert result.exit_code == 1 and total_entries(filled.address) == 6
    result = run("clear", "--server", filled.address, input="y\n")
    assert result.exit_code == 0 and "cleared 6 entries" in result.stdout, result.output
    assert total_entries(filled.address) == 0
    assert run_json("clear", "--server", filled.address, "--yes")[0]["count"] == 0


# ------------------------------------------------------------------ verify
def test_verify_reports_and_drops_a_corrupt_entry(filled):
    result = run("verify", "--server", filled.address)
    assert result.exit_code == 0 and "checked 6 entries, 0 bad" in result.stdout
    # Flip one byte of one entry in the server's shared DRAM arena.
    victim = keys_of(PROMPT_A)[1]
    channel = Channel(filled.address, 5.0)
    try:
        deadline = time.monotonic() + 30  # the server's own check first: damage at rest
        while channel.call(p.Stats())["stats"]["unchecked_entries"]:
            assert time.monotonic() < deadline, "the server's scrub never ran"
            time.sleep(0.02)
        entries = channel.call(p.Ls(tier="dram"))["entries"]
    finally:
        channel.close()
    offset = next(e["offset"] for e in entries if e["key"] == victim)
    [arena] = glob.glob(f"/dev/shm/kvstore-*-{filled.pid}")
    with open(arena, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = run("verify", "--server", filled.address)
    assert result.exit_code == 1
    assert "1 bad" in result.stdout and victim.hex() in result.stdout
    assert total_entries(filled.address) == 5
    stats = run_json("stats", "--server", filled.address)[0]
    assert stats["checksum_failures"] >= 1


# ------------------------------------------------------------------ keys and CURVE
def test_keys_and_curve_auth(server_factory, tmp_path):
    keydir, clients = tmp_path / "keys", tmp_path / "keys" / "clients"
    assert run("keys", str(keydir), "--name", "server").exit_code == 0
    assert run("keys", str(keydir), "--name", "good").exit_code == 0
    assert run("keys", str(keydir), "--name", "bad").exit_code == 0
    assert (os.stat(keydir / "good.key_secret").st_mode & 0o077) == 0
    again = run("keys", str(keydir), "--name", "good")
    assert again.exit_code == 2 and "--force" in again.stderr
    assert run("keys", str(keydir), "--name", "good", "--force").exit_code == 0
    clients.mkdir()
    (clients / "good.key").write_bytes((keydir / "good.key").read_bytes())
    srv = server_factory(extra=("--curve-secret-key", str(keydir / "server.key_secret"),
                                "--curve-authorized-keys", str(clients)))
    server_key = ["--curve-server-key", str(keydir / "server.key")]
    ok = run("health", "--server", srv.address, *server_key,
             "--curve-secret-key", str(keydir / "good.key_secret"))
    assert ok.exit_code == 0, ok.output
    refused = run("health", "--server", srv.address, *server_key, "--timeout", "2",
                  "--curve-secret-key", str(keydir / "bad.key_secret"))
    assert refused.exit_code == 1
    assert len(refused.stderr.strip().splitlines()) == 1 and "not authorized" in refused.stderr
    plain = run("health", "--server", srv.address, "--timeout", "2")
    assert plain.exit_code == 1 and len(plain.stderr.strip().splitlines()) == 1
    assert "CURVE" in plain.stderr
    half = run("health", "--server", srv.address, *server_key)
    assert half.exit_code == 2 and "both" in half.stderr  # a usage error (docs: exit 2)


# ------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize("args,message", [
    (["evict", "--bytes", "1GiB", "--all"], "exactly one"),
    (["evict"], "exactly one"),
    (["evict", "--bytes", "lots"], "not a size"),
    (["evict", "--fraction", "1.5"], "fraction"),
    (["evict", "--key", "abc"], "hex"),
    (["evict", "--prefix", "1,2"], "--model-id"),
    (["evict", "--prefix", "1,2", "--tokens", "3"], "same option"),
    (["ls", "--older-than", "soon"], "duration"),
    (["ls", "--tokens", "1,2,3"], "--model-id"),
    (["ls", "--tokens", "1,x"], "token id"),
    (["pin", "--layers", "2"], "only means something"),
    (["ls", "--layers", "2"], "missing --model-id"),
    (["ls", "--namespace", "xyz"], "hex namespace"),
    (["ls", "--namespace", "ab", *MODEL], "not both"),
    (["ls", "--tier", "tape"], "kvstore ls: --tier: 'tape' is not one of"),
    (["ls", "--limit", "-1"], "kvstore ls: --limit:"),
    (["stats", "--bogus"], "kvstore stats: No such option '--bogus'"),
    (["nope"], "kvstore: No such command 'nope'"),
    (["pin"], "--key"),
])
def test_bad_arguments_exit_2_with_a_reason(args, message):
    # No server is contacted: arguments are checked first.
    result = run(*args, "--server", f"tcp://127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    # One line: no usage block, no "Try --help" hint, no traceback.
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Usage:" not in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("address", ["tcp://127.0.0.1", "127.0.0.1:0", "tcp://host:99999",
                                     "udp://127.0.0.1:7700", "tcp://a b:7700"])
def test_a_server_address_that_is_none_is_a_usage_error(address):
    result = run("stats", "--server", address, "--timeout", "1")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"kvstore stats: server address {address!r} (--server, "
                                     "KVSTORE_CLIENT_SERVER or client.server): need "
                                     "tcp://HOST:PORT")


def test_bad_argument_of_the_console_script_is_one_line_exit_2():
    proc = _kvstore("evict", "--bytes", "lots")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvstore evict: --bytes: not a size: 'lots' (use e.g. 512MiB, 64GiB)"]
    proc = _kvstore("--bogus")
    assert proc.returncode == 2 and proc.stderr.strip() == "kvstore: No such option '--bogus'."


# ------------------------------------------------------------------ console script
def _kvstore(*args: str, env: dict | None = None, timeout: float = 60, cwd=None):
    exe = Path(sys.executable).with_name("kvstore")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvstore.cli"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd, check=False)


def test_console_script_error_is_one_line_no_traceback():
    dead = f"tcp://127.0.0.1:{free_port()}"
    proc = _kvstore("stats", "--timeout", "1", env={"KVSTORE_CLIENT_SERVER": dead})
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert dead in proc.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly(node):
    """`kvstore stats --watch 1 | head`: the pipe closes under a command still writing.
    It ends (exit 1) without an error line or a traceback on stderr."""
    exe = Path(sys.executable).with_name("kvstore")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvstore.cli"]
    proc = subprocess.Popen([*argv, "stats", "--server", node.address, "--watch", "0.1",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.read(100)
        proc.stdout.close()  # what head does once it has its lines
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1 and err == b"", err


def test_shell_completion_script():
    proc = _kvstore(env={"_KVSTORE_COMPLETE": "bash_source"})
    assert proc.returncode == 0 and "_kvstore_completion" in proc.stdout
    proc = _kvstore(env={"_KVSTORE_COMPLETE": "bash_complete", "COMP_WORDS": "kvstore ev",
                         "COMP_CWORD": "1"})
    assert "evict" in proc.stdout


def test_bench_and_demo_delegate_to_tools(tmp_path):
    for name in ("bench", "demo"):
        result = CliRunner().invoke(cli, [name, "--help"])
        assert result.exit_code == 0, result.output
        assert f"tools.{name}" in result.output  # argparse usage of the tool itself
    # The console script finds tools/ beside the package from any directory.
    proc = _kvstore("bench", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "tools.bench" in proc.stdout
    assert "--single-node" in CliRunner().invoke(cli, ["demo", "--help"]).output


def test_bench_runs_its_quickest_section(tmp_path):
    out = tmp_path / "bench.json"
    proc = _kvstore("bench", "--quick", "--only", "hashing", "--repeat", "1", "--json",
                    str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["sections"]
    assert "hashing" in json.dumps(rows) and proc.stdout.strip()


def test_demo_single_node_runs_the_walkthrough(tmp_path):
    data_dir = tmp_path / "walk"
    result = CliRunner().invoke(cli, ["demo", "--single-node", "--tokens", "40",
                                      "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    assert "every read identical; NVMe entries survived the restart" in result.output
    assert "reopen" in result.output and not data_dir.exists()  # temp data removed
