"""kvstore-server: one node's store behind a ZeroMQ ROUTER and a Transfer Engine.

Three threads. The serving thread owns the ROUTER socket: it receives each
request, handles it to completion (decode -> store -> encode) and sends the reply
itself, one request at a time, and runs ``store.reap()`` when its timer is due. A
commit or put may leave its in-memory book-keeping for after its reply
(``store.answer_first``, kvstore/store/writes.py): the serving thread runs it right
after sending, holding the store's lock from the request to the end of that work,
so no other thread or request sees the store in between. No request is handed
between threads: on a small machine every thread woken from idle adds ~0.1 ms to a
round trip (docs/benchmarks.md). It never reads an acquire's NVMe
entries: such an acquire is begun there (held, claimed, staging room allocated
under the store's lock) and handed to the staging thread, which reads and checks
the entries without the lock, settles them under it and hands the reply back
through an inproc socket, so the requests behind it go on. (Allocating the staging
room may still make room the way a reserve does, demoting inline when the victims
have no NVMe copy yet; and NVMe I/O the serving thread does itself waits while the
staging thread holds the NVMe tier's I/O lock for a read.) Push-back: while a
request has been in flight for ``WATCH_S``, the watchdog thread holds the socket
(the serving thread gives it up while it works, ``_sock_lock``) and queues what
arrives; a request that would wait longer than ``server.busy_after_s`` (the one in
flight has run that long, or the queue ahead of it would take that long at the
recent pace) is answered ``busy`` at once, and one that did wait that long in the
queue (the request queue, or the staging queue behind it) is answered ``busy``
instead of being served late (the watchdog answers queued ones as soon as they
have waited that long, not when the work ahead ends): a client hears a clear miss,
never a silent timeout. (The store's background writeback and scrub run in threads of the
store's own.) A signal only sets a flag: the request in flight finishes, then the
store (LMDB), TE and sockets close.

Clients on this node may talk through a second door, a Unix socket beside the
shared DRAM arena (kvstore/server/local.py): the serving thread polls it with the
ROUTER, its requests join the same queue and its replies go back on the connection
they came from (``_send``); it skips libzmq's I/O threads: a round trip 1.4 - 2.1x
faster here.

Bulk bytes cross these sockets only in a small acquire's reply (``_inline``).
Otherwise reserve/acquire replies carry the TE segment name and per-entry addresses
inside the registered tier arenas; the client moves the bytes one-sided with its own
TE engine (or memcpy into the shared DRAM arena when it runs on this node) and then
commits or releases. A client connection that answers no ZeroMQ heartbeat for
``server.peer_timeout_s`` is closed, and what was queued for it dropped.

Security: with ``server.curve_secret_key`` set the socket is a CURVE server and
only clients whose public key is in ``server.curve_authorized_keys`` get through
the handshake. The TE data plane has no authentication: any host that can reach the
TE port can read or write the registered regions, which are the tier arenas only
(never the whole process memory). Run TE on a trusted network.
"""

from __future__ import annotations

import errno
import collections
import gc
import itertools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, cast

import zmq

from kvstore.core import protocol as p
from kvstore.core.config import KVStoreConfig
from kvstore.core.errors import BusyError, ConfigError, InvalidRequestError, KVStoreError
from kvstore.core.nodeid import host_id
from kvstore.server import handlers
from kvstore.server.handlers import ANSWER_FIRST, HANDLERS
from kvstore.server.local import LocalDoor, Sent, is_local, socket_path
from kvstore.store.reads import Staging
from kvstore.store.types import Acquisition
from kvstore.store.writes import Later

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

    from kvstore.store import Store
    from kvstore.transport.te import Transport

log = logging.getLogger(__name__)

POLL_MS = 100  # upper bound on how long a stop request waits for the loop
# A request in flight this long lets the watchdog answer what arrives meanwhile.
WATCH_S = 0.02
# The watchdog's looks come late on a loaded host: a queued request whose caller
# stops waiting within this many periods is answered busy now (one period was too
# few: a lookup waiting 0.27 s timed out behind a verify in 1 of 3 to 4 tries here).
WATCH_LATE = 3
# ... or within twice the longest recent time from one wake of the watchdog to the
# next (its sleep, its wait for a CPU and for the GIL, its look if it looked; not its
# wait for the socket while the serving thread polls, idle), a peak that halves every
# WATCH_MEMORY_S. With 4 CPU hogs on 2 cores, looks came up to 0.5 s apart while the
# serving thread checksummed, and lookups with 0.75 s of wait_s timed out behind it
# in 4 of 6 tries with WATCH_LATE periods alone, in none of 6 with this
# (tests/integration/test_busy.py).
WATCH_MEMORY_S = 2.0
# The ops whose requests may say how long their caller waits (``protocol._WAIT``).
WAIT_OPS = frozenset({p.Hello.OP, p.Lookup.OP, p.Acquire.OP})
_EWMA = 0.2  # weight of the latest request in the recent service time
_REAPING: list[bytes] = []  # ``Server._working_on`` while the reaper runs
BUSY_NOTE_S = 10.0  # ``busy`` answers are logged at most once per this many seconds
_INPROC = itertools.count()
# Inline replies (Server._inline) handed to ZeroMQ and not yet sent, in replies of
# server.inline_max_bytes: what a client that stops reading can make the server hold.
INLINE_BACKLOG = 8
# The most bytes the serving thread copies for one inline reply (entries not back to
# back in the arena, over the ROUTER; sub-page ones over the stream door): ~1 - 2 ms
# of its time. Past it the ROUTER's reply names TE addresses and the door's sends
# each run from the arena (``Store.dram_bytes``).
INLINE_COPY_MAX = 8 << 20
# Unsent inline replies sent from the arena hold their entries in place: one such
# reply whatever its size (its lease held them anyway), more only while all of them
# together hold at most this share of the DRAM tier (1/N); past it, TE addresses.
INLINE_HOLD_SHARE = 4
_DATA = object()  # the key of an inline reply's bytes in a result map (never encoded)
# A release waits at most this long for its inline reply's tracker (_await_sent).
RELEASE_WAIT_S = 0.2
# An inline reply goes in at most this many parts (``_parts``), larger ones where a
# client asks for smaller: INLINE_BACKLOG replies of them stay well within the
# ROUTER's send high-water mark (messages queued for one peer), past which a ROUTER
# drops what is sent to that peer.
MAX_INLINE_PARTS = 64
SNDHWM = 1000
assert INLINE_BACKLOG * (MAX_INLINE_PARTS + 1) < SNDHWM
Observer = Callable[[str, float, bool], None]


# Ops answered however long they waited (Server._never_busy).
NEVER_BUSY = frozenset({"release", "abort"})


