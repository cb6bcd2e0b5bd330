"""The same-node control door: a Unix stream socket beside the shared DRAM arena.

A request over the ROUTER wakes four threads on its way (libzmq's I/O thread on
each side, the serving thread, the caller); a Unix socket wakes the serving thread
and the caller only. A health round trip after 10 ms idle: 0.87 - 0.89 ms over the
ROUTER, 0.53 - 0.55 ms here (``python -m tools.bench.rtt``; docs/benchmarks.md, "The
same-node door"). A client on the server's node, the one that already writes into
the shared arena, sends its requests here instead.

Frames are the ROUTER's request and reply frames, each behind a 4-byte
little-endian length. The serving thread polls the listening socket and every
connection with the ROUTER and reads them without blocking; what it reads joins
the same queue, is answered by the same code (busy included) and goes back on the
connection it came from. A frame longer than the server's hard cap gets an error
reply and the connection is closed: the stream cannot be resynchronised.

Replies never block the serving thread: each is sent without waiting, and what
the socket does not take at once waits in the connection's own buffer, sent as the
peer reads (the serving thread then polls that connection for POLLOUT too). A
connection whose backlog passes ``_BACKLOG_CAP`` (its frames and copies: views of
the arena cost no memory; they pin entries, which the server bounds with its inline
slots and their share of the DRAM tier) or that takes nothing for ``_STUCK_S`` is
closed. Reads take at most ``_READ_CAP`` per connection per pass.

Who may connect: only processes of the server's own user (or root), checked on
every accepted connection (``SO_PEERCRED``); others get one ``auth`` error frame
and are closed. The socket file is 0600 too. Those are the processes that can open
the arena file and read the server's CURVE key anyway, so this door bypasses CURVE
without widening who can talk to the server.

The stream door: the same frames over TCP, for clients on other nodes
(``server.stream_port``), opened only by a server without CURVE, whose ROUTER
admits anyone who can reach it anyway. Over it an acquire's bytes come right after
its reply (``send``'s ``data``: the reply says how many, ``inline``), sent from the
arena without a copy, and the client receives them straight into their
destination. Against the ROUTER, a small drop_select between two network
namespaces spares two I/O threads' wake-ups each way, the client's copy of each
part out of ZeroMQ's messages, and pyzmq's thread that frees zero-copy messages
(docs/benchmarks.md, "The stream door").
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator

from kvstore.core import protocol as p
from kvstore.core.errors import AuthError, InvalidRequestError

log = logging.getLogger(__name__)

# The envelope of a request read from a local connection. The ROUTER's peers may
# set their own routing id, this one included: Server._drain drops any ROUTER
# message whose envelope starts so (``is_local``), and ``send`` parses the id it
# finds behind the tag and drops what it cannot route.
LOCAL_TAG = b"\x00kvstore-local:"
_HEADER = struct.Struct("<I")
_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_READ_BYTES = 256 << 10  # one non-blocking read
_READ_CAP = 4 << 20  # bytes read from one connection per pass: no peer holds the thread
_BACKLOG_CAP = 256 << 20  # replies a peer has not read yet, at most
_STUCK_S = 10.0  # a peer that takes none of its pending replies this long is dropped
_ACCEPT_PAUSE_S = 1.0  # after a failed accept (out of fds): stop polling the listener
# accept() is tried when the serving thread's poll saw the listener ready, else at
# most this often (a serving thread that never polls under load still takes new
# connections): not once per request.
_ACCEPT_EVERY_S = 0.01
_SEND_BUFFERS = 64  # buffers of a connection's backlog given to one sendmsg


def socket_path(arena_path: str) -> str:
    """Where the door of the server whose arena is ``arena_path`` listens."""
    return f"{arena_path}.sock"


def is_local(envelope: bytes) -> bool:
    return envelope.startswith(LOCAL_TAG)


class Sent:
    """Whether the bytes ``LocalDoor.send`` took as ``data`` are out of its hands:
    all handed to the kernel, or the connection closed (``done``), and which of the
    two (``whole``: every byte went to the kernel, the reply frame before them too,
    and the peer had not closed its side by then).
    It has ``zmq.MessageTracker``'s ``done`` and ``wait``; nothing but the serving
    thread moves a door's bytes, so ``wait`` cannot make them go and returns at once."""

    __slots__ = ("done", "whole")

    def __init__(self) -> None:
        self.done = False
        self.whole = False

    def wait(self, timeout: float | None = None) -> None:
        return None


