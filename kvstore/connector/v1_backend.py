"""The engine's attention backend, asked where it keeps K/V inside a paged block.

``block_format_of`` builds, for the layers a connector moves, a writer around each
layer's own cache-update op (``layer.impl.do_kv_cache_update``: the kernel the
forward uses to write K/V into the paged cache) and lets
``block_format.probe`` find the in-block placement from it. Every layer must agree
on one placement (one cache group, one backend), else the connector refuses to
start. A backend that writes its cache inside the forward (no separate update op)
cannot be probed and is refused too: guessing its layout is how wrong KV happens.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvstore.connector.block_format import BlockFormat, Writer, probe
from kvstore.core.errors import ConfigError

log = logging.getLogger(__name__)


def layer_writer(vllm_config: Any, layer_name: str) -> tuple[str, Writer]:
    """(backend name, writer) for one attention layer of the running engine."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    # vLLM annotates layer_type as type[T], which mypy refuses an ABC for (python/mypy#4717);
    # the ABC is what vLLM itself passes (with the same ignore).
    layer = get_layers_from_vllm_config(
        vllm_config, AttentionLayerBase, [layer_name]  # type: ignore[type-abstract]
    ).get(layer_name)
    if layer is None:
        raise ConfigError(f"layer {layer_name} is not an attention layer of this engine")
    backend = layer.get_attn_backend()
    name = backend.get_name()
    impl = getattr(layer, "impl", None)
    update = getattr(impl, "do_kv_cache_update", None)
    # vLLM's MLA layer always writes its latent through the impl's update op (its own
    # do_kv_cache_update); an ordinary attention layer does only where the backend
    # says its forward leaves the write out.
    separate = hasattr(layer, "kv_lora_rank") or \
        not getattr(backend, "forward_includes_kv_cache_update", True)
    if update is None or not separate:
        raise ConfigError(f"attention backend {name} writes its KV cache inside the forward "
                          "(no do_kv_cache_update): kvstore cannot learn its block layout; "
                          "choose another backend (VLLM_ATTENTION_BACKEND / attention_config)")
    if hasattr(layer, "kv_lora_rank"):  # MLA: one latent per token, [kv_c | k_pe]
        mla: Any = layer  # vLLM's MLA layer: attributes AttentionLayerBase does not declare
        rank = int(mla.kv_lora_rank)

        def write_mla(latent: torch.Tensor, second: torch.Tensor | None, cache: torch.Tensor,
                      slots: torch.Tensor) -> None:
            # A [blocks, 1, N, C] view is probed as one "head" of K and V halves
            # ([T, 1, C/2] each); the latent is the two side by side.
            if second is not None:
                latent = torch.cat((latent[:, 0], second[:, 0]), dim=-1)
            update(latent[:, :rank], latent[:, rank:].unsqueeze(1), cache, slots,
                   mla.kv_cache_dtype, mla._k_scale)
        return name, write_mla

    def write(key: torch.Tensor, value: torch.Tensor | None, cache: torch.Tensor,
              slots: torch.Tensor) -> None:
        update(layer, key, value, cache, slots)
    return name, write


def block_format_of(vllm_config: Any, layer_names: Sequence[str],
                    caches: Mapping[str, torch.Tensor]) -> BlockFormat:
    """The one in-block placement every layer in ``layer_names`` uses."""
    found: dict[tuple, BlockFormat] = {}
    fmt = None
    for name in layer_names:
        cache = caches[name]
        backend, writer = layer_writer(vllm_config, name)
        sig = (backend, tuple(cache.shape[1:]), cache.stride(), cache.dtype)
        if sig not in found:
            try:
                found[sig] = probe(cache, writer, backend)
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure means "cannot place KV"
                raise ConfigError(f"{backend}: probing its KV block layout failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
        this = found[sig]
        if fmt is not None and this.coords_key() != fmt.coords_key():
            raise ConfigError(f"layer {name} keeps its KV blocks differently from the "
                              "others; one placement per model is supported")
        fmt = this
    if fmt is None:
        raise ConfigError("no attention layers to move KV for")
    log.info("KV block layout of %s: %s", fmt.backend,
             "as the cache view says" if fmt.identity else "backend-specific (probed)")
    return fmt
