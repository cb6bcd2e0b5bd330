"""Engines forked from the zygote (tools/engine_fork.py) against a fresh interpreter.

Every in-process engine of the engine tests is forked from one process that imported
vLLM once. These tests hold that start to what ``python -m tools.engine_proc`` gives:
the same tokens, the node's network namespace, the engine's own environment and
process group, its errors, its exit status, and nothing left behind.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.engine.conftest import node_prefix
from tools import engine_fork
from tools.engine_proc import EngineError, EngineProc, stop_all
from tools.tiny_models import VOCAB, ModelSpec, build

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SPEC = ModelSpec("llama", "float32")


def test_a_forked_engine_decodes_as_a_fresh_one_in_its_own_node(cluster, tmp_path,
                                                                 monkeypatch):
    model = build(SPEC, tmp_path / "models")
    node = cluster.nodes[1]
    kw = dict(max_model_len=1024, in_process=True, host_ip=node.host,
              prefix=node_prefix(cluster, node))
    forked = EngineProc(model, SPEC.dtype, log_path=tmp_path / "forked.log", name="forked",
                        **kw)
    victim = EngineProc(model, SPEC.dtype, log_path=tmp_path / "victim.log", name="victim",
                        **kw)
    fresh = EngineProc(model, SPEC.dtype, log_path=tmp_path / "fresh.log", name="fresh", **kw)
    try:
        forked.start()
        victim.start()
        monkeypatch.setenv("KVSTORE_ENGINE_FORK", "0")
        fresh.start()
        monkeypatch.delenv("KVSTORE_ENGINE_FORK")
        for eng in (forked, victim, fresh):
            eng.wait_ready()
        assert isinstance(forked.proc, engine_fork.Forked)
        assert not isinstance(fresh.proc, engine_fork.Forked)
        pid = forked.proc.pid
        # Its own process group and session, and the node's netns.
        assert os.getpgid(pid) == pid and os.getsid(pid) == pid
        # The engine's environment, not the zygote's: without the layout's
        # VLLM_ENABLE_V1_MULTIPROCESSING=0 its engine core would be a second process.
        assert forked.leftover_pids() == [pid]
        if cluster.kind == "netns":
            assert os.stat(f"/proc/{pid}/ns/net").st_ino == \
                os.stat(f"/run/netns/{node.netns}").st_ino
        # vLLM's logging went to the engine's own log, in the format of the config
        # EngineProc wrote for it (tools.engine_proc.LOGGING), not vLLM's default.
        assert re.search(r"^(INFO|WARNING) \d\d-\d\d [\d:]+ vllm\.",
                         (tmp_path / "forked.log").read_text(), re.M)

        prompts = [[(7 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((1, 33, 300))]
        want = [c.token_ids for c in fresh.generate(prompts, 24)]
        got = [c.token_ids for c in forked.generate(prompts, 24)]
        assert got == want and all(len(t) == 24 for t in got)

        # A SIGKILL is reported as one, and the zygote reaps the process; the other
        # engines it forked go on.
        os.kill(victim.proc.pid, signal.SIGKILL)
        assert victim.proc.wait(30) == -signal.SIGKILL
        assert victim.leftover_pids() == []
        assert [c.token_ids for c in forked.generate(prompts[:1], 24)] == want[:1]
    finally:
        stop_all([forked, victim, fresh])
    for eng in (forked, victim, fresh):
        assert eng.leftover_pids() == [], eng
    # A clean stop exits 0, as a fresh driver does.
    assert forked.proc.returncode == 0 and fresh.proc.returncode == 0


def test_a_forked_engine_that_cannot_start_says_why_and_exits(tmp_path):
    eng = EngineProc(tmp_path / "no-such-model", "float32", in_process=True,
                     log_path=tmp_path / "bad.log", name="bad")
    eng.start()
    assert isinstance(eng.proc, engine_fork.Forked)
    with pytest.raises(EngineError, match="failed to start") as err:
        eng.wait_ready(120)
    assert "no-such-model" in str(err.value)
    assert eng.proc.wait(60) == 1
    eng.kill()
    assert eng.leftover_pids() == []


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_node_that_is_gone_is_a_start_error_and_leaves_nothing_open(tmp_path):
    eng = EngineProc(tmp_path / "model", "float32", in_process=True, name="nowhere",
                     prefix=("ip", "netns", "exec", f"kvs-no-such-netns-{os.getpid()}"))
    before = _open_fds()
    with pytest.raises(EngineError, match="nowhere failed to start"):
        eng.start()
    assert _open_fds() == before


def test_a_child_that_fails_before_the_driver_says_so_in_its_own_log(tmp_path,
                                                                     monkeypatch):
    # A "namespace" that is a plain file: the child's setns refuses it (EINVAL).
    monkeypatch.setattr(engine_fork, "_NETNS_DIR", str(tmp_path))
    (tmp_path / "not-a-netns").write_text("")
    eng = EngineProc(tmp_path / "model", "float32", in_process=True, name="badns",
                     log_path=tmp_path / "badns.log",
                     prefix=("ip", "netns", "exec", "not-a-netns"))
    eng.start()
    with pytest.raises(EngineError, match="exited"):
        eng.wait_ready(60)
    assert eng.proc.wait(30) == 1
    assert "setns" in (tmp_path / "badns.log").read_text()
    eng.kill()
    assert eng.leftover_pids() == []


def test_a_prefix_the_zygote_cannot_enter_starts_a_fresh_interpreter():
    assert engine_fork.netns_of(()) is None
    assert engine_fork.netns_of(("ip", "netns", "exec", "n1")) == "n1"
    assert engine_fork.netns_of(("nice", "-n", "5")) is False
    assert engine_fork.netns_of(("ip", "netns", "exec", "n1", "taskset")) is False
