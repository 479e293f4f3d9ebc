"""``python -m kvstored``: run the daemon."""

import sys

from kvstored.server.app import main

sys.exit(main())
