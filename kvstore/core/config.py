"""One frozen configuration tree.

Loaded from a TOML file, then ``KVSTORE_<SECTION>_<FIELD>`` environment variables,
then explicit overrides (CLI flags), each layer replacing the one before. Sizes
accept ``64GiB``-style strings. Every dataclass validates itself in
``__post_init__``; an invalid value raises ``ConfigError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping, get_type_hints

from kvstore.core.errors import ConfigError
from kvstore.core.protocol import (MAX_INLINE_BYTES, MAX_LEASE_S, MIN_INLINE_PART_BYTES,
                                   ROUTER_INLINE_BYTES)

log = logging.getLogger(__name__)
_UNKNOWN_ENV_WARNED: set[str] = set()  # KVSTORE_* names warned about (once each)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """``"64GiB"`` -> 68719476736. Ints pass through; negative sizes are refused."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size must be >= 0, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a size: {value!r} (use e.g. 512MiB, 64GiB)")
    nbytes = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if nbytes != int(nbytes):  # "1.5" bytes: refuse rather than silently truncate
        raise ConfigError(f"not a whole number of bytes: {value!r}")
    return int(nbytes)


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


Size = int  # annotation marker: fields typed Size accept "64GiB" strings
TIER_PAGE_BYTES = 4096  # every tier allocates whole pages of this size
# The TE transports kvstore lets a node choose (kvstore/transport/env.py makes TE use
# the one chosen: left alone, TE takes RDMA whenever it finds a NIC, else TCP).
TE_PROTOCOLS = ("tcp", "rdma")
_DEVICE_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")  # mlx5_0, erdma_0, rocep1s0f0, ...


def check_te_protocol(name: str, protocol: object) -> str:
    """``protocol`` if it is one of ``TE_PROTOCOLS``, else a one-line ConfigError."""
    if protocol not in TE_PROTOCOLS:
        raise ConfigError(f"{name}: {protocol!r} is not a TE protocol; use one of "
                          f"{', '.join(TE_PROTOCOLS)}")
    return str(protocol)


def parse_te_devices(name: str, devices: object) -> tuple[str, ...]:
    """``"mlx5_0, mlx5_1"`` -> ``("mlx5_0", "mlx5_1")``; ``""`` -> ``()``: TE then uses
    every RDMA NIC it discovers. A sequence of names is taken as well."""
    if isinstance(devices, (list, tuple)):
        devices = ",".join(str(d) for d in devices)
    if not isinstance(devices, str):
        raise ConfigError(f"{name}: {devices!r} is not a device list (e.g. 'mlx5_0,mlx5_1')")
    names = tuple(d.strip() for d in devices.split(",") if d.strip())
    for device in names:
        if not _DEVICE_RE.match(device):
            raise ConfigError(f"{name}: {device!r} is not an RDMA device name; give a "
                              "comma-separated string such as 'mlx5_0,mlx5_1'")
    return names


@dataclass(frozen=True)
class TiersConfig:
    """Capacity of each tier; 0 disables a tier."""

    gpu_bytes: Size = 0
    gpu_device: str = "cuda:0"
    dram_bytes: Size = 1 << 30
    # Back the DRAM arena with a shared-memory file so same-node clients memcpy into it.
    dram_shared: bool = True
    dram_prefault: bool = True
    nvme_bytes: Size = 4 << 30
    nvme_path: str = ""  # slab file or block device; default <data_dir>/nvme.slab
    nvme_direct: str = "auto"  # auto | on | off  (O_DIRECT)
    nvme_fsync: str = "commit"  # never | commit | always

    def __post_init__(self) -> None:
        _sizes(self, "gpu_bytes", "dram_bytes", "nvme_bytes")
        for name in ("gpu_bytes", "dram_bytes", "nvme_bytes"):
            value = getattr(self, name)
            if 0 < value < TIER_PAGE_BYTES:  # a tier is whole 4 KiB pages
                raise ConfigError(f"tiers.{name}: {value} bytes is less than one 4KiB page "
                                  f"(use 0 to disable the tier, or e.g. 64MiB)")
        _choice(self, "nvme_direct", ("auto", "on", "off"))
        _choice(self, "nvme_fsync", ("never", "commit", "always"))