class _Conn:
    __slots__ = ("sock", "buf", "out", "queued", "done", "sent", "views", "peer",
                 "stuck_since", "polled_out", "stream")

    def __init__(self, sock: socket.socket, peer: int | str, stream: bool = False) -> None:
        self.sock = sock
        self.buf = bytearray()  # read, not yet a whole frame
        # Replies the peer has not taken yet, in order: frames (bytes) and an
        # acquire's bytes (views of the arena, not copied).
        self.out: collections.deque[memoryview] = collections.deque()
        self.queued = 0  # bytes ever put in ``out`` (frames with their headers)
        self.done = 0  # bytes ever sent from it
        # (``queued`` just after a view's last byte, its Sent), in order
        self.sent: collections.deque[tuple[int, Sent]] = collections.deque()
        # (first, last + 1) positions of each reply's views of the arena, in order
        self.views: collections.deque[tuple[int, int]] = collections.deque()
        self.peer = peer  # the client's pid (Unix) or address (TCP), for logs
        self.stuck_since = 0.0  # when ``out`` last stopped moving
        self.polled_out = False  # the serving thread polls it for POLLOUT
        self.stream = stream  # over TCP: an acquire's bytes may follow its reply

    def close(self) -> None:
        self.sock.close()
        self.out.clear()
        self.views.clear()
        while self.sent:  # the views are let go: their entries may go
            self.sent.popleft()[1].done = True


