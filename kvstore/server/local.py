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

Who may connect: only processes of the server's own user (or root), checked on
every accepted connection (``SO_PEERCRED``); the socket file is created 0600 too.
Those are the processes that can open the arena file and read the server's CURVE
key anyway, so this door bypasses CURVE without widening who can talk to the
server. Anyone else is refused at accept and logged.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
from collections.abc import Iterator

from kvstore.core import protocol as p
from kvstore.core.errors import InvalidRequestError

log = logging.getLogger(__name__)

# The envelope of a request read from a local connection. libzmq's own routing ids
# are 5 bytes and a peer may not choose one that starts with a zero byte, so no
# ROUTER envelope can look like this.
LOCAL_TAG = b"\x00kvstore-local:"
_HEADER = struct.Struct("<I")
_READ_BYTES = 1 << 20  # one non-blocking read
_SEND_TIMEOUT_S = 1.0  # a peer that stops reading its replies loses its connection


def socket_path(arena_path: str) -> str:
    """Where the door of the server whose arena is ``arena_path`` listens."""
    return f"{arena_path}.sock"


class _Conn:
    __slots__ = ("sock", "buf", "peer")

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.peer = peer  # the client's pid, for logs


class LocalDoor:
    """The listening socket and its connections. Not thread-safe: the server uses
    it under its socket lock (the serving thread, or the watchdog while it works)."""

    def __init__(self, path: str, max_frame: int) -> None:
        self.path = path
        self.max_frame = max_frame
        self._ids = itertools.count(1)
        self._conns: dict[int, _Conn] = {}
        self.changed = True  # the set of sockets to poll changed since fds() was read
        if os.path.exists(path):
            # The name carries this process's pid (setup.dram_shared_path): an old one
            # was left by a dead process that had the same pid.
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(path)
        except OSError:
            listener.close()
            raise
        finally:
            os.umask(old)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._uid = os.getuid()

    def sockets(self) -> list[socket.socket]:
        """What the serving thread polls: the listener and every connection."""
        self.changed = False
        return [self._listener, *(c.sock for c in self._conns.values())]

    @property
    def connections(self) -> int:
        return len(self._conns)

    def read(self) -> Iterator[list[bytes]]:
        """Accept what is waiting, then every whole frame that arrived, each as
        ``[envelope, body]``; never blocks."""
        self._accept()
        for cid, conn in list(self._conns.items()):
            closed = False
            while True:
                try:
                    chunk = conn.sock.recv(_READ_BYTES, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    log.debug("local connection %s (pid %s) failed: %s", cid, conn.peer, exc)
                    closed = True
                    break
                if not chunk:
                    closed = True
                    break
                conn.buf += chunk
                if len(chunk) < _READ_BYTES:
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
                self.send(envelope, p.encode_error(0, InvalidRequestError(
                    f"frame of {n} bytes exceeds the server's limit of {self.max_frame}")))
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
        """The reply ``body`` to the connection ``envelope`` names; dropped (logged)
        if it is gone or its peer does not read."""
        conn = self._conns.get(int(envelope[len(LOCAL_TAG):]))
        if conn is None:
            log.debug("reply to a closed local connection dropped")
            return
        try:
            conn.sock.sendall(_HEADER.pack(len(body)) + body)
        except OSError as exc:  # a timeout (SO_SNDTIMEO) included
            log.warning("local connection (pid %s) does not take its reply (%s): closing it",
                        conn.peer, exc)
            self._drop(int(envelope[len(LOCAL_TAG):]))

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, say: the peer hears a reset
                log.warning("accepting a local connection failed: %s", exc)
                return
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            if uid not in (self._uid, 0):
                log.warning("local connection from pid %d refused: user %d is neither "
                            "this server's (%d) nor root", pid, uid, self._uid)
                sock.close()
                continue
            sock.setblocking(True)  # sends wait, at most _SEND_TIMEOUT_S
            sec = int(_SEND_TIMEOUT_S)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", sec, int((_SEND_TIMEOUT_S - sec) * 1e6)))
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
