"""The server SIGKILLed or SIGSTOPped at each step of an insert and of a drop_select.

Steps: after ``reserve`` (before the bytes move), after the bytes moved (before
``commit``); after ``acquire`` (before the read), after the read (before
``release``). The fault is a real signal to the real server process, sent from the
client process at that step (its data move is wrapped to know when the step is
reached). Each case must end within bounded time in a result or a miss
(``MissError``), and afterwards (SIGKILL: restarted on the same data dir; SIGSTOP:
continued) nothing committed may be lost: every committed NVMe entry is served
exact, and a drop_select's bytes are in the caller's hands or still on the server.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import numpy as np
import pytest

from kvstore.core.errors import BusyError, MissError
from tests.integration.client_worker import prompt_kv, prompt_tokens

pytestmark = pytest.mark.timeout(120)

N = 64  # tokens: 16 blocks of 512 B
PROMPTS = range(10)  # 160 DRAM pages, past the high watermark: most demote to NVMe
BOUND_S = 2.0 + 5.0 + 3.0  # client timeout, TE's minimum transfer timeout, slack


def _server(server_factory):
    return server_factory(dram="1MiB", nvme="8MiB",
                          extra=("--high-watermark", "0.5", "--low-watermark", "0.05"))


def _settled_on_nvme(client) -> list[int]:
    """Wait for the reaper's demotion, then the prompts wholly on NVMe (what a
    SIGKILL must not lose: DRAM is volatile by design)."""
    deadline = time.monotonic() + 20
    while client.stats()["tiers"]["dram"]["used"] > 0.5 * (1 << 20):
        assert time.monotonic() < deadline, client.stats()
        time.sleep(0.1)
    nvme = {e["key"] for e in client.ls(tier="nvme")}
    return [pid for pid in PROMPTS
            if all(k in nvme for k in client.keys_for(prompt_tokens(pid, N)))]


class _Patient:
    """A client whose calls are tried again while the server answers ``busy`` (for at
    most 10 s). Just continued, a server whose serving thread was stopped at work
    counts the stop as that work's age, and pushes back until the work is done: a
    clear answer that changed nothing, and not what these tests check."""

    def __init__(self, client) -> None:
        self._client = client

    def __getattr__(self, name: str):
        method = getattr(self._client, name)

        def patient(*args, **kwargs):
            deadline = time.monotonic() + 10
            while True:
                try:
                    return method(*args, **kwargs)
                except BusyError:
                    assert time.monotonic() < deadline, f"{name}: busy for 10 s"
                    time.sleep(0.05)
        return patient


def _exact(client, pid: int) -> bool:
    got = client.get(prompt_tokens(pid, N), timeout=5.0)
    return got.matched_tokens == N and np.array_equal(got.kv.numpy(), prompt_kv(pid, N))


class Fault:
    """Sends ``sig`` to the server once, when the wrapped data move reaches ``when``."""

    def __init__(self, srv, sig: int) -> None:
        self.srv, self.sig, self.sent = srv, sig, False

    def __call__(self) -> None:
        if not self.sent:
            self.sent = True
            os.kill(self.srv.pid, self.sig)

    def wrap(self, client, method: str, when: str) -> None:
        real = getattr(client._data, method)

        def move(*args, **kwargs):
            if when == "before":
                self()
            out = real(*args, **kwargs)
            if when == "after":
                self()
            return out

        setattr(client._data, method, move)

    def undo(self) -> None:
        """SIGKILL: restart on the same data dir; SIGSTOP: continue."""
        if self.sig == signal.SIGKILL:
            self.srv.proc.wait(10)
            self.srv.start()
        else:
            os.kill(self.srv.pid, signal.SIGCONT)

    def around(self, what: str, call: Callable[[], Any]) -> tuple[Any, MissError | None]:
        """``call()``'s result or miss, undone afterwards; it must have reached the
        step, ended within ``BOUND_S`` and left the server up."""
        start, got, failed = time.monotonic(), None, None
        try:
            got = call()
        except MissError as exc:
            failed = exc
        finally:
            elapsed = time.monotonic() - start
            assert self.sent, "the step was never reached"
            self.undo()
        name = signal.Signals(self.sig).name
        assert elapsed < BOUND_S, f"{what} took {elapsed:.1f}s under {name}"
        assert self.srv.proc.poll() is None, self.srv.log()
        return got, failed


def _nothing_left_open(admin) -> None:
    """Nothing of the interrupted call stays open past its lease."""
    deadline = time.monotonic() + 10
    while (s := admin.stats())["reservations"] or s["leases"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.2)


CASES = [("insert", "write", "before", "after reserve"),
         ("insert", "write", "after", "after the write, before commit"),
         ("drop_select", "read", "before", "after acquire"),
         ("drop_select", "read", "after", "after the read, before release")]


@pytest.mark.parametrize("path", ["shm", "te"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("op,method,when,step", CASES, ids=[c[3] for c in CASES])
def test_server_signalled_at_each_step(server_factory, client_factory, fault_log,
                                       op, method, when, step, sig, path):
    srv = _server(server_factory)
    setup = client_factory(srv, timeout_s=5.0)
    for pid in PROMPTS:
        setup.insert(prompt_tokens(pid, N), prompt_kv(pid, N))
    durable = _settled_on_nvme(setup)
    assert len(durable) >= 3, durable
    target, keep = durable[0], durable[1:] if sig == signal.SIGKILL else [
        pid for pid in PROMPTS if pid != durable[0]]
    client = client_factory(srv, timeout_s=2.0, same_node=(path == "shm"))
    fault = Fault(srv, sig)
    fault.wrap(client, method, when)

    def call():
        if op == "insert":
            return client.insert(prompt_tokens(99, N), prompt_kv(99, N))
        return client.drop_select(prompt_tokens(target, N))

    got, failed = fault.around(op, call)

    admin = _Patient(client_factory(srv, timeout_s=5.0))
    lost = sum(not _exact(admin, pid) for pid in keep) * prompt_kv(0, N).nbytes
    if op == "drop_select":
        in_hand = (failed is None and got.matched_tokens == N
                   and np.array_equal(got.kv.numpy(), prompt_kv(target, N)))
        if failed is None and got.matched_tokens:  # whatever came back is exact
            assert np.array_equal(got.kv.numpy(), prompt_kv(target, N)[:got.kv.numel()])
        still_there = admin.lookup(prompt_tokens(target, N)).matched_tokens == N
        if not (in_hand or still_there):
            lost += prompt_kv(target, N).nbytes
    elif failed is None and sig == signal.SIGSTOP:  # acknowledged and never killed
        if not _exact(admin, 99):
            lost += prompt_kv(99, N).nbytes
    fault_log(f"server {signal.Signals(sig).name} during {op}, {step}", 1,
              int(srv.proc.poll() is None), lost)
    assert lost == 0
    _nothing_left_open(admin)


def test_an_insert_the_stopped_server_never_answers_ends_at_its_timeout(
        server_factory, client_factory, fault_log):
    """Stopped after the reserve, the server never answers the commit: the insert
    gives up when its commit does (the client's timeout plus the deadline's slack)
    and gives the reservation back one-way. It used to wait for the abort's reply
    too, up to 2 s more, against a server that could not answer (and, first, for a
    health reply to reopen the same-node socket). Continued, the server refuses the
    late commit and ends the reservation itself (``Writes.commit``'s deadline): the
    abort, queued behind it, finds nothing left; nothing stays open either way."""
    from kvstore.client.client import _DEADLINE_SLACK_S

    # A reservation lease far longer than the test: only the abort can end it.
    srv = server_factory(dram="1MiB", nvme="8MiB", reservation_lease=60)
    timeout_s = 1.0
    client = client_factory(srv, timeout_s=timeout_s, same_node=True)
    client.health()  # (the hello: the server's clock, so the commit has a deadline)
    fault = Fault(srv, signal.SIGSTOP)
    fault.wrap(client, "write", "before")  # a fresh client's insert: reserve + commit
    start = time.monotonic()
    _, failed = fault.around("insert", lambda: client.insert(prompt_tokens(99, N),
                                                             prompt_kv(99, N)))
    elapsed = time.monotonic() - start
    assert failed is not None  # (a timeout: the commit's reply never came)
    # the commit's wait, and well under the 2 s the abort's round trip used to add
    assert elapsed < timeout_s + _DEADLINE_SLACK_S + 1.5, elapsed
    admin = _Patient(client_factory(srv, timeout_s=5.0))
    # The late commit's refusal (and the abort) end the reservation within moments
    # of the server going on, not at its lease's end.
    deadline = time.monotonic() + 5
    while admin.stats()["reservations"]:
        assert time.monotonic() < deadline, admin.stats()
        time.sleep(0.05)
    assert admin.lookup(prompt_tokens(99, N)).matched_tokens == 0
    fault_log("server SIGSTOP during insert, commit never answered (insert's bound)", 1,
              int(srv.proc.poll() is None), 0)


INLINE_STEPS = [("acquire", "as the acquire is sent"),
                ("before", "after the reply with the bytes came, before they are copied"),
                ("after", "after they were copied, before release")]


@pytest.mark.parametrize("door", [False, True], ids=["ZeroMQ port", "stream door"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("when,step", INLINE_STEPS, ids=[s[1] for s in INLINE_STEPS])
def test_server_signalled_around_a_drop_select_answered_inline(
        server_factory, client_factory, fault_log, when, step, sig, door):
    """A prompt in DRAM read by a client off the server's node comes in the acquire's
    reply (``Acquire.inline``). Once that reply is in, the bytes are the caller's: a
    server killed or stopped afterwards changes nothing. One signalled before it
    answers is a bounded miss (the client gives up on its socket at the timeout); a
    stopped server, once continued, reaches that acquire after its deadline and
    refuses it (``late_reads``): no reply with the bytes, nothing leased, the prompt
    stays stored for the next reader. (DRAM lost to SIGKILL is volatile by design
    and not counted, as in the fault table.) The same over the stream door, where
    the bytes are taken (received) as they come after the reply."""
    from kvstore.core.config import ClientConfig
    from kvstore.core.protocol import Acquire

    srv = server_factory(dram="4MiB", nvme="8MiB")
    setup = client_factory(srv, timeout_s=5.0)
    target = 7
    setup.insert(prompt_tokens(target, N), prompt_kv(target, N))
    ops: list[str] = []
    client = client_factory(srv, timeout_s=2.0, same_node=False,
                            config=ClientConfig(inline_max_bytes=4 << 20, stream_socket=door),
                            observer=lambda op, s, ok: ops.append(op))
    assert client.hello()["inline_max"] > 0 and client._rpc.stream is door
    take = "take_parts" if door else "take_inline"
    taken = []
    real_take = getattr(client._data, take)
    setattr(client._data, take, lambda *a, **kw: taken.append(1) or real_take(*a, **kw))
    fault = Fault(srv, sig)
    if when == "acquire":
        real_call = client._rpc.call

        def call(req, *args, **kwargs):
            if isinstance(req, Acquire):
                fault()
            return real_call(req, *args, **kwargs)

        client._rpc.call = call
    else:
        fault.wrap(client, take, when)

    got, failed = fault.around("drop_select",
                               lambda: client.drop_select(prompt_tokens(target, N)))
    assert "te_read" not in ops

    admin = _Patient(client_factory(srv, timeout_s=5.0))
    still_there = admin.lookup(prompt_tokens(target, N)).matched_tokens == N
    lost = 0
    if when == "acquire":
        assert failed is not None and not taken, "no reply could have come"
        if sig == signal.SIGSTOP:  # refused once continued: late, nothing leased
            lost = 0 if still_there else prompt_kv(target, N).nbytes
            assert admin.stats()["late_reads"] == 1
    else:  # the reply came before the signal: the bytes are in hand, exact
        assert failed is None and taken
        assert got.matched_tokens == N
        assert np.array_equal(got.kv.numpy(), prompt_kv(target, N))
    over = ", over the stream door" if door else ""
    fault_log(f"server {signal.Signals(sig).name} around an inline drop_select, {step}{over}", 1,
              int(srv.proc.poll() is None), lost)
    assert lost == 0
    _nothing_left_open(admin)
    if sig == signal.SIGSTOP and when != "acquire":  # the one-way release was applied
        assert not admin.lookup(prompt_tokens(target, N)).matched_tokens
    answered = sig == signal.SIGSTOP and when != "acquire"  # (a late acquire: no reply)
    assert admin.stats()["inline_replies"] == int(answered)
    # The same client goes on after every case, the next prompt exact.
    admin.insert(prompt_tokens(8, N), prompt_kv(8, N))
    again = client.drop_select(prompt_tokens(8, N))
    assert again.matched_tokens == N and np.array_equal(again.kv.numpy(), prompt_kv(8, N))
