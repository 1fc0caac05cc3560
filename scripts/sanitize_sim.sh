#!/usr/bin/env bash
# Build and run the CUDA CPU simulation (csrc/cudasim/) under sanitizers:
#   tsan: -DCUDASIM_THREADS -fsanitize=thread     (one OS thread per CUDA thread)
#   asan: -fsanitize=address,undefined            (fiber engine)
# Runs the shim self-test (must pass clean), the injected sanitizer bugs
# (each must be reported: a test that stays silent fails), and every extra
# driver given on the command line (must pass clean in both configurations):
#
#   scripts/sanitize_sim.sh [extra_driver.cpp ...]
#
# A driver is a standalone program (main() returning nonzero on failure)
# compiled with the same flags as the self-test plus -Icsrc; .cu files are
# compiled as C++.
#
# Env: CXX (default g++), CUDA_HOME, SANITIZE_BUILD_DIR (default: a temp dir,
# removed afterwards), SANITIZE_TIMEOUT (seconds per run, default 600).
# Exit status: 0 if everything behaved as expected, 1 otherwise.
set -u -o pipefail

cd "$(dirname "$0")/.."
CXX=${CXX:-g++}
TIMEOUT=${SANITIZE_TIMEOUT:-600}

cuda_home() {
  local h
  for h in "${CUDA_HOME:-}" "$(python3 tools/cuda_home.py 2>/dev/null)" /usr/local/cuda-13.0 /usr/local/cuda \
           "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc 2>/dev/null || echo /nonexistent)")")")"; do
    if [ -n "$h" ] && [ -f "$h/include/cuda_fp16.h" ]; then echo "$h"; return 0; fi
  done
  return 1
}
CUDA=$(cuda_home) || { echo "sanitize_sim: no CUDA toolkit headers found (set CUDA_HOME)" >&2; exit 1; }

if [ -n "${SANITIZE_BUILD_DIR:-}" ]; then
  OUT=$SANITIZE_BUILD_DIR
  mkdir -p "$OUT"
else
  OUT=$(mktemp -d -t sanitize_sim.XXXXXX)
  trap 'rm -rf "$OUT"' EXIT
fi

# -g1: line tables are all a sanitizer report needs, and compile ~30% faster.
# -include: nvcc force-includes cuda_runtime.h into every .cu, so headers may
# use __host__/__device__ before including cuda_compat.cuh; mirror that.
BASE=(-std=c++20 -O1 -g1 -pthread -DCUDASIM -Wall -Wextra -Wno-unknown-pragmas
      -Icsrc/cudasim/shim_include -Icsrc/cudasim "-I$CUDA/include" -Icsrc
      -include cudasim/cuda_compat.cuh)
declare -A CFG_FLAGS=(
  [tsan]="-DCUDASIM_THREADS -fsanitize=thread"
  [asan]="-fsanitize=address,undefined -fno-omit-frame-pointer"
)
CONFIGS=(tsan asan)

export TSAN_OPTIONS=${TSAN_OPTIONS:-"halt_on_error=0 second_deadlock_stack=1"}
export ASAN_OPTIONS=${ASAN_OPTIONS:-"detect_leaks=1:strict_string_checks=1:check_initialization_order=1"}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-"halt_on_error=1:print_stacktrace=1"}

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# ---- build everything, two compiles at a time ---------------------------------
SOURCES=(csrc/cudasim/tests/selftest.cpp csrc/cudasim/tests/sanitizer_bugs.cpp "$@")
for src in "${SOURCES[@]}"; do
  [ -f "$src" ] || { echo "sanitize_sim: no such file: $src" >&2; exit 1; }
done
exe_of() { echo "$OUT/$(basename "${1%.*}").$2"; }

jobs_max=$(nproc 2>/dev/null || echo 2)
declare -A PIDS=()
start=$(date +%s)
for src in "${SOURCES[@]}"; do
  for cfg in "${CONFIGS[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do sleep 0.2; done
    exe=$(exe_of "$src" "$cfg")
    # shellcheck disable=SC2086
    "$CXX" "${BASE[@]}" ${CFG_FLAGS[$cfg]} -x c++ "$src" -x none -o "$exe" >"$exe.build.log" 2>&1 &
    PIDS["$exe"]=$!
  done
