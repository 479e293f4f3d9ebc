"""``python -m tools.bench``: run the benchmark harness (see tools/bench/README.md)."""

import sys

from tools.bench.cli import main

sys.exit(main())
