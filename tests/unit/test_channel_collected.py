"""A client nobody closed, collected by the garbage collector as part of a reference
cycle, must not hang the process: pyzmq's context finalizer could no longer see the
sockets (the cycle's weak references are cleared first) and waited for them forever.
Real ZeroMQ sockets, in a child process so that a hang fails the test."""

import subprocess
import sys

from tests.integration.conftest import REPO

_CHILD = """
import gc
from kvstore.client.rpc import Channel

class Holder:
    pass

gc.disable()
holder = Holder()
holder.me = holder  # a cycle: only the garbage collector can free it
holder.channel = Channel("tcp://127.0.0.1:9", timeout_s=1.0)
del holder
gc.collect()
print("collected")
"""


def test_an_unclosed_channel_in_a_reference_cycle_is_collected():
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "collected", done.stderr
