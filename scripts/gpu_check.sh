#!/usr/bin/env bash
# `make gpu-check`: everything that needs a GPU, in one command, one report.
#
#   scripts/gpu_check.sh [PYTHON] [REPORT]      (defaults: python3, build/gpu-check.txt)
#
# Uses that machine's python (torch, pybind11, ninja, pytest; the model and
# decode tests also read safetensors checkpoints and tokenizers, which the
# GPU image has), installs nothing. Steps, each appended to REPORT:
#   1. build _C with its CUDA kernels for sm_90 (FORCE_CUDA: no CPU fallback),
#      and check that it needs torch's shared libstdc++ (tools/libstdcxx.py);
#   2. the selection: tools/count_cuda_tests.py prints, per test file, the
#      CUDA-parametrized tests and those step 3's -k selects, and fails if one
#      is not selected (or none is), so a -k that matches nothing cannot pass;
#   3. (in GPU_CHECK_WORKERS=8 pytest-xdist processes where xdist is installed)
#      the whole suite's CUDA half (`-k cuda`: every op on the GPU, the models
#      in fp32/bf16/fp16, the decode loop and every method -- d2Cache, DARE,
#      dLLM-KVQ decoding, TRACE, policy selection -- against its float64
#      oracle; not the CPU simulator's own tests, test_cudasim.py, nor the slow
#      re-training), every skip turned into a failure (DLLM_REQUIRE_CUDA=1,
#      conftest.py);
#   4. python -m bench ops --device cuda;
#   5. python -m bench decode --synthetic llada-8b --layers 4 --device cuda;
#   6. python -m bench serve --spawn tiny-llada --device cuda (the HTTP server
#      under load on the GPU; then concurrency 1 and 16 again with
#      --engine-thread, one process), where fastapi, uvicorn and httpx2 import: the
#      image has none of them, so `make gpu-wheels` (here) writes them to .whl/,
#      the run carries .whl and this script installs them into build/gpu-site
#      (no index, no deps); without them the step says it was skipped.
# GPU_CHECK_BENCH=0 skips steps 4-6 (a rerun of the tests alone, when device
# time is short); GPU_CHECK_TESTS=0 skips steps 2-3 (a rerun of the benches).
# Exit status: 0 iff every step passed. Budget: <= 8 minutes on an H200.
set -uo pipefail
PY=${1:-python3}
REPORT=${2:-build/gpu-check.txt}
cd "$(dirname "$0")/.."
mkdir -p "$(dirname "$REPORT")"
export PYTHONUNBUFFERED=1
# torch's extension build looks for `ninja` on PATH only; the image's ninja sits
# beside its python3 (a venv's bin/), so put that first: when PY is given as a
# full path whose bin/ is not on PATH, torch would otherwise fall back to its
# serial distutils build (it still builds, one file at a time).
PATH="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
export PATH
{
  echo "# dllm_ops gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi -L 2>&1 || true
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())'
} | tee "$REPORT"
failed=()
step() {   # step NAME CMD...: run, append its output to the report, remember failures
  local name=$1; shift
  echo "## $name: $*" | tee -a "$REPORT"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$REPORT"
  local rc=${PIPESTATUS[0]}
  echo "## $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$REPORT"
  [ "$rc" -eq 0 ] || failed+=("$name")
  return "$rc"
}
step build env FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 "$PY" setup.py -q build_ext --inplace || {
  echo "# FAILED: build (nothing else ran)" | tee -a "$REPORT"; exit 1; }
# A _C with its own copy of libstdc++ crashes on its first error message that
# formats a number (tools/libstdcxx.py; setup.py avoids it): stop here if so.
step libstdcxx "$PY" tools/libstdcxx.py --check || {
  echo "# FAILED: _C links libstdc++ statically (nothing else ran)" | tee -a "$REPORT"; exit 1; }
# One selection for both steps: the count checks exactly what pytest runs.
SELECT_K="cuda and not cudasim"
SELECT_M="not slow"
if [ "${GPU_CHECK_TESTS:-1}" = 0 ]; then
  echo "## selection, pytest: skipped (GPU_CHECK_TESTS=0)" | tee -a "$REPORT"
else
step selection env DLLM_REQUIRE_CUDA=1 PYTHONPATH="$PWD" "$PY" tools/count_cuda_tests.py --check \
  -k "$SELECT_K" -m "$SELECT_M" python_tests
# With pytest-xdist (the GPU image has it), GPU_CHECK_WORKERS processes share
# the GPU and a test that kills its process (a segfault) is reported as a
# failure and its worker restarted, instead of ending the run there (the
# first GPU run lost every test after the first crash). 0: one process.
WORKERS=${GPU_CHECK_WORKERS:-8}
XDIST=() XDIST_ENV=()
if [ "$WORKERS" != 0 ] && "$PY" -c 'import xdist' 2>/dev/null; then
  XDIST=(-n "$WORKERS" --max-worker-restart 1000) XDIST_ENV=(OMP_NUM_THREADS=2)
fi
step pytest env "${XDIST_ENV[@]}" DLLM_REQUIRE_CUDA=1 PYTHONPATH="$PWD" "$PY" -m pytest python_tests -q -ra \
  -p no:cacheprovider "${XDIST[@]}" -k "$SELECT_K" -m "$SELECT_M" --durations=15 --tb=short
fi
if [ "${GPU_CHECK_BENCH:-1}" = 0 ]; then
  echo "## bench-ops, bench-decode, bench-serve: skipped (GPU_CHECK_BENCH=0)" | tee -a "$REPORT"
else
step bench-ops env PYTHONPATH="$PWD" "$PY" -m bench ops --device cuda
step bench-decode env PYTHONPATH="$PWD" "$PY" -m bench decode --synthetic llada-8b --layers 4 \
  --device cuda --prompt-length 256 --gen-length 256 --block-length 32
SITE=$PWD/build/gpu-site
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl 2>&1 | tee -a "$REPORT"
fi
SERVE_PATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if PYTHONPATH="$SERVE_PATH" "$PY" -c 'import fastapi, uvicorn, httpx2' 2>/dev/null; then
step bench-serve env PYTHONPATH="$SERVE_PATH" "$PY" -m bench serve --spawn tiny-llada \
  --device cuda --requests 64 --concurrency 1 4 16 64 --time-limit 60
# the same server with its engine in the HTTP process, for the split's A/B
step bench-serve-engine-thread env PYTHONPATH="$SERVE_PATH" "$PY" -m bench serve --spawn tiny-llada \
  --device cuda --requests 64 --concurrency 1 16 --time-limit 60 --engine-thread
else
  echo "## bench-serve: skipped (fastapi, uvicorn or httpx2 missing: make gpu-wheels, carry .whl)" | tee -a "$REPORT"
fi
fi
if [ ${#failed[@]} -eq 0 ]; then
  echo "# gpu-check PASSED ($SECONDS s)" | tee -a "$REPORT"
else
  echo "# gpu-check FAILED: ${failed[*]} ($SECONDS s)" | tee -a "$REPORT"
  exit 1
fi
