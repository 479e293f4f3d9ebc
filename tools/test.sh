#!/usr/bin/env bash
# The test command: install (venv + the project with its dev extra) and run the whole suite.
# Extra arguments go to pytest, e.g. `bash tools/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch==2.13.0 in the dev extra is the CPU wheel; a plain "torch" would pull a CUDA build.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
# Test services: etcd for the membership tests (skipped, with the reason, if it cannot be installed).
bash tools/ci/install-etcd.sh || echo "tools/test.sh: etcd could not be installed; membership tests will skip"
# vLLM (CPU) in an environment of its own for tests/integration/test_vllm.py. If it cannot be
# installed those tests fail with the reason; KVSTORED_VLLM=skip leaves vLLM out on purpose.
bash tools/ci/install-vllm.sh || echo "tools/test.sh: vLLM could not be installed; the vLLM tests will fail (KVSTORED_VLLM=skip skips them)"
exec .venv/bin/python -m pytest "$@"
