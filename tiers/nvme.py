"""NVMe tier: a slab file or a block device (a local disk, or a remote NVMe-oF
namespace the kernel initiator attached), read and written at extent offsets.

O_DIRECT keeps KV bytes out of the page cache (they are cold by definition when they
land here, and caching them would steal DRAM from the DRAM tier). It demands that
buffer addresses, file offsets and lengths are multiples of the logical block size:
* offsets: extents are page-aligned by the allocator;
* lengths: each extent owns whole pages, so the I/O always covers its rounded length
  (the padding after ``nbytes`` is zeros, written by us);
* buffers: a caller's page-aligned head goes straight to the kernel; anything else
  passes through a page-aligned bounce buffer (an anonymous mmap).

Not memory: ``address`` and ``view`` are None, TE never sees this tier. Contents
survive a restart; the store re-``claim``s the extents its index still names.
Thread-safe: every I/O call holds the tier's own lock, since the bounce buffer is
shared and the store's background writeback writes while requests read.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import threading

from tiers.errors import ConfigError, InvalidRequestError
from tiers.arena import ArenaTier
from tiers.base import Extent, same_length
from tiers.nvme_runs import RunIO, address

log = logging.getLogger(__name__)

PAGE_SIZE = 4096
BOUNCE_BYTES = 8 << 20
_DIRECT_MODES = ("auto", "on", "off")
_FSYNC_MODES = ("always", "commit", "never")


def _usable_size(path: str, capacity: int) -> tuple[int, bool]:
    """(bytes this tier may use, is a block device); creates a missing slab file."""
    wanted = (capacity // PAGE_SIZE) * PAGE_SIZE
    try:
        st = os.stat(path)
    except FileNotFoundError:
        _create_slab(path, wanted)
        return wanted, False  # (new: NvmeTier.created)
    if stat.S_ISBLK(st.st_mode):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"cannot open nvme block device {path}: {exc}") from exc
        try:
            device = os.lseek(fd, 0, os.SEEK_END) // PAGE_SIZE * PAGE_SIZE
        finally:
            os.close(fd)
        return (min(wanted, device) if wanted > 0 else device), True
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"nvme path {path} is neither a regular file nor a block device")
    if st.st_size != wanted:
        raise ConfigError(f"nvme slab {path} has {st.st_size} bytes, config says {wanted} "
                          f"(capacity {capacity} rounded to pages): set the size it was "
                          f"made with, or start on an empty data dir and remove the slab "
                          f"(the index names entries in it)")
    return wanted, False


def _create_slab(path: str, nbytes: int) -> None:
    if nbytes <= 0:
        raise ConfigError(f"nvme capacity {nbytes} is smaller than one page")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create nvme slab {path}: {exc}") from exc
    try:
        os.ftruncate(fd, nbytes)
        # Reserve the blocks now so a full disk fails here, not in a later write.
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            os.unlink(path)
            raise ConfigError(f"cannot size nvme slab {path} to {nbytes}: {exc}") from exc
    os.close(fd)


def _lock_slab(fd: int, path: str) -> None:
    """An exclusive ``flock`` on the slab for as long as ``fd`` is open. The data dir's
    lock does not cover a slab named by ``nvme_path``: two servers given one would
    each place entries over the other's (each one's reads then a checksum miss).
    A file system without flock is logged and used as before."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(f"nvme slab {path} is in use by another kvstore server (its "
                          "lock is held): give each server a slab of its own") from None
    except OSError as exc:  # e.g. ENOLCK
        log.warning("nvme tier: cannot lock %s (%s): make sure no other server uses it",
                    path, exc.strerror or exc)


