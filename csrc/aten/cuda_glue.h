// Torch-side glue shared by every csrc/cuda/<family>.cu.
//
// A .cu file is compiled twice: by nvcc for the real GPU build, and by g++
// with -DCUDASIM into the test-only simulation extension (python_tests/sim/),
// where "CUDA tensors" are CPU tensors and kernels run on the CUDA simulator.
// These macros hide that difference so the launch glue is written once.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include "aten/checks.h"

#if defined(CUDASIM)
#include "cudasim/cuda_compat.cuh"
#else
// c10's stream/guard headers, not ATen/cuda/CUDAContext.h: the latter pulls in
// cuSPARSE/cuBLAS headers that a minimal toolkit does not ship.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace dllm {

// at:: scalar type -> the type the kernels see.
template <typename T>
struct cuda_type { using type = T; };
template <>
struct cuda_type<at::Half> { using type = __half; };
template <>
struct cuda_type<at::BFloat16> { using type = __nv_bfloat16; };

template <typename T>
inline auto* kernel_ptr(const at::Tensor& t) {
  return reinterpret_cast<const typename cuda_type<T>::type*>(t.const_data_ptr<T>());
}
template <typename T>
inline auto* kernel_mut_ptr(const at::Tensor& t) {
  return reinterpret_cast<typename cuda_type<T>::type*>(t.mutable_data_ptr<T>());
}

#if defined(CUDASIM)
inline void check_kernel_device(const at::Tensor& t, const char* op, const char* name) {
  DLLM_CHECK(t.is_cpu(), op, name, " must be a CPU tensor in the CUDA simulation, got ",
             t.device());
}
#define DLLM_CUDA_GUARD(t) ((void)0)
#define DLLM_CUDA_STREAM() (static_cast<::dllm::cuda::stream_t>(nullptr))
#define DLLM_CUDA_LAUNCH_CHECK() ((void)0)
// The simulation exposes the same functions as torch.ops.dllm_sim.<name>.
#define DLLM_CUDA_LIBRARY(m) TORCH_LIBRARY_FRAGMENT(dllm_sim, m)
#define DLLM_CUDA_REGISTER(m, name, fn) m.def(name, TORCH_FN(fn))
#else
inline void check_kernel_device(const at::Tensor& t, const char* op, const char* name) {
  DLLM_CHECK(t.is_cuda(), op, name, " must be a CUDA tensor, got ", t.device());
}
#define DLLM_CUDA_GUARD(t) const c10::cuda::OptionalCUDAGuard dllm_device_guard_(t.device())
#define DLLM_CUDA_STREAM() (c10::cuda::getCurrentCUDAStream().stream())
#define DLLM_CUDA_LAUNCH_CHECK() C10_CUDA_KERNEL_LAUNCH_CHECK()
#define DLLM_CUDA_LIBRARY(m) TORCH_LIBRARY_IMPL(dllm, CUDA, m)
#define DLLM_CUDA_REGISTER(m, name, fn) m.impl(name, TORCH_FN(fn))
#endif

}  // namespace dllm
