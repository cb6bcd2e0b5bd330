"""The client's control channel: one ZeroMQ DEALER to one server, every wait bounded.

A DEALER (not REQ) so a timed-out call leaves no stuck state machine: replies carry
the request id, and a late reply to an abandoned call is recognised and dropped.
After a timeout the socket is rebuilt, so requests queued for a dead server are
discarded instead of being delivered to its successor minutes later.

A monitor socket watches the connection: a refused CURVE handshake becomes an
``AuthError`` at once instead of a silent timeout, and a connection that drops while
a call waits for its reply a ``PeerUnavailableError`` (its request was lost with it).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstore.core import protocol as p
from kvstore.core.hashing import checksum
from kvstore.core.errors import (AuthError, ConfigError, InvalidRequestError, KVStoreError,
                                 KVTimeoutError, PeerUnavailableError)

log = logging.getLogger(__name__)

_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
REPLY_CAP = 256 << 20  # a reply larger than this is refused (by libzmq, here)
_ONE_WAY_KEPT = 1024  # ids of one-way sends remembered, to report a failed one
_CLOSE_LINGER_MS = 1000
# A wait polls the DEALER alone, in slices this long, and reads the handshake
# monitor between slices: one poll of one socket per reply that comes in time
# (a zmq.Poller over both cost a call ~20 us more), and a refused CURVE key is
# still heard within a slice.
_SLICE_MS = 20
# Errors after which a channel's socket is made anew.
_RESET = (KVTimeoutError, PeerUnavailableError, AuthError)


class Incoming:
    """An acquire's bytes as they come over the stream door, right after its reply
    (kvstore.client.local): ``read_some`` puts the next of them straight into the
    caller's memory, as many as are here (waiting for at least one), so nothing is
    copied on the way. ``nbytes``: all of them; ``left``: those still to come."""

    nbytes: int
    left: int

    def read_some(self, view: memoryview) -> int:
        raise NotImplementedError

    def read_hashed(self, view: memoryview, sizes: list[int]) -> list[int]:
        """All of ``view`` read, which holds entries of ``sizes`` back to back; the
        checksum (``hashing.checksum``) of each, in order, each taken once its bytes
        are in. (``kvstore.client.local``'s hashes each a piece at a time as it lands.)"""
        sums: list[int] = []
        got = start = k = 0
        while got < len(view):
            got += self.read_some(view[got:])
            while k < len(sizes) and start + sizes[k] <= got:
                sums.append(checksum(view[start:start + sizes[k]]))
                start, k = start + sizes[k], k + 1
        return sums


# What a caller does with an acquire's inline bytes while they arrive: ``take(result,
# parts)``, where ``parts`` yields each part's bytes in order, the next one once it
# is here (``Acquire.inline_part`` over the ROUTER), or is an ``Incoming`` (the stream
# door).
Take = Callable[[dict[str, Any], "Iterator[memoryview] | Incoming"], Any]


class CurveKeys(NamedTuple):
    """Client CURVE keys: its own keypair and the server's public key (z85 bytes)."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, secret_file: str, server_public_file: str) -> "CurveKeys":
        import zmq.auth

        try:
            public, secret = zmq.auth.load_certificate(secret_file)
            server_public, _ = zmq.auth.load_certificate(server_public_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load CURVE keys: {exc}") from None
        if secret is None:
            raise ConfigError(f"{secret_file} holds no secret key")
        return cls(public, secret, server_public)


class _Context(zmq.Context):
    """A context that closes its own sockets when it is garbage-collected.

    pyzmq's ``Context.__del__`` closes the sockets it knows of (a WeakSet), then
    terms. When a client nobody closed is collected as part of a reference cycle
    (e.g. inside a vLLM lookup buffer), the garbage collector clears the cycle's weak
    references before it runs any finalizer: the context saw no sockets, termed, and
    waited forever for the sockets still open, hanging the whole process inside a
    GC pass. This one also holds its sockets strongly and closes them first."""

    _held: list[zmq.Socket]  # declared: pyzmq takes other attributes for options

    def __init__(self) -> None:
        super().__init__()
        self._held = []

    def socket(self, socket_type: int, *args: Any, **kwargs: Any) -> Any:
        sock = super().socket(socket_type, *args, **kwargs)
        self._held = [s for s in self._held if not s.closed]
        self._held.append(sock)
        return sock

    def __del__(self) -> None:
        for sock in getattr(self, "_held", ()):
            if not sock.closed:
                sock.close(0)
        super().__del__()


class _Socket(NamedTuple):
    """The DEALER and the monitor watching it: opened, used and closed together."""

    dealer: zmq.Socket
    monitor: zmq.Socket

    def close(self, linger_ms: int = 0) -> None:
        self.dealer.disable_monitor()
        self.dealer.close(linger_ms)
        self.monitor.close(0)


class Requests:
    """What a request channel is, whatever its socket (``Channel`` here, the
    same-node ``kvstore.client.local.LocalChannel``): ``call`` and ``send`` over the
    subclass's ``_exchange``, request ids, the size check, and the one-way sends
    remembered so that a late reply saying one failed is logged, not lost.
    Thread-safe through ``_lock`` (one call at a time)."""

    def __init__(self, where: str, timeout_s: float, max_bytes: int) -> None:
        self.where = where  # for messages: the address or path
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._ids = itertools.count(1)
        self._one_way: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def call(self, req: p.Request, timeout_s: float | None = None,
             take: Take | None = None) -> dict[str, Any]:
        """Send ``req`` and return the reply map; a server error is raised as its class.

        An acquire's inline bytes that come in parts are handed to ``take`` as they
        arrive, before this returns: its result is the reply's ``"taken"`` (what it
        raised, ``"take_error"``; the seconds it took, ``"take_s"``). Without ``take``
        they are joined into ``"inline_data"``, as one part would be (a part that
        fails: ``"take_error"``, and neither ``"inline"`` nor ``"inline_data"``)."""
        result = self._exchange(req, timeout_s, wait_reply=True, take=take)
        assert result is not None
        if "error" in result:
            raise result["error"]
        return result

    def send(self, req: p.Request, timeout_s: float | None = None) -> None:
        """Send ``req`` and do not wait for its reply (a release the caller needs no
        answer to): one network trip instead of two. The server still answers; the
        reply is recognised as stale and dropped by the next ``call``. Raises as
        ``call`` does when the request cannot be sent."""
        self._exchange(req, timeout_s, wait_reply=False)

    def _exchange(self, req: p.Request, timeout_s: float | None,
                  wait_reply: bool, take: Take | None = None) -> dict[str, Any] | None:
        raise NotImplementedError

    def _frame(self, req: p.Request, timeout_s: float | None) -> tuple[int, bytes, float]:
        """A new request id, ``req``'s frame and the call's timeout (``timeout_s`` or
        the channel's); ``InvalidRequestError`` when the frame is larger than the
        server takes."""
        frame_id = next(self._ids)
        frame = p.encode_request(frame_id, req)
        if len(frame) > self.max_bytes:
            raise InvalidRequestError(f"{req.OP} request of {len(frame)} bytes exceeds the "
                                      f"server's limit of {self.max_bytes}")
        return frame_id, frame, self.timeout_s if timeout_s is None else timeout_s

    def _sent_one_way(self, frame_id: int, op: str) -> None:
        self._one_way[frame_id] = op
        while len(self._one_way) > _ONE_WAY_KEPT:
            self._one_way.popitem(last=False)

    def _is_reply(self, rid: int, result: dict[str, Any], frame_id: int) -> bool:
        """Whether a reply with id ``rid`` answers request ``frame_id``; else it is
        stale (a one-way send's, logged if it failed) and dropped."""
        if rid == frame_id:
            return True
        op = self._one_way.pop(rid, "")
        if op and "error" in result:
            log.warning("one-way %s to %s failed: %s", op, self.where, result["error"])
        else:
            log.debug("dropping stale reply %s (waiting for %s)", rid, frame_id)
        return False


def _inline_frame(result: dict[str, Any], frames: list) -> None:
    """An acquire answered with its bytes: the reply's second frame, which must be as
    long as its ``inline`` says (or, when they come in parts, as the first of its
    ``parts``, whose lengths add up to ``inline``), goes in ``result["inline_data"]``
    (a view of it). A reply where they do not match keeps its lease and entries but
    loses ``inline`` (and ``parts``): the caller reads the entries over TE instead
    (logged), and releases as always; parts that follow it are dropped on arrival."""
    n, parts = result.get("inline"), result.get("parts")
    first = n if parts is None else parts[0] if _valid_parts(parts, n) else None
    if "error" not in result and len(frames) == 2 and type(first) is int \
            and len(frames[1]) == first:
        result["inline_data"] = frames[1].buffer
        return
    log.warning("reply with %d frames, inline %r and parts %r: its bytes are not used",
                len(frames), str(n)[:20], str(parts)[:40])
    result.pop("inline", None)
    result.pop("parts", None)


def _valid_parts(parts: Any, total: Any) -> bool:
    return type(parts) is list and len(parts) > 1 and type(total) is int \
        and all(type(n) is int and n > 0 for n in parts) and sum(parts) == total


class Channel(Requests):
    """Request/reply over one DEALER. Thread-safe (one call at a time)."""

    def __init__(self, address: str, timeout_s: float, max_bytes: int = 16 << 20,
                 curve: CurveKeys | None = None) -> None:
        super().__init__(address, timeout_s, max_bytes)
        self.address = address
        self.curve = curve
        self._ctx = _Context()
        self._sock: _Socket | None = None  # None once closed
        self._handshake_error: Exception | None = None
        # The connection dropped since this call's send: its request went down with
        # the pipe (ZeroMQ drops what a dead pipe holds), so no reply can come and
        # waiting on would be a hang. (Set by the monitor's drain; cleared at a send.)
        self._drop_seen = False
        self._open()

    def _open(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # IMMEDIATE: queue only on a finished connection, so "server not there" is
        # visible (not writable) instead of piling requests into a dead pipe.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, REPLY_CAP)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve is not None:
            sock.curve_publickey = self.curve.public
            sock.curve_secretkey = self.curve.secret
            sock.curve_serverkey = self.curve.server_public
        monitor = sock.get_monitor_socket(_EVENTS)
        self._handshake_error = None
        self._drop_seen = False
        try:
            sock.connect(self.address)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            raise ConfigError(f"bad server address {self.address!r}: {exc}") from None
        self._sock = _Socket(sock, monitor)

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._open()

    def _exchange(self, req: p.Request, timeout_s: float | None,
                  wait_reply: bool, take: Take | None = None) -> dict[str, Any] | None:
        frame_id, frame, timeout = self._frame(req, timeout_s)
        with self._lock:
            sock = self._sock
            if sock is None:
                raise PeerUnavailableError("client is closed")
            deadline = time.monotonic() + timeout
            # Events from before this send are not its own (a drop, and the reconnect
            # after it, between two calls): read them now, not as this call waits.
            if cast(int, sock.monitor.get(zmq.EVENTS)) & zmq.POLLIN:
                self._drain_monitor(sock.monitor)
            try:
                try:  # the send queue is almost never full: no poll first
                    sock.dealer.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    self._wait(sock, zmq.POLLOUT, deadline, req.OP, sent=False,
                               timeout=timeout)
                    sock.dealer.send(frame, zmq.NOBLOCK)
                self._drop_seen = False
                if not wait_reply:
                    self._sent_one_way(frame_id, req.OP)
                    return None
                result = self._receive(sock, frame_id, deadline, req.OP, take)
            except _RESET:
                self._reset()
                raise
            # (While parts were due; a ZeroMQ error too: the socket's state is unknown.)
            if isinstance(result.get("take_error"), (*_RESET, zmq.ZMQError)):
                self._reset()
            return result

    def _receive(self, sock: _Socket, frame_id: int, deadline: float,
                 op: str, take: Take | None = None) -> dict[str, Any]:
        while True:
            frames = self._message(sock, deadline, op)
            rid, result = p.decode_reply(frames[0], REPLY_CAP)
            if p.PART_HEAD in result:  # of a reply whose caller stopped taking its parts
                log.debug("dropping part %s of reply %s (waiting for %s)", result[p.PART_HEAD],
                          rid, frame_id)
                continue
            if self._is_reply(rid, result, frame_id):
                if len(frames) > 1 or "inline" in result or "parts" in result:
                    _inline_frame(result, frames)
                if "parts" in result:
                    self._receive_parts(sock, frame_id, deadline, op, result, take)
                return result

    def _message(self, sock: _Socket, deadline: float, op: str) -> list:
        """The next message, once it is here: its first frame as bytes, the others
        (an acquire's inline bytes) as frames, not copied."""
        self._wait(sock, zmq.POLLIN, deadline, op, sent=True)
        frames: list = [sock.dealer.recv(zmq.NOBLOCK)]
        while sock.dealer.getsockopt(zmq.RCVMORE):
            frames.append(sock.dealer.recv(zmq.NOBLOCK, copy=False))
        return frames

    def _receive_parts(self, sock: _Socket, frame_id: int, deadline: float, op: str,
                       result: dict[str, Any], take: Take | None) -> None:
        """The parts after the first of the inline bytes of reply ``frame_id``: each
        must come next, in order, with its length. Handed to ``take`` as they arrive,
        else joined into ``inline_data``. A part that is late, missing or malformed
        ends the take with an error (``take_error``; without ``take``, the reply also
        loses ``inline`` and ``inline_data``), the parts still to come dropped on
        arrival and the lease kept for the caller to release (``KVStoreClient``
        releases it and raises the error: a miss, not bytes read over TE)."""
        sizes: list[int] = result.pop("parts")

        def parts() -> Iterator[memoryview]:
            yield result["inline_data"]
            for index in range(1, len(sizes)):
                frames = self._message(sock, deadline, op)
                rid, head = p.decode_reply(frames[0], REPLY_CAP)
                if rid != frame_id or head.get(p.PART_HEAD) != index or len(frames) != 2 \
                        or len(frames[1]) != sizes[index]:
                    raise InvalidRequestError(
                        f"malformed reply: part {index} of {len(sizes)} of reply {frame_id} "
                        f"was expected ({sizes[index]} bytes), a message of {len(frames)} "
                        f"frames for reply {rid} came ({str(head)[:60]})")
                yield frames[1].buffer

        if take is None:
            joined = bytearray(sum(sizes))
            at = 0
            try:
                for buf in parts():
                    joined[at:at + len(buf)] = buf
                    at += len(buf)
            except KVStoreError as exc:
                log.warning("inline bytes in parts not used: %s", exc)
                result.pop("inline")
                result.pop("inline_data")
                result["take_error"] = exc
                return
            result["inline_data"] = memoryview(joined)
            return
        start = time.perf_counter()
        try:
            result["taken"] = take(result, parts())
        except Exception as exc:  # noqa: BLE001 - the caller releases the lease, then raises
            result["take_error"] = exc
        result["take_s"] = time.perf_counter() - start

    def _wait(self, sock: _Socket, event: int, deadline: float, op: str, sent: bool,
              timeout: float | None = None) -> None:
        dealer = sock.dealer
        while True:
            self._check_handshake()
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout(op, sent, timeout)
            if dealer.poll(min(_SLICE_MS, max(1, int(left * 1000))), event):
                return
            self._drain_monitor(sock.monitor)
            self._check_handshake()
            if sent and self._drop_seen:
                if dealer.poll(0, event):  # what came before the drop is still read
                    return
                raise PeerUnavailableError(
                    f"the connection to {self.address} dropped while {op} waited for its "
                    "reply (the server stopped or restarted, or a message was over a "
                    "size limit); the request may or may not have been carried out")

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                msg = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event = msg["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._drop_seen = True  # (a reconnect after it does not bring it back)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._handshake_error = AuthError(
                    f"{self.address} refused this client's CURVE key (not authorized)")
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                           zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                self._handshake_error = (
                    AuthError(f"CURVE handshake with {self.address} failed "
                              "(wrong server public key, or the server does not use CURVE)")
                    if self.curve else PeerUnavailableError(
                        f"handshake with {self.address} failed: the server may require CURVE "
                        "keys (client.curve_secret_key / client.curve_server_public_key)"))

    def _check_handshake(self) -> None:
        if self._handshake_error is not None:
            raise self._handshake_error

    def _timeout(self, op: str, sent: bool, timeout: float | None) -> Exception:
        hint = " (CURVE in use: is this client's public key authorized?)" if self.curve else ""
        if not sent:
            return PeerUnavailableError(f"server {self.address} not reachable within "
                                        f"{timeout or self.timeout_s:g}s for {op}{hint}")
        return KVTimeoutError(f"no reply from {self.address} to {op} within the timeout{hint}")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                # A one-way release still queued gets this long to leave.
                self._sock.close(linger_ms=_CLOSE_LINGER_MS)
                self._sock = None
            self._ctx.term()
