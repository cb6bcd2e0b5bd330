"""The client's data plane: moving entry bytes to and from a server's tier arenas.

Two ways, chosen per entry:
* same node: the server's DRAM arena is a shared-memory file this process maps
  (``kvstore.client.shm.map_shared``); a DRAM entry is one memcpy at its arena offset;
* otherwise TE: bytes go through this client's registered, page-aligned staging
  buffer in as few one-sided batches as it takes (one when they fit), and the
  Transport coalesces runs that are contiguous on both sides into single transfers.

The server has told us, in ``hello``, its TE segment and its arena file; the
control plane therefore verified the peer before the first TE transfer (a port
that is not a TE peer would otherwise stall TE's handshake for about a minute).

The TE engine and the staging buffer live in a ``TeEngine``, which several
DataPaths may share: a ClusterClient's per-node clients use one engine per process
(each engine registers its own memory and busy-waits its own threads). The engine
resolves segments the way the servers registered theirs (hello's ``te_metadata``:
P2P handshake or a metadata server such as etcd), so every server one engine talks
to must use the same metadata.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

import numpy as np

from kvstore.client.checks import LandedChecks, first_bad, use_background
from kvstore.client.rpc import Incoming
from kvstore.client.shm import copy_in, copy_out, copy_run
from kvstore.core.config import MIN_TE_PIECE_BYTES, TE_WAITS
from kvstore.core.errors import ChecksumError, ConfigError, InvalidRequestError
from kvstore.core.hashing import checksum
from kvstore.core.nodeid import host_id
from kvstore.transport.env import check_protocol
from kvstore.transport.ranges import STREAM_NAP_S, coalesce, split, stream_piece
from tiers.prefault import Prefault

if TYPE_CHECKING:
    from kvstore.transport.te import Transport

log = logging.getLogger(__name__)

# Wire layout of placements / entries (kvstore.server.handlers): tier, offset, nbytes, address,
# and for entries the checksum they were stored with.
_TIER, _OFFSET, _NBYTES, _ADDRESS, _CHECKSUM = 0, 1, 2, 3, 4
_PAGE = 4096  # tiers.dram.PAGE_SIZE: DRAM extents start on, and are rounded up to, pages
# From this many bytes a TE write goes straight from the caller's buffers, registered
# for the call (~0.1 ms/GiB), instead of being copied into staging first.
DIRECT_WRITE_MIN_BYTES = 8 << 20
# How a move is handed to TE. ``client.te_wait``: "sleep" (the default) and "yield"
# stream it (``Transport.stream``): pieces in flight together as one-entry async
# batches, each piece hashed as it lands, the wait sleeping between polls
# (``ranges.STREAM_NAP_S``) or only yielding the CPU; "spin" hands each run to TE's sync
# call, which busy-waits a core until the last byte, and hashes after.
# ``client.te_piece_bytes``: 0 (the default) lets the wait choose (streamed:
# ``ranges.stream_piece``; spin: one transfer per run of entries contiguous on both
# sides); N > 0 cuts runs into N-byte pieces either way. Measured in
# docs/benchmarks.md ("Streamed transfers", "Sleeping between polls"). Entries under
# a page stay bridged into their neighbours either way (``_mirror``).
WHOLE_RUNS = 0
WAITS = TE_WAITS


def _file_id(path: str, nbytes: int) -> tuple[str, int, int, int] | None:
    """What tells one arena file from another at ``path``: path, device, inode and the
    bytes mapped; None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return path, st.st_dev, st.st_ino, nbytes


class Segment(NamedTuple):
    name: str  # the server's TE segment, "host:rpc_port"
    shm: np.ndarray | None  # the server's DRAM arena mapped here, when on the same node


