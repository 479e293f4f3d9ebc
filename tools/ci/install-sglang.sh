#!/usr/bin/env bash
# SGLang's HiCache storage base class for tests/integration/test_sglang.py, in an environment of
# its own (.venv-sglang/ in the checkout), never the product's venv.
#
# SGLang's full stack does not run on a CPU-only machine, and its pins ask for torch 2.14.1: it is
# installed without its dependencies, on the CPU wheel of torch 2.13.0, with only what importing
# its storage and host-pool modules needs (triton is among them: an unconditional import). The SDK
# goes in without the daemon's dependencies, so the tests also show that an engine needs none of
# them. Idempotent: a stamp naming this script's contents makes a second run instant.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-sglang
STAMP="$VENV/.installed-$(sha256sum tools/ci/install-sglang.sh | cut -c1-16)"
if [ -e "$STAMP" ]; then
    echo "install-sglang: $VENV ready"
    exit 0
fi
PYTHON=${PYTHON:-python3}
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch==2.13.0 is the CPU wheel; SGLang's own pin (2.14.1) would pull a CUDA build.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" numpy orjson psutil pybase64 requests triton==3.9.0 packaging pillow starlette msgspec \
    pydantic pyzmq tqdm ipython aiohttp
# the SDK's own dependencies (pyproject.toml's comment), then the project without the daemon's
"${PIP[@]}" "grpcio>=1.85,<2" "grpcio-status>=1.85,<2" "protobuf>=7.35,<8" "cbor2>=5.6" "xxhash>=3.4"
"${PIP[@]}" --no-deps -e .
"$VENV/bin/python" -c "import sglang.srt.mem_cache.hicache_storage, kvstored_client.sglang.hicache"
touch "$STAMP"
echo "install-sglang: $VENV ready (sglang $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))'))"
