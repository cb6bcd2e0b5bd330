"""The disaggregated demo: decode from moved KV gives exactly a single-process run's tokens.

First in one process (the KV only goes through entry bytes), then across two
kvstore-server nodes (network namespaces where allowed, else loopback ports),
then the demo itself as a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstore.layout import pack_hf, unpack_hf
from tools import model as demo_model
from tools.netns import namespaces, netns_available

REPO = Path(__file__).resolve().parents[2]

# Shorter than a block, exactly one block, not a multiple of it, several blocks.
LENGTHS = [1, 7, 16, 33, 100]
DECODE = 12


@pytest.fixture(scope="module")
def model():
    demo_model.configure_torch(1)
    return demo_model.build_model()


@pytest.fixture(scope="module")
def layout(model):
    return demo_model.kv_layout(model)


def _prompt(model, length, seed=0):
    return demo_model.make_prompt(length, seed, model.config.vocab_size)


# ------------------------------------------------------------ single process
def test_model_is_a_pure_function_of_its_seed(model):
    again = demo_model.build_model()
    other = demo_model.build_model(seed=demo_model.DEFAULT_SEED + 1)
    for (name, w), w2, w3 in zip(model.state_dict().items(), again.state_dict().values(),
                                 other.state_dict().values()):
        assert torch.equal(w, w2), name
    assert not all(torch.equal(w, w3) for w, w3 in zip(again.parameters(), other.parameters()))


@pytest.mark.parametrize("length", LENGTHS)
def test_decode_from_entry_bytes_matches_generate(model, layout, length):
    tokens = _prompt(model, length)
    reference = demo_model.reference_tokens(model, tokens, DECODE)
    result = demo_model.prefill(model, tokens)
    assert [k.shape for k, _ in result.past] == [(1, layout.kv_heads, length, layout.head_dim)] * 4
    data = pack_hf(layout, result.past)
    assert data.numel() == layout.nbytes(length)
    past = unpack_hf(layout, data.clone(), length)  # a copy: nothing shared with prefill
    first = demo_model.token_from_hidden(model, result.hidden)
    assert first == result.next_token == reference[0]
    assert [first, *demo_model.decode_greedy(model, past, first, DECODE)] == reference


def test_tokens_depend_on_the_kv(model, layout):
    """The identical-tokens check can fail: wrong or damaged KV changes the output."""
    tokens = _prompt(model, 40)
    reference = demo_model.reference_tokens(model, tokens, DECODE)
    result = demo_model.prefill(model, tokens)
    other = demo_model.prefill(model, _prompt(model, 40, seed=7))
    wrong = [reference[0], *demo_model.decode_greedy(model, other.past, reference[0], DECODE)]
    assert wrong != reference
    data = pack_hf(layout, result.past)
    data[: layout.block_nbytes] = 0  # lose the first block's KV
    damaged = unpack_hf(layout, data, 40)
    assert [reference[0], *demo_model.decode_greedy(model, damaged, reference[0], DECODE)] != reference


def test_decode_leaves_the_callers_kv_alone(model):
    result = demo_model.prefill(model, _prompt(model, 20))
    before = [(k.clone(), v.clone()) for k, v in result.past]
    demo_model.decode_greedy(model, result.past, result.next_token, 4)
    assert all(torch.equal(k, k0) and torch.equal(v, v0)
               for (k, v), (k0, v0) in zip(result.past, before))
    assert result.past[0][0].shape[2] == 20


def test_prompts_are_deterministic_and_in_vocab(model):
    vocab = model.config.vocab_size
    assert _prompt(model, 300) == _prompt(model, 300)
    assert _prompt(model, 300) != _prompt(model, 300, seed=1)
    assert all(0 <= t < vocab for t in _prompt(model, 300))
    with pytest.raises(ValueError):
        demo_model.make_prompt(0, 0, vocab)


# ------------------------------------------------------------- across nodes
def _demo_args(*argv):
    from tools.demo import parse_args

    return parse_args(list(argv))


def _own_namespaces(pid: int | None = None) -> list[str]:
    """This process's (or ``pid``'s) harness namespaces; other sessions may have their own."""
    return [ns for ns in namespaces() if ns.startswith(f"kvsnet-{pid or os.getpid()}-")]


def _our_processes(marker: str) -> list[int]:
    """PIDs whose command line mentions ``marker`` (a directory only this test uses)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(240)
def test_decode_node_continues_exactly_where_prefill_node_stopped(layout, tmp_path, monkeypatch):
    from tools.demo import run_demo

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the servers' data dirs land here
    lengths = [1, 7, 16, 33]
    result = run_demo(_demo_args("--prompt-lengths", ",".join(map(str, lengths)),
                                 "--decode-tokens", "8"))
    print(f"cluster kind: {result.kind}")
    assert result.kind == ("netns" if netns_available() else "loopback")
    assert [r.length for r in result.runs] == lengths
    for run in result.runs:
        assert run.matched_tokens == run.length
        assert run.blocks == -(-run.length // layout.block_tokens)
        assert run.nbytes == layout.nbytes(run.length)
        assert run.tokens == run.reference and len(run.tokens) == 9, run
    assert result.all_identical
    # drop_select emptied A; B keeps each conversation (prompt + answer) for a next turn.
    assert result.stats["A after prefill"]["entries"] >= sum(-(-n // 16) for n in lengths)
    assert result.stats["A after decode"]["entries"] == 0
    assert result.stats["B after decode"]["entries"] == sum(-(-(n + 8) // 16) for n in lengths)
    assert _own_namespaces() == []
    assert _our_processes(str(tmp_path)) == []
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_command_says_identical_and_cleans_up(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "tools.demo", "--loopback",
                           "--prompt-lengths", "5,20", "--decode-tokens", "4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=200,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loopback" in proc.stdout
    assert "identical to a single-process run for all 2 prompts" in proc.stdout
    assert proc.stdout.count(" identical\n") + proc.stdout.count(" identical") >= 2
    assert _our_processes(str(tmp_path)) == []
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_stops_servers_and_removes_namespaces(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    demo = subprocess.Popen([sys.executable, "-m", "tools.demo", "--prompt-lengths", "300",
                             "--decode-tokens", "400"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        progress = ""
        while "servers up" not in progress:  # bounded by the test's timeout
            line = demo.stderr.readline()
            assert line, f"demo ended early: {progress}"
            progress += line
        # Interrupt at once: the reference run and both workers still lie ahead, so
        # the demo cannot have finished (a fixed sleep raced it on a loaded machine).
        assert len(_our_processes(str(tmp_path))) == 2  # both servers
        assert bool(_own_namespaces(demo.pid)) == netns_available()
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=10)
    assert demo.returncode == 130, err[-3000:]
    assert "interrupted" in progress + err
    assert "identical" not in out
    assert _our_processes(str(tmp_path)) == []
    assert _own_namespaces(demo.pid) == []
    assert os.listdir(tmp_path) == []
