"""The durable index: an LMDB map from a 16-byte key to its ``Record``.

Only ``kvstore.store.facade.Store`` uses this, under its lock, for the records that name
NVMe bytes (the records of memory tiers live in memory only: kvstore/store/catalog.py).
Every method is one LMDB transaction over a whole batch, never one per entry: a
store operation (commit, demotion pass, release, ...) hands all its changed
records to one ``apply`` call.

Invariants:
* Only committed entries are ever written here; a reservation lives in the
  store's memory until it commits, so a crash can lose nothing committed and can
  reveal nothing uncommitted.
* The value is the msgpack list of the record's fields in declaration order; a
  value that does not decode, or whose fields are not as the store's own writes
  make them (``check_record``: types, ranges, ``ntokens`` matching ``tokens``), is
  treated as absent (and dropped by ``load``).
* A change that only removes rows never fails for want of disk space while the
  index's reserve (``Reserve``) has bytes left: LMDB copies every page it changes,
  so a delete needs free pages too, and on a full file system deleting is how an
  operator (``kvstore evict``) and the store make room.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import lmdb
import msgpack

from kvstore.core.errors import ConfigError, IntegrityError, StorageError, TierFullError
from kvstore.core.hashing import KEY_BYTES, NAMESPACE_TAG_BYTES

log = logging.getLogger(__name__)

MAX_META_BYTES = 1024
COMMITTED = "committed"
_FORMAT = 1  # first element of every value; bump when the field list changes
# LMDB maps its lock file writable: a page the file system cannot back (full disk)
# is a SIGBUS when touched, so the file's blocks are allocated before LMDB opens it.
# LMDB keeps a lock file at least this big as it is (more reader slots).
_LOCK_FILE_BYTES = 64 << 10


class Record(NamedTuple):
    """One stored entry: where its bytes are and what they must be."""

    key: bytes
    tier: str
    offset: int
    nbytes: int
    ntokens: int
    tokens: bytes  # int32le token ids of the block; re-checked on every hit
    checksum: int  # xxh3_64 of the entry bytes
    created: float  # wall time
    last_access: float  # wall time
    pins: int
    pending: int  # consumers still expected to drop_select it
    meta: bytes  # small opaque caller bytes (<= MAX_META_BYTES)
    state: str = COMMITTED
    # Offset of a still-valid copy in the nvme tier while the entry is served from a
    # memory tier (kept when an NVMe hit is staged): a restart falls back to it, and
    # demoting the entry again costs no write.
    nvme_copy: int | None = None
    # Fingerprint of the writer's namespace (model, layout, TP rank, salt): the first
    # NAMESPACE_TAG_BYTES of ``hashing.namespace_of``, b"" if the writer sent none.
    # Last and defaulted: records written before it existed decode unchanged.
    namespace: bytes = b""
    # Inserts whose prompt ends at this block (its last block) and whose consumer
    # has not taken it yet: what makes a drop_select that ends here its prompt's own
    # (docs/architecture.md, "Who a drop_select takes from"). Defaulted, as above.
    ends: int = 0


_OFFSET, _COPY = Record._fields.index("offset"), Record._fields.index("nvme_copy")
# One field of each of many records in a C-level pass (``map(tier_of, recs)``): the
# store's per-request passes over a prompt's records, where ``rec.tier`` would be a
# descriptor call per record.
key_of, tier_of, offset_of, nbytes_of, pins_of, pending_of, copy_of = (
    operator.itemgetter(Record._fields.index(name))
    for name in ("key", "tier", "offset", "nbytes", "pins", "pending", "nvme_copy"))


def on_disk(rec: Record) -> Record:
    """What the durable index keeps of a record that names NVMe bytes: an entry
    served from memory with an NVMe copy is kept as that copy, which is all a
    restart could serve."""
    if rec.tier == "nvme" or rec.nvme_copy is None:
        return rec
    # tuple.__new__, not _replace: staging builds one per entry, under the lock.
    return tuple.__new__(Record, (rec[0], "nvme", rec.nvme_copy, *rec[_OFFSET + 1:_COPY],
                                  None, *rec[_COPY + 1:]))


def encode(rec: Record, packer: msgpack.Packer | None = None) -> bytes:
    """The stored value of ``rec``. ``packer`` (one per index, used under the
    store's lock) saves building a Packer per record: a third of the cost."""
    return (packer or msgpack.Packer(use_bin_type=True)).pack((_FORMAT, *rec[1:]))


def decode(key: bytes, value: bytes) -> Record:
    """The record stored under ``key``; raises ``IntegrityError`` on a value that does
    not decode, or whose fields ``check_record`` refuses."""
    try:
        fields = msgpack.unpackb(value, raw=False)
        if not isinstance(fields, list) or fields[0] != _FORMAT:
            raise ValueError(f"unknown record format {fields[:1]!r}")
        rec = Record(bytes(key), *fields[1:])
        if len(fields) < len(Record._fields):
            # Written before ``ends`` existed: which of its pending consumers' prompts
            # ended here is unknown, so each may end here (the old rule). Left at 0,
            # a drop_select would read such an entry and never take it: stranded.
            rec = rec._replace(ends=rec.pending)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise IntegrityError(f"undecodable index record {key.hex()}: {exc}") from exc
    try:
        check_record(rec)
    except ValueError as exc:
        raise IntegrityError(f"damaged index record {key.hex()}: {exc}") from None
    return rec


_INT64 = 1 << 63  # offsets, sizes and counts: what a store ever writes is below this
_TIME = (int, float)


def check_record(rec: Record) -> None:
    """``ValueError`` naming the first field of ``rec`` that is not as the store's own
    writes make it (kvstore/store/writes.py, kvstore/store/types.py): a value damaged
    at rest (a bit flip, a stray writer) that msgpack still decodes. Every field is
    checked here, once, as the record is decoded, so nothing downstream (the victim
    heaps, which compare times and counts; the token re-check of a hit; the matched
    token count a client is told) meets a wrong type or an impossible value.

    Checked: the key's length; tier and state are strings (which tier and state a
    record may have is ``Index.load``'s business); offset, nbytes, nvme_copy and the
    counts pins, pending and ends are ints, non-negative (nbytes positive);
    checksum is a u64; created and last_access finite, non-negative numbers;
    tokens non-empty int32le bytes and ntokens exactly their count (a hit reports
    the ntokens of its records as matched tokens: one that disagrees would tell a
    client of tokens it does not get); meta and namespace bytes of the lengths a
    writer may give. (Whether nbytes fits the tier, and offset its alignment, is
    the tier's ``claim`` at recovery; whether the bytes match checksum, the first
    read's.) The usual, good record costs one expression."""
    (key, tier, offset, nbytes, ntokens, tokens, checksum, created, last_access, pins,
     pending, meta, state, nvme_copy, namespace, ends) = rec
    if (type(key) is bytes and len(key) == KEY_BYTES and type(tier) is str
            and type(state) is str and type(offset) is int and 0 <= offset < _INT64
            and type(nbytes) is int and 0 < nbytes < _INT64
            and type(tokens) is bytes and len(tokens) and not len(tokens) % 4
            and type(ntokens) is int and ntokens == len(tokens) >> 2
            and type(checksum) is int and 0 <= checksum < 1 << 64
            and type(created) in _TIME and 0 <= created < math.inf
            and type(last_access) in _TIME and 0 <= last_access < math.inf
            and type(pins) is int and 0 <= pins < _INT64
            and type(pending) is int and 0 <= pending < _INT64
            and type(ends) is int and 0 <= ends < _INT64
            and type(meta) is bytes and len(meta) <= MAX_META_BYTES
            and type(namespace) is bytes and len(namespace) in (0, NAMESPACE_TAG_BYTES)
            and (nvme_copy is None or type(nvme_copy) is int and 0 <= nvme_copy < _INT64)):
        return
    raise ValueError(_first_bad_field(rec))


def _first_bad_field(rec: Record) -> str:
    """What ``check_record`` found wrong, for the log (the slow path: bad records only)."""
    def count(v: object, low: int = 0) -> bool:
        return type(v) is int and low <= v < _INT64  # (not bool: type is int)

    def time_(v: object) -> bool:
        return type(v) in _TIME and 0 <= v < math.inf  # type: ignore[operator]

    tokens = rec.tokens
    tokens_ok = type(tokens) is bytes and len(tokens) > 0 and len(tokens) % 4 == 0
    checks = [
        ("key", type(rec.key) is bytes and len(rec.key) == KEY_BYTES),
        ("tier", type(rec.tier) is str),
        ("state", type(rec.state) is str),
        ("offset", count(rec.offset)),
        ("nbytes", count(rec.nbytes, 1)),
        ("tokens", tokens_ok),
        ("ntokens", type(rec.ntokens) is int and tokens_ok
         and rec.ntokens == len(tokens) // 4),
        ("checksum", type(rec.checksum) is int and 0 <= rec.checksum < 1 << 64),
        ("created", time_(rec.created)),
        ("last_access", time_(rec.last_access)),
        ("pins", count(rec.pins)),
        ("pending", count(rec.pending)),
        ("ends", count(rec.ends)),
        ("meta", type(rec.meta) is bytes and len(rec.meta) <= MAX_META_BYTES),
        ("namespace", type(rec.namespace) is bytes
         and len(rec.namespace) in (0, NAMESPACE_TAG_BYTES)),
        ("nvme_copy", rec.nvme_copy is None or count(rec.nvme_copy)),
    ]
    name = next((name for name, ok in checks if not ok), "?")
    value = getattr(rec, name, None)
    shown = f"{len(value)} bytes" if isinstance(value, bytes) else f"{value!r:.40}"
    if name == "ntokens" and tokens_ok:
        shown += f" for {len(tokens) // 4} tokens"
    return f"bad {name}: {shown}"


# A key no record has (theirs are KEY_BYTES long): ``Index._turn`` writes and deletes it.
_TURN_KEY = b"\0" * (KEY_BYTES - 1)

# Rows ``Index.drop_strays`` deletes in one transaction, and how long it waits after
# the index refused before it tries again.
STRAY_CHUNK = 4096
STRAY_RETRY_S = 10.0


# The reserve: a ballast file beside LMDB's files, given back RESERVE_STEP at a time
# to a delete the file system refuses for want of space. 4 MiB is a thousand 4 KiB
# pages: a delete of a few hundred rows copies at most a page per row and the pages
# above them (``Admin`` evicts in chunks of EVICT_CHUNK rows on a full disk, each
# chunk's freed pages serving the chunks after it).
RESERVE_NAME = "reserve"
RESERVE_BYTES = 4 << 20
RESERVE_STEP = 1 << 20
RESERVE_RETRY_S = 10.0  # a short reserve is made whole again at most this often


class Reserve:
    """Up to ``nbytes`` of allocated blocks in the file ``path`` (on the index's file
    system), kept so that deleting index rows works on a full disk. Owned by one
    ``Index``, used under the store's lock.

    ``give_back`` frees one ``step`` (the delete that needed it is then retried),
    and the reserve is ``drawn`` on until ``refill`` makes it whole again: once the
    file system has room for the missing part and ``nbytes`` more, so the space a
    delete just freed stays for writes while the disk is still full. Neither ever
    raises: an index without its reserve works as before, and a full disk must not
    keep a store from starting."""

    def __init__(self, path: Path, nbytes: int = RESERVE_BYTES,
                 step: int = RESERVE_STEP) -> None:
        self.path, self.nbytes, self.step = path, nbytes, step
        self.retry_s = RESERVE_RETRY_S
        self._retry_at = 0.0
        self.held = _allocated(path)
        self.drawn = False  # some given back, and not made whole since
        self.refill()
        if self.held < nbytes:
            log.warning("index reserve %s holds %s of %s bytes (its file system is "
                        "nearly full); made whole once there is room", path, self.held,
                        nbytes)

    def give_back(self, why: str) -> bool:
        """Free one ``step`` of the reserve for a delete refused with ``why``; False
        when there is nothing left to give."""
        if self.held <= 0:
            return False
        try:
            os.truncate(self.path, max(0, self.held - self.step))
        except OSError as exc:
            log.error("cannot shrink the index reserve %s: %s", self.path, exc)
            return False
        held, self.held = self.held, _allocated(self.path)
        self.drawn = True
        self._retry_at = time.monotonic() + self.retry_s
        log.warning("index reserve: freed %d bytes for a delete on a full file system "
                    "(%s); %d bytes left", held - self.held, why, self.held)
        return True

    def refill(self) -> None:
        """Make the reserve whole if the file system has room for the missing part and
        ``nbytes`` more; after a try, not again for ``retry_s``."""
        missing = self.nbytes - self.held
        now = time.monotonic()
        if missing <= 0 or now < self._retry_at:
            return
        self._retry_at = now + self.retry_s
        try:
            fs = os.statvfs(self.path.parent)
            if fs.f_bavail * fs.f_frsize < missing + self.nbytes:
                return
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
            finally:
                os.close(fd)
        except OSError as exc:  # raced to full, or no fallocate: it stays short
            log.debug("cannot refill the index reserve %s: %s", self.path, exc)
        self.held = _allocated(self.path)
        if self.held >= self.nbytes and self.drawn:
            self.drawn = False
            log.info("index reserve %s is whole again", self.path)


def _allocated(path: Path) -> int:
    """Bytes of ``path`` backed by blocks (a sparse tail reserves nothing)."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return min(st.st_size, st.st_blocks * 512)


def _no_space(exc: lmdb.Error) -> bool:
    """Did LMDB fail for want of space: ENOSPC (``DiskError``), EDQUOT, or the EIO it
    makes of a short write (the file system filled up under it)?"""
    text = str(exc)
    return (isinstance(exc, lmdb.DiskError) or "Input/output" in text
            or "quota" in text.lower())


class LoadResult(NamedTuple):
    kept: list[Record]
    dropped: int  # volatile-tier, uncommitted, undecodable or damaged records removed
    damaged: int = 0  # of those, the undecodable or damaged (decode's IntegrityError)


class Index:
    """LMDB environment at ``path`` (a directory) holding one unnamed database."""

    def __init__(self, path: str | os.PathLike, map_size: int, sync: bool = True) -> None:
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            check_data_file(Path(path) / "data.mdb")
            _allocate_lock_file(Path(path) / "lock.mdb")
        except OSError as exc:
            raise ConfigError(f"cannot open index at {path}: {exc.strerror or exc}") from None
        try:
            # sync=False (fsync "never") trades durability of the last commits
            # after a power loss for speed; a killed process loses nothing.
            # Never writemap: LMDB would then write into a writable map of a sparse
            # file, and a page a full file system cannot back kills the process
            # with SIGBUS. With write() calls a full disk is an error (ENOSPC).
            self._env = lmdb.open(str(path), map_size=map_size, subdir=True,
                                  sync=sync, metasync=sync, max_dbs=0, writemap=False)
        except lmdb.Error as exc:
            raise ConfigError(f"cannot open index at {path}: {exc}") from exc
        self.path = str(path)
        self.reserve = Reserve(Path(path) / RESERVE_NAME)
        self._packer = msgpack.Packer(use_bin_type=True)
        # Rows the store does not hold that the index could not delete when it should
        # have (its map or disk full: ``forget``); ``drop_strays`` tries again. A
        # write of a record under one of these keys makes it a row like any other.
        self.strays: set[bytes] = set()
        self.stray_retry_s = STRAY_RETRY_S
        self._stray_retry_at = 0.0
        self._stray_error: Exception | None = None

    # -------------------------------------------------------------- reads
    def get(self, key: bytes) -> Record | None:
        with self._env.begin() as txn:
            value = txn.get(key)
        return None if value is None else decode(key, value)

    def __len__(self) -> int:
        return self._env.stat()["entries"]

    def records(self) -> Iterator[Record]:
        """Every record, in key order (a snapshot: one read transaction); ``strays``
        left out."""
        with self._env.begin() as txn:
            items = list(txn.cursor())
        for key, value in items:
            if key not in self.strays:
                yield decode(key, value)

    # -------------------------------------------------------------- writes
    def apply(self, put: Iterable[Record] = (), delete: Iterable[bytes] = ()) -> None:
        """Write ``put`` and remove ``delete`` in one transaction (deletes first).
        All or nothing; a full map is ``TierFullError`` (grow store.index_map_bytes).
        A change that only deletes draws on the reserve when the disk is full."""
        delete = list(delete)
        pack = self._packer.pack
        items = []
        for rec in put:
            if rec.state != COMMITTED:
                raise IntegrityError(f"refusing to persist a {rec.state} record")
            items.append((rec.key, pack((_FORMAT, *rec[1:]))))

        def change(txn: lmdb.Transaction) -> None:
            for key in delete:
                txn.delete(key)
            if items:
                txn.cursor().putmulti(items)  # one C loop for the batch

        self._write(change, frees=not items)
        if self.strays:
            self.strays.difference_update(delete)
            self.strays.difference_update(key for key, _ in items)

    def _write(self, change: Callable[[lmdb.Transaction], None], frees: bool) -> None:
        """Run ``change`` in one write transaction. One that only removes rows
        (``frees``) and that the file system refuses for want of space is tried
        again with a step of the reserve given back, until it commits or the reserve
        is gone. LMDB errors become ``TierFullError`` / ``StorageError``."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    change(txn)
                break
            except lmdb.MapFullError as exc:
                raise TierFullError(f"index map is full ({self.path}): raise "
                                    f"store.index_map_bytes") from exc
            except lmdb.Error as exc:  # DiskError (ENOSPC, EIO), ReadonlyError, ...
                if frees and _no_space(exc) and self.reserve.give_back(_reason(exc)):
                    continue
                raise StorageError(f"cannot write the index at {self.path}: "
                                   f"{_reason(exc)}; nothing was changed") from exc
        if self.reserve.held < self.reserve.nbytes:
            if frees and self.reserve.drawn:  # the disk is, or was, full
                self._turn()
            self.reserve.refill()

    def _turn(self) -> None:
        """Commit a transaction that changes no row. LMDB reuses the pages a
        transaction frees only from the second transaction after it (the snapshot
        before it stays readable until then): on a full disk, the pages a delete
        freed would not serve the very next write, only the one after this."""
        try:
            with self._env.begin(write=True) as txn:
                txn.put(_TURN_KEY, b"")
                txn.delete(_TURN_KEY)
        except lmdb.Error as exc:  # no room even for this: the next write may fail once
            log.debug("index %s: no turn after a delete: %s", self.path, exc)

    def put_many(self, records: Iterable[Record]) -> None:
        self.apply(put=records)

    def forget(self, keys: Iterable[bytes], why: str) -> None:
        """Delete rows the store will not hold (``why`` names them in the log). Those
        the index cannot delete (``TierFullError`` / ``StorageError``: a full map or
        disk) stay as ``strays``, ignored, for ``drop_strays`` to delete later: a
        full index must not keep the store from starting."""
        keys = list(keys)
        if not keys:
            return
        self.strays.update(keys)
        self._stray_retry_at = 0.0
        left = self.drop_strays()
        if left:
            log.warning("%d index rows (%s) left in place, to delete once the index "
                        "has room: %s", left, why, self._stray_error)

    def drop_strays(self) -> int:
        """Delete ``strays``, ``STRAY_CHUNK`` to a transaction (each one that commits
        frees pages for the next); after a refusal, not again for ``stray_retry_s``
        (the reaper calls this every tick). How many are left."""
        if not self.strays or time.monotonic() < self._stray_retry_at:
            return len(self.strays)
        had = len(self.strays)
        pending = sorted(self.strays)
        for at in range(0, len(pending), STRAY_CHUNK):
            try:
                self.apply(delete=pending[at:at + STRAY_CHUNK])
            except (TierFullError, StorageError) as exc:
                self._stray_error = exc
                self._stray_retry_at = time.monotonic() + self.stray_retry_s
                break
        if had and not self.strays and self._stray_error is not None:
            log.info("deleted the %d index rows left in place earlier", had)
        return len(self.strays)

    def clear(self) -> None:
        self._write(lambda txn: txn.drop(self._env.open_db(txn=txn), delete=False),
                    frees=True)
        self.strays.clear()

    def load(self, persistent_tiers: set[str]) -> LoadResult:
        """Start-up pass: keep committed records of ``persistent_tiers``, delete the
        rest (volatile tiers lost their bytes with the process) in one transaction
        (``forget``: left as strays when the index cannot take it). A volatile-tier
        record with an NVMe copy falls back to that copy."""
        try:
            result, doomed = self._load(persistent_tiers)
        except lmdb.Error as exc:
            raise ConfigError(f"cannot load the index at {self.path}: {_reason(exc)}") from exc
        self.forget(doomed, "undecodable, damaged, uncommitted, or of a tier without its "
                            "bytes")
        return result

    def _load(self, persistent_tiers: set[str]) -> tuple[LoadResult, list[bytes]]:
        kept: list[Record] = []
        fallen_back: list[Record] = []
        doomed: list[bytes] = []
        damaged, first = 0, ""  # undecodable or damaged rows: how many, the first's reason
        with self._env.begin() as txn:
            for key, value in txn.cursor():
                try:
                    rec = decode(key, value)
                except IntegrityError as exc:  # undecodable, or a field check_record refuses
                    damaged += 1
                    first = first or str(exc)
                    log.debug("dropping %s", exc)
                    doomed.append(bytes(key))
                    continue
                if rec.state != COMMITTED:
                    doomed.append(bytes(key))
                elif rec.tier in persistent_tiers:
                    kept.append(rec)
                elif rec.nvme_copy is not None and "nvme" in persistent_tiers:
                    fallen_back.append(on_disk(rec))
                else:
                    doomed.append(bytes(key))
            # (fallen_back rows stay as they are, which means the same: on_disk.
            # Rewriting them could make a full map refuse the start.)
        if damaged:  # one line however many: a damaged index may hold millions
            log.warning("dropping %d index records that are undecodable or damaged (their "
                        "entries are lost, their NVMe space is free); first: %s",
                        damaged, first)
        return LoadResult(kept + fallen_back, len(doomed), damaged), doomed

    def sync(self) -> None:
        self._env.sync(True)

    def info(self) -> dict:
        stat = self._env.stat()
        info = self._env.info()
        return {"entries": stat["entries"], "map_size": info["map_size"],
                "used_bytes": stat["psize"] * (stat["leaf_pages"] + stat["branch_pages"]
                                               + stat["overflow_pages"]),
                "reserve_bytes": self.reserve.held}

    def close(self) -> None:
        self._env.close()


# LMDB's data file starts with two meta pages (x86-64 layout, LMDB 0.9): after a
# 16-byte page header, magic u32, version u32, address, mapsize, two 48-byte db
# records (the first's leading u32 is the page size), last page number, txn id.
_META = struct.Struct("<IIQQ I44x 48x QQ")
_MAGIC = 0xBEEFC0DE


def check_data_file(path: Path) -> None:
    """Refuse an LMDB data file shorter than its own meta page says it is.

    LMDB maps the file and trusts its meta pages: reading a page past the end of
    a truncated file is a SIGBUS that kills the process. So before opening, the
    newest valid meta page's last page number is checked against the file size.
    A missing file is fine (LMDB creates it), an empty one is not; anything else
    wrong with the meta pages is left to LMDB, which refuses it with an error.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 16 + _META.size, 0)
        # An empty file would be initialized as a new index: refused too, since
        # every record it held would be lost without a word.
        if len(head) < 16 + _META.size:
            raise ConfigError(f"index {path} is truncated ({size} bytes, less than its "
                              f"first page): {_ASIDE}")
        page = _META.unpack_from(head, 16)[4]
        metas = [head, os.pread(fd, 16 + _META.size, page)] if 512 <= page <= 1 << 16 else [head]
    finally:
        os.close(fd)
    best = None
    for raw in metas:
        if len(raw) < 16 + _META.size:
            continue
        magic, _version, _addr, _mapsize, _psize, last_pg, txnid = _META.unpack_from(raw, 16)
        if magic == _MAGIC and (best is None or txnid > best[1]):
            best = (last_pg, txnid)
    if best is None:
        return  # not a data file LMDB recognises: it says so itself
    need = (best[0] + 1) * page
    if size < need:
        raise ConfigError(f"index {path} is truncated ({size} bytes, its meta page needs "
                          f"{need}): {_ASIDE}")


_ASIDE = ("stop, move the data dir aside (or restore it) and start again; the NVMe "
          "entries it indexed are lost")


def _allocate_lock_file(path: Path) -> None:
    """Give LMDB's lock file real blocks now (ENOSPC here is an error, not a SIGBUS
    later when LMDB touches its writable map of the file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(_LOCK_FILE_BYTES, os.fstat(fd).st_size))
    finally:
        os.close(fd)


def _reason(exc: lmdb.Error) -> str:
    """LMDB's message without its C function name: 'No space left on device'. A
    short write (the disk filled up mid-write) is LMDB's EIO: say what it likely is."""
    text = str(exc)
    text = text.split(": ", 1)[1] if ": " in text else text
    if "Input/output" in text:
        text += " (a short write: is its file system full?)"
    return text
