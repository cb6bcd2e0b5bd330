"""``python -m tools.bench`` (what ``make bench`` runs)."""

import sys

from tools.bench import main

sys.exit(main())
