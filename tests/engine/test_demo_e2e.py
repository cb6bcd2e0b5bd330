"""``make run`` (``python -m tools.demo``) as a user runs it: real vLLM engines on
emulated nodes, every prompt's decode identical to one plain engine, and nothing left
behind, whether it finishes or is interrupted while the engines start.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.engine_proc import SHM_PREFIXES
from tools.netns import namespaces, netns_available

REPO = Path(__file__).resolve().parents[2]
_PR_SET_CHILD_SUBREAPER = 36

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.netns]


def _own_namespaces(pid: int) -> list[str]:
    """The harness namespaces of process ``pid``; other sessions may have their own."""
    return [ns for ns in namespaces() if ns.startswith(f"kvsnet-{pid}-")]


def _proc_stat(pid: str) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def _descendants() -> list[int]:
    """Live processes below this one."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _proc_stat(entry)) is not None and st[0] != "Z":
            children.setdefault(st[1], []).append(int(entry))
    found, todo = [], list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.fixture
def started():
    """``started()``: the processes below this one that were not there when the test
    began. This process is made the child subreaper (Linux prctl) meanwhile, so
    orphans of the demo's processes are re-parented here instead of to init: the list
    holds everything the demo started, however deep, even after the demo exited."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    before = set(_descendants())  # e.g. servers of other tests' fixtures
    try:
        yield lambda: sorted(set(_descendants()) - before)
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for entry in os.listdir("/proc"):  # reap the orphans that died here
            st = _proc_stat(entry) if entry.isdigit() else None
            if st is not None and st == ("Z", os.getpid()):
                try:
                    os.waitpid(int(entry), os.WNOHANG)
                except ChildProcessError:
                    pass


def _vllm_shm() -> set[str]:
    """vLLM's files in /dev/shm (tools.engine_proc.SHM_PREFIXES): a process killed
    before it unlinks its SharedMemory leaves 240 MiB there (once in a CI run)."""
    return {str(p) for p in Path("/dev/shm").glob("*")
            if str(p).startswith(SHM_PREFIXES)} if Path("/dev/shm").is_dir() else set()


def _demo(tmp_path: Path, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.Popen([sys.executable, "-m", "tools.demo", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.timeout(400)
def test_make_run_decodes_identically_and_cleans_up(tmp_path, started):
    shm_before = _vllm_shm()
    demo = _demo(tmp_path)  # exactly what `make run` runs
    try:
        out, err = demo.communicate(timeout=360)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=30)
    print(out)
    assert demo.returncode == 0, f"{out}\n{err[-4000:]}"
    assert ("3 nodes in network namespaces" if netns_available() else "loopback") in out
    rows = {int(m[1]): m[0] for m in re.finditer(r"^\s*(\d+)\s+\S.*$", out, re.MULTILINE)}
    assert sorted(rows) == [7, 33, 300, 2000]
    for n, row in rows.items():
        # loaded n-1 tokens, bytes moved, two TTFTs, B's load of every prompt (the
        # connector's metrics counted each), identical for all 3 prompts
        assert re.search(rf"\s{n - 1} tok\s+[\d.]+[KM]iB\s+[\d.]+ ms\s+[\d.]+ ms\s+"
                         r"[\d.]+ ms\s+identical \(3 of 3\)$", row), row
    assert "A's store after all decodes: 0 entries" in out
    assert "identical to one plain engine's for all 4 prompts" in out
    assert started() == []
    assert _own_namespaces(demo.pid) == []
    assert os.listdir(tmp_path) == []
    assert _vllm_shm() - shm_before == set()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("sig", "deep"), [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c-engine-cores-up", "sigterm-engines-just-started"])
def test_interrupt_while_engines_start_leaves_nothing(tmp_path, started, sig, deep):
    """Ctrl-C once vLLM's API servers have spawned an engine core (the deepest process
    tree), SIGTERM right after the engines were launched: exit 130, every process gone,
    namespaces and files removed."""
    shm_before = _vllm_shm()
    demo = _demo(tmp_path)
    try:
        progress = ""
        while "starting 3 vLLM engines" not in progress:  # bounded by the test's timeout
            line = demo.stderr.readline()
            assert line, f"demo ended early: {progress}"
            progress += line
        while deep and not any(b"EngineCore" in _cmdline(pid) for pid in started()):
            assert demo.poll() is None, demo.stderr.read()[-3000:]
            time.sleep(0.2)
        assert len(started()) >= (7 if deep else 6)  # demo, 2 stores, 3 engines, a core
        assert bool(_own_namespaces(demo.pid)) == netns_available()
        demo.send_signal(sig)
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=30)
    assert demo.returncode == 130, err[-3000:]
    assert "interrupted" in err
    assert "identical" not in out
    assert started() == []
    assert _own_namespaces(demo.pid) == []
    assert os.listdir(tmp_path) == []
    assert _vllm_shm() - shm_before == set()
