"""A client reaches a server whose TE registered in etcd (issue 7).

A real etcd, real ``kvstore-server`` processes started with ``--te-metadata``, and
real TE transfers over loopback TCP (``same_node=False``): the client's engine adopts
the metadata the server's hello names, and refuses a second server that differs.
"""

import numpy as np
import pytest

from kvstore.client.datapath import TeEngine
from kvstore.core.errors import ConfigError
from tests.integration.conftest import LAYOUT, make_kv
from tools.etcd_proc import start_etcd

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def etcd_url():
    with start_etcd() as etcd:
        yield etcd.url


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(2000 + seed).integers(0, 50_000, n).tolist()


def test_client_moves_exact_bytes_to_an_etcd_registered_server(etcd_url, server_factory,
                                                                client_factory):
    server = server_factory(extra=("--te-metadata", etcd_url))
    client = client_factory(server, same_node=False)
    hello = client.hello()
    assert hello["te_metadata"] == etcd_url
    assert hello["segment"] in server.log()  # the name it registered in etcd
    for seed, n in enumerate([3, 16, 37]):
        kv = make_kv(n, seed)
        assert client.insert(prompt(n, seed), kv) == (len(LAYOUT.entry_sizes(n)), 0, n, kv.size)
        got = client.drop_select(prompt(n, seed))
        assert got.matched_tokens == n and np.array_equal(got.kv.numpy(), kv)
    te = client._data.engine.transport
    assert te.metadata == etcd_url and not te.p2p and "kvclient-" in te.segment
    assert client.stats()["entries"] == 0


def test_one_engine_refuses_servers_with_different_metadata(etcd_url, server_factory,
                                                            client_factory):
    in_etcd = server_factory(extra=("--te-metadata", etcd_url))
    p2p = server_factory()
    engine = TeEngine("127.0.0.1", 1 << 20, timeout_s=10.0)
    try:
        first = client_factory(in_etcd, same_node=False, te_engine=engine)
        other = client_factory(p2p, same_node=False, te_engine=engine)
        first.hello()
        with pytest.raises(ConfigError, match="te_metadata"):
            other.hello()
        assert engine.metadata == etcd_url  # the refusal changed nothing
        kv = make_kv(8, 5)
        first.insert(prompt(8, 5), kv)
        assert np.array_equal(first.drop_select(prompt(8, 5)).kv.numpy(), kv)
        # A P2P-only process still reaches the P2P server (a fresh engine).
        alone = client_factory(p2p, same_node=False)
        alone.insert(prompt(8, 6), kv)
        assert np.array_equal(alone.drop_select(prompt(8, 6)).kv.numpy(), kv)
        assert alone._data.engine.transport.p2p
    finally:
        engine.close()  # the clients do not own it; client_factory closes them
