"""A SIGKILLed server's shared DRAM arena, and the same-node socket beside it, are
removed by the next store on its data dir.

Real server processes: the first is SIGKILLed (it cannot unlink its /dev/shm arena),
the second opens the same data dir and removes that file, but never an arena of a
live process nor one of another data dir.
"""

import glob
import os
import signal
import subprocess

import pytest

pytestmark = pytest.mark.timeout(120)


def _arena_of(pid: int) -> str:
    paths = glob.glob(f"/dev/shm/kvstore-*-{pid}")
    assert len(paths) == 1, paths
    return paths[0]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_restart_removes_only_dead_arenas_of_its_data_dir(server_factory):
    first = server_factory()
    old = _arena_of(first.pid)
    prefix = old[:old.rindex("-") + 1]  # /dev/shm/kvstore-<data-dir hash>-
    os.kill(first.pid, signal.SIGKILL)  # not first.kill(): its teardown unlinks the arena
    first.proc.wait(timeout=10)
    assert os.path.exists(old)
    assert os.path.exists(f"{old}.sock")

    live = subprocess.Popen(["sleep", "60"])
    keep = [f"{prefix}{live.pid}",  # this data dir, live process
            f"/dev/shm/kvstore-0123456789ab-{first.pid}",  # other data dir, dead process
            f"{prefix}notapid"]
    try:
        for path in keep:
            with open(path, "wb") as f:
                f.write(b"x" * 4096)
        second = server_factory(data_dir=first.data_dir)
        assert not os.path.exists(old)
        assert not os.path.exists(f"{old}.sock")
        assert all(os.path.exists(path) for path in keep)
        assert os.path.exists(_arena_of(second.pid))  # its own, new arena
        assert f"removed stale DRAM arena {old} " in second.log()
        assert f"removed stale same-node socket {old}.sock " in second.log()
        assert second.log().count("removed stale") == 2
    finally:
        live.kill()
        live.wait(timeout=10)
        for path in keep:
            if os.path.exists(path):
                os.unlink(path)
