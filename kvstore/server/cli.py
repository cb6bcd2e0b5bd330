"""The ``kvstore-server`` command line: config layers, start-up, signals, shutdown.

Config precedence: built-in defaults, then ``--config FILE`` (TOML), then
``KVSTORE_*`` environment, then the flags below. With no flags at all the server
binds 127.0.0.1:7700 with a DRAM tier and a file-backed NVMe tier under
./kvstore-data and TE in P2P-handshake mode.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
from typing import Any

import click

from kvstore.core.config import KVStoreConfig, format_size, load_config
from kvstore.core.errors import ConfigError, KVStoreError

log = logging.getLogger("kvstore.server")

# flag -> (config section, field); click passes None for flags not given.
_FLAGS = {
    "host": ("server", "host"), "port": ("server", "port"), "te_host": ("server", "te_host"),
    "te_metadata": ("server", "te_metadata"), "te_protocol": ("server", "te_protocol"),
    "te_devices": ("server", "te_devices"), "metrics_port": ("server", "metrics_port"),
    "max_message_bytes": ("server", "max_message_bytes"),
    "curve_secret_key": ("server", "curve_secret_key"),
    "curve_authorized_keys": ("server", "curve_authorized_keys"),
    "data_dir": ("store", "data_dir"), "block_tokens": ("store", "block_tokens"),
    "reservation_lease": ("store", "reservation_lease_s"), "read_lease": ("store", "read_lease_s"),
    "verify_commits": ("store", "verify_commits"), "answer_first": ("store", "answer_first"),
    "dram": ("tiers", "dram_bytes"), "dram_shared": ("tiers", "dram_shared"),
    "dram_prefault": ("tiers", "dram_prefault"),
    "local_socket": ("server", "local_socket"), "gc_young": ("server", "gc_young"),
    "stream_socket": ("server", "stream_socket"), "stream_port": ("server", "stream_port"),
    "inline_max_bytes": ("server", "inline_max_bytes"),
    "peer_timeout": ("server", "peer_timeout_s"), "busy_after": ("server", "busy_after_s"),
    "nvme": ("tiers", "nvme_bytes"), "nvme_path": ("tiers", "nvme_path"),
    "nvme_direct": ("tiers", "nvme_direct"), "nvme_fsync": ("tiers", "nvme_fsync"),
    "gpu": ("tiers", "gpu_bytes"), "gpu_device": ("tiers", "gpu_device"),
    "high_watermark": ("policy", "high_watermark"), "low_watermark": ("policy", "low_watermark"),
    "cluster": ("cluster", "etcd"), "cluster_prefix": ("cluster", "prefix"),
    "cluster_ttl": ("cluster", "ttl_s"), "node_id": ("cluster", "node_id"),
}


def _overrides(flags: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for flag, (section, name) in _FLAGS.items():
        if flags.get(flag) is not None:
            out.setdefault(section, {})[name] = flags[flag]
    return out


def _check_port_free(host: str, port: int) -> None:
    """Refuse in a fraction of a second, before arenas are mapped, when the port is
    held. The real bind in Server still decides; this only fails early (and binds
    the way libzmq does, with SO_REUSEADDR, so a restart on the same port works)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host if host != "*" else "0.0.0.0", port))
        except OSError as exc:
            reason = "port in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise ConfigError(f"cannot listen on {host}:{port}: {reason}") from None


def open_server(cfg: KVStoreConfig):
    """Bind, open the store (data-dir lock), start TE; undo everything on failure."""
    from kvstore.server.loop import Server
    from kvstore.store.facade import Store
    from kvstore.transport.env import check_protocol
    from kvstore.transport.te import Transport

    srv = cfg.server
    if srv.host in ("0.0.0.0", "*", "::") and not srv.te_host:
        raise KVStoreError("server.te_host is required when binding a wildcard address "
                           "(TE must advertise an address peers can reach)")
    if srv.curve_authorized_keys and not srv.curve_secret_key:
        # Checked on the whole config (file, environment and flags merged): the two
        # may come from different places. Without the server's key the socket is no
        # CURVE server: it would admit everyone while the operator believes only
        # these clients get in.
        raise ConfigError("server.curve_authorized_keys needs server.curve_secret_key "
                          "(the server's key from `kvstore keys`): without it the server "
                          "would admit any client")
    _check_port_free(srv.host, srv.port)
    # Before the store maps its arenas: "rdma" without a NIC is refused in a moment.
    check_protocol(srv.te_protocol, srv.te_devices, section="server.")
    store = transport = None
    try:
        store = Store(cfg)
        transport = Transport(srv.te_host or srv.host, metadata=srv.te_metadata,
                              protocol=srv.te_protocol, devices=srv.te_devices)
        server = Server(cfg, store, transport)
        store.start_writeback()  # NVMe copies ahead of demotion, off the request thread
        store.start_scrub()  # commits hashed off the request thread (verify_commits)
        return server
    except BaseException:
        for part in (transport, store):
            if part is not None:
                part.close()
        raise