def _open_direct(path: str, probe: memoryview) -> int:
    """An O_DIRECT descriptor, after one aligned read proves the file system takes it
    (some refuse at open, some only at the first I/O)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
    try:
        os.preadv(fd, [probe], 0)
    except OSError:
        os.close(fd)
        raise
    return fd


class NvmeTier(ArenaTier):
    name = "nvme"
    volatile = False

    def __init__(self, path: str, capacity: int, direct: str = "auto",
                 fsync: str = "commit") -> None:
        if direct not in _DIRECT_MODES:
            raise ConfigError(f"nvme direct must be one of {_DIRECT_MODES}, got {direct!r}")
        if fsync not in _FSYNC_MODES:
            raise ConfigError(f"nvme fsync must be one of {_FSYNC_MODES}, got {fsync!r}")
        # A slab made now holds nothing an index may name (recovery drops such
        # records: the old slab's bytes are gone).
        self.created = not os.path.exists(path)
        usable, self.block_device = _usable_size(path, capacity)
        super().__init__(usable, PAGE_SIZE)
        self.path, self.fsync_mode = path, fsync
        self._io_lock = threading.RLock()  # the bounce buffer and the fd's state
        self._bounce = mmap.mmap(-1, BOUNCE_BYTES, mmap.MAP_PRIVATE)  # page-aligned
        self._bounce_view = memoryview(self._bounce)
        fd, self.direct = self._open(direct)
        try:
            _lock_slab(fd, path)
        except BaseException:
            os.close(fd)
            self._close_bounce()
            raise
        self._fd: int | None = fd
        self._dirty = False
        self.calls = 0  # vectored calls made by write_many / read_many (tests, bench)
        log.info("nvme tier: %s, %s bytes, O_DIRECT=%s, fsync=%s", path, usable,
                 self.direct, fsync)

    def _open(self, direct: str) -> tuple[int, bool]:
        if direct != "off":
            try:
                return _open_direct(self.path, self._bounce_view[:PAGE_SIZE]), True
            except OSError as exc:
                if direct == "on":
                    self._close_bounce()
                    raise ConfigError(f"O_DIRECT refused for {self.path}: {exc}") from exc
                log.warning("nvme tier: O_DIRECT refused for %s (%s); using buffered I/O",
                            self.path, exc.strerror or exc)
        try:
            return os.open(self.path, os.O_RDWR | os.O_CLOEXEC), False
        except OSError as exc:
            self._close_bounce()
            raise ConfigError(f"cannot open nvme path {self.path}: {exc}") from exc

    # ------------------------------------------------------------ I/O
    def write(self, extent: Extent, data: memoryview) -> None:
        with self._io_lock:
            self._move(extent, self._checked(extent, data), write=True)
            self._written()

    def read_into(self, extent: Extent, out: memoryview) -> None:
        with self._io_lock:
            self._move(extent, self._checked(extent, out, writable=True), write=False)

    def write_many(self, extents: list[Extent], datas: list[memoryview]) -> None:
        """Write every extent, adjacent ones in one ``pwritev`` (tiers/nvme_runs.py)."""
        same_length(extents, datas)
        srcs = [self._checked(e, d) for e, d in zip(extents, datas)]
        with self._io_lock:
            self.calls += self._runs().run(list(extents), srcs, write=True)
            self._written()

    def read_many(self, extents: list[Extent], outs: list[memoryview]) -> None:
        """Read every extent, adjacent ones in one ``preadv``."""
        same_length(extents, outs)
        dsts = [self._checked(e, o, writable=True) for e, o in zip(extents, outs)]
        with self._io_lock:
            self.calls += self._runs().run(list(extents), dsts, write=False)

    def _runs(self) -> RunIO:
        self._require_open()
        return RunIO(PAGE_SIZE, self.direct, self._bounce_view, self._io, self._move)

    def _move(self, extent: Extent, buf: memoryview, write: bool) -> None:
        fd = self._require_open()
        if self.direct:
            self._direct_io(buf, extent.offset, write)
        elif write:
            _exact(os.pwritev(fd, [buf], extent.offset), buf.nbytes, "write")
        else:
            _exact(os.preadv(fd, [buf], extent.offset), buf.nbytes, "read")

    def _written(self) -> None:
        self._dirty = True
        if self.fsync_mode == "always":
            self.flush()

    def flush(self) -> None:
        with self._io_lock:
            if self._dirty and self.fsync_mode != "never":
                os.fdatasync(self._require_open())
            self._dirty = False

    def _direct_io(self, buf: memoryview, offset: int, write: bool) -> None:
        """Move ``buf`` to/from ``offset``. The page-aligned head of a page-aligned
        buffer goes straight to the kernel; the rest rides the bounce buffer."""
        head = 0
        if _address(buf) % PAGE_SIZE == 0:
            head = buf.nbytes // PAGE_SIZE * PAGE_SIZE
            if head:
                self._io([buf[:head]], offset, write)
        for start in range(head, buf.nbytes, BOUNCE_BYTES):
            chunk = buf[start:start + BOUNCE_BYTES]
            span = -(-chunk.nbytes // PAGE_SIZE) * PAGE_SIZE
            bounce = self._bounce_view[:span]
            if write:
                bounce[:chunk.nbytes] = chunk
                bounce[chunk.nbytes:] = bytes(span - chunk.nbytes)  # the extent's padding
                self._io([bounce], offset + start, write)
            else:
                self._io([bounce], offset + start, write)
                chunk[:] = bounce[:chunk.nbytes]

    def _io(self, bufs: list[memoryview], offset: int, write: bool) -> None:
        fd = self._require_open()
        done = os.pwritev(fd, bufs, offset) if write else os.preadv(fd, bufs, offset)
        _exact(done, sum(b.nbytes for b in bufs), "write" if write else "read")

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        with self._io_lock:
            if self._fd is None:
                return
            self.flush()
            os.close(self._fd)
            self._fd = None
            self._close_bounce()

    def _close_bounce(self) -> None:
        self._bounce_view.release()
        try:
            self._bounce.close()
        except BufferError:
            # A probe slice is still referenced (e.g. by a logged traceback); the
            # mapping is unmapped when that reference goes.
            pass

    def _require_open(self) -> int:
        if self._fd is None:
            raise InvalidRequestError("nvme tier is closed")
        return self._fd


def _address(buf: memoryview) -> int:
    return address(buf)


def _exact(done: int, wanted: int, what: str) -> None:
    # Regular files and block devices move all bytes or fail; a short count means the
    # device is failing or the file shrank under us.
    if done != wanted:
        raise OSError(errno.EIO, f"nvme short {what}: {done} of {wanted} bytes")
