#!/usr/bin/env bash
# The main job: install kvstored, start the daemon on its embedded defaults, run the demo
# scenarios against it through the SDK, show `kvctl stats`, stop the daemon; then start it again
# on the same state and check that what was saved comes back from SSD, and stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e .
log=$(mktemp -t kvstored-demo.XXXXXX.log)
# A state directory of its own (the SSD tier lives there): the demo starts cold every time, and a
# stop writes the DRAM blocks to SSD, so the default one would make the next demo's first request warm.
# And a socket of its own in it: on the default socket the demo's daemon would refuse to start
# where another daemon (yours, another demo's) already listens, and the demo would run against
# that one, filling its cache and showing its stats as the demo's.
state=$(mktemp -d -t kvstored-demo-state.XXXXXX)
export KVSTORED_SOCKET=$state/kvstored.sock
daemon=
finish() {
    local rc=$?
    set +e   # clean up whatever failed: the daemon stopped, its state removed
    if [ -n "$daemon" ] && kill -0 "$daemon" 2>/dev/null; then
        kill -TERM "$daemon"
        wait "$daemon" 2>/dev/null
    fi
    rm -rf "$state"
    if [ "$rc" -eq 0 ]; then
        rm -f "$log"
    else
        echo "demo FAILED (exit $rc); the daemon's log, $log, ends with:" >&2
        tail -n 20 "$log" >&2
    fi
    exit "$rc"
}
trap finish EXIT
start() {
    STATE_DIRECTORY=$state .venv/bin/kvstored --no-config --socket "$KVSTORED_SOCKET" >>"$log" 2>&1 &
    daemon=$!
    echo "kvstored started (pid $daemon, socket $KVSTORED_SOCKET)"
}
stop() {
    kill -TERM "$daemon"
    local rc=0
    wait "$daemon" || rc=$?
    daemon=
    if [ "$rc" -ne 0 ]; then
        echo "kvstored exited with $rc on SIGTERM (expected 0)" >&2
        exit 1
    fi
}
start
.venv/bin/python tools/demo.py --wait 30 --daemon-pid "$daemon"
echo
.venv/bin/kvctl stats
stop
echo
echo "kvstored stopped (SIGTERM: DRAM-only blocks written to SSD); starting it again on the same state"
start
.venv/bin/python tools/demo.py --wait 30 --daemon-pid "$daemon" --after-restart
stop