@dataclass(frozen=True)
class PolicyConfig:
    """When entries move down a tier: above ``high_watermark`` of a tier's capacity,
    least-recently-used entries demote until usage is under ``low_watermark``."""

    high_watermark: float = 0.95
    low_watermark: float = 0.85
    stage_nvme_hits: bool = True
    background_writeback: bool = True
    writeback_batch_bytes: Size = 64 << 20
    # Rooms (standing room writers hold for their next insert, so it stores in one
    # round trip) take at most this fraction of a memory tier, all together; 0: none.
    room_fraction: float = 0.25

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError("policy: need 0 < low_watermark <= high_watermark <= 1")
        if not 0 <= self.room_fraction <= 0.5:
            raise ConfigError("policy: room_fraction must be in [0, 0.5]")
        _sizes(self, "writeback_batch_bytes")
        if self.writeback_batch_bytes <= 0:
            raise ConfigError("policy: writeback_batch_bytes must be > 0")


@dataclass(frozen=True)
class StoreConfig:
    data_dir: str = "kvstore-data"
    block_tokens: int = 16
    reservation_lease_s: float = 30.0
    read_lease_s: float = 30.0
    index_map_bytes: Size = 8 << 30
    # When the server hashes a commit's bytes against the writer's checksums:
    # "background" (the commit answers at once; a scrub thread checks the entries
    # soon after, and every reader verifies what it receives anyway) or "inline"
    # (the commit fails on a mismatch and stores nothing). docs/operations.md.
    verify_commits: str = "background"
    # Answer a commit or put once what can fail is done (checks, index write) and make
    # its entries visible in memory right after the reply, before the next request
    # (kvstore/store/writes.py). docs/operations.md.
    answer_first: bool = True

    def __post_init__(self) -> None:
        _sizes(self, "index_map_bytes")
        _positive(self, "block_tokens")
        for name in ("reservation_lease_s", "read_lease_s"):
            # At most the longest lease a request may ask for (kvstore.core.protocol):
            # an infinite one would keep a dead writer's or reader's entries forever.
            seconds(getattr(self, name), f"store.{name}", most=MAX_LEASE_S)
        if not str(self.data_dir).strip():
            raise ConfigError("store.data_dir (--data-dir) is empty; name a directory "
                              "(the default is kvstore-data)")
        if self.verify_commits not in ("background", "inline"):
            raise ConfigError(f"store.verify_commits: {self.verify_commits!r} is not "
                              "'background' or 'inline'")


def _inline(section: Any) -> None:
    if section.inline_max_bytes > MAX_INLINE_BYTES:
        raise ConfigError(f"{type(section).__name__}.inline_max_bytes must be at most "
                          f"{MAX_INLINE_BYTES} (1TiB), got {section.inline_max_bytes}")


MAX_GC_YOUNG = 10**8  # what gc.set_threshold takes is a C int; far above any request
MAX_PEER_TIMEOUT_S = 86_400.0  # a day: longer is "never", which is 0
# The least ``server.max_message_bytes`` a server starts with. The limit applies to
# every request frame (kvstore.core.protocol.decode_request / peek_id), and a frame
# over it cannot even have its id read, so its error reply carries id 0, which the
# client drops as stale: below the smallest request the server answers nothing at
# all. 4 KiB holds every request without keys (hello, health, stats, clear,
# release, ...: 25 - 100 bytes) and a one-block insert (reserve or put) of 16-token
# blocks with the full 1 KiB of caller meta (~1.3 KiB), so the server can always say
# hello (whose reply tells clients the limit, which they then check before sending).
MIN_MESSAGE_BYTES = 4096


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 7700
    te_host: str = ""  # address TE binds/advertises; default: host
    te_metadata: str = "P2PHANDSHAKE"  # or etcd://host:port, http://...
    te_protocol: str = "tcp"  # tcp | rdma
    te_devices: str = ""  # RDMA NICs TE may use, e.g. "mlx5_0,mlx5_1"; empty: all
    max_message_bytes: Size = 16 << 20  # at least MIN_MESSAGE_BYTES (4KiB)
    metrics_port: int = 0  # 0: no Prometheus endpoint
    curve_secret_key: str = ""  # file written by `kvstore keys`; empty: no CURVE
    curve_authorized_keys: str = ""  # directory of client public keys
    busy_after_s: float = 2.0
    # A Unix socket beside the shared DRAM arena for clients on this node
    # (kvstore/server/local.py); off, or without a shared arena, they use the ROUTER.
    local_socket: bool = True
    # The stream door: the same framing over TCP, for clients on other nodes; an
    # acquire's bytes follow its reply there (kvstore/server/local.py). Opened only
    # without CURVE (it bypasses it, as the ROUTER without CURVE admits anyone).
    stream_socket: bool = True
    stream_port: int = 0  # 0: any free port (the hello names it), as TE takes its own
    # The serving process's young-generation GC threshold (kvstore.server.loop.tune_gc;
    # what start-up made is frozen out of every collection). 0: Python's own settings.
    gc_young: int = 50_000
    # An acquire's bytes, up to this many, go in its reply when the client asks
    # (client.inline_max_bytes) and they are all in DRAM (over the ZeroMQ port: at
    # most 64 MiB); 0: always over TE.
    inline_max_bytes: Size = 4 << 30
    # A client connection that answers no ZeroMQ heartbeat for this long is closed
    # (and what was queued for it dropped); 0: never.
    peer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _sizes(self, "max_message_bytes", "inline_max_bytes")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ConfigError(f"server.max_message_bytes (--max-message-bytes): "
                              f"{self.max_message_bytes} is below the minimum of "
                              f"{MIN_MESSAGE_BYTES} (4KiB) that a hello or health request "
                              f"needs; the default is 16MiB")
        _inline(self)
        seconds(self.busy_after_s, "server.busy_after_s")
        if isinstance(self.peer_timeout_s, bool) \
                or not isinstance(self.peer_timeout_s, (int, float)) \
                or not 0 <= self.peer_timeout_s <= MAX_PEER_TIMEOUT_S:
            raise ConfigError(f"ServerConfig.peer_timeout_s must be a number in "
                              f"0..{MAX_PEER_TIMEOUT_S:g}, got {self.peer_timeout_s!r}")
        if isinstance(self.gc_young, bool) or not isinstance(self.gc_young, int) \
                or not 0 <= self.gc_young <= MAX_GC_YOUNG:
            raise ConfigError(f"ServerConfig.gc_young must be an int in 0..{MAX_GC_YOUNG}")
        _te_settings(self, "server")
        if not 0 < self.port < 65536 or not 0 <= self.metrics_port < 65536 \
                or not 0 <= self.stream_port < 65536:
            raise ConfigError("server: ports must be in 1..65535")


