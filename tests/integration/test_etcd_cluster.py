"""etcd gateway client, registration with leases, rendezvous placement, and the cluster
pieces around one node: server registration, ClusterClient edge cases, the CLI view.

Real etcd on a loopback port; servers are real processes on loopback ports (the
multi-node scenario with network namespaces is in test_cluster.py)."""

import collections
import glob
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from click.testing import CliRunner

from kvstore.cli.main import cli
from kvstore.client.client import KVStoreClient
from kvstore.cluster.membership import NodeInfo, NodeSet, Registration, rendezvous_order
from kvstore.cluster.client import ClusterClient, connect
from kvstore.core.errors import InvalidRequestError, PeerUnavailableError
from kvstore.cluster.etcd import EtcdClient
from tests.integration.conftest import LAYOUT, make_kv
from tools.etcd_proc import free_port, start_etcd

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def etcd():
    with start_etcd() as proc:
        yield proc


def _info(i: int) -> NodeInfo:
    return NodeInfo(f"node{i}", f"tcp://127.0.0.1:{7000 + i}", f"127.0.0.1:{16000 + i}",
                    {"dram": 1 << 30}, time.time())


def test_put_get_prefix_and_delete(etcd):
    client = EtcdClient(etcd.url)
    client.put(b"/t1/a", b"1")
    client.put(b"/t1/b", b"2")
    client.put(b"/t10", b"other")
    got = client.get_prefix(b"/t1/")
    assert [(kv.key, kv.value) for kv in got.kvs] == [(b"/t1/a", b"1"), (b"/t1/b", b"2")]
    client.delete(b"/t1/a")
    assert [kv.key for kv in client.get_prefix(b"/t1/").kvs] == [b"/t1/b"]


def test_registration_disappears_when_lease_expires(etcd):
    client = EtcdClient(etcd.url)
    reg = Registration(client, "/exp/", _info(1), ttl_s=2)
    nodes = NodeSet(client, "/exp/", refresh_s=0)
    assert set(nodes.nodes()) == {"node1"}
    # Simulate a dead server: stop refreshing without revoking.
    reg._stop.set()
    reg._thread.join()
    deadline = time.monotonic() + 10
    while nodes.nodes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert nodes.nodes() == {}


def test_registration_kept_alive_and_revoked_on_close(etcd):
    client = EtcdClient(etcd.url)
    info = _info(2)
    reg = Registration(client, "/alive/", info, ttl_s=1)
    nodes = NodeSet(client, "/alive/", refresh_s=0)
    time.sleep(2.5)  # > 2 TTLs: only keepalives keep it there
    assert nodes.nodes() == {"node2": info}
    reg.close()
    assert nodes.nodes() == {}


def test_malformed_node_record_is_skipped(etcd):
    client = EtcdClient(etcd.url)
    client.put(b"/bad/x", b"not json")
    Registration(client, "/bad/", _info(3), ttl_s=5).close()
    reg = Registration(client, "/bad/", _info(4), ttl_s=5)
    assert set(NodeSet(client, "/bad/").nodes()) == {"node4"}
    reg.close()


def test_unreachable_etcd_is_a_clear_error_not_a_hang():
    client = EtcdClient(f"etcd://127.0.0.1:{free_port()}", timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(PeerUnavailableError, match="unreachable"):
        client.status()
    assert time.monotonic() - start < 5


def test_rendezvous_is_stable_and_spreads():
    nodes = [f"node{i}" for i in range(4)]
    keys = [i.to_bytes(16, "little") for i in range(2000)]
    homes = [rendezvous_order(k, nodes)[0] for k in keys]
    counts = collections.Counter(homes)
    assert set(counts) == set(nodes) and min(counts.values()) > 300
    # Removing one node moves only the keys it owned.
    survivors = nodes[:3]
    for key, home in zip(keys, homes):
        new_home = rendezvous_order(key, survivors)[0]
        if home != "node3":
            assert new_home == home
    assert rendezvous_order(keys[0], nodes) == rendezvous_order(keys[0], list(reversed(nodes)))


# ------------------------------------------------------------ servers, clients, CLI
def test_server_with_etcd_down_fails_fast_with_one_line(tmp_path):
    from tests.integration.conftest import server_argv, server_env

    argv = server_argv(free_port(), tmp_path / "data",
                       extra=("--cluster", f"etcd://127.0.0.1:{free_port()}"))
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=server_env(),
                          check=False)
    assert proc.returncode == 2
    assert time.monotonic() - start < 30  # interpreter start-up included; etcd's check is 2 s
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach etcd" in lines[0], proc.stderr