def _describe(server, cfg: KVStoreConfig) -> str:
    tiers = ", ".join(f"{name} {format_size(cap)}" for name, cap in server.capacities().items())
    auth = "CURVE" if cfg.server.curve_secret_key else "no auth"
    door = f", stream door port {server.stream_port}" if server.stream_port else ""
    return (f"kvstore-server listening on {server.endpoint} ({auth}){door}, TE segment "
            f"{server.transport.segment}, tiers: {tiers or 'none'}, data dir {cfg.store.data_dir}")


def _serve(cfg: KVStoreConfig) -> int:
    from kvstore.server.loop import tune_gc
    from kvstore.server.registration import connect_etcd, register_server

    etcd = connect_etcd(cfg)  # before opening anything: etcd down is a quick, clear error
    server = open_server(cfg)
    metrics = registration = None
    previous_wake: int | None = None  # the wakeup fd before ours, once ours is set
    try:
        if cfg.server.metrics_port:
            from kvstore.server.metrics import Metrics

            metrics = Metrics(stats_fn=server.stats)
            metrics.serve(cfg.server.host, cfg.server.metrics_port)
            server.observer = metrics.observe
            server.after_observer = metrics.observe_after
            server.on_result = metrics.on_result
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.stop())
        # A signal that lands on another thread (TE's, ZeroMQ's) still wakes the
        # serving thread's poll, which then runs the handler: a stop takes
        # milliseconds, not the poll's timeout.
        previous_wake = signal.set_wakeup_fd(server.wake_fd, warn_on_full_buffer=False)
        if etcd is not None:
            registration = register_server(etcd, cfg, server)
        log.info("%s", _describe(server, cfg))
        tune_gc(cfg.server.gc_young)  # last: what start-up made is frozen
        server.serve_forever()
        log.info("kvstore-server stopping")
    finally:
        if previous_wake is not None:  # before the server closes the descriptor
            signal.set_wakeup_fd(previous_wake)
        if registration is not None:
            registration.close()  # clients stop placing prompts here at once
        if metrics is not None:
            metrics.close()
        server.close()
    return 0


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML config file.")
@click.option("--host", help="Address the control socket binds. [127.0.0.1]")
@click.option("--port", type=int, help="Control socket port. [7700]")
@click.option("--te-host", help="Address TE binds and advertises. [--host]")
@click.option("--te-metadata",
              help="TE metadata: P2PHANDSHAKE, etcd://h:p, http://... [P2PHANDSHAKE]")
@click.option("--te-protocol", metavar="tcp|rdma",
              help="TE transport; rdma needs an RDMA NIC (clients must match). [tcp]")
@click.option("--te-devices", metavar="NIC,...",
              help="RDMA NICs TE may use, e.g. mlx5_0,mlx5_1. [all it finds]")
@click.option("--data-dir", help="LMDB index, lock and NVMe slab live here. [./kvstore-data]")
@click.option("--dram", help="DRAM tier size, e.g. 8GiB; 0 disables. [1GiB]")
@click.option("--dram-shared/--no-dram-shared", default=None,
              help="Back DRAM with a /dev/shm file so same-node clients memcpy. [on]")
@click.option("--dram-prefault/--no-dram-prefault", default=None,
              help="Map every DRAM page into the server in the background from start. [on]")
@click.option("--local-socket/--no-local-socket", default=None,
              help="A Unix socket beside that file for same-node clients' requests. [on]")
@click.option("--stream-socket/--no-stream-socket", default=None,
              help="The stream door: requests (and acquired bytes) over a TCP port of its "
                   "own, for clients on other nodes; off under CURVE. [on]")