@dataclass(frozen=True)
class ClusterConfig:
    etcd: str = ""  # etcd://host:port; empty: single node
    prefix: str = "/kvstore/nodes/"
    ttl_s: int = 5
    node_id: str = ""  # default: host:port
    # The same on every client of a cluster (kvstore.cluster.placement, docs/cluster.md).
    placement_blocks: int = 256  # at most this many leading blocks choose a prompt's node

    def __post_init__(self) -> None:
        _positive(self, "ttl_s", "placement_blocks")


MIN_TE_PIECE_BYTES = 64 << 10  # smaller TE transfers cost more than they carry
TE_WAITS = ("sleep", "yield", "spin")  # client.te_wait (kvstore.client.datapath)


@dataclass(frozen=True)
class ClientConfig:
    server: str = "tcp://127.0.0.1:7700"
    timeout_s: float = 10.0
    te_host: str = "127.0.0.1"
    te_protocol: str = "tcp"  # tcp | rdma; the same as the servers'
    te_devices: str = ""  # RDMA NICs this client's TE may use; empty: all
    staging_bytes: Size = 256 << 20
    te_piece_bytes: Size = 0  # 0: chosen by te_wait; N: N-byte pieces
    te_wait: str = "sleep"  # sleep / yield: streamed async pieces; spin: TE's sync calls
    prefault_arena: bool = True
    # Same-node copies into the server's shared arena with non-temporal stores (the
    # optional C extension kvstore.client._ntcopy; without it, numpy's copy).
    stream_copies: bool = True
    curve_server_public_key: str = ""
    curve_secret_key: str = ""
    etcd: str = ""
    # A drop_select / get of at most this many bytes asks for them in the acquire's
    # reply (one round trip, no TE read) when te_protocol is tcp (over the ZeroMQ
    # port: at most 64 MiB); 0: always TE.
    inline_max_bytes: Size = 4 << 30
    # A client on another node than its server, without CURVE, sends its requests
    # over the server's stream door (server.stream_socket) when its hello names one;
    # acquired bytes then come straight into their destination. false: the ROUTER.
    stream_socket: bool = True
    # Over the stream door, the server ends a read's lease once it has sent the bytes
    # (a drop_select's entries go then) and no release follows a good read. false:
    # released after the read is verified, as over the ROUTER.
    release_sent: bool = True
    # ... in parts of about this many bytes (whole entries), each copied and verified
    # while the next is on the wire; 0: in one part.
    inline_part_bytes: Size = 512 << 10

    def __post_init__(self) -> None:
        _sizes(self, "staging_bytes", "te_piece_bytes", "inline_max_bytes",
               "inline_part_bytes")
        _inline(self)
        if self.inline_part_bytes and not \
                MIN_INLINE_PART_BYTES <= self.inline_part_bytes <= ROUTER_INLINE_BYTES:
            raise ConfigError(f"client.inline_part_bytes must be 0 or "
                              f"{MIN_INLINE_PART_BYTES} (64KiB) .. {ROUTER_INLINE_BYTES} "
                              f"(64MiB), got {self.inline_part_bytes}")
        seconds(self.timeout_s, "client.timeout_s")
        if 0 < self.te_piece_bytes < MIN_TE_PIECE_BYTES:
            raise ConfigError(f"client.te_piece_bytes: {self.te_piece_bytes} is below "
                              f"{MIN_TE_PIECE_BYTES} (64KiB); 0 lets te_wait choose")
        if self.te_wait not in TE_WAITS:
            raise ConfigError(f"client.te_wait must be one of {', '.join(TE_WAITS)}, "
                              f"got {self.te_wait!r}")
        _te_settings(self, "client")


