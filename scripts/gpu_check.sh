#!/usr/bin/env bash
# GPU check for the CUDA backend: the CUDA tests, then benchmarks/bench_cuda.py.
#
# Meant for one H200 (or any CUDA GPU) within 8 minutes. Run from the repo root:
#     bash scripts/gpu_check.sh
# Writes to $OUT (default ./out): env.txt, tests.txt, tests.xml, bench_cuda.md,
# bench_cuda.json, bench.txt, summary.md.
#
# The GPU image has Python, torch, numpy, cuda-bindings, cuda-core and uvloop but
# no pytest-asyncio. Carry a wheel folder made on a networked box with:
#     pip download --only-binary=:all: --python-version 3.12 \
#         --platform manylinux2014_x86_64 --platform any -d wheels \
#         "pytest==9.2.0" "pytest-asyncio==1.5.0" "hypothesis==6.170.17"
# It is installed with --no-index (nothing else is fetched; torch is never touched).
# aiokvo itself is used from the source tree through PYTHONPATH (no install).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)

log() { echo "[gpu_check +$(($(date +%s) - START))s] $*"; }

# ---------------------------------------------------------------- environment
{
    date -u
    nvidia-smi -L 2>&1 || true
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
    echo "nproc: $(nproc)"
    lscpu 2>/dev/null | grep 'Model name' || true
    "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "numpy", "uvloop", "cuda.bindings", "cuda.core", "pytest", "pytest_asyncio"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:  # report, do not fail
        print(name, "MISSING", type(exc).__name__, exc)
try:
    import torch
    print("torch.cuda", torch.version.cuda, "available", torch.cuda.is_available())
except Exception as exc:
    print("torch.cuda error", exc)
from aiokvo.device.driver import cuda_device_count
print("cuda_device_count", cuda_device_count())
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ------------------------------------------------------------- test packages
have_test_deps() { "$PY" -c "import pytest, pytest_asyncio" 2>/dev/null; }
if ! have_test_deps; then
    if [ -d wheels ]; then
        log "installing pytest/pytest-asyncio from ./wheels (no index)"
        "$PY" -m pip install --quiet --no-index --find-links wheels pytest pytest-asyncio \
            || log "pip install from wheels failed (no pip, or an externally managed Python)"
        if ! have_test_deps; then
            # Fallback without pip: wheels are zip archives; unpack them onto PYTHONPATH.
            DEPS="${TMPDIR:-/tmp}/aiokvo_gpu_deps"
            log "unpacking ./wheels into $DEPS"
            "$PY" -c '
import pathlib, sys, zipfile
target = pathlib.Path(sys.argv[1])
target.mkdir(parents=True, exist_ok=True)
for wheel in sorted(pathlib.Path("wheels").glob("*-none-any.whl")):  # pure Python only
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    print("unpacked", wheel.name)
' "$DEPS"
            export PYTHONPATH="$PYTHONPATH:$DEPS"
        fi
    else
        log "WARNING: pytest-asyncio missing and no ./wheels folder was carried"
    fi
fi
have_test_deps || log "WARNING: pytest/pytest-asyncio still missing; the tests cannot run"

# ---------------------------------------------------------------------- tests
log "running CUDA tests (fake, driver, gpu, the Offloader on the device)"
timeout 240 "$PY" -m pytest -p no:cacheprovider -q -rs \
    tests/handlers/cuda tests/device tests/offloader/test_gpu.py tests/testing/test_gpu.py \
    --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.txt"
TESTS_RC=${PIPESTATUS[0]}
log "tests exit code: $TESTS_RC"

# ------------------------------------------------------------------ benchmark
log "running benchmarks/bench_cuda.py"
timeout 200 "$PY" benchmarks/bench_cuda.py --out "$OUT" 2>&1 | tee "$OUT/bench.txt"
BENCH_RC=${PIPESTATUS[0]}
log "bench exit code: $BENCH_RC"

{
    echo "# gpu_check summary"
    echo
    echo "- tests exit code: $TESTS_RC ($(tail -n 1 "$OUT/tests.txt" 2>/dev/null))"
    if grep -q "needs a CUDA device" "$OUT/tests.txt" 2>/dev/null; then
        echo "- WARNING: GPU tests were SKIPPED (no CUDA device found)"
    fi
    echo "- bench exit code: $BENCH_RC"
    echo "- seconds: $(($(date +%s) - START))"
    echo
    [ -f "$OUT/bench_cuda.md" ] && cat "$OUT/bench_cuda.md"
} > "$OUT/summary.md"
cat "$OUT/summary.md"

if [ "$TESTS_RC" -ne 0 ] || [ "$BENCH_RC" -ne 0 ]; then
    exit 1
fi