class TeEngine:
    """One TE engine and its registered, page-aligned staging buffer, both started on
    first use (admin clients never start one). ``lock`` serialises every use of the
    staging buffer and the engine: the DataPaths sharing it take turns, which is
    also how TE runs fastest here (one transfer thread per process)."""

    def __init__(self, te_host: str, staging_bytes: int, timeout_s: float | None = None,
                 protocol: str = "tcp", devices: str | Sequence[str] = "",
                 piece_bytes: int = WHOLE_RUNS, wait: str = "sleep") -> None:
        if piece_bytes < 0 or 0 < piece_bytes < MIN_TE_PIECE_BYTES:
            raise ConfigError(f"te_piece_bytes must be 0 or at least {MIN_TE_PIECE_BYTES}, "
                              f"got {piece_bytes}")
        if wait not in WAITS:
            raise ConfigError(f"te_wait must be one of {WAITS}, got {wait!r}")
        self.te_host = te_host
        self.piece_bytes = piece_bytes
        self.wait = wait
        self.staging_bytes = staging_bytes
        self.timeout_s = timeout_s  # bounds a TE transfer to a stalled peer (TE minimum 5 s)
        # Checked now, though the engine starts on first use: "rdma" without a NIC is
        # refused when the client is made, not at its first transfer.
        self.protocol = protocol
        self.devices = ",".join(check_protocol(protocol, devices, section="client."))
        self.lock = threading.Lock()
        self.transport: Transport | None = None  # once started
        self._stage: np.ndarray | None = None
        self._stage_address = 0
        self.metadata: str | None = None  # fixed by the first server's hello
        self._metadata_lock = threading.Lock()  # not ``lock``: hello never waits on TE

    def adopt_metadata(self, metadata: str, server: str) -> None:
        """Resolve segments the way ``server`` registered its own. The first hello
        fixes it for the engine's life: one engine cannot be P2P and use etcd, nor
        use two metadata servers; a server that differs is refused, nothing changes."""
        with self._metadata_lock:
            if self.metadata is None:
                self.metadata = metadata
            elif metadata != self.metadata:
                raise ConfigError(
                    f"server {server} registers its TE segment with metadata {metadata!r}, "
                    f"but this process's TE engine uses {self.metadata!r} (one engine per "
                    "process): give every server the same server.te_metadata")

    def te(self) -> Transport:
        """The Transport, started now if need be. Callers hold ``lock``."""
        if self.transport is None:
            from kvstore.transport.te import P2P, Transport

            metadata = self.metadata or P2P
            # With a metadata server the name is the key peers look us up by: unique per
            # engine, so a crashed client's lingering key never blocks a new one.
            name = None if metadata == P2P else \
                f"{self.te_host}:kvclient-{os.getpid()}-{secrets.token_hex(4)}"
            self.transport = Transport(self.te_host, metadata=metadata,
                                       protocol=self.protocol, timeout_s=self.timeout_s,
                                       name=name, devices=self.devices)
        return self.transport

    def staging_buffer(self) -> tuple[np.ndarray, int]:
        """The staging array and its address. Callers hold ``lock``."""
        if self._stage is None:
            # Page-aligned and registered with TE once, for the engine's life.
            buf = self.te().allocate_buffer(self.staging_bytes)
            self._stage, self._stage_address = buf.array, buf.address
        return self._stage, self._stage_address

    def close(self) -> None:
        with self.lock:
            self._stage = None
            if self.transport is not None:
                self.transport.close()  # frees the staging buffer too
                self.transport = None