class Server:
    """Owns the ROUTER socket and the same-node door; the store and transport are
    handed in (and closed here)."""

    def __init__(self, config: KVStoreConfig, store: Store, transport: Transport,
                 observer: Observer | None = None) -> None:
        self.config = config
        self.store = store
        self.transport = transport
        self.observer = observer
        # after_observer(op, seconds) for the work a request left for after its reply.
        self.after_observer: Callable[[str, float], None] | None = None
        # on_result(request, result) after each successful op (kvstore.server.metrics uses it
        # for transfer and reserve->commit / acquire->release timings); never raises.
        self.on_result: Callable[[p.Request, dict], None] | None = None
        self.max_bytes = config.server.max_message_bytes
        self._stop = False
        self._started = time.time()
        self.counters = {"requests": 0, "errors": 0, "busy": 0, "local_requests": 0,
                         "stream_requests": 0,
                         "inline_replies": 0, "inline_bytes": 0, "inline_views": 0}
        # Acquires answered with their bytes (``Acquire.inline``): at most this many
        # bytes per reply, and INLINE_BACKLOG replies handed to ZeroMQ and not sent
        # yet (``_Slot``); past that, replies name TE addresses.
        self._inline_max = config.server.inline_max_bytes
        self._inline_slots: list[_Slot] = []
        self._ends_due = 0  # slots whose lease the server ends once sent (``_end_sent``)
        # Arena bytes unsent replies may hold in place (their views) beyond one reply:
        # a reader that stops reading pins at most this much of the DRAM tier.
        self._hold_budget = config.tiers.dram_bytes // INLINE_HOLD_SHARE
        self._counters_lock = threading.Lock()
        # Whoever holds _sock_lock may use the ROUTER socket: the serving thread while
        # it receives and sends, the watchdog while the serving thread works.
        self._sock_lock = threading.Lock()
        # The request queue: (frames, arrival time); filled under _sock_lock, taken
        # by the serving thread.
        self._queue: collections.deque[tuple[list[bytes], float]] = collections.deque()
        self._working_since: float | None = None  # when the request in flight began
        # Its frames (``_REAPING``: the reaper's turn), for the busy note, which alone
        # reads its op; None when idle.
        self._working_on: list[bytes] | None = None
        self._busy_noted = (0.0, 0)  # when ``_busy`` last logged, and busy answers since
        self._service_s = 0.0  # recent time per request (EWMA)
        # Recent peak time between the watchdog's wakes (``watch_gap``; it alone writes it).
        self._watch_gap = WATCH_S
        self._busy_after = config.server.busy_after_s
        # Acquires waiting on NVMe: (envelope, request id, request, staging, arrival).
        self._staging: collections.deque[tuple[list[bytes], int, p.Acquire, Staging, float]] \
            = collections.deque()
        self._staged_at = f"inproc://kvstore-staged-{next(_INPROC)}"
        self._staging_wake = threading.Condition()
        self._requests_done = threading.Event()
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._local: LocalDoor | None = None
        # Wakes the serving thread's poll: ``stop`` writes to it, and so does the
        # interpreter on a signal (``wake_fd``, for signal.set_wakeup_fd), whichever
        # thread the signal lands on; without it a stop waited out the poll.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        try:
            self._sock = self._bind()
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._register_arenas()
            # Same-node clients' door (kvstore/server/local.py), beside the shared
            # arena, and the stream door for the others.
            arena = store.dram_shared_path
            path = socket_path(arena) if config.server.local_socket and arena is not None \
                else None
            stream = self._stream_address()
            door = LocalDoor(path, 2 * self.max_bytes + 4096, stream)
            self._local = door if door.listening else None
            if door.stream_error is not None and config.server.stream_port:
                door.close()
                self._local = None
                raise ConfigError(f"cannot listen on {srv_where(*cast(tuple, stream))} for "
                                  f"the stream door (server.stream_port): "
                                  f"{door.stream_error}; 0 takes any free port")
        except BaseException:
            # Whatever step failed: a socket left open would block the context's
            # termination forever (a hung start instead of the error).
            self._close_zmq(every_socket=True)
            self._close_wake()
            raise

    # ---------------------------------------------------------------- set-up
    def _bind(self) -> zmq.Socket:
        srv = self.config.server
        sock = self._ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # Frames between max_message_bytes and this hard cap get a typed error
            # reply; beyond it libzmq drops the connection before we ever see the frame.
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_bytes + 4096)
            # (ZeroMQ's default, set here because MAX_INLINE_PARTS relies on it.)
            sock.setsockopt(zmq.SNDHWM, SNDHWM)
            if srv.peer_timeout_s > 0:  # a peer that answers no heartbeat is let go
                timeout_ms = max(1, int(srv.peer_timeout_s * 1000))
                sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, min(timeout_ms // 3, 10_000)))
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
            if srv.curve_secret_key:
                self._setup_curve(sock)  # a bad key: ConfigError, the socket closed below
            try:
                sock.bind(f"tcp://{srv.host}:{srv.port}")
            except zmq.ZMQError as exc:
                reason = "port in use" if exc.errno == errno.EADDRINUSE else str(exc)
                raise ConfigError(f"cannot listen on {srv.host}:{srv.port}: {reason}") \
                    from None
        except BaseException:
            sock.close(0)  # not self._sock yet: _close_zmq would not see it
            raise
        return sock

    def _stream_address(self) -> tuple[str, int] | None:
        """Where the stream door listens: the ROUTER's host, at ``server.stream_port``
        (0: any free port, as TE's; the hello names it); None when it is off, or under
        CURVE, which it would bypass."""
        srv = self.config.server
        if not srv.stream_socket:
            return None
        if srv.curve_secret_key:
            log.info("no stream door: the server uses CURVE, which only its ROUTER checks")
            return None
        return ("0.0.0.0" if srv.host == "*" else srv.host), srv.stream_port

    def _setup_curve(self, sock: zmq.Socket) -> None:
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        srv = self.config.server
        if not srv.curve_authorized_keys:
            raise ConfigError("server.curve_secret_key needs server.curve_authorized_keys "
                              "(a directory of client public keys)")
        try:
            public, secret = zmq.auth.load_certificate(srv.curve_secret_key)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load CURVE key {srv.curve_secret_key}: {exc}") from None
        if secret is None:
            raise ConfigError(f"{srv.curve_secret_key} holds no secret key")
        _check_authorized_keys(srv.curve_authorized_keys)
        self._auth = auth = ThreadAuthenticator(self._ctx)
        auth.start()
        auth.configure_curve(domain="*", location=srv.curve_authorized_keys)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def _register_arenas(self) -> None:
        # Only the tier arenas are registered: that is all a TE peer can reach.
        regions = [r for rs in self.store.regions().values() for r in rs]
        self.transport.register_many(regions)

    # ---------------------------------------------------------------- serving
    @property
    def wake_fd(self) -> int:
        """A non-blocking descriptor whose write wakes the serving thread's poll:
        ``kvstore-server`` hands it to ``signal.set_wakeup_fd``."""
        return self._wake_w

    def stop(self) -> None:
        """Ask the loop to exit after the request in flight (signal-safe)."""
        self._stop = True
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full (a wake is pending anyway) or closed (stopped already)
            pass

    def serve_forever(self) -> None:
        """The serving thread (the caller's): owns the ROUTER socket, receives each
        request and answers it itself, one at a time, so a request costs no hand-off
        between threads (on a machine this small, each thread woken from idle adds
        ~0.1 ms to a round trip). While it works on one, the watchdog thread answers
        what cannot wait (``_watch``)."""
        staged = self._ctx.socket(zmq.PULL)
        staged.setsockopt(zmq.LINGER, 0)
        staged.bind(self._staged_at)
        stager = threading.Thread(target=self._stage, name="kvstore-staging", daemon=True)
        watchdog = threading.Thread(target=self._watch, args=(staged,), name="kvstore-pushback",
                                    daemon=True)
        stager.start()
        watchdog.start()
        poller = self._poller(staged)
        reap_every = _reap_interval(self.config)
        next_reap = time.monotonic() + reap_every
        try:
            while not self._stop:
                with self._sock_lock:
                    if self._local is not None and self._local.changed:
                        poller = self._poller(staged)
                    ready: list = []
                    if not self._queue:
                        wait_ms = max(0, min(POLL_MS, int((next_reap - time.monotonic()) * 1000)))
                        try:
                            ready = poller.poll(wait_ms)
                        except zmq.ZMQError as exc:
                            if exc.errno != errno.EINTR:
                                raise
                        if any(sock == self._wake_r for sock, _ in ready):
                            _drain_pipe(self._wake_r)
                    self._forward(staged)
                    self._drain(listener_ready=self._local is not None
                                and self._local.polled_ready(ready))
                    item = self._queue.popleft() if self._queue else None
                    if item is not None:
                        self._working_since = time.monotonic()
                        self._working_on = item[0]
                if item is not None:
                    self._serve(*item)
                elif self._ends_due:  # bytes that went out since: their leases end
                    self._settle_slots()
                if time.monotonic() >= next_reap:
                    with self._sock_lock:  # slow work too: the watchdog pushes back
                        self._working_since = time.monotonic()
                        self._working_on = _REAPING
                    try:
                        self._reap()
                    finally:
                        with self._sock_lock:
                            self._working_since = self._working_on = None
                    next_reap = time.monotonic() + reap_every
        finally:
            self._stop = True
            with self._sock_lock:  # queued and never served: a clear answer, not silence
                while self._queue:
                    frames, _ = self._queue.popleft()
                    self._send(self._busy(frames, 0.0, "server stopping"))
            self._requests_done.set()
            with self._staging_wake:  # the staging thread waits for this or more work
                self._staging_wake.notify_all()
            while stager.is_alive() or watchdog.is_alive():  # stagings left are answered
                stager.join(POLL_MS / 1000)
                watchdog.join(POLL_MS / 1000)
                with self._sock_lock:
                    self._forward(staged)
            self._forward(staged)
            staged.close(0)

    def _serve(self, frames: list[bytes], arrived: float) -> None:
        """Answer one queued request (``busy`` if it waited too long) and send the
        reply; the socket is the watchdog's meanwhile. A commit or put answered
        first (``store.answer_first``) is sent before the store's in-memory
        book-keeping of it, which runs right after, the store's lock held from the
        request to the end of that work: nothing else sees the store in between."""
        reply: list[bytes] | None = None
        start = time.monotonic()
        if self._ends_due:  # leases ended once sent: before any later request sees them
            self._settle_slots()
        try:
            waited = start - arrived
            if waited > self._busy_after and not self._never_busy(frames):
                reply = self._busy(frames, waited, reached=True)
            else:
                self._await_sent(frames)
                after: list[Callable[[], None]] = []
                with self.store.lock:
                    reply = self._respond(frames, arrived, after.append)
                    if after:
                        if reply is not None:
                            with self._sock_lock:
                                self._send(reply)
                            reply = None
                        self._run_after(frames, after)
        finally:
            with self._sock_lock:
                self._working_since = self._working_on = None
                if reply is not None:  # None: sent, or the staging thread answers it
                    self._send(reply)
            if self._ends_due:  # (its bytes may be out already: the lease ends now)
                self._settle_slots()
            spent = time.monotonic() - start
            self._service_s += _EWMA * (spent - self._service_s)

    def _run_after(self, frames: list[bytes], after: list[Callable[[], None]]) -> None:
        """Run what a request left for after its answer (in-memory book-keeping, which
        cannot fail; a bug is logged) and time it."""
        begin = time.perf_counter()
        for work in after:
            try:
                work()
            except Exception:  # noqa: BLE001 - a bug must not take the node down
                log.exception("internal error in the book-keeping after a reply")
        if self.after_observer is not None:
            self.after_observer(p.peek_op(frames[-1], self.max_bytes),
                                time.perf_counter() - begin)

    def _watch(self, staged: zmq.Socket) -> None:
        """The watchdog: every ``WATCH_S``, if a request (or the reaper) has been at
        work that long, take the socket for a moment: queue what arrived, answer
        ``busy`` what could not start within ``busy_after_s`` (so within about two
        ``WATCH_S`` of its arrival), pass on staged replies. It never wakes the
        serving thread, and costs nothing per request. It times itself: how late its
        looks come is how early it must answer a caller about to stop waiting."""
        while not self._stop:
            asleep = time.monotonic()
            time.sleep(WATCH_S)
            woke = time.monotonic()
            gap = woke - asleep  # its sleep, and its wait for a CPU and for the GIL
            since = self._working_since
            if since is not None and woke - since >= WATCH_S:
                with self._sock_lock:  # (not counted: the serving thread may be polling)
                    if self._working_since is not None:
                        began = time.monotonic()
                        self._forward(staged)
                        self._drain()
                        self._expire_queued(self.watch_ahead_s(gap))
                        gap += time.monotonic() - began
            self._watch_gap = watch_gap(self._watch_gap, gap)

    def watch_ahead_s(self, late: float) -> float:
        """How long before its caller stops waiting a queued request is answered
        ``busy``: ``WATCH_LATE`` periods, or twice the recent peak time between the
        watchdog's wakes where that is longer (a loaded host), or twice ``late`` (how
        long the wake now looking took: the first late one of a stall)."""
        return max(WATCH_LATE * WATCH_S, 2 * max(self._watch_gap, late))

    def _poller(self, staged: zmq.Socket) -> zmq.Poller:
        """What the serving thread waits on: the ROUTER, staged replies, and the
        same-node door's listener and connections (rebuilt when those change)."""
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._sock, zmq.POLLIN)
        poller.register(staged, zmq.POLLIN)
        for sock, pending in self._local.sockets() if self._local is not None else ():
            poller.register(sock, zmq.POLLIN | (zmq.POLLOUT if pending else 0))
        return poller

    def _send(self, frames: list[bytes]) -> None:
        """A reply, to the ROUTER peer or the local connection its envelope names.
        Holds the socket (``_sock_lock``)."""
        if is_local(frames[0]):
            last = frames[-1]
            if type(last) is not _Slot:
                if self._local is not None:
                    self._local.send(frames[0], last)
                return
            slot = cast(_Slot, last)
            try:  # (the stream door's: no parts; its Sent tracks the bytes as a tracker)
                slot.tracker = None if self._local is None else \
                    self._local.send(frames[0], frames[-2], slot.data)
            finally:
                slot.handed = False
        elif type(frames[-1]) is _Slot:  # an acquire's bytes (``_inline``)
            slot = cast(_Slot, frames[-1])
            try:  # zero-copy: the slot is busy until ZeroMQ is done with the bytes
                if not slot.parts:
                    slot.tracker = self._sock.send_multipart(
                        [*frames[:-1], cast(bytes, slot.data)], copy=False, track=True)
                    return
                # The first part after the reply, each other in a message of its own,
                # all handed to ZeroMQ here, in order: nothing comes between them.
                envelope, reply = frames[:-2], frames[-2]
                data, at = memoryview(cast(bytes, slot.data)), slot.parts[0]
                trackers: list[zmq.MessageTracker] = []
                try:
                    trackers.append(self._sock.send_multipart(
                        [*envelope, reply, data[:at]], copy=False, track=True))
                    for index, nbytes in enumerate(slot.parts[1:], start=1):
                        head = p.encode_part(cast(Inline, reply).rid, index)
                        trackers.append(self._sock.send_multipart(
                            [*envelope, head, data[at:at + nbytes]], copy=False, track=True))
                        at += nbytes
                finally:  # (a send that failed half-way: what went out is still tracked)
                    if trackers:
                        slot.tracker = zmq.MessageTracker(*trackers)
            finally:
                slot.handed = False
        else:
            self._sock.send_multipart(frames)

    def _forward(self, replies: zmq.Socket) -> None:
        while True:
            try:
                self._send(replies.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return

    def _drain(self, budget: int = 256, listener_ready: bool = False) -> None:
        """Queue what arrived, answering ``busy`` at once what could not start in
        time. Holds the socket (``_sock_lock``).

        What one pass reads from several connections arrived in an order nobody
        can know any more; a release or abort that opens its connection's part of
        the pass is queued first (``_gives_back_first``): a client's one-way
        release, then another client's acquire of the same prompt, is then served
        in the order they were sent, as the ROUTER alone used to serve them."""
        batch: list[list[bytes]] = []
        for _ in range(budget):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            if is_local(frames[0]):  # a ROUTER peer may choose its routing id
                log.warning("dropped a request whose routing id poses as a local "
                            "connection's (%r)", frames[0][:40])
                continue
            batch.append(frames)
        if self._local is not None:
            streamed = self._local.stream_requests
            local = list(self._local.read(listener_ready))
            if local:
                streamed = self._local.stream_requests - streamed
                with self._counters_lock:
                    self.counters["local_requests"] += len(local) - streamed
                    self.counters["stream_requests"] += streamed
                batch += local
        for frames in self._gives_back_first(batch) if len(batch) > 1 else batch:
            self._admit(frames)

    def _gives_back_first(self, batch: list[list[bytes]]) -> list[list[bytes]]:
        """``batch`` with each connection's leading releases and aborts moved to the
        front; every connection's own requests keep their order."""
        first, rest, seen = [], [], set()
        for frames in batch:
            peer = frames[0]
            if peer not in seen and self._never_busy(frames):
                first.append(frames)
                continue
            seen.add(peer)
            rest.append(frames)
        return first + rest

    def _expire_queued(self, ahead: float) -> None:
        """Answer ``busy`` now the queued requests that have waited past
        ``busy_after_s`` behind the work in flight (one admitted while that work was
        young), or whose callers stop waiting within ``ahead`` seconds, before the
        next look or the one after (``wait_s``; ``watch_ahead_s``), rather than
        when the work ends: slow work may outlast their
        clients' timeouts. Holds the socket (``_sock_lock``); decodes the queued
        requests, which only a stall of ``WATCH_S`` or more brings about."""
        if not self._queue:
            return
        now = time.monotonic()
        kept: list[tuple[list[bytes], float]] = []
        late: list[tuple[list[bytes], float, str]] = []
        for item in self._queue:
            frames, arrived = item
            if self._never_busy(frames):
                kept.append(item)
            elif now - arrived > self._busy_after:
                late.append((frames, arrived, ""))
            elif (due := self._due(frames, arrived)) is not None \
                    and now + ahead >= due:
                # Its caller stops waiting before this watchdog looks again, or
                # before the look after, should that one come late (a woken thread
                # waits for the GIL, on a busy host for its CPU too).
                late.append((frames, arrived, self._late(now - arrived, due - arrived)))
            else:
                kept.append(item)
        if not late:
            return
        self._queue.clear()
        self._queue.extend(kept)
        for frames, arrived, why in late:
            self._send(self._busy(frames, now - arrived, why))

    def _admit(self, frames: list[bytes]) -> None:
        """Queue one arrived request, or answer it ``busy`` at once: when it would
        start after ``busy_after_s``, or after its caller stops waiting (its
        ``wait_s``)."""
        now = time.monotonic()
        working = self._working_since
        wait = (now - working if working is not None else 0.0) \
            + len(self._queue) * self._service_s
        if wait > min(WATCH_S, self._busy_after) and not self._never_busy(frames):
            if wait > self._busy_after:
                self._send(self._busy(frames, wait))
                return
            # (Slow path only: reading the request's wait_s / deadline decodes it.)
            due = self._due(frames, now)
            if due is not None and now + wait > due:
                self._send(self._busy(frames, wait, self._late(wait, due - now)))
                return
        self._queue.append((frames, now))

    def _never_busy(self, frames: list[bytes]) -> bool:
        """Releases and aborts are always served, however late: they only give back
        what the server holds (refused, a lease or reservation would stay until it
        expires), and drop_select's last release is one-way, so its sender would
        never hear a ``busy``. Read only on the slow path, when ``busy`` is due."""
        return p.peek_op(frames[-1], self.max_bytes) in NEVER_BUSY

    def _due(self, frames: list[bytes], arrived: float) -> float | None:
        """When (``time.monotonic()``) the request's caller stops waiting: ``arrived``
        plus its ``wait_s``; None for a request without one (writes: the store judges
        their ``deadline`` itself, and gives back the room or reservation a late one
        named), or one that does not decode (the serving thread answers that).
        Decodes the request: slow path only. (The serving thread does not use it:
        a request it reaches late goes to the store, which refuses a late acquire
        itself; a late lookup or hello is answered, to no one.)"""
        if p.peek_op(frames[-1], self.max_bytes) not in WAIT_OPS:
            return None  # (cheap: a write is not decoded for nothing)
        try:
            _, req = p.decode_request(frames[-1], self.max_bytes)
        except InvalidRequestError:
            return None
        wait_s = getattr(req, "wait_s", None)
        return None if wait_s is None else arrived + wait_s

    @staticmethod
    def _late(wait: float, left: float) -> str:
        return (f"the request would start after {wait:.2f} s, and its caller waits "
                f"{max(0.0, left):.2f} s")

    def _busy(self, frames: list[bytes], waited: float, why: str = "",
              reached: bool = False) -> list[bytes]:
        """The ``busy`` error reply to ``frames``; ``reached``: the serving thread
        answers it, having only now come to it (else the watchdog or a stop does)."""
        with self._counters_lock:
            self.counters["busy"] += 1
        envelope, body = frames[:-1], frames[-1]
        why = why or (f"the request would start after {waited:.1f} s "
                      f"(server.busy_after_s = {self._busy_after:g})")
        self._note_busy(why, reached)
        err = BusyError(f"server busy: {why}; retry or recompute")
        return [*envelope[:2], p.encode_error(p.peek_id(body, self.max_bytes), err)]

    def _note_busy(self, why: str, reached: bool = False) -> None:
        """Log a ``busy`` answer, at most once per ``BUSY_NOTE_S`` (with how many
        there were since): what the serving thread was at, and for how long, so an
        operator sees whether one slow request or a starved process held it up
        (``reached``: it has just come to this request, after the wait ``why`` says)."""
        now = time.monotonic()
        with self._counters_lock:
            last, since = self._busy_noted
            if now - last < BUSY_NOTE_S:
                self._busy_noted = (last, since + 1)
                return
            self._busy_noted = (now, 0)
        # (Read without _sock_lock, which most callers hold: a pair torn by the serving
        # thread's next request says the wrong op or time in this line, nothing more.)
        working, frames = self._working_since, self._working_on
        op = "reap" if frames is _REAPING else \
            "?" if frames is None else p.peek_op(frames[-1], self.max_bytes) or "?"
        at = "has only now reached it" if reached else "is idle" if working is None else \
            f"is on a {op} for {now - working:.1f} s"
        log.warning("answered busy (%s; %d more since the last note): the serving thread "
                    "%s, %d requests queued, %.1f ms per request lately, the watchdog's "
                    "wakes up to %.0f ms apart", why, since, at, len(self._queue),
                    self._service_s * 1000, self._watch_gap * 1000)

    def _respond(self, frames: list[bytes], arrived: float,
                 later: Later | None = None) -> list[bytes] | None:
        # DEALER peers send [identity, body]; a REQ peer adds an empty delimiter; a
        # local connection's requests come as [its tag, body].
        envelope, body = frames[:-1], frames[-1]
        if len(envelope) > 2 or (len(envelope) == 2 and envelope[1] != b""):
            self._count("invalid", 0.0, False)
            err = InvalidRequestError("a request is exactly one frame")
            return [*envelope[:1], p.encode_error(0, err)]

        def defer(rid: int, req: p.Acquire, staging: Staging) -> None:
            with self._staging_wake:
                self._staging.append((envelope, rid, req, staging, arrived))
                self._staging_wake.notify()

        # Bytes in the reply over the ROUTER, and the stream door (not the same-node
        # socket: its clients copy from the arena). Parts only to a DEALER (envelope:
        # its routing id alone): a REQ socket takes one message per request, and
        # would read a part as its next reply; the stream door sends them whole.
        local = bool(envelope) and is_local(envelope[0])
        door = self._local
        stream = local and door is not None and door.streams(envelope[0])
        reply = self.handle(body, defer, later, inline=not local or stream,
                            parts=len(envelope) == 1 and not local, runs=stream)
        if reply is None:
            return None
        slot = getattr(reply, "data", None)
        if slot is None:
            return [*envelope, reply]
        # The slot itself is the last frame: ``_send`` sends its bytes and tracks them.
        return [*envelope, reply, cast(bytes, slot)]

    def _stage(self) -> None:
        """The staging thread: acquires whose NVMe entries must be read, in order.
        One that waited past ``busy_after_s`` since it arrived is answered ``busy``
        (its holds and staging room given back); at stop, those not started are."""
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(self._staged_at)
        try:
            while True:
                with self._staging_wake:
                    # Until the request thread is done: it may hand over one more.
                    while not self._staging and not self._requests_done.is_set():
                        self._staging_wake.wait(POLL_MS / 1000)
                    if not self._staging:
                        return
                    envelope, rid, req, staging, arrived = self._staging.popleft()
                    stopping = self._stop
                waited = time.monotonic() - arrived
                if stopping or waited > self._busy_after:
                    with self._counters_lock:
                        self.counters["busy"] += 1
                    why = "server stopping" if stopping else \
                        f"the request would finish after {waited:.1f} s"
                    err = BusyError(f"server busy: {why} (an acquire staging "
                                    f"{staging.nbytes} NVMe bytes); retry or recompute")
                    answered: bytes | None = p.encode_error(rid, err)
                else:
                    answered = self._answer(rid, req, time.perf_counter(), lambda: self._acquired(
                        staging.finish(*staging.read())))
                try:  # a busy or failed one gives back its holds, claims and room
                    staging.abandon()
                except Exception:  # noqa: BLE001 - the thread must live on
                    log.exception("staging thread: abandoning a staging failed")
                if answered is not None:  # (finishing never hands it on again)
                    out.send_multipart([*envelope, answered])
        finally:
            out.close(0)

    def _count(self, op: str, seconds: float, ok: bool) -> None:
        with self._counters_lock:
            self.counters["requests"] += 1
            self.counters["errors"] += not ok
        if self.observer is not None:
            try:
                self.observer(op, seconds, ok)
            except Exception:  # noqa: BLE001 - metrics must not fail a request
                log.exception("observer failed for %s", op)

    def handle(self, frame: bytes,
               defer: Callable[[int, p.Acquire, Staging], None] | None = None,
               later: Later | None = None, inline: bool = False,
               parts: bool = False, runs: bool = False) -> bytes | None:
        """One request frame -> one reply frame. Never raises. With ``defer``, an
        acquire that must stage NVMe entries is handed to it instead (None: its
        reply comes from there). With ``later``, a commit or put may hand it the
        work that follows its answer (the caller runs it after sending the reply).
        With ``inline`` (the request came over the ZeroMQ port), an acquire that asks
        for its bytes in the reply may get them: the reply is then an ``Inline``,
        whose ``data`` goes out as a frame after it; with ``parts`` too (from a
        DEALER), in parts when it asks so (``Acquire.inline_part``); with ``runs``
        (the stream door), as views of the arena however the entries lie in it."""
        start = time.perf_counter()
        try:
            rid, req = p.decode_request(frame, self.max_bytes)
        except Exception as exc:  # noqa: BLE001 - never raises: a bad frame is answered
            if not isinstance(exc, KVStoreError):
                log.exception("internal error decoding a request")
                exc = KVStoreError(f"internal error decoding the request: {exc}")
            log.debug("invalid request: %s", exc)
            self._count("invalid", time.perf_counter() - start, False)
            return p.encode_error(p.peek_id(frame, self.max_bytes), exc)
        if isinstance(req, p.Release) and self._inline_slots:
            self._settle_slots()  # (``_await_sent`` gave its reply's tracker time)
        if defer is not None and isinstance(req, p.Acquire):
            def begin() -> dict | None:
                step = handlers.begin_acquire(self.store, req)
                if isinstance(step, Staging):
                    defer(rid, req, step)
                    return None
                result = self._acquired(step)
                if inline and req.inline:
                    self._inline(req.inline, step, result,
                                 req.inline_part if parts else None, runs)
                    if req.release_sent and runs and _DATA in result and not step.short:
                        # (the stream door's bytes: ``_settle_slots`` ends the lease)
                        cast(_Slot, result[_DATA]).ends = req.claim
                        self._ends_due += 1
                        result["release_sent"] = True
                return result

            return self._answer(rid, req, start, begin)
        return self._answer(rid, req, start, lambda: self._dispatch(req, later))

    def _answer(self, rid: int, req: p.Request, start: float,
                run: Callable[[], dict | None]) -> bytes | None:
        """``run()``'s result as the reply to ``req`` (None: no reply now, it was
        handed on), or the error it raised; counted, and told to ``on_result``."""
        op, ok, result = req.OP, False, {}
        slot: _Slot | None = None
        try:
            answer = run()
            if answer is None:
                return None
            result = answer
            slot = result.pop(_DATA, None)
            reply = p.encode_ok(rid, result)
            if slot is not None:
                reply = Inline(reply)
                reply.data, reply.rid, slot = slot, rid, None
            ok = True
        except KVStoreError as exc:
            log.debug("%s failed: %s", op, exc)
            reply = p.encode_error(rid, exc)
        except Exception as exc:  # noqa: BLE001 - a bug must not take the node down
            log.exception("internal error handling %s", op)
            reply = p.encode_error(rid, KVStoreError(f"internal error in {op}: {exc}"))
        if slot is not None:  # its reply failed: the slot was never handed to ZeroMQ
            slot.handed = False
        self._count(op, time.perf_counter() - start, ok)
        if ok and self.on_result is not None:
            try:
                self.on_result(req, result)
            except Exception:  # noqa: BLE001 - metrics must not fail a request
                log.exception("on_result hook failed for %s", op)
        return reply

    def _inline(self, cap: int, acq: Acquisition, result: dict,
                part: int | None = None, runs: bool = False) -> None:
        """Put ``acq``'s bytes in ``result`` (under ``_DATA``, in a ``_Slot``;
        ``"inline"``: their length) when they fit ``cap`` and this server's limit
        (over the ROUTER, ``ROUTER_INLINE_BYTES`` too: one ZeroMQ message), are
        all in DRAM, and a slot is free: at most ``INLINE_BACKLOG`` replies' bytes are
        handed to ZeroMQ and not sent yet. With ``part`` (``Acquire.inline_part``) and
        more than that many bytes, they go in parts (``"parts"``: their lengths).
        With ``runs`` (a stream door reply), views of the arena wherever the entries
        lie (``Store.dram_bytes``); copies of at most ``INLINE_COPY_MAX`` either way.
        Views beside others not sent yet only within ``INLINE_HOLD_SHARE``."""
        sizes = [e[3] for e in acq.entries]  # (EntryInfo.nbytes)
        nbytes = sum(sizes)
        limit = self._inline_max if runs else min(self._inline_max, p.ROUTER_INLINE_BYTES)
        if not sizes or nbytes > min(cap, limit):
            return
        # (The slots are the serving thread's alone: it fills, sends and settles them.)
        self._settle_slots()  # after which a slot is free exactly when it has no bytes
        slot = next((s for s in self._inline_slots if s.data is None and s.ends is None),
                    None)
        if slot is None:
            if len(self._inline_slots) >= INLINE_BACKLOG:
                return
            slot = _Slot()
            self._inline_slots.append(slot)
        holding = sum(s.nbytes for s in self._inline_slots if s.held)
        data = self.store.dram_bytes(acq.entries, runs, INLINE_COPY_MAX)
        if data is None:
            return
        if type(data) is not bytes:  # the arena itself: its entries stay until it is out
            if holding and holding + nbytes > self._hold_budget:
                return  # (others already hold their share: this one goes over TE)
            self.store.hold_send(acq.id)
        slot.take(data, acq.id, _parts(sizes, part), nbytes)
        result["inline"] = nbytes
        if slot.parts:
            result["parts"] = slot.parts
        result[_DATA] = slot
        with self._counters_lock:
            self.counters["inline_replies"] += 1
            self.counters["inline_bytes"] += nbytes
            self.counters["inline_views"] += slot.held

    def _settle_slots(self) -> None:
        """Give back the holds of inline replies whose bytes are out of ZeroMQ's hands
        (and of any that was taken and never handed to it: a bug, logged), and let go
        of the bytes of every reply that is out."""
        now = time.monotonic()
        for slot in self._inline_slots:
            if slot.data is None or not slot.done(now):
                continue
            held, slot.data = slot.held, None
            if held:
                try:
                    self.store.end_send(slot.aid)
                except Exception:  # noqa: BLE001 - a bug must not take the node down
                    log.exception("giving back an inline reply's hold failed")
            if slot.ends is not None:
                self._end_sent(slot, now)

    def _end_sent(self, slot: _Slot, now: float) -> None:
        """End the lease of ``slot``'s reply, which asked the server to
        (``Acquire.release_sent``), when every byte of it went to the kernel: as the
        reader's release would (its drop, and the read's time for the metrics: here,
        from the reply made to the last byte out). A connection that closed before
        that leaves the lease open, for the reader's release or its expiry."""
        drop, slot.ends = slot.ends, None
        self._ends_due -= 1
        if not getattr(slot.tracker, "whole", False):
            return
        try:
            freed = self.store.end_sent(slot.aid, bool(drop))
        except KVStoreError as exc:  # (expired on the way: as a late release)
            log.debug("ending acquisition %d once sent: %s", slot.aid, exc)
            return
        except Exception:  # noqa: BLE001 - a bug must not take the node down
            log.exception("ending acquisition %d once sent failed", slot.aid)
            return
        if self.on_result is not None:
            release = p.Release(aid=slot.aid, drop=bool(drop), xfer_s=now - slot.taken_at,
                                xfer_bytes=slot.nbytes)
            try:
                self.on_result(release, {"released": freed})
            except Exception:  # noqa: BLE001 - metrics must not fail a request
                log.exception("on_result hook failed for a release once sent")

    def _await_sent(self, frames: list[bytes]) -> None:
        """Before a release of an acquisition whose reply was sent from the arena
        (held), without the store's lock: wait up to ``RELEASE_WAIT_S`` for that
        reply's tracker. The peer has every byte by then, but the tracker learns so
        from pyzmq's collector thread, and the release's drop must find the entries
        unheld (``_settle_slots``) to free them at once, not at the next reap. So must
        a release that reports corrupt entries (rare), to drop the bad ones at once. A
        plain release without drop frees nothing, and is not held up: it may come
        while parts of its reply are still on their way (a take that failed early)."""
        unsent = [s for s in self._inline_slots
                  if s.held and not s.handed and s.tracker is not None and not s.tracker.done]
        if not unsent or p.peek_op(frames[-1], self.max_bytes) != "release":
            return
        try:
            _, req = p.decode_request(frames[-1], self.max_bytes)
        except Exception:  # noqa: BLE001 - handle() answers a bad frame
            return
        if not (getattr(req, "drop", False) or getattr(req, "corrupt", None)):
            return
        for slot in unsent:
            if slot.aid == getattr(req, "aid", None):
                try:
                    cast(zmq.MessageTracker, slot.tracker).wait(RELEASE_WAIT_S)
                except zmq.NotDone:
                    pass

    def _acquired(self, acq: Acquisition) -> dict:
        # Addresses are only meaningful in this segment; a client holding an
        # older hello (the server restarted) sees the change and re-hellos.
        return {**handlers.acquired(acq), "segment": self.transport.segment}

    def _dispatch(self, req: p.Request, later: Later | None = None) -> dict:
        if isinstance(req, p.Hello):
            return self.hello()
        if isinstance(req, p.Stats):
            return {"stats": self.stats()}
        if isinstance(req, p.Health):
            if req.deep:
                self.store.check_integrity()
            return {"status": "ok", "uptime_s": time.time() - self._started}
        answer_first = ANSWER_FIRST.get(req.OP)
        result = HANDLERS[req.OP](self.store, req) if answer_first is None else \
            answer_first(self.store, req, later)
        if isinstance(req, (p.Reserve, p.Acquire)) or result.get("room"):
            result["segment"] = self.transport.segment  # see _acquired
        return result

    @property
    def stream_port(self) -> int | None:
        """The stream door's port; None when it is closed."""
        return None if self._local is None else self._local.stream_port

    def hello(self) -> dict:
        path = self.store.dram_shared_path
        local = None if self._local is None else self._local.path
        # te_metadata: a client's TE engine must resolve this segment the way ours was
        # registered (P2P handshake, or the same metadata server).
        return {"version": p.VERSION, "segment": self.transport.segment, "host_id": host_id(),
                "te_metadata": self.transport.metadata,
                "dram": None if path is None else {"path": path,
                                                   "nbytes": self.capacities()["dram"]},
                "local": local,
                "stream_port": self.stream_port,
                "block_tokens": self.config.store.block_tokens,
                "max_message_bytes": self.max_bytes, "te_probe": self._te_probe(),
                "inline_max": self._inline_max, "inline_parts": True,
                "release_sent": True,
                "acquire_deadline": True, "wait_s": True, "now": time.time()}

    def _te_probe(self) -> list[int] | None:
        """[address, nbytes] of one page a TE peer may read: a client's first TE
        contact (the handshake, which has no timeout of its own) happens at hello."""
        regions = self.store.regions()
        for name in ("dram", *regions):  # host memory first: any TE peer can read it
            for region in regions.get(name, ()):
                return [region.address, min(4096, region.nbytes)]
        return None

    def capacities(self) -> dict[str, int]:
        return {name: t["capacity"] for name, t in self.store.stats()["tiers"].items()}

    def stats(self) -> dict:
        """The store's stats plus this server's request counters (metrics read this)."""
        door = self._local
        local = 0 if door is None else door.connections
        return {**self.store.stats(), **self.counters, "local_connections": local,
                "stream_connections": 0 if door is None else door.stream_connections,
                "uptime_s": time.time() - self._started}

    def _reap(self) -> None:
        self._settle_slots()
        try:
            self.store.reap()
        except Exception:  # noqa: BLE001 - reaping again next tick is the remedy
            log.exception("store.reap failed")

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        """Close store (LMDB), TE and sockets, in that order; idempotent. Only once
        ``serve_forever`` has returned: its poll watches the wake pipe closed here."""
        for slot in getattr(self, "_inline_slots", ()):
            slot.data = None  # a view of the arena goes before the arena does
        for name, closer in (("store", self.store.close), ("transport", self.transport.close)):
            try:
                closer()
            except Exception:  # noqa: BLE001 - keep closing the rest
                log.exception("closing %s failed", name)
        self._close_zmq()
        self._close_wake()

    def _close_wake(self) -> None:
        wake, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in wake:
            if fd >= 0:  # (-1: closed by an earlier close)
                os.close(fd)

    def _close_zmq(self, every_socket: bool = False) -> None:
        """Close the sockets and terminate the context, which waits for every socket
        of it to be closed. ``every_socket`` (a failed start, when no other thread of
        ours runs): also close, linger 0, any socket of the context still open, so
        that wait cannot block the start's error forever, whatever step failed."""
        sock: zmq.Socket | None = getattr(self, "_sock", None)  # unset if _bind failed
        if sock is not None:
            sock.close(0)  # a second close does nothing
        local: LocalDoor | None = getattr(self, "_local", None)
        if local is not None:
            local.close()
            self._local = None
        if self._auth is not None:
            try:
                self._auth.stop()  # its thread closes its own (ZAP) sockets
            except Exception:  # noqa: BLE001 - the context must still be terminated
                log.exception("stopping the CURVE authenticator failed")
            self._auth = None
        if every_socket:
            self._ctx.destroy(linger=0)
        else:
            self._ctx.term()


def srv_where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Inline(bytes):
    """A reply frame with the acquired bytes that follow it as the next frame (their
    first part, when they go in parts), to request ``rid``."""

    data: _Slot
    rid: int


def _parts(sizes: list[int], part: int | None) -> list[int] | None:
    """The lengths of the parts an inline reply of entries of ``sizes`` goes in: whole
    entries, each part closed once it holds ``part`` bytes or more (or a
    ``MAX_INLINE_PARTS``-th of them, when that is more); None for one part."""
    total = sum(sizes)
    if not part or total <= part:
        return None
    part = max(part, -(-total // MAX_INLINE_PARTS))
    parts, acc = [], 0
    for nbytes in sizes:
        acc += nbytes
        if acc >= part:
            parts.append(acc)
            acc = 0
    if acc:
        parts.append(acc)
    return parts if len(parts) > 1 else None


class _Slot:
    """One of the ``INLINE_BACKLOG`` inline replies a server may have handed to
    ZeroMQ and not sent yet: its bytes (``data``: a view of the DRAM arena when the
    entries lie back to back there, sent without a copy; else one copy of them; to
    the stream door, a list of views of each run of them there, copied only when
    they are sub-page entries: ``Store.dram_bytes``) and
    its acquisition (``aid``), and the lengths of the parts they go in (``parts``;
    None: one). Taken (``handed``) in ``_inline`` until ``_send`` hands the bytes to
    ZeroMQ, then busy until that send's tracker (of every part) is done. While a view
    may still be read, the store holds its entries (``held``: ``Store.hold_send``,
    given back by ``Server._settle_slots``), so they neither move nor go, nor is
    their space written, whenever the lease ends; the lease itself ends on time, so
    a peer that stops reading keeps no claim, only those entries in place (at most
    ``INLINE_BACKLOG`` replies of ``server.inline_max_bytes``). The view instead of
    a copy took ``Server._inline`` of a 2 MiB reply from 0.55 to 0.07 ms (the copy's
    source, written by a TE transfer, was in no cache)."""

    __slots__ = ("data", "aid", "parts", "handed", "tracker", "taken_at", "nbytes", "ends")

    # Handed this long and never given to ZeroMQ: taken by a reply that failed on a
    # path that did not say so (a bug); its hold goes.
    LOST_S = 60.0

    def __init__(self) -> None:
        self.data: memoryview | bytes | list[memoryview] | None = None
        self.aid = 0
        self.parts: list[int] | None = None
        self.handed = False
        self.tracker: zmq.MessageTracker | Sent | None = None
        self.taken_at = 0.0
        self.nbytes = 0  # the reply's bytes
        # Set (to its drop): the server ends the lease once the bytes are all out
        # (``Acquire.release_sent``); None: the reader releases it.
        self.ends: bool | None = None

    @property
    def held(self) -> bool:
        """Whether its bytes are a view of the arena (whose entries the store holds)."""
        return self.data is not None and type(self.data) is not bytes

    def take(self, data: memoryview | bytes | list[memoryview], aid: int,
             parts: list[int] | None = None, nbytes: int = 0) -> None:
        self.data, self.aid, self.parts, self.tracker = data, aid, parts, None
        self.nbytes = nbytes
        self.handed, self.taken_at = True, time.monotonic()

    def done(self, now: float) -> bool:
        """Whether ZeroMQ is done with the bytes (or they were never handed to it)."""
        if self.handed:
            if now - self.taken_at < self.LOST_S:
                return False
            log.error("an inline reply was never sent; giving back its slot")
            self.handed = False
        return self.tracker is None or self.tracker.done


def _check_authorized_keys(directory: str) -> None:
    """``ConfigError`` unless ``directory`` holds client public keys (``NAME.key``) that
    all load. pyzmq's authenticator only logs a directory it cannot use, and then
    refuses every client: such a server would run, and no client could ever get in."""
    import zmq.auth

    what = f"server.curve_authorized_keys {directory}"
    if not os.path.isdir(directory):
        reason = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise ConfigError(f"{what} {reason}: no client could connect (it must be a "
                          f"directory of client public keys, NAME.key from `kvstore keys`)")
    try:
        os.listdir(directory)  # (glob, in pyzmq, reads an unreadable directory as empty)
        keys = zmq.auth.load_certificates(directory)
    except OSError as exc:  # unreadable: the directory, or one of its NAME.key files
        raise ConfigError(f"cannot read the client keys in {what}: "
                          f"{exc.strerror or exc}: {exc.filename or directory}") from None
    except ValueError as exc:  # a NAME.key without a public key: pyzmq drops them all
        raise ConfigError(f"{what}: {exc}; no client could connect") from None
    if not keys:
        raise ConfigError(f"{what} holds no client public keys (NAME.key): no client could "
                          f"connect; copy each client's NAME.key from `kvstore keys` into it")


def watch_gap(peak: float, gap: float) -> float:
    """The watchdog's recent peak time between wakes after one of ``gap`` seconds:
    the larger of ``gap`` and ``peak`` decayed by half every ``WATCH_MEMORY_S``."""
    return max(gap, peak * 0.5 ** (gap / WATCH_MEMORY_S))


def _reap_interval(config: KVStoreConfig) -> float:
    shortest = min(config.store.reservation_lease_s, config.store.read_lease_s)
    return min(1.0, max(0.05, shortest / 4))


def tune_gc(young: int) -> None:
    """Tune this process's garbage collector for serving (``server.gc_young``; 0: leave
    Python's settings). With Python's young-generation threshold (700 container
    objects) a put of 2 048 entries, which makes ~7 000 that live until its end (an
    acquire ~2 000 more), set off ~20 collections a put / acquire / release round,
    each scanning the young records, one in eight rounds the whole heap (~10 ms):
    3.5 ms of such a round's ~25 ms of store work (docs/benchmarks.md, "The garbage
    collector"). With ``young`` well above what one request makes, they die before a
    collection sees them; ``gc.freeze`` first takes
    everything start-up made (modules, the store, records recovered from the index)
    out of every later collection. Records are flat tuples: Python stops tracking
    them at their first collection, so a store's size does not grow what a
    collection scans. Cycles are rare here (a traceback); they wait for a
    collection, which comes after ``young`` more objects at most."""
    if young <= 0:
        return
    gc.collect()  # start-up's garbage is freed, not frozen for good
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young, older, oldest)


def _drain_pipe(fd: int) -> None:
    """Read what a non-blocking pipe holds, so that it wakes a poll only once."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
