"""``python -m kvstore.server``: the same as ``kvstore-server``."""

from kvstore.server.cli import main

main()