def test_cluster_client_with_etcd_down_is_a_quick_error():
    start = time.monotonic()
    with pytest.raises(PeerUnavailableError, match="unreachable"):
        ClusterClient(f"etcd://127.0.0.1:{free_port()}", LAYOUT, timeout_s=1.0)
    assert time.monotonic() - start < 5


def test_without_nodes_reads_miss_and_inserts_fail(etcd):
    with ClusterClient(etcd.url, LAYOUT, prefix="/empty/", timeout_s=1.0) as client:
        assert client.get(list(range(8))).matched_tokens == 0
        assert client.lookup(list(range(8))).matched_tokens == 0
        with pytest.raises(PeerUnavailableError, match="no kvstore nodes"):
            client.insert(list(range(8)), make_kv(8))


def test_placement_key_is_the_key_of_the_block_before_the_last(etcd, monkeypatch):
    shared = list(range(100, 104))  # one block of "system prompt"
    a, b = shared + [1, 2, 3, 4, 5], shared + [6, 7, 8, 9, 10]
    with ClusterClient(etcd.url, LAYOUT, prefix="/p1/", placement_blocks=1) as p1, \
            ClusterClient(etcd.url, LAYOUT, prefix="/p2/") as deep:
        # P = 1 (the rule before): the first block decides, so the template does.
        assert p1.placement_key(a) == p1.placement_key(b) == p1.placement_key(shared + [7])
        # The default: the block before the one holding the last token.
        assert deep.placement_key(a) == deep.keys_for(a)[1] != deep.placement_key(b)
        assert deep.placement_key(a[:-1] + [99]) == deep.placement_key(a)
        assert deep.placement_key(shared) == deep.namespace  # within one block
    monkeypatch.setenv("KVSTORE_CLUSTER_PLACEMENT_BLOCKS", "3")
    with ClusterClient(etcd.url, LAYOUT, prefix="/p3/") as from_env:
        assert from_env.placement_blocks == 3
    with pytest.raises(InvalidRequestError):
        ClusterClient(etcd.url, LAYOUT, placement_blocks=0)


def test_timeout_and_prefix_come_from_the_config_when_not_given(etcd, monkeypatch):
    """As the docs say of every client made without them: ``client.timeout_s`` (from
    ``config=``, else ``KVSTORE_CLIENT_TIMEOUT_S``) and ``cluster.prefix``
    (``KVSTORE_CLUSTER_PREFIX``); given ones win."""
    from kvstore.core.config import load_config

    reg = Registration(EtcdClient(etcd.url), "/from-env/", _info(5), ttl_s=5)
    try:
        monkeypatch.setenv("KVSTORE_CLIENT_TIMEOUT_S", "3")
        monkeypatch.setenv("KVSTORE_CLUSTER_PREFIX", "/from-env/")
        with ClusterClient(etcd.url, LAYOUT, staging_bytes=1 << 20) as from_env:
            assert from_env.timeout_s == 3.0 and from_env._client_args["timeout_s"] == 3.0
            assert set(from_env.nodes.nodes()) == {"node5"}
        cfg = load_config(overrides={"client": {"timeout_s": 3.5}}).client
        with ClusterClient(etcd.url, LAYOUT, config=cfg, staging_bytes=1 << 20) as given_cfg:
            assert given_cfg.timeout_s == 3.5
        with ClusterClient(etcd.url, LAYOUT, prefix="/elsewhere/", timeout_s=4.0,
                           staging_bytes=1 << 20) as given:
            assert given.timeout_s == 4.0 and not given.nodes.nodes()
    finally:
        reg.close()


