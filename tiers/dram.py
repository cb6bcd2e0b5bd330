"""Host DRAM tier: one page-aligned arena, mapped once, registered with TE once.

With ``shared_path`` the arena is a file (normally under /dev/shm), its pages
reserved at start (``posix_fallocate``: a /dev/shm too small for it is refused
then, not a SIGBUS later), mapped MAP_SHARED, so a client process on the same node can map (``kvstore.client.shm.map_shared``) the very same
bytes and memcpy an insert straight into a reserved extent, with no TE transfer.
Without it the arena is an anonymous mapping. Either way mmap gives page alignment.
Where CUDA exists *and torch is already imported* the arena is pinned
(cudaHostRegister) so GPU copies are DMA; see ``_cuda_host_register`` for why the
tier never imports torch itself. Otherwise, with ``prefault``, a background thread
maps every page of the arena into this process (``tiers.prefault``), so neither a
copy nor TE's send from it takes a page fault on the request path.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import sys
from collections.abc import Sequence

import numpy as np

from tiers.errors import ConfigError, InvalidRequestError
from tiers.arena import ArenaTier
from tiers.base import Extent, MemoryRegion
from tiers.prefault import Prefault

log = logging.getLogger(__name__)

PAGE_SIZE = 4096
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def _map_arena(path: str | None, nbytes: int) -> mmap.mmap:
    if path is None:
        return mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE)  # fd -1: anonymous
    try:
        # A new file, never one an earlier process left at this path (a server
        # restarted under the same pid, in a container): clients of that process
        # may still map the old file and write into it (a room they were granted),
        # and must never reach this server's memory that way.
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create shared DRAM arena {path}: {exc}") from exc
    try:
        # Reserve every page now. A file only ftruncate'd to size is sparse: when
        # its file system (a container's 64 MiB /dev/shm) cannot back a page the
        # first touch of it is a SIGBUS, long after start. fallocate fails instead.
        _reserve(fd, path, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.unlink(path)
        raise ConfigError(f"cannot size/map shared DRAM arena {path}: {exc}") from exc
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _reserve(fd: int, path: str, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        st = os.statvfs(os.path.dirname(path) or ".")
        free = st.f_bavail * st.f_frsize
        raise ConfigError(
            f"cannot reserve {format_bytes(nbytes)} for the shared DRAM arena {path}: "
            f"{exc.strerror} ({os.path.dirname(path)} has {format_bytes(free)} free); "
            f"lower tiers.dram_bytes or enlarge it (e.g. docker --shm-size)") from None


def physical_memory() -> int | None:
    """Bytes of memory this process may use: RAM, or a smaller cgroup limit."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    for cg in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(cg) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 1 << 60:
            limits.append(int(value))
    return min(limits) if limits else None


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def _cuda_host_register(address: int, nbytes: int) -> bool:
    """Pin the arena for CUDA if this process uses CUDA; False (and nothing done) otherwise.

    Only when torch is already imported: importing it costs ~2 s per server start, and
    pinning only pays off for copies between this arena and a GPU *in this process*
    (registration is per process, so a same-node client mapping the arena file gets
    nothing from it). Those copies exist only with a GPU tier, and the store builds
    the GPU tier (which imports torch) before this one; an embedding process that
    uses CUDA has imported torch too. A DRAM-only server stays torch-free.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        log.warning("cudaHostRegister of %s bytes failed (%s); DRAM arena stays pageable",
                    nbytes, err)
        return False
    return True


def _cuda_host_unregister(address: int) -> None:
    import torch

    err = torch.cuda.cudart().cudaHostUnregister(address)
    if int(err) != 0:
        log.warning("cudaHostUnregister failed: %s", err)


class DramTier(ArenaTier):
    name = "dram"
    volatile = True

    def __init__(self, capacity: int, shared_path: str | None = None,
                 prefault: bool = False) -> None:
        memory = physical_memory()
        if memory is not None and capacity > memory:
            raise ConfigError(f"dram tier of {format_bytes(capacity)} exceeds this machine's "
                              f"memory ({format_bytes(memory)}): lower tiers.dram_bytes")
        super().__init__(capacity, PAGE_SIZE)
        self.shared_path = shared_path
        self._mm: mmap.mmap | None = _map_arena(shared_path, self.capacity)
        self._arr: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)
        self._base = int(self._arr.ctypes.data)
        self.pinned = _cuda_host_register(self._base, self.capacity)
        # (pinning has mapped every page already)
        self.prefault = Prefault(self._arr, "dram") if prefault and not self.pinned else None
        log.info("dram tier: %s bytes at %#x (%s, pinned=%s)", self.capacity, self._base,
                 shared_path or "anonymous", self.pinned)

    @property
    def base_address(self) -> int:
        return self._base

    def write(self, extent: Extent, data: memoryview) -> None:
        src = self._checked(extent, data)
        arena = self._arena()
        arena[extent.offset:extent.end] = np.frombuffer(src, dtype=np.uint8)

    def read_into(self, extent: Extent, out: memoryview) -> None:
        dst = self._checked(extent, out, writable=True)
        np.frombuffer(dst, dtype=np.uint8)[:] = self._arena()[extent.offset:extent.end]

    def view(self, extent: Extent) -> memoryview:
        self._own(extent)
        self._require_live(extent)
        return self._arena()[extent.offset:extent.end].data

    def views(self, extents: list[Extent]) -> list[memoryview]:
        """``view`` of each extent, the checks inlined (commit verifies a batch)."""
        arena, live = self._arena(), self._alloc.is_live
        out = []
        for ext in extents:
            if ext.tier != self.name or not live(ext.offset, ext.nbytes):
                self._own(ext)
                self._require_live(ext)
            out.append(arena[ext.offset:ext.offset + ext.nbytes].data)
        return out

    def span_of(self, offsets: Sequence[int], sizes: Sequence[int]) -> memoryview | None:
        """``Tier.span_of``, checked in C-level passes rather than per extent in
        Python (that loop took a third of a server's handling of a 128-entry inline
        read)."""
        arena = self._arena()  # (a closed tier raises, whatever the extents)
        if not offsets:
            return None
        start = offsets[0]
        ends = list(itertools.accumulate(sizes, initial=start))
        if ends[:-1] != list(offsets) or not self._alloc.all_live(offsets, sizes):
            return None
        return arena[start:ends[-1]].data

    def runs_of(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[memoryview] | None:
        """Views of live extents at ``offsets`` of ``sizes``, in their order, those that
        lie back to back joined into one view (``span_of``'s when all do); None if one
        is not live. Nothing is copied: a stream door reply sends the list as it is."""
        arena = self._arena()
        if not offsets:
            return None
        if not self._alloc.all_live(offsets, sizes):
            return None
        runs: list[memoryview] = []
        start = end = offsets[0]
        for off, n in zip(offsets, sizes):
            if off != end:
                runs.append(arena[start:end].data)
                start = off
            end = off + n
        runs.append(arena[start:end].data)
        return runs

    def address(self, extent: Extent) -> int:
        self._own(extent)
        return self._base + extent.offset

    def regions(self) -> list[MemoryRegion]:
        return [MemoryRegion(self._base, self.capacity, "cpu:0")]

    def close(self) -> None:
        if self._mm is None:
            return
        if self.prefault is not None:
            self.prefault.stop()  # its chunk in progress holds a view of the arena
        if self.pinned:
            _cuda_host_unregister(self._base)
            self.pinned = False
        self._arr = None
        try:
            self._mm.close()
        except BufferError:
            # A caller still holds a view; the mapping goes when the last view does.
            log.warning("dram tier closed while views of it are alive")
        self._mm = None
        if self.shared_path is not None:
            try:
                os.unlink(self.shared_path)
            except FileNotFoundError:
                pass

    def _arena(self) -> np.ndarray:
        if self._arr is None:
            raise InvalidRequestError("dram tier is closed")
        return self._arr
