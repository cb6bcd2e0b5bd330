"""How much a thread of short torch calls slows beside a busy Python thread.

    python -m tools.gil_convoy

The connector's transfer thread makes hundreds of short torch calls per load; each
releases the GIL and must take it back. Beside a thread that runs Python without
pause (vLLM stepping empty steps while a request waits for its KV) every take-back
can wait a switch interval. Prints the time of 384 block copies (16 blocks x 24
layers of ``[2, 32, 64]`` fp32) alone and beside such a thread
(docs/benchmarks.md, "Connector inside vLLM").
"""

from __future__ import annotations

import threading
import time

import torch


def copies(caches: list[torch.Tensor], src: torch.Tensor) -> float:
    start = time.perf_counter()
    for layer, cache in enumerate(caches):
        for block in range(src.shape[1]):
            cache[block].copy_(src[layer, block])
    return time.perf_counter() - start


def main() -> None:
    caches = [torch.zeros(200, 2, 32, 64) for _ in range(24)]
    src = torch.randn(24, 16, 2, 32, 64)
    alone = copies(caches, src)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            {i: i for i in range(50)}

    spinner = threading.Thread(target=spin)
    spinner.start()
    beside: list[float] = []
    worker = threading.Thread(target=lambda: beside.append(copies(caches, src)))
    worker.start()
    worker.join()
    stop.set()
    spinner.join()
    print(f"384 copies: {alone * 1e3:.1f} ms alone, {beside[0] * 1e3:.1f} ms beside a "
          f"busy Python thread ({beside[0] / alone:.0f}x)")


if __name__ == "__main__":
    main()