class LocalDoor:
    """The listening sockets and their connections: the same-node Unix socket at
    ``path`` and the stream door on TCP ``stream`` ((host, port)), either or both.
    Not thread-safe: the server uses it under its socket lock (the serving thread,
    or the watchdog while it works)."""

    def __init__(self, path: str | None, max_frame: int,
                 stream: tuple[str, int] | None = None) -> None:
        """Listens on each of ``path`` and ``stream`` given; one that cannot listen is
        logged and left out (``path`` None, ``stream_port`` None: its clients use the
        ROUTER), and ``listening`` says whether any does."""
        self.max_frame = max_frame
        self._ids = itertools.count(1)
        self._conns: dict[int, _Conn] = {}
        self._scratch = bytearray(_READ_BYTES)
        self._accept_paused_until = 0.0
        self._accepted_at = 0.0  # when accept() was last tried
        self.changed = True  # the set of sockets to poll changed since sockets() was read
        self._listeners: list[socket.socket] = []
        self.path: str | None = None
        self.stream_port: int | None = None  # the stream door's, once it listens
        self.stream_requests = 0  # read from stream door connections, ever
        if path is not None:
            try:
                self._listeners.append(_unix_listener(path))
                self.path = path
            except OSError as exc:
                log.warning("no same-node socket at %s (%s): local clients use the ROUTER",
                            path, exc)
        self.stream_error: str | None = None  # why the stream door does not listen
        if stream is not None:
            try:
                listener = _tcp_listener(*stream)
            except OSError as exc:
                self.stream_error = exc.strerror or str(exc)
                log.warning("no stream door on %s (%s): clients on other nodes use the "
                            "ROUTER (server.stream_port; server.stream_socket = false turns "
                            "it off)", _where(*stream), self.stream_error)
            else:
                self._listeners.append(listener)
                self.stream_port = listener.getsockname()[1]
        self._uid = os.getuid()
        self.admitted = {self._uid, 0}  # users whose processes may connect

    def sockets(self) -> list[tuple[socket.socket, bool]]:
        """What the serving thread polls: (socket, also for POLLOUT) for the listeners
        (unless paused) and every connection."""
        self.changed = False
        for conn in self._conns.values():
            conn.polled_out = bool(conn.out)
        out = [] if self._accept_paused_until else [(s, False) for s in self._listeners]
        return out + [(c.sock, c.polled_out) for c in self._conns.values()]

    @property
    def listening(self) -> bool:
        return bool(self._listeners)

    @property
    def connections(self) -> int:
        """Connections on the same-node socket."""
        return sum(1 for c in self._conns.values() if not c.stream)

    @property
    def stream_connections(self) -> int:
        """Connections on the stream door."""
        return sum(1 for c in self._conns.values() if c.stream)

    def streams(self, envelope: bytes) -> bool:
        """Whether ``envelope`` names a stream door connection (an acquire's bytes
        may follow its reply there)."""
        conn = self._conns.get(_cid(envelope))
        return conn is not None and conn.stream

    def polled_ready(self, ready: list) -> bool:
        """Whether a listener is among the sockets a poll found ready."""
        return any(sock in self._listeners for sock, _ in ready)

    def read(self, listener_ready: bool = False) -> Iterator[list[bytes]]:
        """Send what replies wait, accept what is waiting (when ``listener_ready``,
        or ``_ACCEPT_EVERY_S`` after the last try), then every whole frame that
        arrived, each as ``[envelope, body]``; never blocks."""
        self._flush()
        now = time.monotonic()
        if self._accept_paused_until:
            if now >= self._accept_paused_until:
                self._accept_paused_until = 0.0
                self.changed = True  # poll the listener again
        elif listener_ready or now - self._accepted_at >= _ACCEPT_EVERY_S:
            self._accepted_at = now
            self._accept()
        view = memoryview(self._scratch)
        for cid, conn in list(self._conns.items()):
            closed, got = False, 0
            while got < _READ_CAP:
                try:
                    n = conn.sock.recv_into(view, _READ_BYTES, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    log.debug("local connection %s (%s) failed: %s", cid, conn.peer, exc)
                    closed = True
                    break
                if not n:
                    closed = True
                    break
                conn.buf += view[:n]
                got += n
                if n < _READ_BYTES:
                    break
            yield from self._frames(cid, conn)
            if closed:
                self._drop(cid)

    def _frames(self, cid: int, conn: _Conn) -> Iterator[list[bytes]]:
        envelope = LOCAL_TAG + str(cid).encode()
        buf, at = conn.buf, 0
        while len(buf) - at >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf, at)
            if n > self.max_frame:
                log.warning("local connection %s (%s) sent a %d-byte frame, over the "
                            "cap of %d: closing it", cid, conn.peer, n, self.max_frame)
                self._last_words(conn, p.encode_error(0, InvalidRequestError(
                    f"frame of {n} bytes exceeds the server's limit of {self.max_frame}; "
                    "connection closed")))
                del buf[:]
                self._drop(cid)
                return
            if len(buf) - at - _HEADER.size < n:
                break
            start = at + _HEADER.size
            self.stream_requests += conn.stream
            yield [envelope, bytes(buf[start:start + n])]
            at = start + n
        del buf[:at]

    def send(self, envelope: bytes, body: bytes,
             data: memoryview | bytes | list[memoryview] | None = None) -> Sent | None:
        """The reply ``body`` to the connection ``envelope`` names, without waiting:
        what the socket does not take now is kept and sent as its peer reads.
        Dropped (logged) if the connection is gone or its backlog is over the cap.
        ``data`` (a stream door connection's only): an acquire's bytes (or a list of
        views of them, in order), sent right after the reply, not copied; the
        ``Sent`` says when the door is done with them (None: dropped, never taken)."""
        cid = _cid(envelope)
        conn = self._conns.get(cid)
        if conn is None:
            log.debug("reply to a closed or unroutable local connection %r dropped",
                      envelope[:40])
            return None
        views: list[memoryview | bytes] = [] if data is None else \
            list(data) if isinstance(data, list) else [data]
        frame = memoryview(_HEADER.pack(len(body)) + body)
        size = len(frame) + sum(map(len, views))
        # What the server keeps in memory for the peer: its frames and any copy. Views
        # of the arena cost none (and are bounded by the server's inline slots).
        owned = len(frame) + sum(len(v) for v in views if type(v) is bytes)
        if conn.queued - conn.done - _viewing(conn) + owned > _BACKLOG_CAP:
            log.warning("local connection %s (%s) has %d bytes of replies unread: "
                        "closing it", cid, conn.peer, conn.queued - conn.done)
            self._drop(cid)
            return None
        if data is not None and not conn.stream:
            raise AssertionError("an acquire's bytes go over the stream door only")
        waiting = bool(conn.out)
        conn.out.append(frame)
        start = conn.queued + len(frame)
        conn.queued += size
        sent = None
        if data is not None:
            sent = Sent()
            pieces = [memoryview(v).cast("B") for v in views if len(v)]
            if pieces:
                conn.out.extend(pieces)
                conn.sent.append((conn.queued, sent))
                if type(data) is not bytes:
                    conn.views.append((start, conn.queued))
            else:
                sent.done = True  # (nothing to send: never ``whole``)
        if not waiting:
            conn.stuck_since = time.monotonic()
            self._push(cid, conn)
        return sent

    def _flush(self) -> None:
        for cid, conn in list(self._conns.items()):
            if conn.out:
                self._push(cid, conn)

    def _push(self, cid: int, conn: _Conn) -> None:
        """Send what ``conn`` can take now of its pending replies."""
        try:
            sent = conn.sock.sendmsg(list(itertools.islice(conn.out, _SEND_BUFFERS)), (),
                                     socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            log.debug("local connection %s (%s) gone while replying: %s",
                      cid, conn.peer, exc)
            self._drop(cid)
            return
        now = time.monotonic()
        if sent:
            _consume(conn, sent)
            conn.stuck_since = now
        elif now - conn.stuck_since > _STUCK_S:
            log.warning("local connection %s (%s) took none of its %d bytes of replies "
                        "for %.0f s: closing it", cid, conn.peer, conn.queued - conn.done,
                        _STUCK_S)
            self._drop(cid)
            return
        if bool(conn.out) != conn.polled_out:
            self.changed = True  # poll it for POLLOUT, or no more

    def _last_words(self, conn: _Conn, body: bytes) -> None:
        """One frame sent to a connection about to close, if it takes it now."""
        try:
            conn.sock.send(_HEADER.pack(len(body)) + body, socket.MSG_DONTWAIT)
        except OSError:
            pass

    def _accept(self) -> None:
        for listener in self._listeners:
            if not self._accept_from(listener):
                return

    def _accept_from(self, listener: socket.socket) -> bool:
        """Take every connection waiting on ``listener``; False after a failed accept
        (accepting paused)."""
        while True:
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:  # out of fds, say: try again in a while
                log.warning("accepting a local connection failed: %s; not accepting for "
                            "%.0f s", exc, _ACCEPT_PAUSE_S)
                self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S
                self.changed = True
                return False
            if listener.family != socket.AF_UNIX:  # the stream door: no CURVE here
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
                peer = f"{address[0]}:{address[1]}"
                self._conns[next(self._ids)] = _Conn(sock, peer, stream=True)
                self.changed = True
                continue
            pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       _CRED.size))
            if uid not in self.admitted:
                log.warning("local connection from pid %d refused: user %d is neither "
                            "this server's (%d) nor root", pid, uid, self._uid)
                conn = _Conn(sock, pid)
                self._last_words(conn, p.encode_error(0, AuthError(
                    f"{self.path} admits only user {self._uid} and root, not user {uid}; "
                    "use the server's TCP port")))
                sock.close()
                continue
            self._conns[next(self._ids)] = _Conn(sock, f"pid {pid}")
            self.changed = True

    def _drop(self, cid: int) -> None:
        conn = self._conns.pop(cid, None)
        if conn is not None:
            conn.close()
            self.changed = True

    def close(self) -> None:
        for cid in list(self._conns):
            self._drop(cid)
        for listener in self._listeners:
            listener.close()
        if self.path is not None:
            _unlink(self.path)


