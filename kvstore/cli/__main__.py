"""``python -m kvstore.cli``: the same as ``kvstore``."""

from kvstore.cli.main import main

main()
