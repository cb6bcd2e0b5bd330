"""The client's same-node control path: the server's Unix socket (kvstore/server/local.py).

``LocalChannel`` speaks the ROUTER's frames, each behind a 4-byte little-endian
length, with ``Channel``'s contract: ``call`` waits for the reply with the same id
(stale replies to one-way sends are dropped, a failed one logged), ``send`` does
not wait, every wait is bounded. After a timeout or a broken connection it is
closed for good: ``Control`` then goes back to the ROUTER and the client's next
hello opens a new one.

``Control`` is what ``KVStoreClient`` talks through: the ROUTER ``Channel`` until a
hello names a local socket this process can use, then that socket for everything,
so one client's requests (a one-way release, then an acquire) keep their order.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from typing import Any

from kvstore.client.rpc import REPLY_CAP, Channel, Requests
from kvstore.core import protocol as p
from kvstore.core.errors import KVStoreError, KVTimeoutError, PeerUnavailableError

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")


class NotSent(PeerUnavailableError):
    """The request never left: the connection was closed, or its server is gone
    (a send to a Unix socket whose peer closed fails at once). Safe to send again
    another way."""


class LocalChannel(Requests):
    """Request/reply over one Unix stream socket. Thread-safe (one call at a time)."""

    def __init__(self, path: str, timeout_s: float, max_bytes: int) -> None:
        super().__init__(path, timeout_s, max_bytes)
        self.path = path
        self._buf = bytearray()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(min(timeout_s, 2.0))
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise PeerUnavailableError(f"cannot connect to {path}: {exc}") from None
        self._sock: socket.socket | None = sock

    @property
    def open(self) -> bool:
        return self._sock is not None

    def _exchange(self, req: p.Request, timeout_s: float | None,
                  wait_reply: bool) -> dict[str, Any] | None:
        frame_id, frame = self._frame(req)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            sock = self._sock
            if sock is None:
                raise NotSent(f"local connection {self.path} is closed")
            deadline = time.monotonic() + timeout
            try:
                sock.settimeout(timeout)
                sock.sendall(_HEADER.pack(len(frame)) + frame)
            except (BrokenPipeError, ConnectionResetError) as exc:
                self._close()  # the server that had this socket is gone
                raise NotSent(f"local connection {self.path} is gone: {exc}") from None
            except OSError as exc:  # a timeout: part of the frame may have left
                self._close()
                raise PeerUnavailableError(f"local connection {self.path} failed sending "
                                           f"{req.OP}: {exc}") from None
            if not wait_reply:
                self._sent_one_way(frame_id, req.OP)
                return None
            try:
                while True:
                    rid, result = p.decode_reply(self._read_frame(sock, deadline, req.OP),
                                                 REPLY_CAP)
                    if self._is_reply(rid, result, frame_id):
                        return result
            except (KVTimeoutError, PeerUnavailableError):
                self._close()
                raise
            except OSError as exc:  # the server went away
                self._close()
                raise PeerUnavailableError(f"local connection {self.path} failed during "
                                           f"{req.OP}: {exc}") from None

    def _read_frame(self, sock: socket.socket, deadline: float, op: str) -> bytes:
        need = _HEADER.size
        while True:
            if len(self._buf) >= need:
                if need == _HEADER.size:
                    (n,) = _HEADER.unpack_from(self._buf)
                    if n > REPLY_CAP:
                        raise PeerUnavailableError(f"{self.path} sent a {n}-byte reply")
                    need = _HEADER.size + n
                    continue
                frame = bytes(self._buf[_HEADER.size:need])
                del self._buf[:need]
                return frame
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTimeoutError(f"no reply from {self.path} to {op} within the timeout")
            sock.settimeout(left)
            try:
                chunk = sock.recv(max(1 << 16, need - len(self._buf)))
            except TimeoutError:
                raise KVTimeoutError(f"no reply from {self.path} to {op} within the "
                                     "timeout") from None
            if not chunk:
                raise PeerUnavailableError(f"server closed the local connection {self.path}")
            self._buf += chunk

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()


class Control:
    """The client's control path: ``rpc`` (the ROUTER), or the server's local socket
    once ``use_local`` opened it. ``call`` / ``send`` as ``Channel``'s."""

    def __init__(self, rpc: Channel) -> None:
        self.rpc = rpc
        self._local: LocalChannel | None = None

    @property
    def max_bytes(self) -> int:
        return self.rpc.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self.rpc.max_bytes = value
        if self._local is not None:
            self._local.max_bytes = value

    @property
    def local(self) -> bool:
        return self._local is not None and self._local.open

    def use_local(self, path: str | None) -> None:
        """After a hello: talk over ``path`` (None: over the ROUTER). A socket that
        cannot be opened leaves the ROUTER in use (logged)."""
        old, self._local = self._local, None
        if old is not None:
            old.close()
        if path:
            try:
                self._local = LocalChannel(path, self.rpc.timeout_s, self.rpc.max_bytes)
            except KVStoreError as exc:
                log.info("same-node socket unusable (%s): requests go over %s", exc,
                         self.rpc.address)

    def _channel(self) -> Channel | LocalChannel:
        local = self._local
        return local if local is not None and local.open else self.rpc

    # A request the local socket could not send at all (its server is gone: a restart
    # leaves the address to a new process) goes over the ROUTER, which reaches
    # whoever listens there now, as it would have without the socket.
    def call(self, req: p.Request, timeout_s: float | None = None) -> dict[str, Any]:
        try:
            return self._channel().call(req, timeout_s)
        except NotSent as exc:
            log.info("%s; %s goes over %s", exc, req.OP, self.rpc.address)
            return self.rpc.call(req, timeout_s)

    def send(self, req: p.Request, timeout_s: float | None = None) -> None:
        try:
            self._channel().send(req, timeout_s)
        except NotSent as exc:
            log.info("%s; %s goes over %s", exc, req.OP, self.rpc.address)
            self.rpc.send(req, timeout_s)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        self.rpc.close()
