#!/usr/bin/env bash
# The main job: install kvstored, start the daemon on its embedded defaults, run the demo
# scenarios against it through the SDK, show `kvctl stats`, stop the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e .
log=$(mktemp -t kvstored-demo.XXXXXX.log)
# A state directory of its own (the SSD tier lives there): the demo starts cold every time, and a
# stop writes the DRAM blocks to SSD, so the default one would make the next demo's first request warm.
state=$(mktemp -d -t kvstored-demo-state.XXXXXX)
STATE_DIRECTORY=$state .venv/bin/kvstored --no-config >"$log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true; rm -rf "$state"' EXIT
echo "kvstored started (pid $daemon, log $log)"
.venv/bin/python tools/demo.py --wait 30
echo
.venv/bin/kvctl stats
