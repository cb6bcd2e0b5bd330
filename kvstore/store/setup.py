"""Opening a store: the data-dir lock, the tiers from config, restart recovery.

Only kvstore/store/facade.py calls this module.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
from pathlib import Path
from typing import NamedTuple

from kvstore.core.config import KVStoreConfig, resolve_data_path
from kvstore.core.errors import (ConfigError, IntegrityError, InvalidRequestError,
                                 StorageError, TierFullError)
from kvstore.store.index import Index, Record
from tiers.base import Extent, Tier

log = logging.getLogger(__name__)

LOCK_NAME = "kvstore.lock"
_SHM_DIR = "/dev/shm"


class DataDirLock:
    """An exclusive ``flock`` on ``<data_dir>/kvstore.lock`` for the store's lifetime.

    flock locks belong to the open file, so a second store in the same process is
    refused too; the kernel drops the lock when the process dies (no stale locks).
    Whoever takes the lock removes the shared DRAM arenas its dead predecessors on
    this data dir left in /dev/shm (a SIGKILLed store cannot unlink its own).
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = _lock_file(self.path, data_dir)
        try:
            _write_pid(self._fd, self.path)
            remove_stale_arenas(data_dir)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Remove the lock file and let go. Unlinked while still locked: a store
        that opened the old file meanwhile sees it is no longer the path's (below)."""
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


# The lock file's PID could not be written for want of space: the lock (the flock)
# holds all the same, and a full disk must not keep a store from starting.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _write_pid(fd: int, path: Path) -> None:
    """This process's PID into the lock file: informational only (the flock is the
    lock). No space for it is logged; any other OSError is a one-line ConfigError."""
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            log.warning("cannot write this process's PID into %s (%s); the data dir is "
                        "locked all the same", path, exc.strerror or exc)
            return
        raise ConfigError(f"cannot write the data-dir lock {path}: "
                          f"{exc.strerror or exc}") from None


