"""``python -m tools.bench [SUBCOMMAND] [options]``: the benchmarks (see tools/bench/README.md)."""

import sys

from tools.bench.cli import main

sys.exit(main())
