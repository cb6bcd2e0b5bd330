"""Shared plumbing of the ``kvstore`` CLI: server/CURVE options and the per-node
control channels, prompt -> key options, parameter types, CURVE key files."""

from __future__ import annotations

import functools
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn

import click

from kvstore.cliformat import parse_bytes, parse_key, parse_tokens
from kvstore.config import load_config
from kvstore.errors import ConfigError, KVStoreError
from kvstore.index import NAMESPACE_TAG_BYTES
from kvstore.rpc import Channel, CurveKeys


def fail(message: str) -> NoReturn:
    """Bad arguments: one line and exit 2 (``kvstore.cli.one_line`` shows it)."""
    raise click.UsageError(message, ctx=click.get_current_context(silent=True))


# ------------------------------------------------------------------ parameter types
class _Parsed(click.ParamType):
    parse: Callable[[str], Any]

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return type(self).parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class SizeType(_Parsed):
    name = "size"
    parse = staticmethod(parse_bytes)


class KeyType(_Parsed):
    name = "hexkey"
    parse = staticmethod(parse_key)


class NamespaceType(_Parsed):
    name = "hex"
    parse = staticmethod(lambda v: parse_namespace(v))


class TokensType(_Parsed):
    name = "tokens"
    parse = staticmethod(parse_tokens)


def apply(decorators: list[Callable]) -> Callable:
    """Apply a list of click decorators (listed in --help order)."""
    def wrap(f: Callable) -> Callable:
        for deco in reversed(decorators):
            f = deco(f)
        return f
    return wrap


# ------------------------------------------------------------------ servers
class Admin:
    """The servers a command addresses, one lazily opened ``Channel`` each.

    ``map`` runs a function per node and records a node's failure instead of
    stopping, so ``stats`` of three nodes still shows the two that answer;
    ``finish`` then prints one line per failed node and exits 1.
    """

    def __init__(self, servers: list[str], timeout_s: float, curve: CurveKeys | None,
                 as_json: bool) -> None:
        self.servers = servers
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


def _address(server: str) -> str:
    return server if "://" in server else f"tcp://{server}"


def _open_admin(server: tuple[str, ...], timeout: float | None, config_file: str | None,
                curve_server_key: str | None, curve_secret_key: str | None,
                as_json: bool) -> Admin:
    overrides = {"timeout_s": timeout, "curve_server_public_key": curve_server_key,
                 "curve_secret_key": curve_secret_key}
    cfg = load_config(config_file, overrides={"client": overrides}).client
    servers = [_address(s) for s in server] or [_address(cfg.server)]
    curve = None
    if cfg.curve_secret_key or cfg.curve_server_public_key:
        if not (cfg.curve_secret_key and cfg.curve_server_public_key):
            raise ConfigError("CURVE needs both --curve-secret-key and --curve-server-key")
        curve = CurveKeys.load(cfg.curve_secret_key, cfg.curve_server_public_key)
    return Admin(servers, cfg.timeout_s, curve, as_json)


