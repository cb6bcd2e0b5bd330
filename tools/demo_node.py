"""One node's side of the disaggregated demo; ``tools.demo`` starts it inside a node.

``prefill``: build the model, prefill each prompt, insert its KV (and the last
hidden state) into this node's kvstore-server, and print one hand-off per prompt
(the prompt, the server that holds its KV) — what vLLM's ``kv_transfer_params``
carry from the prefill instance to the decode instance.

``decode``: read hand-offs on stdin, ``drop_select`` each prompt's KV from the
server named in it, rebuild the cache, take the first token from the moved hidden
state and continue greedy decoding. The finished conversation (prompt + answer) is
then inserted into this node's own server, as a prefix cache for a follow-up turn.

Every line on stdout is one JSON object; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # before mooncake is imported

import torch

from kvstore.client import KVStoreClient
from kvstore.layout import unpack_hf
from tools import model as demo_model

log = logging.getLogger("tools.demo_node")


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _client(server: str, te_host: str, model, timeout: float,
            same_node: bool | str = "auto") -> KVStoreClient:
    return KVStoreClient(server=server, layout=demo_model.kv_layout(model),
                         model_id=demo_model.MODEL_ID, te_host=te_host, timeout_s=timeout,
                         same_node=same_node)


def run_prefill(args: argparse.Namespace) -> None:
    model = demo_model.build_model(args.seed, getattr(torch, args.dtype))
    vocab = model.config.vocab_size
    with _client(args.server, args.te_host, model, args.timeout) as client:
        for length in args.lengths:
            tokens = demo_model.make_prompt(length, args.prompt_seed, vocab)
            t0 = time.perf_counter()
            result = demo_model.prefill(model, tokens)
            t1 = time.perf_counter()
            inserted = client.insert(tokens, kv=result.past, hidden=result.hidden)
            t2 = time.perf_counter()
            _emit({"handoff": {"tokens": tokens, "server": args.server},
                   "prefill_s": t1 - t0, "insert_s": t2 - t1,
                   "inserted": _as_dict(inserted)})
        _emit({"stats": client.stats()})


def run_decode(args: argparse.Namespace) -> None:
    model = demo_model.build_model(args.seed, getattr(torch, args.dtype))
    layout = demo_model.kv_layout(model)
    handoffs = [json.loads(line)["handoff"] for line in sys.stdin if line.strip()]
    clients: dict[str, KVStoreClient] = {}
    try:
        own = clients[args.server] = _client(args.server, args.te_host, model, args.timeout)
        for handoff in handoffs:
            peer = handoff["server"]
            if peer not in clients:
                # The peer is another node even when loopback emulation puts it on
                # this host: always move its KV with TE, never the shared-memory path.
                clients[peer] = _client(peer, args.te_host, model, args.timeout,
                                        same_node=False)
            _emit(_decode_one(args, model, layout, clients[peer], own, handoff["tokens"]))
        _emit({"stats": {name: c.stats() for name, c in clients.items()}})
    finally:
        for c in clients.values():
            c.close()


def _decode_one(args, model, layout, peer: KVStoreClient, own: KVStoreClient,
                tokens: list[int]) -> dict[str, Any]:
    t0 = time.perf_counter()
    selected = peer.drop_select(tokens, timeout=args.timeout)
    t1 = time.perf_counter()
    matched = selected.matched_tokens
    row: dict[str, Any] = {"length": len(tokens), "matched_tokens": matched,
                           "nbytes": int(selected.kv.numel()) if selected.kv is not None else 0,
                           "transfer_s": t1 - t0, "tokens": None}
    if matched != len(tokens) or selected.hidden is None:
        # Not the whole prompt: a real engine would recompute the rest; the demo
        # reports it, and the tokens are missing so the run cannot say "identical".
        log.warning("prompt of %s tokens: only %s matched", len(tokens), matched)
        return row
    past = unpack_hf(layout, selected.kv, matched)
    first = demo_model.token_from_hidden(model, selected.hidden)
    t2 = time.perf_counter()
    answer, kept = demo_model.decode_with_past(model, past, first, args.decode_tokens)
    t3 = time.perf_counter()
    row.update(tokens=[first, *answer], decode_s=t3 - t2,
               blocks=len(layout.block_token_counts(matched)))
    # Keep the conversation's KV on this node for a follow-up turn: prompt + answer
    # but the last token, whose KV the model has not computed yet.
    conversation = [*tokens, first, *answer[:-1]]
    row["kept"] = _as_dict(own.insert(conversation, kv=kept))
    return row


def _as_dict(result: Any) -> Any:
    if hasattr(result, "_asdict"):
        return {k: _as_dict(v) for k, v in result._asdict().items()}
    if isinstance(result, (list, tuple)):
        return [_as_dict(v) for v in result]
    if isinstance(result, (bytes, bytearray)):
        return result.hex()
    return result


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.demo_node")
    ap.add_argument("role", choices=("prefill", "decode"))
    ap.add_argument("--server", required=True, help="this node's kvstore-server, tcp://host:port")
    ap.add_argument("--te-host", required=True, help="this node's address for TE")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=demo_model.DEFAULT_SEED)
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--timeout", type=float, default=20.0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{args.role}] %(levelname)s %(name)s: %(message)s")
    demo_model.configure_torch(1)
    (run_prefill if args.role == "prefill" else run_decode)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
