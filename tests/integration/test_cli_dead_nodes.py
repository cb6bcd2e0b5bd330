"""``kvstore ls`` and ``kvstore verify`` over several ``--server``s, one of them down:
like stats, health, evict, ... the live nodes' output is still printed (text, or a
valid ``--json`` list of the nodes that answered), the dead node is one error line
naming the command, and the exit code is 1 (docs/operations.md, "Exit codes")."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvstore.cli.main import cli
from tests.integration.conftest import LAYOUT, free_port, make_kv

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(100, 112))  # 3 blocks of 4 tokens


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False, prog_name="kvstore")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One real server holding PROMPT's 3 entries."""
    from kvstore.client.client import KVStoreClient
    from tests.integration.conftest import ServerFactory

    factory = ServerFactory(tmp_path_factory.mktemp("dead_nodes"))
    server = factory()
    with KVStoreClient(server.address, layout=LAYOUT, timeout_s=10.0,
                       staging_bytes=1 << 20) as client:
        client.insert(PROMPT, make_kv(len(PROMPT), seed=3))
        keys = client.keys_for(PROMPT)
    server.keys = [k.hex() for k in keys]  # type: ignore[attr-defined]
    yield server
    factory.stop_all()


@pytest.fixture
def dead() -> str:
    return f"tcp://127.0.0.1:{free_port()}"  # nothing listens there


def one_error_line(result, dead: str, op: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert dead in lines[0] and "not reachable" in lines[0], lines[0]
    assert f"for {op}" in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("dead_first", [True, False])
def test_ls_lists_the_live_node_when_another_is_down(live, dead, dead_first):
    servers = [dead, live.address] if dead_first else [live.address, dead]
    result = run("ls", "--server", servers[0], "--server", servers[1], "--timeout", "1")
    assert result.exit_code == 1
    assert live.address in result.stdout
    for key in live.keys:
        assert key[:12] in result.stdout  # the live node's entries are listed
    one_error_line(result, dead, "ls")


def test_ls_json_is_a_valid_list_of_the_nodes_that_answered(live, dead):
    result = run("ls", "--server", dead, "--server", live.address, "--timeout", "1", "--json")
    assert result.exit_code == 1
    [node] = json.loads(result.stdout)
    assert node["server"] == live.address and node["total"] == 3
    assert sorted(e["key"] for e in node["entries"]) == sorted(live.keys)
    one_error_line(result, dead, "ls")


@pytest.mark.parametrize("dead_first", [True, False])
def test_verify_checks_the_live_node_when_another_is_down(live, dead, dead_first):
    servers = [dead, live.address] if dead_first else [live.address, dead]
    result = run("verify", "--server", servers[0], "--server", servers[1], "--timeout", "1")
    assert result.exit_code == 1
    assert f"{live.address}: checked 3 entries, 0 bad" in result.stdout
    line = one_error_line(result, dead, "verify")
    assert "for ls" not in line  # the operator ran verify


def test_verify_json_is_a_valid_list_of_the_nodes_that_answered(live, dead):
    result = run("verify", "--server", live.address, "--server", dead, "--timeout", "1",
                 "--json")
    assert result.exit_code == 1
    [node] = json.loads(result.stdout)
    assert node == {"server": live.address, "checked": 3, "bad": []}
    one_error_line(result, dead, "verify")


def test_all_nodes_up_still_exit_0(live):
    assert run("ls", "--server", live.address).exit_code == 0
    assert run("verify", "--server", live.address).exit_code == 0