done
for exe in "${!PIDS[@]}"; do
  if ! wait "${PIDS[$exe]}"; then
    fail "build $(basename "$exe")"
    sed -n '1,40p' "$exe.build.log"
  elif grep -q "warning:" "$exe.build.log"; then
    echo "note: warnings building $(basename "$exe"):"
    grep "warning:" "$exe.build.log" | head -5
  fi
done
echo "built ${#PIDS[@]} binaries in $(( $(date +%s) - start )) s"

# ---- run ----------------------------------------------------------------------------
# TSan needs a fixed memory layout; disabling ASLR avoids its
# "unexpected memory mapping" failure on kernels with high mmap entropy.
runner() {
  if [ "$1" = tsan ] && setarch "$(uname -m)" -R true 2>/dev/null; then
    echo setarch "$(uname -m)" -R
  fi
}

# expect_clean CFG EXE [ARGS...]: must exit 0 with no sanitizer report.
expect_clean() {
  local cfg=$1 exe=$2; shift 2
  local log="$exe.$(echo "${*:-all}" | tr ' /' '__').log" t0=$SECONDS rc
  [ -x "$exe" ] || { fail "$(basename "$exe") $* [$cfg]: not built"; return; }
  # shellcheck disable=SC2046
  timeout "$TIMEOUT" $(runner "$cfg") "$exe" "$@" >"$log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] || grep -qE "ERROR: (Address|Leak)Sanitizer|WARNING: ThreadSanitizer|runtime error:" "$log"; then
    fail "$(basename "$exe") $* [$cfg] (exit $rc)"
    grep -m1 -A25 -E "ERROR: (Address|Leak)Sanitizer|WARNING: ThreadSanitizer|runtime error:|FAIL|CHECK failed" "$log" | head -40
  else
    echo "ok   $(basename "$exe") $* [$cfg] ($((SECONDS - t0)) s)"
  fi
}

# expect_report CFG PATTERN EXE ARGS...: the sanitizer must report PATTERN
# and the program must exit nonzero.
expect_report() {
  local cfg=$1 pattern=$2 exe=$3; shift 3
  local log="$exe.$(echo "$*" | tr ' /' '__').log" rc
  [ -x "$exe" ] || { fail "$(basename "$exe") $* [$cfg]: not built"; return; }
  # shellcheck disable=SC2046
  timeout "$TIMEOUT" $(runner "$cfg") "$exe" "$@" >"$log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] && grep -qE "$pattern" "$log"; then
    echo "ok   $(basename "$exe") $* [$cfg]: caught ($(grep -m1 -oE "$pattern" "$log"), at $(grep -m1 -oE '(tests|csrc)/[^ :]+:[0-9]+' "$log"))"
  else
    fail "$(basename "$exe") $* [$cfg]: expected '$pattern' and a nonzero exit, got exit $rc"
    tail -20 "$log"
  fi
}

bugs_tsan=$(exe_of csrc/cudasim/tests/sanitizer_bugs.cpp tsan)
bugs_asan=$(exe_of csrc/cudasim/tests/sanitizer_bugs.cpp asan)
expect_clean tsan "$(exe_of csrc/cudasim/tests/selftest.cpp tsan)"
expect_clean asan "$(exe_of csrc/cudasim/tests/selftest.cpp asan)"
expect_clean tsan "$bugs_tsan" clean
expect_clean asan "$bugs_asan" clean
expect_report tsan "WARNING: ThreadSanitizer: data race" "$bugs_tsan" race
# UBSan's bounds check usually fires first (it also covers template kernels,
# whose statics ASan leaves without redzones); ASan's redzone is the backstop.
expect_report asan "AddressSanitizer: global-buffer-overflow|runtime error: index [0-9]+ out of bounds for type '[a-z ]+\\[[0-9]+\\]'" \
  "$bugs_asan" static_smem_oob
expect_report asan "AddressSanitizer: heap-buffer-overflow" "$bugs_asan" global_oob
for src in "$@"; do
  for cfg in "${CONFIGS[@]}"; do expect_clean "$cfg" "$(exe_of "$src" "$cfg")"; done
done

echo "sanitize_sim: $failures failure(s) in $(( $(date +%s) - start )) s"
[ "$failures" -eq 0 ]