def test_registered_server_serves_both_modes_and_leaves_on_stop(etcd, server_factory):
    prefix = "/serve/"
    server = server_factory(extra=("--cluster", etcd.url, "--cluster-prefix", prefix,
                                   "--node-id", "alpha"))
    nodes = NodeSet(EtcdClient(etcd.url), prefix, refresh_s=0)
    info = nodes.nodes()["alpha"]
    assert info.address == server.address and set(info.tiers) == {"dram", "nvme"}
    tokens, kv = list(range(10)), make_kv(10, seed=3)
    with ClusterClient(etcd.url, LAYOUT, prefix=prefix, timeout_s=5.0,
                       staging_bytes=1 << 20) as cluster, \
            KVStoreClient(server.address, layout=LAYOUT, staging_bytes=1 << 20) as direct:
        assert cluster.insert(tokens, kv).new_blocks == 3
        assert cluster.lookup(tokens).matched_tokens == 10
        keys = cluster.keys_for(tokens)
        assert keys == direct.keys_for(tokens)
        assert cluster.pin(keys) == 3 and cluster.unpin(keys) == 3
        # The explicit-address mode finds what the cluster client placed, and vice versa.
        got = direct.drop_select(tokens)
        assert got.matched_tokens == 10 and bytes(got.kv.numpy()) == kv.tobytes()
        direct.stats()  # its release was one-way: its next reply comes after it is applied
        assert cluster.get(tokens).matched_tokens == 0
    with connect(etcd.url, LAYOUT, prefix=prefix) as by_etcd, \
            connect(server.address, LAYOUT) as by_address:
        assert isinstance(by_etcd, ClusterClient) and isinstance(by_address, KVStoreClient)
    with connect(server.address, LAYOUT, prefix=prefix) as by_address:  # prefix: etcd only
        assert isinstance(by_address, KVStoreClient)
    with pytest.raises(InvalidRequestError, match="tcp://host:port or etcd://host:port"):
        connect("http://127.0.0.1:2379", LAYOUT)
    out = CliRunner().invoke(cli, ["nodes", "--etcd", etcd.url, "--prefix", prefix])
    assert out.exit_code == 0 and "alpha" in out.output and "UP" in out.output, out.output
    out = CliRunner().invoke(cli, ["stats", "--cluster", "--etcd", etcd.url, "--prefix", prefix,
                                   "--json"])
    assert out.exit_code == 0, out.output
    total, node = json.loads(out.output)
    assert total["server"].startswith("cluster total (1 nodes)") and node["server"] == server.address
    server.stop()  # clean stop revokes the lease: gone now, not after the TTL
    assert nodes.nodes() == {}


def test_nodes_cli_shows_a_registered_silent_node_as_down(etcd, tmp_path):
    info = NodeInfo("ghost", f"tcp://127.0.0.1:{free_port()}", "127.0.0.1:1", {"dram": 1 << 20})
    reg = Registration(EtcdClient(etcd.url), "/ghost/", info, ttl_s=10)
    try:
        args = ["nodes", "--etcd", etcd.url, "--prefix", "/ghost/", "--timeout", "0.5"]
        # The list, then exit 1 with a line per DOWN node: `kvstore nodes` is a probe.
        out = CliRunner().invoke(cli, [*args, "--json"])
        assert out.exit_code == 1, out.output
        (row,) = json.loads(out.stdout)
        assert row["node_id"] == "ghost" and row["alive"] is False
        text = CliRunner().invoke(cli, args)
        assert "ghost" in text.stdout and "DOWN" in text.stdout and text.exit_code == 1
        assert text.stderr.startswith("Error: node ghost is DOWN: ")
        assert len(text.stderr.strip().splitlines()) == 1
        empty = CliRunner().invoke(cli, ["nodes", "--etcd", etcd.url, "--prefix", "/none/"])
        assert empty.exit_code == 0 and "no nodes registered" in empty.output
        # Where --etcd and --prefix are not given, --config's client.etcd and
        # cluster.prefix name them.
        conf = tmp_path / "kvstore.toml"
        conf.write_text(f'[client]\netcd = "{etcd.url}"\n[cluster]\nprefix = "/ghost/"\n')
        from_file = CliRunner().invoke(cli, ["nodes", "--config", str(conf), "--timeout",
                                             "0.5", "--json"], env={"KVSTORE_CLIENT_ETCD": None,
                                                                    "KVSTORE_CLUSTER_PREFIX": None})
        assert from_file.exit_code == 1, from_file.output
        assert [r["node_id"] for r in json.loads(from_file.stdout)] == ["ghost"]
    finally:
        reg.close()


