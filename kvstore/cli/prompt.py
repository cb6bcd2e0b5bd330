"""Prompt -> keys for the ``kvstore`` CLI: the options that name a prompt and its
model (``prompt_options``), and the block keys / namespace tag they give, computed
exactly as the engine's connector does (``kvstore.core.hashing``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import tomllib

from kvstore.cli.params import TokensType, apply, fail
from kvstore.cli.format import parse_tokens
from kvstore.core.errors import KVStoreError
from kvstore.core.hashing import NAMESPACE_TAG_BYTES


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
    from kvstore.core.hashing import block_keys, hidden_key  # imported late, as in _namespace

    ns = _namespace_settings(opts)
    # opts["tokens"] is set when there is no prompt file: checked above.
    tokens = opts["tokens"] if prompt_file is None else _read_prompt(prompt_file, ns["model_id"])
    layout, namespace = _namespace(ns)
    chain = block_keys(namespace, tokens, layout.block_tokens)
    if not chain.keys:
        fail("the prompt has no tokens")
    hidden = hidden_key(chain.keys[-1])
    order = [*chain.keys, hidden]
    return PromptKeys(chain.keys, chain.token_counts, hidden, {k: i for i, k in enumerate(order)})


def _namespace(ns: dict[str, Any]) -> tuple[Any, bytes]:
    """(KVLayout, namespace fingerprint) of the settings; bad ones fail the command."""
    # Imported here: kvstore.core.layout pulls in torch (seconds), which only prompts need.
    from kvstore.core.hashing import namespace_of
    from kvstore.core.layout import KVLayout

    try:
        layout = KVLayout(ns["layers"], ns["kv_heads"], ns["head_dim"], ns["dtype"],
                          ns["block_tokens"])
        return layout, namespace_of(ns["model_id"], layout, ns["tp_rank"], ns["tp_size"],
                                    ns["salt"])
    except KVStoreError as exc:
        fail(str(exc))


def has_model_options(opts: dict[str, Any]) -> bool:
    return any(opts.get(f) is not None for f in _NS_FIELDS + ("namespace_config",))


def namespace_tag(opts: dict[str, Any]) -> bytes:
    """The namespace tag records of this model/layout carry (the first 8 bytes of
    ``hashing.namespace_of``), from --model-id/--layers/... or --namespace-config."""
    return _namespace(_namespace_settings(opts))[1][:NAMESPACE_TAG_BYTES]


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
