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
connection whose backlog passes ``_BACKLOG_CAP`` or that takes nothing for
``_STUCK_S`` is closed. Reads take at most ``_READ_CAP`` per connection per pass.

Who may connect: only processes of the server's own user (or root), checked on
every accepted connection (``SO_PEERCRED``); others get one ``auth`` error frame
and are closed. The socket file is 0600 too. Those are the processes that can open
the arena file and read the server's CURVE key anyway, so this door bypasses CURVE
without widening who can talk to the server.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import time
from collections.abc import Iterator

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


def socket_path(arena_path: str) -> str:
    """Where the door of the server whose arena is ``arena_path`` listens."""
    return f"{arena_path}.sock"


def is_local(envelope: bytes) -> bool:
    return envelope.startswith(LOCAL_TAG)


class _Conn:
    __slots__ = ("sock", "buf", "out", "peer", "stuck_since", "polled_out")

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock = sock
        self.buf = bytearray()  # read, not yet a whole frame
        self.out = bytearray()  # replies the peer has not taken yet
        self.peer = peer  # the client's pid, for logs
        self.stuck_since = 0.0  # when ``out`` last stopped moving
        self.polled_out = False  # the serving thread polls it for POLLOUT


class LocalDoor:
    """The listening socket and its connections. Not thread-safe: the server uses
    it under its socket lock (the serving thread, or the watchdog while it works)."""

    def __init__(self, path: str, max_frame: int) -> None:
        self.path = path
        self.max_frame = max_frame
        self._ids = itertools.count(1)
        self._conns: dict[int, _Conn] = {}
        self._scratch = bytearray(_READ_BYTES)
        self._accept_paused_until = 0.0
        self._accepted_at = 0.0  # when accept() was last tried
        self.changed = True  # the set of sockets to poll changed since sockets() was read
        if os.path.exists(path):
            # The name carries this process's pid (setup.dram_shared_path): an old one
            # was left by a dead process that had the same pid.
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            os.chmod(path, 0o600)  # (the peer check at accept is the gate)
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener = listener
        self._uid = os.getuid()
        self.admitted = {self._uid, 0}  # users whose processes may connect

    def sockets(self) -> list[tuple[socket.socket, bool]]:
        """What the serving thread polls: (socket, also for POLLOUT) for the listener
        (unless paused) and every connection."""
        self.changed = False
        for conn in self._conns.values():
            conn.polled_out = bool(conn.out)
        out = [] if self._accept_paused_until else [(self._listener, False)]
        return out + [(c.sock, c.polled_out) for c in self._conns.values()]

    @property
    def connections(self) -> int:
        return len(self._conns)

    def polled_ready(self, ready: list) -> bool:
        """Whether the listener is among the sockets a poll found ready."""
        return any(sock is self._listener for sock, _ in ready)

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
                    log.debug("local connection %s (pid %s) failed: %s", cid, conn.peer, exc)
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
                log.warning("local connection %s (pid %s) sent a %d-byte frame, over the "
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
            yield [envelope, bytes(buf[start:start + n])]
            at = start + n
        del buf[:at]

    def send(self, envelope: bytes, body: bytes) -> None:
        """The reply ``body`` to the connection ``envelope`` names, without waiting:
        what the socket does not take now is kept and sent as its peer reads.
        Dropped (logged) if the connection is gone or its backlog is over the cap."""
        try:
            cid = int(envelope[len(LOCAL_TAG):])
        except ValueError:
            log.warning("reply to an unroutable local envelope %r dropped", envelope[:40])
            return
        conn = self._conns.get(cid)
        if conn is None:
            log.debug("reply to a closed local connection dropped")
            return
        if len(conn.out) + len(body) > _BACKLOG_CAP:
            log.warning("local connection %s (pid %s) has %d bytes of replies unread: "
                        "closing it", cid, conn.peer, len(conn.out))
            self._drop(cid)
            return
        waiting = bool(conn.out)
        conn.out += _HEADER.pack(len(body))
        conn.out += body
        if not waiting:
            conn.stuck_since = time.monotonic()
            self._push(cid, conn)

    def _flush(self) -> None:
        for cid, conn in list(self._conns.items()):
            if conn.out:
                self._push(cid, conn)

    def _push(self, cid: int, conn: _Conn) -> None:
        """Send what ``conn`` can take now of its pending replies."""
        try:
            sent = conn.sock.send(conn.out, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            log.debug("local connection %s (pid %s) gone while replying: %s",
                      cid, conn.peer, exc)
            self._drop(cid)
            return
        now = time.monotonic()
        if sent:
            del conn.out[:sent]
            conn.stuck_since = now
        elif now - conn.stuck_since > _STUCK_S:
            log.warning("local connection %s (pid %s) took none of its %d bytes of replies "
                        "for %.0f s: closing it", cid, conn.peer, len(conn.out), _STUCK_S)
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
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, say: try again in a while
                log.warning("accepting a local connection failed: %s; not accepting for "
                            "%.0f s", exc, _ACCEPT_PAUSE_S)
                self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S
                self.changed = True
                return
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
            self._conns[next(self._ids)] = _Conn(sock, pid)
            self.changed = True

    def _drop(self, cid: int) -> None:
        conn = self._conns.pop(cid, None)
        if conn is not None:
            conn.sock.close()
            self.changed = True

    def close(self) -> None:
        for cid in list(self._conns):
            self._drop(cid)
        self._listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