def test_forgotten_node_stays_hidden_until_it_registers_anew(etcd):
    client = EtcdClient(etcd.url)
    old = _info(5)
    reg = Registration(client, "/fg/", old, ttl_s=5)
    nodes = NodeSet(client, "/fg/", refresh_s=0, forget_s=30)
    brief = NodeSet(client, "/fg/", refresh_s=0, forget_s=2.0)  # outlasts the checks below
    nodes.forget("node5")
    brief.forget("node5")
    assert nodes.nodes() == {} and brief.nodes() == {}
    assert set(nodes.registered()) == {"node5"}  # etcd still lists it
    time.sleep(2.1)
    assert set(brief.nodes()) == {"node5"}  # forget_s passed: maybe it was only slow
    reg.close()
    new = NodeInfo(old.node_id, old.address, "127.0.0.1:9", old.tiers, old.started + 1)
    reg = Registration(client, "/fg/", new, ttl_s=5)  # the node restarted
    assert nodes.nodes() == {"node5": new}
    reg.close()


def test_node_list_outlives_an_etcd_outage():
    with start_etcd() as proc:
        client = EtcdClient(proc.url, timeout_s=3.0)
        reg = Registration(client, "/out/", _info(6), ttl_s=30)
        sync = NodeSet(client, "/out/", refresh_s=0)
        watched = NodeSet(client, "/out/", refresh_s=0.1).watch()
        reg._stop.set()  # no keepalives against a stalled or stopped etcd
        reg._thread.join()
        # A stalled etcd (accepts, never answers): the watcher's fetch waits out its
        # 3 s timeout, the caller does not. Below 3 s even on busy shared cores.
        os.kill(proc.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(0.3)  # the watcher is inside a fetch by now
            start = time.monotonic()
            assert set(watched.nodes()) == {"node6"}
            assert time.monotonic() - start < 2.0
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
    # etcd is gone: both keep serving the last listing instead of failing requests.
    assert set(sync.nodes()) == {"node6"}
    assert set(watched.nodes()) == {"node6"}
    watched.close()


def test_registration_comes_back_when_etcd_forgot_its_lease(etcd):
    client = EtcdClient(etcd.url)
    reg = Registration(client, "/again/", _info(7), ttl_s=1)
    nodes = NodeSet(client, "/again/", refresh_s=0)
    client.revoke(reg.lease)  # as if the lease expired while etcd was unreachable
    assert nodes.nodes() == {}
    deadline = time.monotonic() + 5
    while not nodes.nodes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(nodes.nodes()) == {"node7"}
    reg.close()


class _FakeServer:
    """What register_server reads from a Server: its TE segment and capacities."""

    class transport:
        segment = "127.0.0.1:1"

    @staticmethod
    def capacities() -> dict[str, int]:
        return {"dram": 1 << 20}


def test_a_node_id_taken_at_another_address_is_refused(etcd):
    from kvstore.server.registration import register_server
    from kvstore.core.config import KVStoreConfig
    from kvstore.core.errors import ConfigError

    def config(port: int) -> KVStoreConfig:
        return KVStoreConfig().replace(server={"port": port}, cluster={
            "etcd": etcd.url, "prefix": "/dup/", "node_id": "same", "ttl_s": 5})

    client = EtcdClient(etcd.url)
    first = register_server(client, config(7001), _FakeServer())
    with pytest.raises(ConfigError, match="already registered by tcp://127.0.0.1:7001"):
        register_server(client, config(7002), _FakeServer())
    # Same address: the crashed predecessor's record, taken over.
    again = register_server(client, config(7001), _FakeServer())
    assert NodeSet(client, "/dup/").nodes()["same"].address == "tcp://127.0.0.1:7001"
    first.close()  # revokes the first lease only: the key now lives on the second
    assert set(NodeSet(client, "/dup/").nodes()) == {"same"}
    again.close()


def test_server_from_toml_registers_and_a_duplicate_node_id_exits_2(etcd, server_factory,
                                                                     tmp_path):
    from tests.integration.conftest import server_argv, server_env

    toml = tmp_path / "cluster.toml"
    toml.write_text(f'[cluster]\netcd = "{etcd.url}"\nprefix = "/toml/"\nttl_s = 4\n'
                    'node_id = "from-toml"\n')
    first = server_factory(extra=("--config", str(toml)))  # no cluster flags: TOML only
    (info,) = NodeSet(EtcdClient(etcd.url), "/toml/").nodes().values()
    assert info.node_id == "from-toml" and info.address == first.address
    assert set(info.tiers) == {"dram", "nvme"}
    # A second real server under the same id at another address: refused, one line.
    argv = server_argv(free_port(), tmp_path / "second", extra=("--config", str(toml)))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=server_env())
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 2, stderr
    # Besides its INFO start-up log: one error line, no traceback.
    errors = [line for line in stderr.splitlines() if line.startswith("kvstore-server:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert f"'from-toml' is already registered by {first.address}" in errors[0]
    assert not glob.glob(f"/dev/shm/kvstore-*-{proc.pid}")  # its DRAM arena went with it
    # The refused server took nothing: the first keeps its record and serves.
    (info,) = NodeSet(EtcdClient(etcd.url), "/toml/").nodes().values()
    assert info.address == first.address
    with KVStoreClient(first.address, timeout_s=5.0) as admin:
        assert admin.health()["status"] == "ok"


def test_nodes_cli_with_etcd_down_is_one_line():
    out = CliRunner().invoke(cli, ["nodes", "--etcd", f"etcd://127.0.0.1:{free_port()}"])
    assert out.exit_code == 1 and "unreachable" in out.output
    assert len(out.output.strip().splitlines()) == 1, out.output


def test_cluster_client_shares_one_te_engine_across_nodes(etcd, server_factory, transports_made):
    """Per-node clients share one TE engine and staging buffer: TE recommends one
    engine per process (registrations and busy-waiting threads multiply otherwise)."""
    made = transports_made
    prefix = "/share/"
    servers = [server_factory(extra=("--cluster", etcd.url, "--cluster-prefix", prefix,
                                     "--node-id", name)) for name in ("a", "b")]
    prompts = [[1000 + i] * 4 + list(range(6)) for i in range(12)]  # distinct first blocks
    with ClusterClient(etcd.url, LAYOUT, prefix=prefix, timeout_s=5.0, refresh_s=0.1,
                       staging_bytes=1 << 20, same_node=False) as cluster:
        deadline = time.monotonic() + 10
        while len(cluster.nodes.nodes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        homes = {cluster.placement(t)[0].node_id for t in prompts}
        assert homes == {"a", "b"}  # both nodes get prompts (rendezvous over 12)
        for i, tokens in enumerate(prompts):
            cluster.insert(tokens, make_kv(len(tokens), seed=i))
        for srv in servers:  # every node holds some, all written through TE
            with KVStoreClient(srv.address) as admin:
                assert admin.stats()["entries"] > 0
        for i, tokens in enumerate(prompts):
            got = cluster.drop_select(tokens)
            assert bytes(got.kv.numpy()) == make_kv(len(tokens), seed=i).tobytes()
        assert len(made) == 1
        assert len({id(c._data.engine) for _, c in cluster._clients.values()}) == 1
    assert cluster.te_engine.transport is None  # closed with the cluster client


def _kv_of(tokens: list[int]) -> np.ndarray:
    """Entry bytes that depend on each token and its position only, so prompts under
    one template agree on its blocks' bytes (a node keeps the first writer's)."""
    per = LAYOUT.nbytes(1)
    return np.concatenate([np.random.default_rng([t, j]).integers(0, 256, per, dtype=np.uint8)
                           for j, t in enumerate(tokens)])


def _common_blocks(stored: list[bytes], asked: list[bytes]) -> int:
    """Blocks of the stored chain that a read of ``asked`` gets on one node."""
    return next((i for i, (s, a) in enumerate(zip(stored, asked)) if s != a),
                min(len(stored), len(asked)))


def test_prompts_sharing_a_template_spread_and_every_read_is_exact(etcd, server_factory):
    """Prompts under one 3-block template land on all three nodes (placement by the
    block before the last, not the first block), and each drop_select of the stored
    part, of the whole prompt (one token more) or of one token fewer gets exactly
    what one node holding the prompt would give: the reads find the producer's node
    even where that token opens a block. At the end every store is empty."""
    prefix = "/spread/"
    servers = [server_factory(extra=("--cluster", etcd.url, "--cluster-prefix", prefix,
                                     "--node-id", f"n{i}")) for i in range(3)]
    rng = np.random.default_rng(5)
    template = list(range(500, 512))  # 3 blocks of 4 tokens
    prompts = [template + rng.integers(0, 9_000, 6 + i).tolist() for i in range(36)]
    with ClusterClient(etcd.url, LAYOUT, prefix=prefix, timeout_s=5.0, refresh_s=0.1,
                       staging_bytes=1 << 20) as cluster:
        deadline = time.monotonic() + 10
        while len(cluster.nodes.nodes()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        for prompt in prompts:
            cluster.insert(prompt[:-1], _kv_of(prompt[:-1]))
        held = {}
        for srv in servers:
            with KVStoreClient(srv.address) as admin:
                held[srv.address] = admin.stats()["entries"]
        assert all(held.values()), held  # every node holds some: not one per template
        whole, elsewhere = [], 0
        for i, prompt in enumerate(prompts):
            stored = prompt[:-1]
            asked = (stored, prompt, prompt[:-2])[i % 3]
            # The token off opens a block and moves the list: found by asking both homes.
            elsewhere += cluster.placement(asked)[0] != cluster.placement(stored)[0]
            keys = cluster.keys_for(stored)
            blocks = _common_blocks(keys, cluster.keys_for(asked))
            tokens = min(blocks * LAYOUT.block_tokens, len(stored))  # the last may be partial
            assert cluster.lookup(asked).matched_tokens == tokens
            got = cluster.drop_select(asked)
            assert got.matched_tokens == tokens > len(template), (i, len(asked))
            assert bytes(got.kv.numpy()) == _kv_of(stored[:tokens]).tobytes()
            whole.append(blocks == len(keys))
        assert elsewhere > 0
        assert not all(whole)  # some reads stopped short of the stored end ...
        # ... and took nothing: a read that does not reach where an insert ended
        # reads its blocks and leaves them. Each insert is handed out exactly once.
        for i, (prompt, taken) in enumerate(zip(prompts, whole)):
            again = cluster.drop_select(prompt[:-1]).matched_tokens
            # (one taken before: at most the template, read, which later prompts own)
            assert again <= len(template) if taken else again == len(prompt) - 1, i
        # Each node's last drop_select ended with a one-way release: a reply to the same
        # node client comes after it is applied (another connection's may come before).
        for _, node_client in cluster._clients.values():
            node_client.stats()
        for srv in servers:
            with KVStoreClient(srv.address) as admin:
                assert admin.stats()["entries"] == 0
