#!/usr/bin/env bash
# Configure the CMake build against the venv's torch.
#   scripts/cmake_configure.sh PYTHON BUILD_DIR [extra cmake args...]
# A CUDA build of torch makes find_package(Torch) look for the toolkit and for
# libnvrtc; the minimal toolkit lacks nvrtc, which the torch wheels ship.
set -euo pipefail
py=$1; dir=$2; shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
cuda_home=${CUDA_HOME:-$("$py" "$here/tools/cuda_home.py")}
args=(-DCMAKE_PREFIX_PATH="$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
      -DPython3_EXECUTABLE="$(command -v "$py" || echo "$py")")
if [ -n "$cuda_home" ]; then
  args+=(-DCUDA_TOOLKIT_ROOT_DIR="$cuda_home" -DCUDAToolkit_ROOT="$cuda_home")
  nvrtc=$("$py" - <<'PY'
import glob, os
try:
    import nvidia
    for base in nvidia.__path__:
        hits = sorted(glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so*")))
        if hits:
            print(hits[0]); break
except ImportError:
    pass
PY
)
  [ -n "$nvrtc" ] && args+=(-DCUDA_nvrtc_LIBRARY="$nvrtc")
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
mkdir -p "$(dirname "$dir")"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
[ -f "$dir/CMakeCache.txt" ] && gen=()
cmake -S "$here" -B "$dir" "${gen[@]}" "${args[@]}" "$@" > "$dir.configure.log" 2>&1 || {
  cat "$dir.configure.log"; exit 1; }