_SERVER_OPTS = [
    click.option("--server", "-s", multiple=True, envvar="KVSTORE_CLIENT_SERVER",
                 show_envvar=True, metavar="tcp://HOST:PORT",
                 help="Server to address; repeat for several nodes [client.server]."),
    click.option("--timeout", type=click.FloatRange(min=0.01), envvar="KVSTORE_CLIENT_TIMEOUT_S",
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


# ------------------------------------------------------------------ prompts -> keys
@dataclass(frozen=True)
class PromptKeys:
    """A prompt's block keys in chain order, the key its optional hidden-state entry
    would have, and each key's position (the hidden key last)."""

    keys: list[bytes]
    token_counts: list[int]
    hidden: bytes
    position: dict[bytes, int]

    @property
    def all_keys(self) -> list[bytes]:
        return [*self.keys, self.hidden]


_NS_FIELDS = ("model_id", "layers", "kv_heads", "head_dim", "dtype", "block_tokens",
              "tp_rank", "tp_size", "salt")

prompt_options = apply([
    click.option("--tokens", type=TokensType(), help="Prompt token ids: 1,2,3 or a JSON list."),
    click.option("--prompt-file", type=click.Path(dir_okay=False, exists=True),
                 help="File of token ids, or text (tokenized with --model-id's tokenizer)."),
    click.option("--namespace-config", type=click.Path(dir_okay=False, exists=True),
                 help="TOML with model_id, layers, kv_heads, head_dim, dtype, block_tokens, "
                      "tp_rank, tp_size, salt (flags below override it)."),
    click.option("--model-id", help="Model id the engine hashes into keys."),
    click.option("--layers", type=click.IntRange(min=1), help="KV layers."),
    click.option("--kv-heads", type=click.IntRange(min=1), help="KV heads per TP rank."),
    click.option("--head-dim", type=click.IntRange(min=1), help="Head dimension."),
    click.option("--dtype", help="KV dtype [bfloat16]."),
    click.option("--block-tokens", type=click.IntRange(min=1), help="Tokens per block [16]."),
    click.option("--tp-rank", type=click.IntRange(min=0), help="TP rank [0]."),
    click.option("--tp-size", type=click.IntRange(min=1), help="TP size [1]."),
    click.option("--salt", help="Tenant salt, if the engine uses one."),
])


def prompt_keys(opts: dict[str, Any]) -> PromptKeys | None:
    """Keys of the prompt given by --tokens / --prompt-file, or None if neither."""
    tokens, prompt_file = opts.get("tokens"), opts.get("prompt_file")
    if tokens is None and prompt_file is None:
        _refuse_stray_model_options(opts)
        return None
    if tokens is not None and prompt_file is not None:
        fail("give --tokens or --prompt-file, not both")
    # Imported here: kvstore.layout pulls in torch (seconds), which only prompts need.
    from kvstore.hashing import block_keys, hidden_key, namespace_of
    from kvstore.layout import KVLayout

    ns = _namespace_settings(opts)
    if prompt_file is not None:
        tokens = _read_prompt(prompt_file, ns["model_id"])
    try:
        layout = KVLayout(ns["layers"], ns["kv_heads"], ns["head_dim"], ns["dtype"],
                          ns["block_tokens"])
        namespace = namespace_of(ns["model_id"], layout, ns["tp_rank"], ns["tp_size"],
                                 ns["salt"])
    except KVStoreError as exc:
        fail(str(exc))
    chain = block_keys(namespace, tokens, layout.block_tokens)
    if not chain.keys:
        fail("the prompt has no tokens")
    hidden = hidden_key(chain.keys[-1])
    order = [*chain.keys, hidden]
    return PromptKeys(chain.keys, chain.token_counts, hidden, {k: i for i, k in enumerate(order)})


def has_model_options(opts: dict[str, Any]) -> bool:
    return any(opts.get(f) is not None for f in _NS_FIELDS + ("namespace_config",))


def namespace_tag(opts: dict[str, Any]) -> bytes:
    """The namespace tag records of this model/layout carry (the first 8 bytes of
    ``hashing.namespace_of``), from --model-id/--layers/... or --namespace-config."""
    from kvstore.hashing import namespace_of
    from kvstore.layout import KVLayout

    ns = _namespace_settings(opts)
    try:
        layout = KVLayout(ns["layers"], ns["kv_heads"], ns["head_dim"], ns["dtype"],
                          ns["block_tokens"])
        return namespace_of(ns["model_id"], layout, ns["tp_rank"], ns["tp_size"],
                            ns["salt"])[:NAMESPACE_TAG_BYTES]
    except KVStoreError as exc:
        fail(str(exc))


def parse_namespace(value: str) -> str:
    """--namespace: hex, a prefix of the 16-hex-digit tag (or of the full 32-digit
    fingerprint, whose first 16 digits are the tag) -> lower-case hex prefix."""
    text = value.strip().lower()
    if not text or len(text) > 2 * 2 * NAMESPACE_TAG_BYTES or any(
            c not in "0123456789abcdef" for c in text):
        raise ValueError(f"not a hex namespace (up to 32 hex digits): {value!r}")
    return text[:2 * NAMESPACE_TAG_BYTES]


def _refuse_stray_model_options(opts: dict[str, Any]) -> None:
    stray = [f for f in _NS_FIELDS + ("namespace_config",) if opts.get(f) is not None]
    if stray:
        fail(f"--{stray[0].replace('_', '-')} only means something with --tokens/--prompt-file")


def _namespace_settings(opts: dict[str, Any]) -> dict[str, Any]:
    ns: dict[str, Any] = {"dtype": "bfloat16", "block_tokens": 16, "tp_rank": 0,
                          "tp_size": 1, "salt": ""}
    if opts.get("namespace_config"):
        try:
            with open(opts["namespace_config"], "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            fail(f"cannot read {opts['namespace_config']}: {exc}")
        data = data.get("namespace", data)
        if "num_layers" in data:
            data["layers"] = data.pop("num_layers")
        unknown = sorted(set(data) - set(_NS_FIELDS))
        if unknown:
            fail(f"{opts['namespace_config']}: unknown field(s) {unknown}; use {list(_NS_FIELDS)}")
        ns.update(data)
    ns.update({f: opts[f] for f in _NS_FIELDS if opts.get(f) is not None})
    missing = [f for f in ("model_id", "layers", "kv_heads", "head_dim") if ns.get(f) is None]
    if missing:
        fail("keys of a prompt need the model and layout: missing "
             + ", ".join(f"--{m.replace('_', '-')}" for m in missing))
    return ns


def _read_prompt(path: str, model_id: str) -> list[int]:
    text = Path(path).read_text()
    try:
        return parse_tokens(text)
    except ValueError:
        pass  # not token ids: a text prompt
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_id, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any loading failure is the same advice
        fail(f"{path} is text and the tokenizer of {model_id!r} is not available offline "
             f"({type(exc).__name__}); pass token ids instead")
    return list(tokenizer(text)["input_ids"])


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
