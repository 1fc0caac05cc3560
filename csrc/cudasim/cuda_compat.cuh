// The one header every ATen-free kernel header (csrc/cuda/<family>.cuh)
// includes first. Under nvcc it is plain CUDA; under -DCUDASIM (g++/clang++)
// it brings the CPU simulation in csrc/cudasim/cudasim.h, so the same kernel
// source runs in CPU tests. Kernels launch and take dynamic shared memory only
// through the two macros below, the only spots where the two builds differ.
#pragma once

#if defined(__CUDACC__)

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

// DLLM_LAUNCH(kernel, grid, block, smem_bytes, stream, args...)
#define DLLM_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) \
  kernel<<<(grid), (block), (smem_bytes), (stream)>>>(__VA_ARGS__)

// T* name = the block's dynamic shared memory (16-byte aligned).
#define DLLM_DYNAMIC_SMEM(T, name)                             \
  extern __shared__ __align__(16) unsigned char name##_raw_[]; \
  T* name = reinterpret_cast<T*>(name##_raw_)

#elif defined(CUDASIM)

#include "cudasim.h"
// By relative path, so the shim wins even if the real (device-only) header
// comes first on the include path; kernels should still pass
// -I csrc/cudasim/shim_include before the CUDA include dir for their own
// <cooperative_groups.h> includes.
#include "shim_include/cooperative_groups.h"

// Synchronous: the launch has finished (or thrown cudasim::Error) when this
// returns. The stream is evaluated and ignored; the kernel's spelling is kept
// for error messages.
#define DLLM_LAUNCH(kernel, grid, block, smem_bytes, stream, ...)                 \
  ((void)(stream), ::cudasim::launch(::cudasim::named(kernel, #kernel), (grid), (block), \
                                     (smem_bytes)__VA_OPT__(, ) __VA_ARGS__))

// Per launch: smem_bytes for each block, filled with 0xFF before each block
// and guarded by canaries checked after it.
#define DLLM_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::cudasim::dynamic_smem())

#else
#error "cuda_compat.cuh: compile with nvcc, or with -DCUDASIM for the CPU simulation"
#endif
