"""What the connector's worker keeps about a request from one step to another, and
when it lets go of it.

Two facts outlive the step that learns them:

* ``held``: the tokens a keep-mode load found stored, until the request's save starts
  copying (a save never skips more than its own load saw);
* ``chunk failed``: a chunk save of the request failed, so its later chunk orders
  are not made (they would be stored behind a hole, unreachable).

Both are written by jobs on the transfer thread, and vLLM says when a request is
finished (``get_finished``'s ``finished_req_ids``) without waiting for those jobs: a
keep-mode background load of a request aborted while it waits for its KV, or a chunk
save still on its way when its request is aborted, ends after the finish. So each
request's entries go at the later of the two: its finish, and the end of its last
load or save queued on the thread. Invariant: a request finished by vLLM has entries
only while a job of it is queued or running.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class RequestStates:
    """Per request: ``held``, ``chunk failed``, and its jobs queued on the transfer
    thread. Every method may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._chunk_failed: set[str] = set()
        self._jobs: dict[str, int] = {}  # loads and saves queued or running (> 0)
        self._finished: set[str] = set()  # finished by vLLM while a job of theirs runs

    # ------------------------------------------------------------ lifetime
    def job_queued(self, req_id: str) -> None:
        """A load or save of ``req_id`` goes to the thread (before vLLM can finish it:
        its order came in the step being run)."""
        with self._lock:
            self._jobs[req_id] = self._jobs.get(req_id, 0) + 1

    def job_ended(self, req_id: str) -> None:
        """That job is over (whatever its outcome: every queued job ends once). The last
        one of a request vLLM has finished takes the request's entries with it."""
        with self._lock:
            # (Never raises: a load's waiters are woken right after this.)
            left = self._jobs.pop(req_id, 1) - 1
            if left:
                self._jobs[req_id] = left
            elif req_id in self._finished:
                self._finished.discard(req_id)
                self._forget(req_id)

    def finished(self, req_ids: Iterable[str]) -> None:
        """vLLM finished these requests (done, aborted): their entries go now, or when
        their last job ends."""
        with self._lock:
            for req_id in req_ids:
                if req_id in self._jobs:
                    self._finished.add(req_id)
                else:
                    self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        self._held.pop(req_id, None)
        self._chunk_failed.discard(req_id)

    # ------------------------------------------------------------ the facts
    def hold(self, req_id: str, tokens: int) -> None:
        """A keep-mode load of ``req_id`` found ``tokens`` stored."""
        with self._lock:
            self._held[req_id] = tokens

    def take_held(self, req_id: str) -> int | None:
        """What a keep-mode load of ``req_id`` found stored (None: no such load), once."""
        with self._lock:
            return self._held.pop(req_id, None)

    def fail_chunks(self, req_id: str) -> None:
        with self._lock:
            self._chunk_failed.add(req_id)

    def chunks_failed(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._chunk_failed

    def chunks_done(self, req_id: str) -> None:
        """The request's last save order ended: its chunks are over, failed or not."""
        with self._lock:
            self._chunk_failed.discard(req_id)

    # ------------------------------------------------------------ checks
    def tracked(self) -> set[str]:
        """Every request with an entry here (empty once every request finished and
        every job ended)."""
        with self._lock:
            return {*self._held, *self._chunk_failed, *self._jobs, *self._finished}

    def check_integrity(self) -> None:
        with self._lock:
            assert all(n > 0 for n in self._jobs.values()), self._jobs
            assert self._finished <= self._jobs.keys(), (self._finished, self._jobs)
