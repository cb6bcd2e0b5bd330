"""The server path never imports torch (it costs ~2 s of every server start).

Only a GPU tier needs torch; hashing, the store, the DRAM and NVMe tiers, TE and the
ROUTER do not. Each check runs in a fresh interpreter, since this test process has
torch loaded already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.integration.conftest import REPO, free_port, server_env

pytestmark = pytest.mark.timeout(60)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          env=server_env(), capture_output=True, text=True, timeout=50)


def test_server_modules_import_without_torch():
    out = _run("""
        import sys
        import kvstore.server.cli, kvstore.store.facade, kvstore.server.loop, kvstore.server.registration
        import kvstore.server.metrics, kvstore.transport.te, kvstore.core.hashing
        assert 'torch' not in sys.modules, 'torch imported'
    """)
    assert out.returncode == 0, out.stderr


def test_opening_a_dram_nvme_server_does_not_import_torch(tmp_path):
    # open_server builds the tiers (DramTier used to import torch for its CUDA check),
    # the store (index, recovery), the TE engine and the ROUTER socket.
    out = _run(f"""
        import sys
        from kvstore.core.config import KVStoreConfig
        from kvstore.server.cli import open_server
        cfg = KVStoreConfig().replace(
            tiers={{"dram_bytes": 4 << 20, "nvme_bytes": 8 << 20, "nvme_fsync": "never"}},
            store={{"data_dir": {str(tmp_path / "data")!r}}},
            server={{"port": {free_port()}}})
        server = open_server(cfg)
        try:
            assert server.store.tier_names == ["dram", "nvme"], server.store.tier_names
        finally:
            server.close()
        assert 'torch' not in sys.modules, 'torch imported'
    """)
    assert out.returncode == 0, out.stderr
