#!/usr/bin/env bash
# kvchat on a CUDA machine: the checks that need a GPU, in one run (at most ~8.5 minutes: the
# sum of the step limits below; less when the steps finish early).
#
#   KVCHAT_CACHE_DIR=/path/to/copied/cache OUT=results/gpu scripts/gpu_check.sh
#
# Runs from the repository root, with no network:
#   1. environment: GPU, versions, imports (env.txt);
#   2. kvchat verify --device cuda --quick           -> $OUT/verify/ (report.md, results.json, PNGs)
#   3. kvchat bench --device cuda --only latency     -> $OUT/bench/
#   4. pytest tests/engine/kvdirect/test_cache_exact.py tests/engine/kvdirect/test_real_models.py
#             tests/engine/chat/test_memory.py tests/engine/kvdirect/test_disk_tier.py -q --device cuda
#             -> $OUT/pytest.log, $OUT/pytest.xml
# Every step runs even when an earlier one failed; each has a time limit. The script exits
# non-zero if any step failed or timed out. $OUT/summary.txt lists each step, its exit status
# and seconds; $OUT/<step>.log holds its output.
#
# Models: the machine cannot download anything, so the converted models must be copied there
# and KVCHAT_CACHE_DIR pointed at the copy. Copy the folder `kvchat` uses as its cache
# (`python -c "from kvchat.paths import cache_dir; print(cache_dir())"`, usually
# ~/.cache/kvchat); only its models/ subfolder is needed (SmolLM2-135M-Instruct.Q4_1-* ~540 MB,
# gemma-3-270m-q4_k_m-* ~1.1 GB; the wheels/ subfolder is not). Without KVCHAT_CACHE_DIR the
# default cache is used, which on a fresh machine is empty and the steps fail to find a model.
#
# Software: torch with CUDA and transformers must be installed (the machine has torch 2.11 and
# transformers 5.17, older than pyproject.toml asks for); kvchat is run from this checkout
# (PYTHONPATH), not installed. Its other imports (click, platformdirs, psutil, safetensors,
# accelerate, pytest; matplotlib for the PNGs) are checked first and reported in env.txt.
#
# Time limits (seconds) can be changed: VERIFY_TIMEOUT, BENCH_TIMEOUT, PYTEST_TIMEOUT.

set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
PYTHON="${PYTHON:-python}"
VERIFY_TIMEOUT="${VERIFY_TIMEOUT:-180}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-120}"
PYTEST_TIMEOUT="${PYTEST_TIMEOUT:-150}"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export KVCHAT_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Conversations and disk-tier spills of the tests go to a scratch folder, not the data dir.
export KVCHAT_DATA_DIR="${KVCHAT_DATA_DIR:-$OUT/data}"
export PYTHONUNBUFFERED=1

SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LIMIT_SECONDS COMMAND...: run it, log to $OUT/NAME.log, record status and time.
step() {
    local name="$1" limit="$2"
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS rc
    timeout --signal=TERM --kill-after=20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        note "$name: ok (${took}s)"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        note "$name: TIMED OUT after ${limit}s (rc $rc)"
        FAILED=$((FAILED + 1))
    else
        note "$name: FAILED rc $rc (${took}s)"
        FAILED=$((FAILED + 1))
    fi
}

# -- 1. environment -------------------------------------------------------------------------
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "repo: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
    echo "KVCHAT_CACHE_DIR: ${KVCHAT_CACHE_DIR:-<unset: default cache>}"
    nvidia-smi 2>&1 || echo "nvidia-smi not available"
} >"$OUT/env.txt"
step env 60 "$PYTHON" - <<'EOF'
import importlib
import sys

print("python", sys.version.split()[0])
missing = []
for name in ("torch", "transformers", "safetensors", "psutil", "click", "platformdirs",
             "accelerate", "pytest", "matplotlib"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name} MISSING ({type(exc).__name__}: {exc})")
        if name != "matplotlib":  # figures are skipped without it
            missing.append(name)
import torch

print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(), "| torch cuda", torch.version.cuda)
from kvchat.paths import cache_dir
from kvchat.engine.models.resolve import resolve_model

print("kvchat cache:", cache_dir())
for model in ("smollm2-135m", "gemma-3-270m"):
    try:
        print(f"model {model}: {resolve_model(model).path}")
    except Exception as exc:  # noqa: BLE001
        print(f"model {model}: NOT FOUND ({exc})")
        missing.append(model)
if missing or not torch.cuda.is_available():
    sys.exit(f"environment incomplete: missing {missing}, cuda {torch.cuda.is_available()}")
EOF
cat "$OUT/env.log" >>"$OUT/env.txt" 2>/dev/null

# -- 2. verify, quick -----------------------------------------------------------------------
step verify "$VERIFY_TIMEOUT" "$PYTHON" -m kvchat.cli verify --device cuda --quick --out "$OUT/verify"

# -- 3. latency per operation (default sizes: both models, 1K and 4K contexts) ---------------
step bench_latency "$BENCH_TIMEOUT" "$PYTHON" -m kvchat.cli bench --device cuda --only latency \
    --out "$OUT/bench"

# -- 4. exactness tests on the GPU ----------------------------------------------------------
TESTS=(tests/engine/kvdirect/test_cache_exact.py tests/engine/kvdirect/test_real_models.py tests/engine/chat/test_memory.py
    tests/engine/kvdirect/test_disk_tier.py)
if grep -q -- '--device' tests/conftest.py 2>/dev/null; then
    # The 8K-token resume test is a CPU-sized check of the 2 MB ceiling; skip it here.
    step pytest "$PYTEST_TIMEOUT" "$PYTHON" -m pytest "${TESTS[@]}" -q --device cuda -k "not 8k" \
        -p no:cacheprovider --junitxml="$OUT/pytest.xml"
else
    note "pytest: FAILED: tests/conftest.py has no --device option, the tests would run on CPU"
    FAILED=$((FAILED + 1))
fi

echo
echo "== summary ($OUT/summary.txt)"
cat "$SUMMARY"
if [ "$FAILED" -ne 0 ]; then
    echo "$FAILED step(s) failed"
    exit 1
fi
echo "all steps passed"