@click.option("--stream-port", type=int,
              help="The stream door's port; 0: any free one (the start line names it). [0]")
@click.option("--gc-young", type=int,
              help="Young-generation GC threshold of this process; 0: Python's. [50000]")
@click.option("--inline-max-bytes",
              help="Send a drop_select's bytes in its reply up to this size; 0: TE. [4GiB]")
@click.option("--peer-timeout", type=float,
              help="Close a client connection that answers no heartbeat this long (s); "
                   "0: never. [30]")
@click.option("--busy-after", type=float,
              help="Answer busy at once a request that would wait longer than this (s). [2]")
@click.option("--nvme", help="NVMe tier size; 0 disables. [4GiB]")
@click.option("--nvme-path", help="NVMe slab file or block device. [<data-dir>/nvme.slab]")
@click.option("--nvme-direct", type=click.Choice(["auto", "on", "off"]), help="O_DIRECT. [auto]")
@click.option("--nvme-fsync", type=click.Choice(["never", "commit", "always"]), help="[commit]")
@click.option("--gpu", help="GPU tier size; 0 disables. [0]")
@click.option("--gpu-device", help="Torch device of the GPU tier. [cuda:0]")
@click.option("--block-tokens", type=int, help="Tokens per block (entry). [16]")
@click.option("--reservation-lease", type=float, help="Seconds an uncommitted insert lives. [30]")
@click.option("--read-lease", type=float, help="Seconds an acquired entry stays leased. [30]")
@click.option("--verify-commits", type=click.Choice(["background", "inline"]),
              help="Hash committed bytes off the request path, or before answering. "
                   "[background]")
@click.option("--answer-first/--no-answer-first", default=None,
              help="Answer a commit or put before its in-memory book-keeping, done "
                   "before the next request. [on]")
@click.option("--high-watermark", type=float, help="Demote above this fill fraction. [0.95]")
@click.option("--low-watermark", type=float, help="...until under this one. [0.85]")
@click.option("--max-message-bytes", help="Largest control message accepted. [16MiB]")
@click.option("--cluster", metavar="etcd://HOST:PORT", help="Register this node in etcd. [off]")
@click.option("--cluster-prefix", help="etcd key prefix of the node records. [/kvstore/nodes/]")
@click.option("--cluster-ttl", type=int, help="Seconds a dead node stays registered. [5]")
@click.option("--node-id", help="This node's name in the cluster. [host:port]")
@click.option("--metrics-port", type=int, help="Prometheus /metrics port; 0 disables. [0]")
@click.option("--curve-secret-key", help="Server CURVE key file (.key_secret); enables CURVE.")
@click.option("--curve-authorized-keys", help="Directory of authorized client public keys.")
@click.option("--gen-keys", type=click.Path(file_okay=False), metavar="DIR",
              help="Write a CURVE keypair (server.key, server.key_secret) into DIR and exit.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def cli(config_file: str | None, gen_keys: str | None, log_level: str, **flags: Any) -> None:
    """Serve one node's KV-cache tiers over ZeroMQ (control) and Mooncake TE (data).

    Every option can also come from the TOML file or a KVSTORE_<SECTION>_<FIELD>
    environment variable; flags win.
    """
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if gen_keys:
        public, secret = generate_keys(gen_keys)
        click.echo(f"public key {public}\nsecret key {secret}")
        return
    try:
        cfg = load_config(config_file, overrides=_overrides(flags))
        code = _serve(cfg)
    except KVStoreError as exc:
        click.echo(f"kvstore-server: {exc}", err=True)
        sys.exit(2)
    # Everything is closed and flushed by now. TE has no shutdown call and its
    # engine's destructors spend seconds at interpreter exit; skip them.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def generate_keys(directory: str, name: str = "server") -> tuple[str, str]:
    """Write a CURVE keypair ``<name>.key`` (public) and ``<name>.key_secret`` into
    ``directory``; returns their paths. Copy a client's ``.key`` into the server's
    ``curve_authorized_keys`` directory to let it in."""
    import os

    import zmq.auth

    os.makedirs(directory, exist_ok=True)
    return zmq.auth.create_certificates(directory, name)



def main(argv: list[str] | None = None) -> None:
    """Entry point of ``kvstore-server``."""
    cli.main(args=argv, prog_name="kvstore-server")
