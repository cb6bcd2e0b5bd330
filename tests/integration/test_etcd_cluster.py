"""etcd gateway client, registration with leases, rendezvous placement (real etcd)."""

import collections
import time

import pytest

from kvstore.cluster import NodeInfo, NodeSet, Registration, rendezvous_order
from kvstore.etcd import EtcdClient
from kvstore.errors import PeerUnavailableError
from tools.etcd_proc import free_port, start_etcd


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
