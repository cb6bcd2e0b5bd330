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

import dataclasses
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

from kvstore.client.rpc import REPLY_CAP, Channel, Incoming, Requests, Take
from kvstore.client.shm import RECV_HASHED
from kvstore.core import protocol as p
from kvstore.core.errors import (AuthError, BusyError, InvalidRequestError, KVStoreError,
                                 KVTimeoutError, PeerUnavailableError)

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
_TIMEVAL = struct.Struct("@ll")  # struct timeval, for SO_RCVTIMEO


class NotSent(PeerUnavailableError):
    """The request never left: the connection was closed, belongs to the process
    this one was forked from, or its server is gone (a send to a Unix socket whose
    peer closed fails at once). Safe to send again another way."""


class Refused(NotSent):
    """The server does not admit this process's user on its local socket."""


_PROBE_TIMEOUT_S = 2.0  # the health call that proves a new connection, and a settle
_CONNECT_S = 0.5  # a TCP connect to the stream door (a firewall that drops: no stall)
_READ_BYTES = 1 << 20  # reply bytes a take left unread are dropped this many at a time
# A verified read of a door reply receives it this many bytes per system call and
# hashes each piece right after it lands, while it is in the cache
# (``_ntcopy.recv_hashed``): hashing all of it after one receive read it back from
# memory (docs/benchmarks.md, "Hashing a door reply as it arrives").
HASH_PIECE_BYTES = 512 << 10


class LocalChannel(Requests):
    """Request/reply over one stream socket: the server's same-node Unix socket
    (``address`` its path) or its stream door (``address`` (host, port), TCP).
    Thread-safe (one call at a time)."""

    def __init__(self, address: str | tuple[str, int], timeout_s: float,
                 max_bytes: int) -> None:
        where = address if isinstance(address, str) else \
            f"stream door {_host_port(*address)}"
        super().__init__(where, timeout_s, max_bytes)
        self.path = where
        self.stream = not isinstance(address, str)
        self._buf = bytearray()
        self._pid = os.getpid()
        probe_s = min(timeout_s, _PROBE_TIMEOUT_S)
        try:
            if isinstance(address, str):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(probe_s)
                try:
                    sock.connect(address)
                except OSError:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection(address, timeout=min(probe_s, _CONNECT_S))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise PeerUnavailableError(f"cannot connect to {where}: {exc}") from None
        self._sock: socket.socket | None = sock
        try:
            self.call(p.Health(), timeout_s=probe_s)
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
        # (``take``: an acquire's bytes that follow its reply, over the stream door.)
        frame_id, frame, timeout = self._frame(req, timeout_s)
        with self._lock:
            sock = self._sock
            if sock is None:
                raise NotSent(f"local connection {self.path} is closed")
            if self._pid != os.getpid():
                raise NotSent(f"local connection {self.path} belongs to process {self._pid}")
            deadline = time.monotonic() + timeout
            if self.stream and self._closed_by_peer(sock):
                self._close()  # (TCP takes a send to a closed peer; a Unix socket fails it)
                raise NotSent(f"{self.path} was closed by the server (stopped, or "
                              "restarted)")
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
                    inline = "inline" in result and "error" not in result
                    if inline and not self.stream:
                        raise PeerUnavailableError(f"{self.path} sent bytes after a reply, "
                                                   "which only a stream door may")
                    mine = self._is_reply(rid, result, frame_id)
                    if inline:  # (a stale reply's too: the stream goes on after them)
                        asked = getattr(req, "inline", None) if mine else None
                        self._bytes_after(sock, result, deadline, req.OP,
                                          take if mine else None, mine,
                                          p.MAX_INLINE_BYTES if asked is None else asked)
                    if mine:
                        return result
            except (KVTimeoutError, PeerUnavailableError):
                self._close()
                raise
            except OSError as exc:  # the server went away
                self._close()
                raise PeerUnavailableError(f"local connection {self.path} failed during "
                                           f"{req.OP}: {exc}") from None

    @staticmethod
    def _closed_by_peer(sock: socket.socket) -> bool:
        """Whether the peer closed its side: the connection's end is here to read
        (any reply waiting before it is read first, and stays)."""
        try:
            sock.settimeout(0.0)  # (with a timeout, Python would wait for a byte first)
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # reset
            return True

    def _bytes_after(self, sock: socket.socket, result: dict[str, Any], deadline: float,
                     op: str, take: Take | None, keep: bool = True,
                     asked: int = p.MAX_INLINE_BYTES) -> None:
        """The bytes that follow an acquire's reply on the stream door (``inline`` of
        them, at most the ``asked``), handed to ``take`` as they arrive (its result
        ``"taken"``, what it raised ``"take_error"``, the seconds ``"take_s"``:
        ``Channel``'s contract), else read into ``"inline_data"`` (unless not
        ``keep``: a stale reply's, dropped). What ``take`` leaves unread is read and
        dropped, so the next reply is found. A connection that fails on the way is
        closed, the error the reply's ``"take_error"`` (it keeps its lease, for the
        caller to release another way)."""
        nbytes = result.get("inline")
        if type(nbytes) is not int or not 0 <= nbytes <= asked or "parts" in result:
            raise PeerUnavailableError(f"{self.path} sent a malformed reply: inline "
                                       f"{str(nbytes)[:20]}, parts {'parts' in result}")
        incoming = _Incoming(self, sock, nbytes, deadline, op)
        start = time.perf_counter()
        try:
            if take is None and not keep:
                pass  # (all of it dropped below, a slice at a time)
            elif take is None:
                data = memoryview(bytearray(nbytes))
                got = 0
                while got < nbytes:
                    got += incoming.read_some(data[got:])
                result["inline_data"] = data
            else:
                result["taken"] = take(result, incoming)
        except Exception as exc:  # noqa: BLE001 - the caller releases the lease, then raises
            result["take_error"] = exc
            result.pop("inline_data", None)
        except BaseException:  # (KeyboardInterrupt, say): the rest would be read as frames
            self._close()
            raise
        if take is not None:
            result["take_s"] = time.perf_counter() - start
        if incoming.broken is None and incoming.left:
            scratch = memoryview(bytearray(min(incoming.left, _READ_BYTES)))
            try:
                while incoming.left:
                    incoming.read_some(scratch)
            except KVStoreError:
                pass  # (broken)
        if incoming.broken is not None:
            self._close()
            result.setdefault("take_error", incoming.broken)
            result.pop("inline", None)

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


