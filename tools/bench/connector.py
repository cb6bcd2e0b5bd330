"""``make bench`` section "connector": the vLLM connector measured inside real engines.

    python -m tools.bench.connector [--quick] [--repeat N] [--plots docs/img]

One kvstore-server and six real vLLM CPU engines on this node, alive at once, on a
locally built model deep enough that prefill costs more than the transfer (24 layers,
fp32, so tokens compare exactly):

* ``recompute``: a plain engine (no connector): what a decode engine does without a
  store — it computes the prompt itself;
* ``kvstore``: a prefill engine (``kv_producer``: layer-wise saves) and a decode
  engine (``kv_consumer``: async loads) through the kvstore-server (same node: the
  shared-memory path); a second prefill engine saves whole prompts instead
  (``layerwise_saves`` false: every layer copied at the step's end), for the
  exposed-transfer table;
* ``example``: vLLM's own example connector (``ExampleConnector``, formerly
  ``SharedStorageConnector``: one safetensors file per layer under a directory),
  a prefill and a decode engine sharing that directory. It stores only a prompt's
  first scheduled chunk, so its engines prefill in one step (``max_num_batched_tokens``
  = the model length; the others keep vLLM's default of 4096, chunked).

Per prompt length, fresh random prompts (no engine ever has a prefix-cache hit):

* table "decode TTFT": each system's prefill time and the decode engine's time to its
  first token once the prefill's KV is stored; ``speedup`` = recompute / system;
  ``tokens_match``: the decode's token equals the plain engine's;
* table "exposed transfer": ``exposed_s`` = decode-ready minus prefill-end: the
  decode asked the moment the prefill engine answered (a proxy's pattern) minus the
  decode asked once the save had committed. ``save_tail_s``: prefill-end to the
  store holding every block (polled). ``serial_s``: one ``drop_select`` of a stored
  prompt through the client (the transfer done serially, nothing to hide behind);
  ``exposed_share`` = exposed / serial (issue 11's goal: <= 0.10; both signed: the
  difference of two best-of-N times, which noise can make negative). ``whole_*``: the
  same with the decode asked the moment the whole-prompt-save prefill engine
  answered (its ``whole_prefill_s`` includes the copies it makes at the end);
* table "inter-token latency": 4 short requests decoding alone, then beside a long
  prompt (the longest length) whose KV loads (kvstore, example) or is recomputed
  (plain). Latency is the batch's wall time per output token (the engine driver
  reports no per-token times): every request generates the same number of tokens,
  64 (32 with --quick), enough that the long prompt's load or compute happens while
  the short ones decode. The long request's own decode steps are in both ``beside``
  runs alike: ``stall`` = beside / alone, ``vs_recompute`` = beside / beside of the
  plain engine (below 1: loading stalls the others less than recomputing).

Times are the best of ``--repeat`` (at most 3) prompts, as ``tools.bench.measure``
reports (other people's jobs only ever add time here), through tools.engine_proc (one
JSON line each way per batch, ~1 ms). Engines run in-process (vLLM's engine core in
the driver: ~3x faster starts; the connector's threads are the same). The machine is
shared: compare the ratios of one run, never seconds across runs.
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tools.bench import BenchOptions, Row

log = logging.getLogger(__name__)

LAYERS = 24
BLOCK = 32
SHORTS = 4  # requests decoding beside the long prompt
SHORT_TOKENS = 64
PLOT_NAME = "connector.png"
TTFT = "decode TTFT (s): kvstore and vLLM's example connector vs recompute"
EXPOSED = "exposed transfer (s): layer-wise and whole-prompt saves vs the serial transfer"
ITL = "inter-token latency (ms) of 4 running requests beside a long prompt"


class Workload(NamedTuple):
    lengths: tuple[int, ...]
    repeat: int
    itl_tokens: int  # output tokens per request in the inter-token runs
    layers: int = LAYERS


def workload(opts: BenchOptions) -> Workload:
    return Workload(lengths=opts.pick((512, 2048), (2048, 8192)),
                    repeat=max(1, min(opts.repeat, 3)), itl_tokens=opts.pick(32, 64))


def bench_connector(opts: BenchOptions) -> list[Row]:
    rows = run(workload(opts), opts.workdir)
    if opts.plots is not None:
        plot(rows, Path(opts.plots) / PLOT_NAME)
    return rows


# ------------------------------------------------------------------ engines
@dataclass
class Engines:
    plain: Any
    prefill: Any
    decode: Any
    ex_prefill: Any
    ex_decode: Any
    whole: Any  # a second kv_producer whose saves copy the prompt at the step's end
    admin: Any  # a KVStoreClient of the server, with the engines' layout and model id
    model_id: str
    reference: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def all(self) -> list[Any]:
        return [self.plain, self.prefill, self.decode, self.ex_prefill, self.ex_decode,
                self.whole]


def _engines(spec, model: Path, server, work: Path, max_len: int) -> Engines:
    from kvstore.client import KVStoreClient
    from kvstore.layout import KVLayout
    from tools.engine_proc import EngineProc

    per_token = spec.layers * 2 * spec.kv_heads * (spec.hidden // 4) * 4
    # Room for the long prompt, the short ones and a spare long one, at least 256 MiB.
    cache = max(256 << 20, 3 * max_len * per_token)
    connector = {"server": server.address, "model_id": spec.name, "timeout_s": 60.0,
                 "staging_bytes": "256MiB"}
    # The example connector stores only a prompt's first scheduled chunk (it builds
    # its save orders for new requests alone) and then loads that short file for the
    # whole prompt: its engines prefill a prompt in one step.
    example = {"kv_transfer_config": {
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(work / "example-kv")}},
        "max_num_batched_tokens": max_len}

    def engine(name: str, role: str | None = None, engine_args: dict | None = None,
               extra: dict | None = None):
        # No warm-up prompt for the example engines: it would save a 16-token prompt,
        # zero full blocks, as empty files. (fp32 needs none; bf16 AMX attention does.)
        return EngineProc(model, spec.dtype, role=role,
                          connector={**connector, **(extra or {})} if role else None,
                          log_path=work / f"{name}.log", max_model_len=max_len,
                          block_size=BLOCK, in_process=True, kv_cache_bytes=cache,
                          warmup=False if engine_args else None, name=name,
                          engine_args=engine_args)

    layout = KVLayout(spec.layers, spec.kv_heads, spec.hidden // 4, spec.dtype, BLOCK)
    return Engines(engine("plain"), engine("prefill", "kv_producer"),
                   engine("decode", "kv_consumer"), engine("ex-prefill", None, example),
                   engine("ex-decode", None, example),
                   engine("prefill-whole", "kv_producer", extra={"layerwise_saves": False}),
                   KVStoreClient(server.address, layout=layout, model_id=spec.name,
                                 timeout_s=60.0), spec.name)


def run(work_: Workload, workdir: Path) -> list[Row]:
    """Every table's rows for ``work_``; engines and server stopped before it returns."""
    from tests.integration.conftest import ServerFactory  # the suite's real-server starter
    from tools.engine_proc import start_all, stop_all
    from tools.tiny_models import ModelSpec, build

    work = Path(tempfile.mkdtemp(prefix="bench-connector-", dir=workdir))
    max_len = max(work_.lengths) + 2 * BLOCK
    spec = ModelSpec(arch="llama", dtype="float32", layers=work_.layers, max_len=max_len)
    model = build(spec, work / "models")
    (work / "servers").mkdir()
    factory = ServerFactory(work / "servers")
    engines: Engines | None = None
    done = False
    try:
        server = factory(dram="2GiB", nvme="64MiB", block_tokens=BLOCK,
                         reservation_lease=120.0, read_lease=120.0)
        engines = _engines(spec, model, server, work, max_len)
        start_all(engines.all())
        rng = random.Random(7)
        _warm(engines, rng)
        rows: list[Row] = []
        for n in work_.lengths:
            rows += _ttft_rows(engines, rng, n, work_.repeat)
        rows += _itl_rows(engines, rng, max(work_.lengths), work_.itl_tokens, work_.repeat)
        done = True
        return rows
    finally:
        if engines is not None:
            engines.admin.close()
            stop_all(engines.all())
        factory.stop_all()
        if done:  # a failed run keeps its engine and server logs
            shutil.rmtree(work, ignore_errors=True)
        else:
            log.warning("connector bench failed: logs in %s", work)


