#!/usr/bin/env bash
# Install the etcd server binary used by tests/integration/test_membership.py.
#
# Idempotent: does nothing when an `etcd` binary is already on PATH (or in /usr/bin). Uses Debian's
# `etcd-server` package (etcd 3.4), installed without recommends and without starting the service.
# Safe for CI: non-interactive, fails loudly if apt cannot install it, never touches other packages.
set -euo pipefail

if command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ]; then
    echo "install-etcd: $(command -v etcd || echo /usr/bin/etcd) already present"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-etcd: need root (or sudo) to apt-get install etcd-server" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
# The package's postinst would start etcd as a system service; the tests start their own on random
# ports, so keep the service from starting (policy-rc.d exit code 101 = "action forbidden").
POLICY=/usr/sbin/policy-rc.d
CREATED_POLICY=0
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    CREATED_POLICY=1
fi
cleanup() { if [ "$CREATED_POLICY" = 1 ]; then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT

$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
echo "install-etcd: installed $(/usr/bin/etcd --version 2>/dev/null | head -1)"