def _for_router(req: p.Request) -> p.Request:
    """``req`` as the ROUTER may carry it: an acquire built for the stream door asks
    for no more bytes in its reply than one ZeroMQ message carries (a server from
    before larger replies refuses a larger ask as out of range)."""
    inline = getattr(req, "inline", None)
    if isinstance(req, p.Acquire) and inline is not None and inline > p.ROUTER_INLINE_BYTES:
        return dataclasses.replace(req, inline=p.ROUTER_INLINE_BYTES)
    return req


class _Incoming(Incoming):
    """``Incoming`` of one reply on a ``LocalChannel``: what was read past the reply
    first (the channel's buffer), then straight from the socket. An error on the way
    is kept (``broken``) for the channel, which closes the connection."""

    def __init__(self, channel: LocalChannel, sock: socket.socket, nbytes: int,
                 deadline: float, op: str) -> None:
        self.channel, self.sock, self.deadline, self.op = channel, sock, deadline, op
        self.nbytes = self.left = nbytes
        self.broken: KVStoreError | None = None
        # One blocking system call waits for all that was asked (MSG_WAITALL), bounded
        # by the socket's receive timeout: a reader that took the bytes as they came,
        # a chunk per call, went back for the GIL after each, and in a vLLM worker,
        # whose engine thread holds it in turns of up to 5 ms, a 2 MiB load took
        # tens of ms more than over the ROUTER (where libzmq's thread gathers the
        # bytes without it). ``_exchange`` puts the timeout mode back before its next
        # request.
        sock.settimeout(None)

    def read_some(self, view: memoryview) -> int:
        want = min(len(view), self.left)
        if not want:
            raise InvalidRequestError(f"read past the {self.nbytes} bytes of a reply")
        buf = self.channel._buf
        if buf:
            got = min(len(buf), want)
            view[:got] = buf[:got]
            del buf[:got]
            self.left -= got
            return got
        if self.broken is not None:
            raise self.broken
        try:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                 _TIMEVAL.pack(int(left), int(left % 1 * 1e6) or 1))
            try:
                got = self.sock.recv_into(view, want, socket.MSG_WAITALL)
            except (BlockingIOError, InterruptedError):  # the receive timeout, nothing in
                raise TimeoutError from None
        except TimeoutError:
            raise self._cut("timeout") from None
        except OSError as exc:
            raise self._cut(str(exc)) from None
        if not got:
            raise self._cut("closed")
        self.left -= got
        return got

    def _cut(self, why: str) -> KVStoreError:
        """The reply's bytes stopped coming (``why``: "timeout", "closed", or the
        error): what the reader raises, kept as ``broken`` for the channel."""
        where = self.channel.path
        if why == "timeout":
            self.broken = KVTimeoutError(f"the bytes of the reply from {where} to {self.op} "
                                         f"stopped coming: {self.left} of {self.nbytes} not "
                                         "here within the timeout")
        elif why == "closed":
            self.broken = PeerUnavailableError(
                f"{where} closed the connection with {self.left} of the {self.nbytes} bytes "
                f"of its reply to {self.op} still to come")
        else:
            self.broken = PeerUnavailableError(f"{where} failed while the bytes of its reply "
                                               f"to {self.op} came: {why}")
        return self.broken

    def read_hashed(self, view: memoryview, sizes: list[int]) -> list[int]:
        """``Incoming.read_hashed``: what the channel read past the reply first, then the
        rest straight from the socket in pieces of ``HASH_PIECE_BYTES``, each entry
        hashed a piece at a time as it lands, in one call without the GIL (a read that
        went back for the GIL after each piece would wait, in a vLLM worker, for the
        engine thread's turns: ``_Incoming``'s first comment). Python's loop where the
        extension lacks it."""
        if RECV_HASHED is None:
            return super().read_hashed(view, sizes)
        if len(view) > self.left:
            raise InvalidRequestError(f"read of {len(view)} bytes past the {self.left} "
                                      f"left of a reply")
        got = 0
        while self.channel._buf and got < len(view):
            got += self.read_some(view[got:])
        if self.broken is not None:
            raise self.broken
        try:
            done, sums, why = RECV_HASHED(self.sock.fileno(), view, got, sizes,
                                          HASH_PIECE_BYTES, self.deadline)
        except BaseException as exc:  # (a signal's handler raised): the reply is cut short
            self.broken = PeerUnavailableError(f"the read of the reply from "
                                               f"{self.channel.path} to {self.op} stopped "
                                               f"half-way: {type(exc).__name__}: {exc}")
            raise
        self.left -= done - got
        if why:
            raise self._cut(why)
        return sums


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def door_address(server: str, port: int) -> tuple[str, int] | None:
    """The stream door at ``port`` of the server at ``server`` (``tcp://host:port``,
    the address this client reaches its ROUTER by); None for another transport."""
    if not server.startswith("tcp://"):
        return None
    host = server[len("tcp://"):].rsplit(":", 1)[0]
    return (host[1:-1] if host.startswith("[") else host), port


