"""``python -m tools.workloads SHAPE --requests N --seed S --out PATH``: write a synthetic trace."""

import sys

from tools.workloads.cli import main

sys.exit(main())
