"""The engine harnesses (tools/engine_proc.py, tools/pd_cluster.py) find the vLLM
shared-memory files their processes mapped, to remove them once those are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tools.engine_proc import shm_files

# What vLLM's message queues do: a SharedMemory ("psm_" name) its creator keeps from
# the resource tracker, so nobody unlinks it when the process is killed.
_SHARED_MEMORY = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(shm._name, "shared_memory")
print(shm.name, flush=True)
time.sleep(60)
"""
# A lock of a "spawn" context is a named semaphore (/dev/shm/sem.mp-*) that only the
# resource tracker unlinks: killed with its tracker (a group kill), it stays. glibc
# maps it under the temporary name it made it as, so it is found by its inode.
_SEMAPHORE = """
import multiprocessing, time
from multiprocessing import resource_tracker
lock = multiprocessing.get_context("spawn").Lock()
name = lock._semlock.name
resource_tracker.unregister(name, "semaphore")
print(name, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
@pytest.mark.parametrize(("holder", "file_name"), [
    (_SHARED_MEMORY, lambda name: name if name.startswith("psm_") else None),
    (_SEMAPHORE, lambda name: f"sem.{name}" if name.startswith("mp-") else None),
], ids=["shared-memory", "semaphore"])
def test_a_killed_process_s_file_is_found_by_its_mapping(holder, file_name):
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    path = None
    try:
        name = file_name(proc.stdout.readline().strip().lstrip("/"))
        assert name is not None
        path = f"/dev/shm/{name}"
        assert os.path.exists(path)
        assert path in shm_files([proc.pid])
        assert shm_files([os.getpid()]) & {path} == set()  # only the mapping's owner
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert os.path.exists(path)  # left behind: the harness must remove it
        assert shm_files([proc.pid]) == set()  # gone: nothing more to learn from it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        if path is not None and os.path.exists(path):
            os.unlink(path)
