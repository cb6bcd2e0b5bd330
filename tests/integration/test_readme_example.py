"""The README's client example, run as written against a real kvstore-server.

The python blocks of README.md run in order in one namespace, with only the
addresses changed to the test server's (the prefill and decode nodes are this
machine). The facts the README states beside them are checked here too: the server
command listens where the client connects, the hidden tensor takes token ids, and
keys follow the client's layout whatever the server's ``--block-tokens``.
"""

from __future__ import annotations

import re
import shlex

import pytest
import torch

from kvstore.client.client import KVStoreClient
from kvstore.core.errors import ConfigError, InvalidRequestError
from kvstore.core.layout import KVLayout, unpack_hf

from tests.integration.conftest import REPO

pytestmark = pytest.mark.timeout(120)

README = (REPO / "README.md").read_text()
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in _BLOCK.findall(README) if kind == lang]


def _server_commands() -> list[list[str]]:
    """Every ``kvstore-server ...`` command the README shows, as argv."""
    cmds = re.findall(r"`(kvstore-server [^`]+)`", README)
    cmds += [line for body in _blocks("bash") for line in body.splitlines()
             if line.startswith("kvstore-server ")]
    return [shlex.split(c) for c in cmds]


def _option(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def test_readme_server_listens_where_its_clients_connect():
    servers = {(_option(a, "--host", "127.0.0.1"), _option(a, "--port", "7700"))
               for a in _server_commands()}
    clients = set(re.findall(r"tcp://([\d.]+):(\d+)", "".join(_blocks("python"))))
    assert servers and clients
    assert clients <= servers, f"the client connects to {clients}, servers listen on {servers}"


def test_readme_client_example_round_trips_kv_and_hidden(server_factory):
    server = server_factory(dram="64MiB", nvme="0")
    code = _blocks("python")
    assert len(code) >= 2, "the README's prefill and decode blocks"
    ns: dict = {}
    try:
        for i, body in enumerate(code):
            body = body.replace("tcp://10.0.0.1:7700", server.address)
            body = body.replace("10.0.0.1", server.host).replace("10.0.0.2", server.host)
            exec(compile(body, f"README.md python block {i + 1}", "exec"), ns)
        hit, tokens, layout = ns["hit"], ns["tokens"], ns["layout"]
        assert hit.matched_tokens == len(tokens)
        assert hit.kv.dtype == torch.uint8 and hit.kv.numel() == layout.nbytes(len(tokens))
        for (k, v), (k2, v2), (k3, v3) in zip(ns["kv"], unpack_hf(layout, hit.kv, len(tokens)),
                                              ns["past"]):
            assert torch.equal(k, k2) and torch.equal(v, v2)
            assert torch.equal(k, k3) and torch.equal(v, v3)
        assert torch.equal(ns["next_token"], ns["first_token"])
        assert ns["next_token"].dtype == torch.int64
        # Asked by the decode client: its drop_select's last release is one-way, applied
        # before its own next request (another connection's may be served first).
        assert ns["decode"].stats()["entries"] == 0  # drop_select took it
    finally:
        for value in ns.values():
            if isinstance(value, KVStoreClient):
                value.close()


def test_hidden_takes_token_ids_and_names_itself_when_refused(server, client_factory):
    """``hidden=torch.tensor([tok])`` is int64, not a KV dtype: it travels as is. A
    dtype that cannot is the caller's mistake about the hidden tensor, not a config error."""
    client = client_factory(server)
    tokens = list(range(1, 10))
    kv = torch.zeros(client.layout.nbytes(len(tokens)), dtype=torch.uint8)
    for hidden in (torch.tensor([7]), torch.tensor([[True, False]]),
                   torch.arange(6, dtype=torch.int32).reshape(2, 3)):
        client.insert(tokens, kv, hidden=hidden)
        got = client.drop_select(tokens)
        assert got.hidden.dtype == hidden.dtype and torch.equal(got.hidden, hidden)
    with pytest.raises(InvalidRequestError, match="hidden tensor") as refused:
        client.insert(tokens, kv, hidden=torch.zeros(2, dtype=torch.complex64))
    assert not isinstance(refused.value, ConfigError)
    with pytest.raises(ConfigError, match="KV dtype"):
        KVLayout(1, 1, 1, "int64")  # a layout's dtype is still configuration
    assert client.stats()["entries"] == 0


def test_keys_follow_the_clients_layout_not_the_servers_block_tokens(server_factory,
                                                                     client_factory):
    """The README (and docs/operations.md) say the server's ``--block-tokens`` is not
    part of any key: the same client stores the same keys and entries in servers
    started with 4 and with 32."""
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=4, dtype="float16", block_tokens=16)
    tokens = list(range(40))
    stored = []
    for block_tokens in (4, 32):
        client = client_factory(server_factory(block_tokens=block_tokens), layout=layout)
        client.insert(tokens, torch.zeros(layout.nbytes(40), dtype=torch.uint8))
        stored.append(sorted((e["key"], e["ntokens"]) for e in client.ls()))
        assert sorted(k for k, _ in stored[-1]) == sorted(client.keys_for(tokens))
    assert stored[0] == stored[1]
    assert sorted(n for _, n in stored[0]) == [8, 16, 16]