class Control:
    """The client's control path: ``rpc`` (the ROUTER), or the server's local socket
    once ``use_local`` named one. ``call`` / ``send`` as ``Channel``'s."""

    RETRY_S = 1.0  # a local socket that failed is tried again after this long
    # ... the stream door: a port a firewall closes would cost each try a connect
    # timeout (the ROUTER carries the requests meanwhile, as it did before the door)
    STREAM_RETRY_S = 30.0

    def __init__(self, rpc: Channel) -> None:
        self.rpc = rpc
        # The socket the last hello named, if usable: a path, or the stream door.
        self._path: str | tuple[str, int] | None = None
        self._local: LocalChannel | None = None
        self._retry_at = 0.0
        self._one_way_on: Requests | None = None  # a one-way send, no call since
        self._lock = threading.Lock()  # the fields above
        # The socket the hello named was found closed by its server (stopped, or
        # restarted: a new one may name another): the client says hello again.
        self.lost = False

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

    @property
    def stream(self) -> bool:
        """Whether requests go over the stream door now."""
        local = self._local
        return local is not None and local.open and local.stream

    def use_local(self, path: str | tuple[str, int] | None) -> None:
        """After a hello: talk over ``path`` from now on, the same-node socket's path
        or the stream door's (host, port) (None: over the ROUTER). A socket that
        cannot be opened leaves the ROUTER in use (logged) until a later request
        opens it."""
        with self._lock:
            old, self._local, self._path, self._retry_at = self._local, None, path, 0.0
            self.lost = False
        if old is not None:
            self._leave(old)
            old.close()
        if path:
            self._channel()

    def _channel(self, reopen: bool = True) -> Requests:
        """The channel for the next request: the local socket when there is one
        (opened again if it failed, at most every ``RETRY_S``; not for ``reopen``
        False), else the ROUTER."""
        fresh = None
        with self._lock:
            local = self._local
            # A forked child opens its own at once: the parent's is not its to use,
            # and neither is the ROUTER channel (ZeroMQ does not survive a fork).
            forked = local is not None and local.forked
            if (local is None or not local.open) and self._path \
                    and (forked or (reopen and time.monotonic() >= self._retry_at)):
                path, self._retry_at = self._path, time.monotonic() + self.RETRY_S
                try:
                    fresh = LocalChannel(path, self.rpc.timeout_s, self.rpc.max_bytes)
                except Refused as exc:
                    log.warning("%s: requests go over %s", exc, self.rpc.address)
                    self._path = None
                except KVStoreError as exc:
                    if isinstance(path, str):
                        log.info("same-node socket unusable (%s): requests go over %s for "
                                 "now", exc, self.rpc.address)
                    else:
                        self._retry_at = time.monotonic() + self.STREAM_RETRY_S
                        log.warning("stream door unusable (%s): requests go over %s, the "
                                    "door tried again in %.0f s (is its port open? "
                                    "client.stream_socket = false stops trying)", exc,
                                    self.rpc.address, self.STREAM_RETRY_S)
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
            self.lost = True
            channel = self.rpc
            result = channel.call(_for_router(req), timeout_s, take)
        with self._lock:
            if self._one_way_on is channel:
                self._one_way_on = None
        return result

    def send(self, req: p.Request, timeout_s: float | None = None) -> None:
        # A one-way send (a release, an abort) does not open the socket again: that
        # waits for a health reply, and the send is often the cleanup after a call
        # the server did not answer. The ROUTER takes it; the next call settles it
        # there before it uses a socket opened again (``_leave``).
        channel = self._channel(reopen=False)
        try:
            channel.send(req, timeout_s)
        except NotSent as exc:
            log.info("%s; %s goes over %s", exc, req.OP, self.rpc.address)
            self.lost = True
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