@dataclass(frozen=True)
class KVStoreConfig:
    tiers: TiersConfig = field(default_factory=TiersConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    client: ClientConfig = field(default_factory=ClientConfig)

    def replace(self, **sections: Mapping[str, Any]) -> "KVStoreConfig":
        """New config with ``section={field: value}`` overrides applied."""
        return _merge(self, {k: dict(v) for k, v in sections.items()})


def load_config(path: str | os.PathLike | None = None,
                env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Mapping[str, Any]] | None = None,
                sections: Iterable[str] | None = None) -> KVStoreConfig:
    """TOML file, then ``KVSTORE_*`` environment, then ``overrides``.

    ``sections``: read only these sections, of the file and of the environment (a
    tool that uses ``[client]`` alone, say). The node's environment, and often its
    config file, are shared with the server, whose options a client never reads: a
    bad ``KVSTORE_SERVER_*`` or ``[server]`` must not stop ``kvstore health`` (the
    server's own start reports it). None: every section (the server's own start)."""
    cfg = KVStoreConfig()
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        if sections is not None:  # (a name that is no section still fails _merge)
            known = {f.name for f in fields(KVStoreConfig)}
            data = {k: v for k, v in data.items() if k in set(sections) or k not in known}
        cfg = _merge(cfg, data)
    source = os.environ if env is None else env
    if sections is not None:
        prefixes = tuple(f"KVSTORE_{name.upper()}_" for name in sections)
        source = {k: v for k, v in source.items() if k.startswith(prefixes)}
    cfg = _merge(cfg, _from_env(source))
    if overrides:
        if not all(isinstance(sec, Mapping) for sec in overrides.values()):
            raise ConfigError("overrides must be {section: {field: value}}")
        cfg = _merge(cfg, {k: {f: v for f, v in sec.items() if v is not None}
                           for k, sec in overrides.items()})
    return cfg


def client_config_from_env(env: Mapping[str, str] | None = None) -> ClientConfig:
    """The ``[client]`` options from ``KVSTORE_CLIENT_*`` alone: what a client made
    without a config uses. The other sections' variables (a server's, sharing the
    node's environment) are not read, so a bad one cannot stop a client."""
    return load_config(env=env, sections=("client",)).client


def describe_options() -> list[tuple[str, str, str, str]]:
    """(toml key, env var, type, default) for every option; docs are generated from it."""
    rows = []
    for section, cls in _section_classes().items():
        hints = get_type_hints(cls)
        for f in fields(cls):
            default = getattr(cls(), f.name)
            rows.append((f"{section}.{f.name}",
                         f"KVSTORE_{section.upper()}_{f.name.upper()}",
                         _type_name(hints[f.name]), repr(default)))
    return rows


# ------------------------------------------------------------------ helpers
def _section_classes() -> dict[str, type[Any]]:
    """Section name -> its dataclass (``"tiers"`` -> ``TiersConfig``), in field order."""
    hints = get_type_hints(KVStoreConfig)
    return {f.name: hints[f.name] for f in fields(KVStoreConfig)}


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", str(t))


