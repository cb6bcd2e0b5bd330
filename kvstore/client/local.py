"""The client's same-node control path: the server's Unix socket (kvstore/server/local.py).

``LocalChannel`` speaks the ROUTER's frames, each behind a 4-byte little-endian
length, with ``Channel``'s contract: ``call`` waits for the reply with the same id
(stale replies to one-way sends are dropped, a failed one logged), ``send`` does
not wait, every wait is bounded. It proves the connection with one ``health`` call
when it opens (a server that refuses this process's user says so then). After a
timeout or a broken connection it is closed for good, and in a forked child it is
never used (parent and child would read each other's replies).

``Control`` is what ``KVStoreClient`` talks through: the ROUTER ``Channel`` until a
hello names a local socket this process can use, then that socket for everything.
When the socket fails, requests go over the ROUTER and the socket is opened again
on a later request (at most once a second). When it switches from one channel to
the other after a one-way send, it first makes one ``health`` call on the channel
it leaves, so that send is applied before anything the other channel carries: one
client's requests (a one-way release, then an acquire) keep their order.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from typing import Any

from kvstore.client.rpc import REPLY_CAP, Channel, Requests, Take
from kvstore.core import protocol as p
from kvstore.core.errors import (AuthError, BusyError, KVStoreError, KVTimeoutError,
                                 PeerUnavailableError)

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")


class NotSent(PeerUnavailableError):
    """The request never left: the connection was closed, belongs to the process
    this one was forked from, or its server is gone (a send to a Unix socket whose
    peer closed fails at once). Safe to send again another way."""


class Refused(NotSent):
    """The server does not admit this process's user on its local socket."""


_PROBE_TIMEOUT_S = 2.0  # the health call that proves a new connection, and a settle


class LocalChannel(Requests):
    """Request/reply over one Unix stream socket. Thread-safe (one call at a time)."""

    def __init__(self, path: str, timeout_s: float, max_bytes: int) -> None:
        super().__init__(path, timeout_s, max_bytes)
        self.path = path
        self._buf = bytearray()
        self._pid = os.getpid()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(min(timeout_s, _PROBE_TIMEOUT_S))
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise PeerUnavailableError(f"cannot connect to {path}: {exc}") from None
        self._sock: socket.socket | None = sock
        try:
            self.call(p.Health(), timeout_s=min(timeout_s, _PROBE_TIMEOUT_S))
        except BusyError:
            pass  # answered: the connection works
        except KVStoreError:
            self.close()
            raise

    @property
    def open(self) -> bool:
        return self._sock is not None and not self.forked

    @property
    def forked(self) -> bool:
        """This object was made by the process this one was forked from."""
        return self._pid != os.getpid()

    def _exchange(self, req: p.Request, timeout_s: float | None,
                  wait_reply: bool, take: Take | None = None) -> dict[str, Any] | None:
        # (``take``: never used here, the server sends no bytes over this socket.)
        frame_id, frame, timeout = self._frame(req, timeout_s)
        with self._lock:
            sock = self._sock
            if sock is None:
                raise NotSent(f"local connection {self.path} is closed")
            if self._pid != os.getpid():
                raise NotSent(f"local connection {self.path} belongs to process {self._pid}")
            deadline = time.monotonic() + timeout
            try:
                sock.settimeout(timeout)
                sock.sendall(_HEADER.pack(len(frame)) + frame)
            except (BrokenPipeError, ConnectionResetError) as exc:
                refusal = self._refusal(sock)
                self._close()  # the server that had this socket is gone, or refused it
                raise refusal or NotSent(f"local connection {self.path} is gone: {exc}") \
                    from None
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
                    if rid == 0 and "error" in result:
                        # The server could not read a frame this far, or refused this
                        # process: nothing sent here since is answered.
                        self._close()
                        if isinstance(result["error"], AuthError):
                            raise Refused(str(result["error"]))
                        return result
                    if self._is_reply(rid, result, frame_id):
                        return result
            except (KVTimeoutError, PeerUnavailableError):
                self._close()
                raise
            except OSError as exc:  # the server went away
                self._close()
                raise PeerUnavailableError(f"local connection {self.path} failed during "
                                           f"{req.OP}: {exc}") from None

    def _refusal(self, sock: socket.socket) -> Refused | None:
        """The server's refusal, if that is what it left on a connection it closed."""
        try:
            self._buf += sock.recv(1 << 16, socket.MSG_DONTWAIT)
            rid, result = p.decode_reply(self._read_frame(sock, 0.0, "hello"), REPLY_CAP)
        except (OSError, KVStoreError):
            return None
        err = result.get("error")
        return Refused(str(err)) if rid == 0 and isinstance(err, AuthError) else None

    def _read_frame(self, sock: socket.socket, deadline: float, op: str) -> bytes:
        need = _HEADER.size
        while True:
            if len(self._buf) >= need:
                if need == _HEADER.size:
                    (n,) = _HEADER.unpack_from(self._buf)
                    if n > REPLY_CAP:
                        raise PeerUnavailableError(
                            f"{self.path} announced a reply of {n} bytes, over the cap of "
                            f"{REPLY_CAP}: closing the connection")
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
            self._sock.close()  # in a forked child: only the child's descriptor
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()


