#!/usr/bin/env bash
# The main job: install kvstored, start the daemon on its embedded defaults, run the demo
# scenarios against it through the SDK, show `kvctl stats`, stop the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e .
log=$(mktemp -t kvstored-demo.XXXXXX.log)
.venv/bin/kvstored --no-config >"$log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
echo "kvstored started (pid $daemon, log $log)"
.venv/bin/python tools/demo.py --wait 30
echo
.venv/bin/kvctl stats
