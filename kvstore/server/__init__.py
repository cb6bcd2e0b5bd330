"""kvstore-server: one node's store behind ZeroMQ and a Transfer Engine. The loop
(``loop.Server``), one handler per wire op (``handlers``), the command line and
start-up (``cli``), Prometheus (``metrics``, ``transfer_metrics``), the node's
record in etcd (``registration``). The server talks to the store through its typed
interface (``kvstore.store.facade``) and never imports the client."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``kvstore-server`` (pyproject's ``kvstore.server:main``)."""
    from kvstore.server.cli import main as run

    run(argv)
