"""``kvstore``, the admin CLI: one click group (``main``), its commands by concern
(``entries``, ``cluster``), the per-node channels and CURVE options (``admin``,
``group``), argument types (``params``, ``prompt``), text views (``views``) and pure
parsers/formatters (``format``). It uses the client's channel and the protocol,
never the store or the server."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``kvstore`` (pyproject's ``kvstore.cli:main``)."""
    from kvstore.cli.main import main as run

    run(argv)