class Control:
    """The client's control path: ``rpc`` (the ROUTER), or the server's local socket
    once ``use_local`` named one. ``call`` / ``send`` as ``Channel``'s."""

    RETRY_S = 1.0  # a local socket that failed is tried again after this long

    def __init__(self, rpc: Channel) -> None:
        self.rpc = rpc
        self._path: str | None = None  # the socket the last hello named, if usable
        self._local: LocalChannel | None = None
        self._retry_at = 0.0
        self._one_way_on: Requests | None = None  # a one-way send, no call since
        self._lock = threading.Lock()  # the fields above

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
        local = self._local
        return local is not None and local.open

    def use_local(self, path: str | None) -> None:
        """After a hello: talk over ``path`` from now on (None: over the ROUTER). A
        socket that cannot be opened leaves the ROUTER in use (logged) until a later
        request opens it."""
        with self._lock:
            old, self._local, self._path, self._retry_at = self._local, None, path, 0.0
        if old is not None:
            self._leave(old)
            old.close()
        if path:
            self._channel()

    def _channel(self) -> Requests:
        """The channel for the next request: the local socket when there is one
        (opened again if it failed, at most every ``RETRY_S``), else the ROUTER."""
        fresh = None
        with self._lock:
            local = self._local
            # A forked child opens its own at once: the parent's is not its to use,
            # and neither is the ROUTER channel (ZeroMQ does not survive a fork).
            forked = local is not None and local.forked
            if (local is None or not local.open) and self._path \
                    and (forked or time.monotonic() >= self._retry_at):
                path, self._retry_at = self._path, time.monotonic() + self.RETRY_S
                try:
                    fresh = LocalChannel(path, self.rpc.timeout_s, self.rpc.max_bytes)
                except Refused as exc:
                    log.warning("%s: requests go over %s", exc, self.rpc.address)
                    self._path = None
                except KVStoreError as exc:
                    log.info("same-node socket unusable (%s): requests go over %s for now",
                             exc, self.rpc.address)
                if fresh is not None:
                    self._local = local = fresh
            chosen: Requests = local if local is not None and local.open else self.rpc
            left = self._one_way_on
        if left is not None and left is not chosen:
            self._leave(left)
        return chosen

    def _leave(self, channel: Requests) -> None:
        """Before the other channel carries anything: one call on ``channel``, so a
        one-way send it carried is applied first (its server serves one connection
        in order). A channel that fails is left anyway."""
        with self._lock:
            if self._one_way_on is not channel:
                return
            self._one_way_on = None
        try:
            channel.call(p.Health(), timeout_s=min(channel.timeout_s, _PROBE_TIMEOUT_S))
        except KVStoreError as exc:
            log.debug("settling one-way sends on %s failed: %s", channel.where, exc)

    # A request the local socket could not send at all (its server is gone: a restart
    # leaves the address to a new process) goes over the ROUTER, which reaches
    # whoever listens there now, as it would have without the socket.
    def call(self, req: p.Request, timeout_s: float | None = None,
             take: Take | None = None) -> dict[str, Any]:
        channel = self._channel()
        try:
            result = channel.call(req, timeout_s, take)
        except NotSent as exc:
            log.info("%s; %s goes over %s", exc, req.OP, self.rpc.address)
            channel = self.rpc
            result = channel.call(req, timeout_s, take)
        with self._lock:
            if self._one_way_on is channel:
                self._one_way_on = None
        return result

    def send(self, req: p.Request, timeout_s: float | None = None) -> None:
        channel = self._channel()
        try:
            channel.send(req, timeout_s)
        except NotSent as exc:
            log.info("%s; %s goes over %s", exc, req.OP, self.rpc.address)
            channel = self.rpc
            channel.send(req, timeout_s)
        with self._lock:
            self._one_way_on = channel

    def close(self) -> None:
        with self._lock:
            local, self._local, self._path = self._local, None, None
        if local is not None:
            local.close()
        self.rpc.close()