def _from_env(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    known: set[str] = set()
    for section, cls in _section_classes().items():
        for f in fields(cls):
            name = f"KVSTORE_{section.upper()}_{f.name.upper()}"
            known.add(name)
            if name in env:
                out.setdefault(section, {})[f.name] = env[name]
    _warn_unknown_env(env, known)
    return out


def _warn_unknown_env(env: Mapping[str, str], known: set[str]) -> None:
    """A ``KVSTORE_<SECTION>_*`` variable that names no option is most likely a typo
    that would silently leave the option at its default: say so, once per name (a
    warning, not the error an unknown TOML key is: the environment is shared with
    other versions and tools)."""
    prefixes = tuple(f"KVSTORE_{section.upper()}_" for section in _section_classes())
    for name in env:
        if name.startswith(prefixes) and name not in known \
                and name not in _UNKNOWN_ENV_WARNED:
            _UNKNOWN_ENV_WARNED.add(name)
            close = difflib.get_close_matches(name, sorted(known), n=1)
            log.warning("environment variable %s names no kvstore option; ignored%s", name,
                        f" (did you mean {close[0]}?)" if close else "")


def _merge(cfg: KVStoreConfig, data: Mapping[str, Any]) -> KVStoreConfig:
    sections = {f.name: f for f in fields(KVStoreConfig)}
    new = {}
    for name, values in data.items():
        if name not in sections:
            raise ConfigError(f"unknown config section [{name}]; one of {sorted(sections)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{name}] must be a table")
        current = getattr(cfg, name)
        new[name] = _replace_section(current, name, values)
    return dataclasses.replace(cfg, **new)


def _replace_section(current: Any, section: str, values: Mapping[str, Any]) -> Any:
    hints = get_type_hints(type(current))
    raw = type(current).__annotations__  # (strings here: "Size" is told from "int")
    known = {f.name for f in fields(current)}
    changes = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown option {section}.{key}; one of {sorted(known)}")
        changes[key] = _coerce(f"{section}.{key}", hints[key], value,
                               size=raw.get(key) in ("Size", Size))
    return dataclasses.replace(current, **changes)


def _coerce(name: str, typ: Any, value: Any, size: bool = True) -> Any:
    """``value`` as ``typ``; an int only from a ``Size`` field accepts "64GiB"."""
    try:
        if typ is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(value)
                return low in ("1", "true", "yes", "on")
            return bool(value)
        if typ is int:
            # bool is an int subclass and 1.5 would truncate: both are mistakes here.
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            if not size:  # a port, a count, seconds: "5m" is not five minutes here
                return int(value.strip()) if isinstance(value, str) else int(value)
            if isinstance(value, str) and value.strip().startswith("-") and _SIZE_RE.match(
                    value.strip()[1:]):  # "-1GiB": say what is wrong with it
                raise ConfigError(f"{name}: must be >= 0, got {value!r}")
            if isinstance(value, str) and _SIZE_RE.match(value) and not value.strip().isdigit():
                return parse_size(value)
            return int(value)
        if typ is float:
            return float(value)
        return str(value)
    except ConfigError as exc:
        if str(exc).startswith(f"{name}:"):
            raise
        raise ConfigError(f"{name}: cannot use {value!r} as {_type_name(typ)}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: cannot use {value!r} as {_type_name(typ)}") from exc


def _sizes(obj: Any, *names: str) -> None:
    for name in names:
        try:
            object.__setattr__(obj, name, parse_size(getattr(obj, name)))
        except ConfigError as exc:
            raise ConfigError(f"{type(obj).__name__}.{name}: {exc}") from exc


def seconds(value: Any, name: str, error: type[Exception] = ConfigError,
            most: float = math.inf) -> float:
    """``value`` as a timeout: a finite number of seconds > 0 (and at most ``most``),
    else ``error`` naming ``name`` (NaN, infinity, 0, a negative number or a
    non-number: each would otherwise end in a traceback deep in a call, or a call
    that never ends)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value < math.inf or value > most:
        limit = "" if most == math.inf else f" and at most {most:g}"
        raise error(f"{name} must be a finite number of seconds > 0{limit}, got {value!r}")
    return float(value)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        # "not > 0" also refuses NaN; non-numbers are a ConfigError, not a TypeError.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be > 0")


def _choice(obj: Any, name: str, allowed: tuple[str, ...]) -> None:
    if getattr(obj, name) not in allowed:
        raise ConfigError(f"{type(obj).__name__}.{name} must be one of {allowed}, "
                          f"got {getattr(obj, name)!r}")


def _te_settings(obj: Any, section: str) -> None:
    """Check ``te_protocol``; store ``te_devices`` as ``"a,b"`` (spaces dropped)."""
    check_te_protocol(f"{section}.te_protocol", obj.te_protocol)
    devices = parse_te_devices(f"{section}.te_devices", obj.te_devices)
    object.__setattr__(obj, "te_devices", ",".join(devices))


def resolve_data_path(data_dir: str, path: str, default_name: str) -> Path:
    return Path(path) if path else Path(data_dir) / default_name