def _lock_file(path: Path, data_dir: Path) -> int:
    """An fd of ``path`` holding its exclusive flock. The file is removed when its
    holder lets go, so a lock won on a file that is no longer ``path`` is retried.
    Any OSError is a one-line ``ConfigError`` (never a traceback)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot use data dir {data_dir}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"data dir {data_dir} is in use by another kvstore store "
                              f"(lock {path} is held)") from None
        except OSError as exc:  # e.g. ENOLCK: a file system without flock
            os.close(fd)
            raise ConfigError(f"cannot lock data dir {data_dir} ({path}): "
                              f"{exc.strerror or exc}") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"cannot use data dir {data_dir}: {exc.strerror or exc}") from None
        if same:
            return fd
        os.close(fd)  # its holder removed it after we opened it: take the new one


def _arena_prefix(data_dir: Path) -> str:
    """``kvstore-<data-dir hash>-``: every arena of this data dir, any process."""
    return f"kvstore-{hashlib.sha1(str(data_dir.resolve()).encode()).hexdigest()[:12]}-"


def dram_shared_path(data_dir: Path) -> str | None:
    """A /dev/shm name unique to this data dir and process, or None without /dev/shm."""
    if not os.path.isdir(_SHM_DIR):
        log.warning("no %s: the DRAM arena is private, same-node clients use TE", _SHM_DIR)
        return None
    return f"{_SHM_DIR}/{_arena_prefix(data_dir)}{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def remove_stale_arenas(data_dir: Path) -> list[str]:
    """Unlink this data dir's shared DRAM arenas whose process is gone, and their
    servers' same-node sockets (``<arena>.sock``, kvstore/server/local.py); the paths.

    Called with the data-dir lock held, so no live store uses this data dir; the pid
    check still keeps any file whose pid is alive (e.g. reused by another process).
    Arenas of other data dirs are never looked at. Clients that still map a removed
    arena keep their mapping; the memory is freed when the last one unmaps.
    """
    prefix = _arena_prefix(data_dir)
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return []  # no /dev/shm: arenas are private, nothing to clean
    removed = []
    for name in names:
        pid = name[len(prefix):].removesuffix(".sock")
        if not name.startswith(prefix) or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        path = f"{_SHM_DIR}/{name}"
        what = "same-node socket" if name.endswith(".sock") else "DRAM arena"
        try:
            size = "" if name.endswith(".sock") else f" ({os.stat(path).st_size} bytes)"
            os.unlink(path)
        except OSError as exc:
            log.warning("cannot remove stale %s %s: %s", what, path, exc)
            continue
        log.warning("removed stale %s %s%s of dead process %s", what, path, size, pid)
        removed.append(path)
    return removed


def build_tiers(config: KVStoreConfig, data_dir: Path) -> dict[str, Tier]:
    """The tiers config asks for, fastest first. Closes what it opened on failure."""
    t = config.tiers
    if t.gpu_bytes <= 0 and t.dram_bytes <= 0:
        raise ConfigError("kvstore needs a memory tier (tiers.gpu_bytes or tiers.dram_bytes "
                          "> 0): writers and readers reach entries through it")
    tiers: dict[str, Tier] = {}
    try:
        if t.gpu_bytes > 0:
            from tiers.gpu import GpuTier

            tiers["gpu"] = GpuTier(t.gpu_bytes, device=t.gpu_device)
        if t.dram_bytes > 0:
            from tiers.dram import DramTier

            shared = dram_shared_path(data_dir) if t.dram_shared else None
            tiers["dram"] = DramTier(t.dram_bytes, shared_path=shared,
                                     prefault=t.dram_prefault)
        if t.nvme_bytes > 0:
            from tiers.nvme import NvmeTier

            path = resolve_data_path(str(data_dir), t.nvme_path, "nvme.slab")
            tiers["nvme"] = NvmeTier(str(path), t.nvme_bytes, direct=t.nvme_direct,
                                     fsync=t.nvme_fsync)
    except BaseException:
        for tier in tiers.values():
            tier.close()
        raise
    return tiers


class Recovered(NamedTuple):
    records: list[Record]
    dropped: int  # volatile, uncommitted, undecodable or unclaimable records


def recover(index: Index, tiers: dict[str, Tier]) -> Recovered:
    """Keep the index records of persistent tiers whose extents can be claimed again.

    Volatile-tier records are deleted (their bytes died with the process). A record
    whose extent cannot be claimed (outside the tier, or overlapping another) is
    deleted too: its bytes are not trustworthy. Checksums are verified lazily, on
    the first read of each entry.

    A kept record may be the head of a prompt whose last block died with DRAM, so no
    drop_select could end at that prompt's end any more: each of its pending
    consumers may end at any kept block (``ends = pending``), else the survivors would
    be read and never taken. If the index cannot take that change (its map or disk
    full), they stay as stored and the store starts all the same; rows it cannot
    delete then stay in place as ``Index.strays`` (ignored; deleted once it can).
    """
    persistent = {name for name, tier in tiers.items() if not tier.volatile}
    loaded = index.load(persistent)
    kept: list[Record] = []
    bad: list[bytes] = []
    reopened: list[Record] = []
    # A tier whose storage was made at this start (its slab file was removed, or
    # nvme_path names a new one) holds none of the bytes its records name.
    fresh = {name for name, tier in tiers.items() if getattr(tier, "created", False)}
    lost = sum(1 for rec in loaded.kept if rec.tier in fresh)
    if lost:
        log.warning("dropping %d index records of the %s tier: its storage was made at "
                    "this start, so their bytes are gone", lost, ", ".join(sorted(fresh)))
    index.forget([rec.key for rec in loaded.kept if rec.tier in fresh],
                 "entries of a slab made at this start")
    for rec in loaded.kept:
        if rec.tier in fresh:
            continue
        try:
            tiers[rec.tier].claim(Extent(rec.tier, rec.offset, rec.nbytes))
        except (IntegrityError, InvalidRequestError) as exc:
            log.warning("dropping index record %s: %s", rec.key.hex(), exc)
            bad.append(rec.key)
            continue
        if rec.pending > rec.ends:
            reopened.append(rec)
            rec = rec._replace(ends=rec.pending)
        kept.append(rec)
    index.forget(bad, "extents that cannot be claimed")
    if reopened:
        try:
            index.put_many([rec._replace(ends=rec.pending) for rec in reopened])
        except (TierFullError, StorageError) as exc:
            # A full map or disk must not keep the store from starting: those records
            # stay as stored (read, but not taken, until evicted) rather than differ
            # from the index.
            log.warning("%d records kept as stored, not reopened for drop_select: %s",
                        len(reopened), exc)
            as_stored = {rec.key: rec for rec in reopened}
            kept = [as_stored.get(rec.key, rec) for rec in kept]
    dropped = loaded.dropped + len(bad) + lost
    log.info("recovered %s entries, dropped %s records", len(kept), dropped)
    return Recovered(kept, dropped)