def _warm(e: Engines, rng: random.Random) -> None:
    """One prompt through every path first: one-time costs (TE, arenas, files)."""
    p = _prompt(rng, 4 * BLOCK)
    e.plain.generate([p], 1)
    params = _prefill(e, p)
    e.decode.generate([p], 1, [params])
    e.ex_prefill.generate([p], 1)
    e.ex_decode.generate([p], 1)


# ------------------------------------------------------------------ measuring
def _prompt(rng: random.Random, n: int) -> list[int]:
    from tools.tiny_models import VOCAB

    return [rng.randrange(VOCAB) for _ in range(n)]


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _blocks(n: int) -> int:
    """Entries a producer stores for an n-token prompt: its n - 1 loadable tokens."""
    return -(-(n - 1) // BLOCK)


def _prefill(e: Engines, p: list[int], committed: bool = True, engine: Any = None) -> dict:
    """The prefill engine's (or ``engine``'s) kv_transfer_params for ``p``;
    ``committed``: after the store holds all its blocks (the save finishes after
    ``generate`` returned)."""
    before = e.admin.stats()["entries"]
    params = (engine or e.prefill).generate([p], 1)[0].kv_transfer_params
    if committed:
        _wait_entries(e, before + _blocks(len(p)))
    return params


def _wait_entries(e: Engines, want: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while e.admin.stats()["entries"] < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the prefill's save never reached {want} entries")
        time.sleep(0.005)


def _ttft_rows(e: Engines, rng: random.Random, n: int, repeat: int) -> list[Row]:
    t: dict[str, list[float]] = {k: [] for k in (
        "recompute", "kv_prefill", "kv_decode", "ex_prefill", "ex_decode", "tail",
        "at_once", "whole_prefill", "whole_at_once", "serial")}
    match = {"kvstore": True, "example": True}
    loaded: dict[str, list[int]] = {"kvstore": [], "example": [], "at_once": [],
                                    "whole_at_once": []}
    for _ in range(repeat):
        p = _prompt(rng, n)
        took, ref = _timed(lambda: e.plain.generate([p], 1)[0])
        t["recompute"].append(took)
        # kvstore, committed first: the decode's own cost.
        before = e.admin.stats()["entries"]
        took, out = _timed(lambda: e.prefill.generate([p], 1)[0])
        end = time.perf_counter()
        t["kv_prefill"].append(took)
        _wait_entries(e, before + _blocks(n))
        t["tail"].append(time.perf_counter() - end)
        took, got = _timed(lambda: e.decode.generate([p], 1, [out.kv_transfer_params])[0])
        t["kv_decode"].append(took)
        match["kvstore"] &= got.token_ids == ref.token_ids
        loaded["kvstore"].append(got.num_cached_tokens)
        # The example connector on the same prompt (its own directory of files).
        took, _ = _timed(lambda: e.ex_prefill.generate([p], 1))
        t["ex_prefill"].append(took)
        took, got = _timed(lambda: e.ex_decode.generate([p], 1)[0])
        t["ex_decode"].append(took)
        match["example"] &= got.token_ids == ref.token_ids
        loaded["example"].append(got.num_cached_tokens)
        # kvstore, the decode asked the moment the prefill answered (a proxy).
        q = _prompt(rng, n)
        params = _prefill(e, q, committed=False)
        took, got = _timed(lambda: e.decode.generate([q], 1, [params])[0])
        t["at_once"].append(took)
        loaded["at_once"].append(got.num_cached_tokens)
        # The same, from the producer that copies the whole prompt at the step's end.
        w = _prompt(rng, n)
        took, params = _timed(lambda: _prefill(e, w, committed=False, engine=e.whole))
        t["whole_prefill"].append(took)
        took, got = _timed(lambda: e.decode.generate([w], 1, [params])[0])
        t["whole_at_once"].append(took)
        loaded["whole_at_once"].append(got.num_cached_tokens)
        # The same transfer done serially: one drop_select of a stored prompt.
        s = _prompt(rng, n)
        _prefill(e, s)
        took, res = _timed(lambda: e.admin.drop_select(s[:-1]))
        if res.matched_tokens < (n - 1) // BLOCK * BLOCK:
            raise RuntimeError(f"drop_select matched {res.matched_tokens} of {n - 1} tokens")
        t["serial"].append(took)
    med = {k: min(v) for k, v in t.items()}
    # Signed: below 0 the decode asked at once was the faster one (noise, or the
    # load's lookups found the entries as they landed).
    exposed = med["at_once"] - med["kv_decode"]
    exposed_whole = med["whole_at_once"] - med["kv_decode"]
    rows: list[Row] = [
        {"table": TTFT, "tokens": n, "system": "recompute", "prefill_s": med["recompute"],
         "ttft_s": med["recompute"], "speedup": 1.0, "loaded_tokens": 0,
         "tokens_match": True, "runs": repeat},
        {"table": TTFT, "tokens": n, "system": "kvstore", "prefill_s": med["kv_prefill"],
         "ttft_s": med["kv_decode"], "speedup": med["recompute"] / med["kv_decode"],
         "loaded_tokens": min(loaded["kvstore"]), "tokens_match": match["kvstore"],
         "runs": repeat},
        {"table": TTFT, "tokens": n, "system": "example", "prefill_s": med["ex_prefill"],
         "ttft_s": med["ex_decode"], "speedup": med["recompute"] / med["ex_decode"],
         "loaded_tokens": min(loaded["example"]), "tokens_match": match["example"],
         "runs": repeat},
        {"table": EXPOSED, "tokens": n, "mib": n * _bytes_per_token(e) / 2**20,
         "save_tail_s": med["tail"], "ttft_at_once_s": med["at_once"],
         "at_once_loaded": min(loaded["at_once"]),
         "ttft_committed_s": med["kv_decode"], "exposed_s": exposed,
         "serial_s": med["serial"], "exposed_share": exposed / med["serial"],
         "whole_prefill_s": med["whole_prefill"], "whole_at_once_s": med["whole_at_once"],
         "whole_loaded": min(loaded["whole_at_once"]), "whole_exposed_s": exposed_whole,
         "whole_share": exposed_whole / med["serial"], "runs": repeat},
    ]
    return rows


def _bytes_per_token(e: Engines) -> int:
    return e.admin.layout.token_nbytes


def _itl_rows(e: Engines, rng: random.Random, long_n: int, steps: int,
              repeat: int) -> list[Row]:
    """Short requests decoding alone, then beside a long prompt, per system."""
    alone: dict[str, list[float]] = {"recompute": [], "kvstore": [], "example": []}
    beside: dict[str, list[float]] = {k: [] for k in alone}
    match = {k: True for k in alone}
    engine = {"recompute": e.plain, "kvstore": e.decode, "example": e.ex_decode}
    for _ in range(repeat):
        for system, eng in engine.items():
            shorts = [_prompt(rng, SHORT_TOKENS) for _ in range(SHORTS)]
            alone[system].append(_timed(lambda: eng.generate(shorts, steps))[0] / steps)
            long_p = _prompt(rng, long_n)
            params: list[dict | None] = [None] * (SHORTS + 1)
            if system == "kvstore":
                params[-1] = _prefill(e, long_p)
            elif system == "example":
                e.ex_prefill.generate([long_p], 1)
            shorts = [_prompt(rng, SHORT_TOKENS) for _ in range(SHORTS)]
            batch = [*shorts, long_p]
            took, outs = _timed(lambda: eng.generate(batch, steps, params))
            beside[system].append(took / steps)
            if system != "recompute":
                want = e.plain.generate(batch, steps)
                match[system] &= [o.token_ids for o in outs] == [w.token_ids for w in want]
    rows = []
    for system in engine:
        a, b = min(alone[system]), min(beside[system])
        rows.append({"table": ITL, "system": system, "long_tokens": long_n,
                     "long_kv": "recomputed" if system == "recompute" else "loaded",
                     "itl_alone_ms": 1000 * a, "itl_beside_ms": 1000 * b, "stall": b / a,
                     "vs_recompute": b / min(beside["recompute"]),
                     "tokens_match": match[system], "out_tokens": steps, "runs": repeat})
    return rows


# ------------------------------------------------------------------ plot
def plot(rows: list[Row], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg")

    colors = {"recompute": "tab:gray", "kvstore": "tab:blue", "example": "tab:orange"}
    label = {"recompute": "recompute (no connector)", "kvstore": "kvstore",
             "example": "vLLM ExampleConnector"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ttft = [r for r in rows if r["table"] == TTFT]
    lengths = sorted({r["tokens"] for r in ttft})
    width = 0.27
    for i, system in enumerate(colors):
        ys = [next(r["ttft_s"] for r in ttft if r["tokens"] == n and r["system"] == system)
              for n in lengths]
        xs = [j + (i - 1) * width for j in range(len(lengths))]
        ax1.bar(xs, ys, width, color=colors[system], label=label[system])
    ax1.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax1.set_yscale("log")
    ax1.set_ylabel("decode TTFT (s, log)")
    ax1.set_title("decode time to first token", fontsize=9)
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    itl = [r for r in rows if r["table"] == ITL]
    for i, r in enumerate(itl):
        ax2.bar(i - 0.2, r["itl_alone_ms"], 0.4, color=colors[r["system"]], alpha=0.45)
        ax2.bar(i + 0.2, r["itl_beside_ms"], 0.4, color=colors[r["system"]])
    ax2.set_xticks(range(len(itl)), [label[r["system"]] for r in itl], fontsize=7)
    ax2.set_ylabel("ms per output token")
    long_n = itl[0]["long_tokens"] if itl else 0
    ax2.set_title(f"4 running requests: alone (light) / beside a {long_n}-token prompt",
                  fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    from tools.bench import print_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 and 2k tokens, not 2k and 8k")
    parser.add_argument("--repeat", type=int, default=3, help="prompts per measurement (<= 3)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the model, the server and the engine logs go")
    parser.add_argument("--plots", metavar="DIR", type=Path, default=None,
                        help=f"also draw DIR/{PLOT_NAME} (--plots docs/img: the committed "
                             "one); without it nothing is written")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    opts = BenchOptions(quick=args.quick, repeat=args.repeat, workdir=args.dir,
                        plots=args.plots)
    rows = bench_connector(opts)
    print_rows("connector", rows)
    if args.plots is not None:
        print(f"\nwrote {args.plots / PLOT_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