class DataPath:
    """``observer(op, seconds, ok)`` (e.g. ``kvstore.server.metrics.Metrics.observe``) is told
    how long each TE move took, as ``te_write`` / ``te_read`` (and ``inline_read``: the
    copy and check of bytes that came in an acquire's reply): staging copy plus the
    batched transfers (the first one also starts the TE engine). Same-node memcpys
    are not reported.

    ``engine``: a ``TeEngine`` shared with other DataPaths (its owner closes it);
    without one this DataPath makes and owns its own from ``te_host``,
    ``staging_bytes``, ``timeout_s``, ``protocol``, ``devices``, ``piece_bytes`` and
    ``wait``."""

    def __init__(self, te_host: str, staging_bytes: int, same_node: bool | str = "auto",
                 observer: Callable[[str, float, bool], None] | None = None,
                 timeout_s: float | None = None, engine: TeEngine | None = None,
                 protocol: str = "tcp", devices: str | Sequence[str] = "",
                 piece_bytes: int = WHOLE_RUNS, wait: str = "sleep",
                 prefault: bool = True, stream: bool = True) -> None:
        if same_node not in (True, False, "auto"):
            raise ConfigError(f"same_node must be True, False or 'auto', got {same_node!r}")
        self.same_node = same_node
        # Populate this process's mapping of the server's arena in the background from
        # the first copy through it (tiers.prefault): a client that never copies (the
        # scheduler's, looking up) maps the arena but never pays for its page tables.
        self.prefault = prefault
        self.stream = stream  # copy_in's: non-temporal stores into the arena
        self._prefault: Prefault | None = None  # the job of the arena mapped now
        self._prefault_lock = threading.Lock()
        self._arena_id: tuple[str, int, int, int] | None = None  # _file_id of segment.shm
        self.observer = observer
        self.segment: Segment | None = None
        self._owns_engine = engine is None
        self.engine = engine or TeEngine(te_host, staging_bytes, timeout_s, protocol, devices,
                                         piece_bytes, wait)
        self.staging_bytes = self.engine.staging_bytes
        self.direct_write_min_bytes = DIRECT_WRITE_MIN_BYTES
        self._lock = self.engine.lock

    def connect(self, hello: dict[str, Any]) -> None:
        """Adopt a server's hello: its TE segment and metadata, and its DRAM arena if
        on this node. ``ConfigError`` (nothing adopted): the server's TE metadata
        differs from this engine's."""
        # A server from before hello carried te_metadata runs P2P.
        self.engine.adopt_metadata(hello.get("te_metadata") or "P2PHANDSHAKE",
                                   hello["segment"])
        shm = None
        dram = _local_arena(hello)
        if self.same_node is True and dram is None:
            raise ConfigError("same_node=True but the server's DRAM arena is not shared "
                              "with this process (other node, or no shared arena)")
        if self.same_node and dram is not None:
            shm = self._map_arena(dram["path"], int(dram["nbytes"]))
        self.segment = Segment(hello["segment"], shm)
        transport = self.engine.transport
        if transport is not None:
            # The control plane just saw this peer: let TE try it again.
            transport.mark_alive(hello["segment"])
        if shm is None and hello.get("te_probe") and self.same_node is not True:
            self._handshake(hello["segment"], hello["te_probe"])

    def _handshake(self, segment: str, probe: list[int]) -> None:
        """TE's first contact with a server, made now, right after its hello answered:
        TE's handshake with a peer that then stalls (SIGSTOP, a hung host) blocks
        ~62 s with no setting to shorten it; every transfer after it is bounded by
        ``MC_TRANSFER_TIMEOUT``. One page of the server's arena is read."""
        address, nbytes = int(probe[0]), min(int(probe[1]), _PAGE)
        page = mmap.mmap(-1, _PAGE)  # page-aligned; registered for this read only
        local = np.frombuffer(page, dtype=np.uint8)
        try:
            with self._lock:
                te = self._te()
                te.register(local.ctypes.data, _PAGE)
                try:
                    te.read(segment, [local.ctypes.data], [address], [nbytes])
                finally:
                    te.unregister(local.ctypes.data)
        finally:
            del local
            try:
                page.close()
            except BufferError:  # a view outlived the read (a profiler's frame): GC frees it
                pass

    def _map_arena(self, path: str, nbytes: int) -> np.ndarray:
        """The server's arena mapped here: the mapping this data path holds already
        when the file is the same one (a hello again to the same server process: a
        restarted server always makes a new file, kvstore/store/setup.py), else a new
        one. Each new mapping costs its page tables again when it is populated."""
        from kvstore.client.shm import map_shared

        current = self.segment.shm if self.segment is not None else None
        ident = _file_id(path, nbytes)
        if current is not None and ident is not None and ident == self._arena_id:
            return current
        shm = map_shared(path, nbytes)
        # Recorded only when the path named the same file before and after mapping it.
        self._arena_id = ident if ident is not None and ident == _file_id(path, nbytes) \
            else None
        log.info("same-node fast path: mapped %s (%s bytes)", path, nbytes)
        return shm

    def warm(self, shm: np.ndarray) -> None:
        """Start populating ``shm`` in the background, once per mapping, when it is
        the arena mapped now (not an older one a room still goes through): called
        before each copy through it (here, and a layer-wise insert's). A job still
        running for a mapping let go of is told to stop."""
        if not self.prefault or self.segment is None or shm is not self.segment.shm:
            return
        if self._prefault is not None and self._prefault.covers(shm):
            return
        with self._prefault_lock:
            old = self._prefault
            if old is None or not old.covers(shm):
                if old is not None:
                    old.stop(wait=False)
                self._prefault = Prefault(shm, "shm")

    @property
    def uses_shared_memory(self) -> bool:
        return self.segment is not None and self.segment.shm is not None

    # ------------------------------------------------------------------ moves
    def write(self, seg: Segment, buffers: list[np.ndarray], placements: list[list]
              ) -> list[int]:
        """Copy each buffer into its placement (same-node memcpy or TE write); returns
        each buffer's checksum (``kvstore.core.hashing.checksum``, xxh3_64) for the commit.
        A same-node copy hashes each entry right after copying it, in the same loop
        (``kvstore.client.shm``: measured faster than copy-all-then-hash for 64 KiB
        and for 2 MiB entries); a TE write hashes its sources while they are on the
        wire (streamed; after it, with ``te_wait = "spin"``)."""
        sums: list[int] = [0] * len(buffers)
        shm = seg.shm
        local, remote, where = [], [], []
        if len(buffers) != len(placements):
            raise InvalidRequestError(f"{len(buffers)} buffers for {len(placements)} placements")
        for i, (buf, pl) in enumerate(zip(buffers, placements)):
            if buf.nbytes != pl[_NBYTES]:  # numpy would broadcast a 1-byte buffer
                raise InvalidRequestError(
                    f"buffer {i} has {buf.nbytes} bytes, its placement {pl[_NBYTES]}")
            if shm is not None and pl[_TIER] == "dram":
                local.append(i)
            else:
                remote.append((buf, pl))
                where.append(i)
        if shm is not None and local:
            self.warm(shm)
            local_sums = copy_in(shm, [buffers[i] for i in local],
                                 [placements[i] for i in local], stream=self.stream)
            for i, value in zip(local, local_sums):
                sums[i] = value
        if remote:
            def hash_sources(items: list[int]) -> Callable[[], None]:
                def run() -> None:
                    for k in items:
                        sums[where[k]] = checksum(remote[k][0])
                return run

            with self._lock, self._timed("te_write"):
                if not self._te_write_direct(seg.name, remote,
                                             hash_sources(list(range(len(remote))))):
                    for group in self._groups([pl[_NBYTES] for _, pl in remote]):
                        self._te_write(seg.name, [remote[i] for i in group],
                                       hash_sources(group))
        return sums

    def write_run(self, seg: Segment, data: np.ndarray, sizes: list[int], start: int,
                  nbytes: int, page: int) -> tuple[list[int], list[int]] | None:
        """A same-node writer's room, ``nbytes`` of the arena from offset ``start``:
        the entries of ``sizes``, back to back in ``data`` (flat uint8), copied into
        it, each page-aligned after the one before (``shm.copy_run``, which refuses
        entries that leave the room); their offsets from ``start`` and their
        checksums. None, nothing copied, where the segment is not mapped here or the
        one-call copy is not built: ``write`` then."""
        shm = seg.shm
        if shm is None:
            return None
        if data.nbytes != sum(sizes):
            raise InvalidRequestError(f"{data.nbytes} bytes of KV for entries of "
                                      f"{sum(sizes)}")
        if not 0 <= start <= start + nbytes <= shm.size:
            raise InvalidRequestError(f"a room of {nbytes} bytes at {start} is outside the "
                                      f"{shm.size}-byte arena")
        self.warm(shm)
        return copy_run(shm[start:start + nbytes], 0, data, page, sizes, stream=self.stream)

    def read(self, seg: Segment, entries: list[list], into: Any = None,
             verify: bool = False) -> np.ndarray:
        """All entries' bytes back to back, in entry order: in a new array, or in the
        first bytes of ``into`` (a contiguous numpy array / CPU tensor the caller reuses).

        Into a reused buffer, TE writes straight into it (no staging copy). Into new
        memory it goes through staging: TE receiving into pages never touched costs
        more than the copy (each page is faulted in during the transfer, measured
        ~3x slower on 256 MiB).

        ``verify``: each entry's bytes as they arrived must match the checksum it was
        stored with (entry field 4), else ``ChecksumError``; a same-node copy hashes
        each entry right after copying it, as ``write`` does, and a streamed TE read
        each entry as soon as all of it has landed, while the rest is on the wire."""
        sizes = [e[_NBYTES] for e in entries]
        out = _output(into, sum(sizes))
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        shm = seg.shm
        local, remote = [], []
        for e, start in zip(entries, starts):
            if shm is not None and e[_TIER] == "dram":
                local.append((start, e))
            else:
                remote.append((start, e))
        if shm is not None and local:
            self.warm(shm)
            bad = copy_out(shm, out, local, verify)
            if bad is not None:
                raise _corrupt(local[bad][1], entries)
        if remote:
            def check(items: list[tuple[int, list]]) -> None:
                bad = first_bad(out, items)
                if bad is not None:
                    raise _corrupt(items[bad][1], entries)

            # Large entries: hashed on a low-priority thread as they land (checks.py).
            background = LandedChecks(out, lambda e: _corrupt(e, entries)) if verify and \
                use_background([e[_NBYTES] for _, e in remote]) else None
            landed = background.landed if background is not None else \
                check if verify else None
            try:
                with self._lock, self._timed("te_read"):
                    if into is None or not self._te_read_direct(seg.name, out, remote, landed):
                        for group in self._groups([e[_NBYTES] for _, e in remote]):
                            self._te_read(seg.name, out, [remote[i] for i in group], landed)
            except BaseException:
                if background is not None:
                    background.cancel()
                raise
            if background is not None:
                corrupt = background.finish()
                if corrupt is not None:
                    raise _corrupt(corrupt[1], entries)
        return out

    def take_inline(self, acq: dict[str, Any], skip: int, into: Any = None) -> np.ndarray:
        """The entries of an acquire answered with their bytes (``acq["inline_data"]``,
        the reply's frame; ``kvstore.client.rpc``) but the first ``skip``, back to back
        in a new array or in ``into``, each verified against the checksum it was stored
        with while it is copied (``ChecksumError`` names the first bad one)."""
        nbytes, total = len(acq["inline_data"]), sum(e[_NBYTES] for e in acq["entries"])
        if nbytes != total:  # (its length against ``inline``: _inline_frame)
            raise InvalidRequestError(f"malformed reply: {nbytes} inline bytes for "
                                      f"entries of {total}")
        return self.take_parts(acq, iter((acq["inline_data"],)), into, skip)

    def take_parts(self, acq: dict[str, Any], parts: Iterator[memoryview],
                   into: Any = None, skip: int = 0) -> np.ndarray:
        """``take_inline`` of bytes that come in parts (``Acquire.inline_part``), each
        part copied and verified as ``parts`` yields it, while the next is still on the
        wire (``kvstore.client.rpc.Requests.call``'s ``take``). Each part must hold
        whole entries, in order, and together exactly all of them. From the stream
        door (``parts`` an ``Incoming``): ``_take_stream``."""
        if isinstance(parts, Incoming):
            return self._take_stream(acq, parts, into, skip)
        entries = acq["entries"]
        wanted = entries[skip:]
        out = _output(into, sum(e[_NBYTES] for e in wanted))
        with self._timed("inline_read"):
            i = dst = 0
            for buf in parts:
                data = np.frombuffer(buf, dtype=np.uint8)
                # copy_out's items: each entry at its place in the part, not the arena.
                items, src, first = [], 0, i
                while i < len(entries) and src < data.size:
                    e = entries[i]
                    if i >= skip:
                        items.append((dst, [e[_TIER], src, e[_NBYTES], None, e[_CHECKSUM]]))
                        dst += e[_NBYTES]
                    src += e[_NBYTES]
                    i += 1
                if src != data.size or not data.size:
                    raise InvalidRequestError(
                        f"malformed reply: a part of {data.size} bytes does not end where "
                        f"an entry does (entries {first} .. {i - 1}: {src} bytes)")
                bad = copy_out(data, out, items, verify=True)
                if bad is not None:
                    raise _corrupt(wanted[i - len(items) - skip + bad], wanted)
            if i != len(entries):
                raise InvalidRequestError(f"malformed reply: parts for {i} of "
                                          f"{len(entries)} entries")
        return out

    def _take_stream(self, acq: dict[str, Any], incoming: Incoming, into: Any = None,
                     skip: int = 0) -> np.ndarray:
        """``take_parts`` of bytes that come over the stream door: received straight
        into the output, each entry hashed as its bytes land (``Incoming.read_hashed``:
        the stream door's in one call, without the GIL) and verified. A bad
        entry (``ChecksumError``, the first) is named once all bytes are in, so the
        connection stays in step."""
        entries = acq["entries"]
        wanted = entries[skip:]
        sizes = [e[_NBYTES] for e in entries]  # (one pass over the entries for all uses)
        if incoming.nbytes != sum(sizes):
            raise InvalidRequestError(f"malformed reply: {incoming.nbytes} bytes follow it "
                                      f"for entries of {sum(sizes)}")
        out = _output(into, sum(sizes[skip:]))
        with self._timed("inline_read"):
            if skip:  # (never asked so by this client: a skipping read asks no bytes)
                dropped = memoryview(bytearray(sum(sizes[:skip])))
                got = 0
                while got < len(dropped):
                    got += incoming.read_some(dropped[got:])
            sums = incoming.read_hashed(out.data, sizes[skip:])
            if len(sums) != len(wanted):
                raise InvalidRequestError(f"{len(sums)} checksums read for "
                                          f"{len(wanted)} entries")
            bad = None
            if sums != [e[_CHECKSUM] for e in wanted]:  # (the usual case: one comparison)
                bad = next(e for e, s in zip(wanted, sums) if s != e[_CHECKSUM])
        if bad is not None:
            raise _corrupt(bad, wanted)
        return out

    @contextlib.contextmanager
    def _timed(self, op: str) -> Iterator[None]:
        start, ok = time.perf_counter(), False
        try:
            yield
            ok = True
        finally:
            if self.observer is not None:
                self.observer(op, time.perf_counter() - start, ok)

    def _groups(self, sizes: list[int]) -> list[list[int]]:
        """Consecutive runs of entries that fit the staging buffer together (each
        counted with a page of slack for the gaps ``_mirror`` may keep)."""
        groups: list[list[int]] = [[]]
        used = 0
        for i, n in enumerate(sizes):
            if n + _PAGE > self.staging_bytes:
                raise InvalidRequestError(f"entry of {n} bytes does not fit the client's "
                                          f"staging buffer ({self.staging_bytes}); raise "
                                          "staging_bytes")
            if used + n + _PAGE > self.staging_bytes:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += n + _PAGE
        return [g for g in groups if g]

    def _te_write(self, segment: str, items: list[tuple[np.ndarray, list]],
                  overlap: Callable[[], None]) -> None:
        stage, base = self._staging_buffer()
        pls = [pl for _, pl in items]
        offsets, local, remote, lengths = _mirror(pls, writing=True)
        for (buf, pl), off in zip(items, offsets):
            stage[off:off + pl[_NBYTES]] = buf
        self._move("write", segment, [base + x for x in local], remote, lengths,
                   overlap=overlap)

    def _te_write_direct(self, segment: str, items: list[tuple[np.ndarray, list]],
                         overlap: Callable[[], None]) -> bool:
        """TE straight from the caller's buffers, registered for this write only, when
        the write is large and needs about as few transfers as through staging (a
        prompt's entries are views of one packed array; a hidden tensor adds one).
        Saves the copy into staging and is not bounded by its size. False: not that
        shape (or the memory is registered already), use staging."""
        sizes = [pl[_NBYTES] for _, pl in items]
        if sum(sizes) < self.direct_write_min_bytes or not all(
                buf.flags.c_contiguous and buf.nbytes == n for (buf, _), n in zip(items, sizes)):
            return False
        local = [buf.ctypes.data for buf, _ in items]
        remote = [_address(pl) for _, pl in items]
        transfers = _runs(local, remote, sizes)  # (local, remote, nbytes), coalesced
        if len(transfers) > len(_mirror([pl for _, pl in items], writing=True)[1]) + 1:
            return False  # e.g. many small entries: staging bridges their gaps
        spans = _runs(local, local, sizes)  # caller memory to register, (start, _, n)
        te = self._te()
        try:
            te.register_many([(start, n) for start, _, n in spans])
        except InvalidRequestError:  # overlaps registered memory
            return False
        try:
            self._move("write", segment, [t[0] for t in transfers], [t[1] for t in transfers],
                       [t[2] for t in transfers], overlap=overlap)
        finally:
            for start, _, _ in spans:
                te.unregister(start)
        return True

    def _te_read(self, segment: str, out: np.ndarray, items: list[tuple[int, list]],
                 landed: Callable[[list[tuple[int, list]]], None] | None) -> None:
        """Through staging: each entry is copied out (and handed to ``landed``) as soon
        as all of it has arrived."""
        stage, base = self._staging_buffer()
        offsets, local, remote, lengths = _mirror([e for _, e in items], writing=False)
        order = sorted(range(len(items)), key=offsets.__getitem__)

        def arrived(first: int, last: int) -> None:
            done = [items[i] for i in order[first:last]]
            sizes = [e[_NBYTES] for _, e in done]
            for dst, src, n in _runs([start for start, _ in done],
                                     [offsets[i] for i in order[first:last]], sizes):
                out[dst:dst + n] = stage[src:src + n]
            if landed is not None:
                landed(done)

        self._move("read", segment, [base + x for x in local], remote, lengths,
                   ends=[base + offsets[i] + items[i][1][_NBYTES] for i in order],
                   arrived=arrived)

    def _te_read_direct(self, segment: str, out: np.ndarray, items: list[tuple[int, list]],
                        landed: Callable[[list[tuple[int, list]]], None] | None) -> bool:
        """TE straight into ``out`` (registered for this read only) when the entries
        land in it exactly as they would in staging: one run, no bridged gaps. Saves
        the staging-to-output copy (a fifth of a large prompt's drop_select here) and
        is not bounded by the staging size. False: not that shape, use staging."""
        sizes = [e[_NBYTES] for _, e in items]
        offsets, local, remote, lengths = _mirror([e for _, e in items], writing=False)
        if len(_runs([start for start, _ in items], offsets, sizes)) != 1:
            return False
        te = self._te()
        address = out.ctypes.data
        shift = address + items[0][0] - offsets[0]  # staging offset -> address in out
        try:
            te.register(address, out.nbytes)
        except InvalidRequestError:  # overlaps registered memory (e.g. our staging)
            return False
        order = sorted(range(len(items)), key=lambda i: items[i][0])
        try:
            self._move("read", segment, [shift + x for x in local], remote, lengths,
                       ends=[address + items[i][0] + items[i][1][_NBYTES] for i in order],
                       arrived=None if landed is None else
                       lambda first, last: landed([items[i] for i in order[first:last]]))
        finally:
            te.unregister(address)
        return True

    def _move(self, op: str, segment: str, local: list[int], remote: list[int],
              lengths: list[int], overlap: Callable[[], None] | None = None,
              ends: list[int] | None = None,
              arrived: Callable[[int, int], None] | None = None) -> None:
        """One TE move of the runs, per ``te_wait`` and ``te_piece_bytes``.

        ``overlap()`` runs while the bytes are on the wire (spin: after). For a read,
        ``ends`` are the local end addresses of the caller's items, ascending, and
        ``arrived(first, last)`` is called for items ``first:last`` once all of them
        have landed, in order, each item once."""
        loc, rem, ln = self._pieces(local, remote, lengths)
        te = self._te()
        done = 0

        def landed_below(limit: int) -> None:
            nonlocal done
            if ends is None or arrived is None:
                return
            last = done
            while last < len(ends) and ends[last] <= limit:
                last += 1
            if last > done:
                first, done = done, last
                arrived(first, last)

        if self.engine.wait == "spin":
            (te.write if op == "write" else te.read)(segment, loc, rem, ln, merge=False)
            if overlap is not None:
                overlap()
            landed_below(1 << 63)
            return
        order = np.argsort(loc, kind="stable")  # landed prefixes are local prefixes
        loc, rem, ln = loc[order], rem[order], ln[order]
        tops = (loc + ln).tolist()
        te.stream(op, segment, loc, rem, ln, overlap=overlap,
                  on_landed=None if arrived is None else lambda n: landed_below(tops[n - 1]),
                  nap_s=STREAM_NAP_S if self.engine.wait == "sleep" else 0.0)
        landed_below(1 << 63)  # nothing left, unless ranges were empty

    def _pieces(self, local: list[int], remote: list[int], lengths: list[int]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs as TE transfers: cut per ``client.te_piece_bytes``, else whole
        (spin) or in ``stream_piece`` pieces (sleep, yield)."""
        loc, rem, ln = coalesce(local, remote, lengths)
        piece = self.engine.piece_bytes
        if not piece and self.engine.wait != "spin":
            piece = stream_piece(int(ln.sum()))
        return split(loc, rem, ln, piece)

    # -------------------------------------------------------------- resources
    def _te(self):
        return self.engine.te()

    def _staging_buffer(self) -> tuple[np.ndarray, int]:
        return self.engine.staging_buffer()

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()
        with self._lock:
            self.segment = None  # drops the shared mapping with the last view of it


def _mirror(items: list[list], writing: bool) -> tuple[list[int], list[int], list[int], list[int]]:
    """Lay ``items`` out in staging so that remote neighbours stay neighbours.

    Entries smaller than a page sit a page-padding gap apart in the arena, so their
    transfers would not coalesce (each small TE transfer costs ~100 us). Bridging
    the gap costs a few bytes: a read may span any gap under a page (the bytes in it
    are dropped); a write only a DRAM entry's own tail padding (the next entry starts
    on the page boundary right after it, so the gap belongs to the extent being
    written). Returns each item's staging offset and the transfers
    (staging offset, remote address, length).
    """
    whole = _back_to_back(items)
    if whole is not None:
        return whole
    order = sorted(range(len(items)), key=lambda i: _address(items[i]))
    offsets = [0] * len(items)
    local: list[int] = []
    remote: list[int] = []
    lengths: list[int] = []
    pos = prev_end = 0
    prev_tier = None
    for i in order:
        addr, n, tier = _address(items[i]), items[i][_NBYTES], items[i][_TIER]
        gap = addr - prev_end
        bridge = local and tier == prev_tier and 0 <= gap < _PAGE and (
            gap == 0 or not writing or (tier == "dram" and addr % _PAGE == 0))
        if bridge:
            offsets[i] = local[-1] + (addr - remote[-1])
            lengths[-1] = addr + n - remote[-1]
        else:
            offsets[i] = pos
            local.append(pos)
            remote.append(addr)
            lengths.append(n)
        pos = offsets[i] + n
        prev_end, prev_tier = addr + n, tier
    return offsets, local, remote, lengths


def _back_to_back(items: list[list]) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """``_mirror`` of the usual layout, in a few array passes: entries of one tier
    back to back in address order, as a room or reservation carves a prompt (one
    transfer; each offset the sizes before it). None: not that layout (or an entry
    without an address: ``_mirror``'s loop says so)."""
    if not items:
        return None
    addrs = [e[_ADDRESS] for e in items]
    if None in addrs:
        return None
    try:
        a = np.asarray(addrs, dtype=np.int64)
        n = np.asarray([e[_NBYTES] for e in items], dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        return None
    if not (a[1:] == a[:-1] + n[:-1]).all():
        return None
    tier = items[0][_TIER]
    if any(e[_TIER] != tier for e in items):
        return None
    offsets = np.concatenate(([0], np.cumsum(n[:-1]))).tolist()
    return offsets, [0], [addrs[0]], [int(n.sum())]


def _local_arena(hello: dict[str, Any]) -> dict[str, Any] | None:
    """The hello's DRAM arena when it is on this node: same host id, file there."""
    dram = hello.get("dram")
    if hello.get("host_id") == host_id() and dram is not None and os.path.exists(dram["path"]):
        return dram
    return None


def _corrupt(entry: list, entries: list | None = None) -> ChecksumError:
    """The error for ``entry``; ``.position`` is its index in ``entries`` (what the
    reader reports back with its release so the server can check and drop it)."""
    err = ChecksumError(f"entry at {entry[_TIER]}:{entry[_OFFSET]} arrived corrupt "
                        f"({entry[_NBYTES]} bytes)")
    err.position = next((i for i, e in enumerate(entries or ()) if e is entry), None)
    return err


def _runs(dst: list[int], src: list[int], sizes: list[int]) -> list[tuple[int, int, int]]:
    """Merge copies that are contiguous on both sides into ``(dst, src, nbytes)`` runs:
    a prompt's entries are usually back to back in staging and in the output, so a
    whole group is one memcpy instead of one slice copy per block."""
    d, s, n = (np.asarray(x, dtype=np.int64) for x in (dst, src, sizes))
    cut = np.flatnonzero((d[1:] != d[:-1] + n[:-1]) | (s[1:] != s[:-1] + n[:-1])) + 1
    first = np.concatenate(([0], cut))
    last = np.concatenate((cut, [len(n)])) - 1
    lengths = d[last] + n[last] - d[first]
    return list(zip(d[first].tolist(), s[first].tolist(), lengths.tolist()))


def _output(into: Any, nbytes: int) -> np.ndarray:
    """``nbytes`` of output: new, or the first bytes of the caller's buffer."""
    if into is None:
        return np.empty(nbytes, dtype=np.uint8)
    flat = flat_buffer(into)
    if flat.size < nbytes:
        raise InvalidRequestError(f"into holds {flat.size} bytes; these entries need {nbytes}")
    return flat[:nbytes]


def flat_buffer(into: Any) -> np.ndarray:
    """A caller's output buffer (contiguous writable numpy array or CPU tensor) as
    flat uint8; InvalidRequestError for anything else."""
    if not isinstance(into, np.ndarray) and hasattr(into, "numpy"):  # a torch tensor
        import torch

        if into.device.type != "cpu" or not into.is_contiguous():
            raise InvalidRequestError("into: a tensor must be contiguous and on the CPU")
        into = into.reshape(-1).view(torch.uint8).numpy()
    if not isinstance(into, np.ndarray) or not into.flags.c_contiguous \
            or not into.flags.writeable:
        raise InvalidRequestError("into: need a writable, contiguous numpy array or tensor")
    return into.reshape(-1).view(np.uint8)


def _address(item: list) -> int:
    addr = item[_ADDRESS]
    if addr is None:
        raise InvalidRequestError(f"server gave no TE address for a {item[_TIER]} entry")
    return addr
