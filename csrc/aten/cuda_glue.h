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
#include "cuda/attention_tile.cuh"  // the split-KV rule (ATen-free)

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <vector>

#if defined(CUDASIM)
#include "cudasim/cuda_compat.cuh"
#else
// c10's stream/guard headers, not ATen/cuda/CUDAContext.h: the latter pulls in
// cuSPARSE/cuBLAS headers that a minimal toolkit does not ship.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
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
using kernel_t = typename cuda_type<T>::type;

template <typename T>
inline const kernel_t<T>* kernel_ptr(const at::Tensor& t) {
  return reinterpret_cast<const kernel_t<T>*>(t.const_data_ptr<T>());
}
template <typename T>
inline kernel_t<T>* kernel_mut_ptr(const at::Tensor& t) {
  return reinterpret_cast<kernel_t<T>*>(t.mutable_data_ptr<T>());
}

// The data of an optional input or scratch tensor, or null when it is
// undefined (the kernels' "not given").
template <typename T>
inline const T* optional_ptr(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}
template <typename T>
inline T* optional_mut_ptr(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<T>() : nullptr;
}

#if defined(CUDASIM)
inline void check_kernel_device(const char* op, const at::Tensor& t, const char* name) {
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
inline void check_kernel_device(const char* op, const at::Tensor& t, const char* name) {
  DLLM_CHECK(t.is_cuda(), op, name, " must be a CUDA tensor, got ", t.device());
}
#define DLLM_CUDA_GUARD(t) const c10::cuda::OptionalCUDAGuard dllm_device_guard_(t.device())
#define DLLM_CUDA_STREAM() (c10::cuda::getCurrentCUDAStream().stream())
#define DLLM_CUDA_LAUNCH_CHECK() C10_CUDA_KERNEL_LAUNCH_CHECK()
#define DLLM_CUDA_LIBRARY(m) TORCH_LIBRARY_IMPL(dllm, CUDA, m)
#define DLLM_CUDA_REGISTER(m, name, fn) m.impl(name, TORCH_FN(fn))
#endif

// Every CUDA op, right after its argument checks: `t` (named `name` in
// messages) must be a CUDA tensor -- in the simulation, a CPU tensor -- and
// the op runs on t's device.
#define DLLM_CUDA_ENTER(op, t, name) \
  check_kernel_device(op, t, name);  \
  DLLM_CUDA_GUARD(t)

// Kernels that put one row per block index rows with a 32-bit grid dimension.
inline void check_launch_rows(const char* op, int64_t rows) {
  DLLM_CHECK(rows <= INT32_MAX, op, "too many rows (", rows, ") for one launch");
}

// ---- kernel status read-back ------------------------------------------------
// Kernels report data-dependent faults (a NaN input, an index out of range, a
// corrupt packed cache) into a small zeroed device record: a status word of
// OR-ed fault bits (select, rollout, quant: math::<Family>Status) or the
// first-error record of sparse_kv's index validation. After its launches the
// glue reads the record back once -- one device-to-host copy, the one sync
// these ops make -- and hands it to the family's raise_* helper
// (aten/<family>_checks.h), which raises "dllm::<op>: ..." when it holds a
// fault.
//
// Under CUDA graph capture a sync would invalidate the capture, so read()
// skips the copy and returns an all-zero record: nothing is raised, and the
// outputs are what the kernels produce for bad input (select: the fallbacks
// documented in select.cuh; rollout and quant: unspecified values, never an
// out-of-bounds access; sparse_kv: the copy kernels see the validation's
// fault and write nothing). Validate new inputs with one uncaptured call.
inline bool stream_is_capturing() {
#if defined(CUDASIM)
  return false;  // simulated launches run synchronously; there is no graph to capture
#else
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#endif
}

template <typename Word>
class KernelStatus {
 public:
  // A zeroed record of `words` words on `like`'s device.
  explicit KernelStatus(const at::Tensor& like, int64_t words = 1)
      : record_(at::zeros({words}, like.options().dtype(c10::CppTypeToScalarType<Word>::value))) {}

  Word* data() { return record_.mutable_data_ptr<Word>(); }

  // The record after the launches so far (all zeros under graph capture).
  std::vector<Word> read() const {
    std::vector<Word> host(static_cast<size_t>(record_.numel()), Word{0});
    if (stream_is_capturing()) return host;
    const at::Tensor copy = record_.cpu();
    std::copy_n(copy.const_data_ptr<Word>(), host.size(), host.begin());
    return host;
  }

 private:
  at::Tensor record_;
};

// The usual record: one int of OR-ed math::<Family>Status bits.
using StatusWord = KernelStatus<int32_t>;

// ---- split-KV plan of the attention ops -------------------------------------------
// sparse_attention and quant_attention cut the keys into chunks when their
// grid would under-fill the device (cuda/attention_tile.cuh: the occupancy
// rule attention_key_splits, which the glue feeds with this SM count).
constexpr int kMaxPlannedSms = 65536;  // bounds the split grid and workspace an override can ask for

// The SM count the rule plans for: DLLM_ATTN_SM_COUNT when set (run time; how
// tests force or rule out the split path on any backend; 0 = never split),
// else the device's multiprocessor count. The simulator has no device to
// fill: unset, it plans for 0 SMs, so by default it runs the one-pass path.
inline int attention_sm_count(const char* op, const at::Tensor& t) {
  if (const char* e = std::getenv("DLLM_ATTN_SM_COUNT"); e != nullptr && *e != '\0') {
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(e, &end, 10);
    DLLM_CHECK(*end == '\0' && errno == 0 && v >= 0 && v <= kMaxPlannedSms, op,
               "DLLM_ATTN_SM_COUNT must be an integer in [0, ", kMaxPlannedSms,
               "] (or unset), got '", e, "'");
    return static_cast<int>(v);
  }
#if defined(CUDASIM)
  (void)t;
  return 0;
#else
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, t.get_device()));
  return n;
#endif
}

// The key chunks of one attention call on q's device, and their fp32
// workspace (undefined when the rule does not split).
struct SplitKvPlan {
  int splits = 1;
  at::Tensor workspace;
};

// The fp32 split-KV workspace of `splits` chunks over `rows` query rows on q's
// device (undefined for one pass).
inline at::Tensor split_kv_workspace(const at::Tensor& q, int splits, int64_t rows, int64_t d) {
  if (splits <= 1) return at::Tensor();
  return at::empty({cuda::attention_split_workspace_floats(splits, rows, d)},
                   q.options().dtype(at::kFloat));
}

inline SplitKvPlan plan_split_kv(const char* op, const at::Tensor& q, int64_t B, int64_t Q,
                                 int64_t H, int64_t H_kv, int64_t T, int64_t d) {
  SplitKvPlan plan;
  plan.splits = cuda::attention_key_splits_for(B, Q, H, H_kv, T, static_cast<int>(d),
                                               attention_sm_count(op, q));
  plan.workspace = split_kv_workspace(q, plan.splits, B * Q * H, d);
  return plan;
}

}  // namespace dllm
