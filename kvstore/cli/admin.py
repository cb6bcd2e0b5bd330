"""Shared plumbing of the ``kvstore`` CLI: the server/CURVE options and the
per-node control channels (``Admin``), and CURVE key files.

Argument types live in cli_params.py and prompt -> keys in cli_prompt.py; their
names are re-exported here, where the commands have always imported them.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvstore.cli.params import (
    FiniteFloatRange,
    KeyType,
    NamespaceType,
    SizeType,
    TokensType,
    apply,
    fail,
    parse_namespace,
)
from kvstore.cli.prompt import (
    PromptKeys,
    has_model_options,
    namespace_tag,
    prompt_keys,
    prompt_options,
)
from kvstore.core.config import load_config
from kvstore.core.errors import KVStoreError
from kvstore.client.rpc import Channel, CurveKeys

__all__ = ["Admin", "KeyType", "NamespaceType", "PromptKeys", "SizeType", "TokensType",
           "apply", "fail", "generate_keypair", "has_model_options", "namespace_tag",
           "parse_namespace", "prompt_keys", "prompt_options", "server_options"]


# ------------------------------------------------------------------ servers
class Admin:
    """The servers a command addresses, one lazily opened ``Channel`` each.

    ``map`` runs a function per node and records a node's failure instead of
    stopping, so ``stats`` of three nodes still shows the two that answer;
    ``finish`` then prints one line per failed node and exits 1.
    """

    def __init__(self, servers: list[str], timeout_s: float, curve: CurveKeys | None,
                 as_json: bool, config_file: str | None = None) -> None:
        self.servers = servers
        self.config_file = config_file  # --config: the cluster commands read it too
        self.timeout_s = timeout_s
        self.curve = curve
        self.as_json = as_json
        self.errors: list[str] = []
        self._channels: dict[str, Channel] = {}

    def channel(self, server: str) -> Channel:
        if server not in self._channels:
            self._channels[server] = Channel(server, self.timeout_s, curve=self.curve)
        return self._channels[server]

    def map(self, fn: Callable[[str, Channel], Any]) -> list[tuple[str, Any]]:
        out = []
        for server in self.servers:
            try:
                out.append((server, fn(server, self.channel(server))))
            except KVStoreError as exc:
                text = str(exc)
                self.errors.append(text if server in text else f"{server}: {text}")
        return out

    def each(self) -> list[tuple[str, Channel]]:
        """(server, channel) pairs; a node whose address is unusable is reported."""
        return self.map(lambda s, c: c)

    def call_each(self, make_request: Callable[[], Any]) -> list[tuple[str, dict]]:
        return self.map(lambda s, c: c.call(make_request()))

    def finish(self) -> None:
        if self.errors:
            for line in self.errors:
                click.echo(f"Error: {line}", err=True)
            raise click.exceptions.Exit(1)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


# tcp://HOST:PORT, HOST a name, an IPv4 address or a bracketed IPv6 one.
_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})")


def _address(server: str) -> str:
    """``server`` as a control address (``tcp://`` added to a bare HOST:PORT); one that
    is none is a usage error (exit 2), not a node that failed."""
    address = server if "://" in server else f"tcp://{server}"
    match = _ADDRESS.fullmatch(address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        fail(f"server address {server!r} (--server, KVSTORE_CLIENT_SERVER or client.server): "
             "need tcp://HOST:PORT")
    return address


def _open_admin(server: tuple[str, ...], timeout: float | None, config_file: str | None,
                curve_server_key: str | None, curve_secret_key: str | None,
                as_json: bool) -> Admin:
    overrides = {"timeout_s": timeout, "curve_server_public_key": curve_server_key,
                 "curve_secret_key": curve_secret_key}
    cfg = load_config(config_file, overrides={"client": overrides},
                      sections=("client",)).client
    servers = [_address(s) for s in server] or [_address(cfg.server)]
    curve = None
    if cfg.curve_secret_key or cfg.curve_server_public_key:
        if not (cfg.curve_secret_key and cfg.curve_server_public_key):  # usage: exit 2
            missing = "--curve-secret-key" if cfg.curve_server_public_key else "--curve-server-key"
            fail(f"{missing}: missing (CURVE needs both --curve-secret-key and "
                 f"--curve-server-key)")
        curve = CurveKeys.load(cfg.curve_secret_key, cfg.curve_server_public_key)
    return Admin(servers, cfg.timeout_s, curve, as_json, config_file)


_SERVER_OPTS = [
    click.option("--server", "-s", multiple=True, envvar="KVSTORE_CLIENT_SERVER",
                 show_envvar=True, metavar="tcp://HOST:PORT",
                 help="Server to address; repeat for several nodes [client.server]."),
    click.option("--timeout", type=FiniteFloatRange(min=0.01), envvar="KVSTORE_CLIENT_TIMEOUT_S",
                 help="Seconds to wait for each reply [client.timeout_s]."),
    click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True),
                 envvar="KVSTORE_CONFIG", help="TOML config file (its [client] section)."),
    click.option("--curve-server-key", type=click.Path(dir_okay=False, exists=True),
                 help="Server public key file (CURVE)."),
    click.option("--curve-secret-key", type=click.Path(dir_okay=False, exists=True),
                 help="This client's key file, NAME.key_secret from `kvstore keys`."),
    click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
]


def server_options(f: Callable) -> Callable:
    """Add the server/CURVE/--json options; the command gets ``admin: Admin``."""
    @functools.wraps(f)
    def wrapper(*args: Any, server: tuple[str, ...], timeout: float | None,
                config_file: str | None, curve_server_key: str | None,
                curve_secret_key: str | None, as_json: bool, **kwargs: Any) -> Any:
        admin = _open_admin(server, timeout, config_file, curve_server_key, curve_secret_key,
                            as_json)
        try:
            return f(*args, admin=admin, **kwargs)
        finally:
            admin.close()
    return apply(_SERVER_OPTS)(wrapper)

# ------------------------------------------------------------------ CURVE keys
def generate_keypair(directory: str, name: str, force: bool) -> tuple[str, str]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (secret readable by owner only)."""
    import zmq.auth

    if not name or "/" in name or name.startswith("."):
        fail(f"bad key name {name!r}")
    public = Path(directory) / f"{name}.key"
    secret = Path(directory) / f"{name}.key_secret"
    if not force and (public.exists() or secret.exists()):
        fail(f"{public} or {secret} exists; use --force to replace it")
    try:
        os.makedirs(directory, exist_ok=True)
        old = os.umask(0o077)  # the secret file is never readable by others, even briefly
        try:
            public_file, secret_file = zmq.auth.create_certificates(directory, name)
        finally:
            os.umask(old)
        os.chmod(public_file, 0o644)
    except OSError as exc:
        raise click.ClickException(f"cannot write keys into {directory}: {exc}") from None
    return public_file, secret_file
