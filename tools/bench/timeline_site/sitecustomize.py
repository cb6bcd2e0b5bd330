"""Loaded by Python at start-up in the processes ``tools.bench.timeline`` starts (this
directory is first on their ``PYTHONPATH``): stamps kvstore's functions when the tool
asks (``KVSTORE_BENCH_TIMELINE``); anywhere else, nothing."""

import os

if os.environ.get("KVSTORE_BENCH_TIMELINE"):
    from tools.bench.timeline import install

    install()
