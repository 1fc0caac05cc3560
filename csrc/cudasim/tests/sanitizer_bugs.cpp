// Injected bugs that only a sanitizer catches; scripts/sanitize_sim.sh runs
// each mode and expects the named report (and a nonzero exit).
//
//   sanitizer_bugs race             missing __syncthreads       TSan (-DCUDASIM_THREADS): data race
//   sanitizer_bugs static_smem_oob  static __shared__ overflow  ASan: global-buffer-overflow
//   sanitizer_bugs global_oob       off-by-one global read      ASan: heap-buffer-overflow
//   sanitizer_bugs clean            a correct kernel            must run clean everywhere
#include "cudasim/cuda_compat.cuh"

#include <cstdio>
#include <cstring>
#include <vector>

// Thread t writes s[t] and, with no barrier, reads its neighbour's slot. On
// the threads engine two OS threads touch s[t+1] unordered: a data race.
__global__ void missing_sync_kernel(int* out) {
  __shared__ int s[128];
  const int t = threadIdx.x, n = blockDim.x;
  s[t] = t + 1;
  // __syncthreads();   <- the bug
  out[t] = s[(t + 1) % n];
}

// One thread too many for the static array. ASan puts redzones around
// function-local statics of ordinary functions (not around those of inline
// functions or templates, which live in COMDAT sections).
__global__ void static_smem_oob_kernel(float* out) {
  __shared__ float s[64];
  s[threadIdx.x] = 1.f;  // launched with 65 threads: s[64] is out of bounds
  __syncthreads();
  out[threadIdx.x] = s[0];
}

__global__ void global_oob_kernel(const float* x, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) out[0] += x[i] * 0.f;  // `<=`: reads x[n]
}

__global__ void clean_kernel(const float* x, float* out, int n) {
  __shared__ float s[128];
  const int t = threadIdx.x;
  s[t] = t < n ? x[t] : 0.f;
  __syncthreads();
  for (int stride = 64; stride > 0; stride /= 2) {
    if (t < stride) s[t] += s[t + stride];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "race") == 0) {
    std::vector<int> out(128);
    DLLM_LAUNCH(missing_sync_kernel, 4, 128, 0, nullptr, out.data());
  } else if (std::strcmp(mode, "static_smem_oob") == 0) {
    std::vector<float> out(65);
    DLLM_LAUNCH(static_smem_oob_kernel, 1, 65, 0, nullptr, out.data());
  } else if (std::strcmp(mode, "global_oob") == 0) {
    std::vector<float> x(100, 1.f), out(1, 0.f);
    DLLM_LAUNCH(global_oob_kernel, 1, 128, 0, nullptr, x.data(), out.data(), 100);
  } else if (std::strcmp(mode, "clean") == 0) {
    std::vector<float> x(100, 1.f), out(3, 0.f);
    DLLM_LAUNCH(clean_kernel, 3, 128, 0, nullptr, x.data(), out.data(), 100);
    if (out[0] != 100.f || out[2] != 100.f) {
      std::printf("clean: wrong result %g\n", out[0]);
      return 1;
    }
  } else {
    std::fprintf(stderr, "usage: %s race|static_smem_oob|global_oob|clean\n", argv[0]);
    return 2;
  }
  std::printf("%s: finished\n", mode);
  return 0;
}