def _cid(envelope: bytes) -> int:
    """The connection id a local envelope names (0, which none has, if none)."""
    try:
        return int(envelope[len(LOCAL_TAG):]) if is_local(envelope) else 0
    except ValueError:
        return 0


def _consume(conn: _Conn, nbytes: int) -> None:
    """``nbytes`` of ``conn.out`` went to the kernel: drop them, and mark done each
    view whose last byte went."""
    conn.done += nbytes
    out = conn.out
    while nbytes:
        head = out[0]
        if nbytes >= len(head):
            nbytes -= len(head)
            out.popleft()
        else:
            out[0] = head[nbytes:]
            nbytes = 0
    while conn.sent and conn.sent[0][0] <= conn.done:
        sent = conn.sent.popleft()[1]
        sent.done = True
        # A peer that closed (FIN, nothing left unread) still takes writes: its
        # socket sits in CLOSE_WAIT. Whole only if it has not said it is gone.
        sent.whole = _peer_open(conn.sock)
    while conn.views and conn.views[0][1] <= conn.done:
        conn.views.popleft()


def _peer_open(sock: socket.socket) -> bool:
    """Whether the peer has not closed its side (no EOF waiting): a peek, no read."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except (BlockingIOError, InterruptedError):
        return True  # nothing to read: open
    except OSError:
        return False


def _viewing(conn: _Conn) -> int:
    """Bytes of views of the arena in ``conn``'s backlog, not sent yet."""
    return sum(end - max(start, conn.done) for start, end in conn.views)


def _unix_listener(path: str) -> socket.socket:
    if os.path.exists(path):
        # The name carries this process's pid (setup.dram_shared_path): an old one
        # was left by a dead process that had the same pid.
        os.unlink(path)

    def bind(listener: socket.socket) -> None:
        listener.bind(path)
        os.chmod(path, 0o600)  # (the peer check at accept is the gate)

    return _listening(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), bind)


def _tcp_listener(host: str, port: int) -> socket.socket:
    def bind(listener: socket.socket) -> None:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), port))

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return _listening(socket.socket(family, socket.SOCK_STREAM), bind)


def _listening(listener: socket.socket, bind: Callable[[socket.socket], None]
               ) -> socket.socket:
    """``listener`` bound by ``bind``, listening and non-blocking; closed if a step
    fails."""
    try:
        bind(listener)
        listener.listen(64)
    except OSError:
        listener.close()
        raise
    listener.setblocking(False)
    return listener


def _where(host: str, port: int) -> str:
    return f"{host} port {port}" if port else f"{host} (any free port)"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
