// The one way the CPU kernels are built for several instruction sets and
// picked at run time, and the grain sizes of their at::parallel_for loops.
//
// Instruction sets. A family whose hot loops profit from wider vectors keeps
// them in csrc/cpu/<family>_kernels.h (no include guard) and includes this
// header a second time with DLLM_ISA_KERNELS naming it:
//
//   #define DLLM_ISA_KERNELS "cpu/<family>_kernels.h"
//   #include "cpu/isa.h"
//
// which compiles the kernels header three times, each copy in its own
// namespace (isa_generic, isa_avx2, isa_avx512) under `#pragma GCC target`
// (x86-64 baseline, x86-64-v3, x86-64-v4), with DLLM_VEC_FLOATS floats per
// vector register (4, 8, 16) for code that sizes GCC vector types by it. A
// call site picks the copy with DLLM_ISA_CALL(isa, f(args)), isa from
// active_isa(op): the widest level this CPU runs, capped by the DLLM_CPU_ISA
// environment variable (generic | avx2 | avx512 | avx512bf16; read on every
// call, so a test can run the narrower levels on a wide machine). `python -m
// bench ops` reports the level in use (torch.ops.dllm_cpu.isa, csrc/cpu/isa.cpp).
//
// Numerics. A copy compiled with FMA lets GCC contract a * b + c, which can
// change the last bit. So a kernels header either allows for that in its tests
// or keeps the roundings apart itself:
//   select: cosine_drift's and token_confidence's row kernels (GCC vector
//     types; tolerance tests);
//   sparse_kv: RoPE rows and the softmax / transpose loops of sparse_attention
//     (tolerance tests);
//   quant: the quantize / dequantize rows, bit-exact against their oracle in
//     every copy: quantizing has nothing to contract, and dequantizing passes
//     the product through an empty asm statement before adding the min
//     (quant_kernels.h explains).
//   layer: add_rms_norm_'s sum of squares and silu_mul's exp (tolerance
//     tests; the residual update, one add and one rounding, is exact).
// Compiled once, for the baseline: the rollout sums (their multiply-adds
// would contract), quant's per-group scale / min step and its K error loop.
//
// Kernels header rules: inline or template functions only (each copy is its
// own set of definitions); types shared with the generic code are declared
// before the #include; a row function that must not be inlined into a
// generic caller (where GCC would lose its restrict guarantees and keep the
// loop scalar) is marked DLLM_CPU_NOINLINE.

#ifndef DLLM_CPU_ISA_H_
#if defined(DLLM_ISA_KERNELS)
#error "include cpu/isa.h at the top of the file before instantiating a kernels header with it"
#endif
#define DLLM_CPU_ISA_H_

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#define DLLM_ISA_X86 1
#else
#define DLLM_ISA_X86 0
#endif

#if defined(__GNUC__)
#define DLLM_CPU_NOINLINE __attribute__((noinline))
#else
#define DLLM_CPU_NOINLINE
#endif

namespace dllm {
namespace cpu {

// kAvx512Bf16 runs the AVX-512 copy and lets a kernel use AVX512-BF16's
// instructions too (functions with their own target attribute, picked by
// testing the level at run time): its conversions in bf16 K dequantization
// (quant) and bf16 RoPE rows (sparse_kv), both giving the AVX-512 copy's
// bits, and its dot products in the bf16 attention tiles (sparse_attention,
// quant_attention, two_source_attention), which sum in another order than
// the BLAS calls below this level and are held to the same bound. It is not
// a copy of its own: DLLM_ISA_CALL maps it to isa_avx512.
enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

// The widest level this CPU can run: the feature levels the copies are
// compiled for (x86-64-v4: AVX-512 F/BW/CD/DQ/VL; x86-64-v3: AVX2, FMA, BMI,
// F16C, ...), and x86-64-v4 with AVX512-BF16, probed once.
inline Isa best_isa() {
  static const Isa best = [] {
#if DLLM_ISA_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4"))
      return __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
    if (__builtin_cpu_supports("x86-64-v3")) return Isa::kAvx2;
#endif
    return Isa::kGeneric;
  }();
  return best;
}

// best_isa(), capped by DLLM_CPU_ISA. An unknown value is an error, not a
// silent fallback, so a typo cannot pass for a test of a narrower copy.
inline Isa active_isa(const char* op) {
  const Isa best = best_isa();
  const char* cap = std::getenv("DLLM_CPU_ISA");
  if (cap == nullptr || *cap == '\0') return best;
  const std::string c(cap);
  Isa want = Isa::kGeneric;
  if (c == "avx2") {
    want = Isa::kAvx2;
  } else if (c == "avx512") {
    want = Isa::kAvx512;
  } else if (c == "avx512bf16") {
    want = Isa::kAvx512Bf16;
  } else {
    TORCH_CHECK(c == "generic", "dllm::", op,
                ": DLLM_CPU_ISA must be generic, avx2, avx512 or avx512bf16 (or unset), got '", c,
                "'");
  }
  return static_cast<int>(want) < static_cast<int>(best) ? want : best;
}

// ---- grain sizes of at::parallel_for -------------------------------------------
// A task is worth a fork/join of ATen's thread pool only when it does at
// least this much; below, one thread runs the whole loop. Each constant is in
// the unit its loops count.

// Elements streamed once (cosine_drift's rows, token_confidence's logits):
// ~32K elements is tens of microseconds, well above the fork/join cost.
constexpr int64_t kGrainStreamElems = 32768;
// Elements of the selection rows (select_transfer, drift_select): each
// element costs a key build and a partial sort step, so twice the above.
constexpr int64_t kGrainSelectElems = 65536;
// Kernel terms of certainty_density (one multiply-add each): ~1 ms a task.
constexpr int64_t kGrainDensityTerms = int64_t{1} << 20;
// Elements of a rollout layer (row sums, column updates): a decode step's
// layers are small, so each layer forks at most about twice.
constexpr int64_t kGrainRolloutElems = int64_t{1} << 17;
// Columns of a rollout layer below which splitting its column sweep costs
// more than the sweep.
constexpr int64_t kGrainRolloutColumns = 256;
// Sorted candidates of nucleus_select (a sort and a scan per row).
constexpr int64_t kGrainNucleusElems = 16384;
// Rotated elements of rope_scatter_kv ((H + 2 H_kv) * d per token).
constexpr int64_t kGrainRopeElems = 4096;
// Bytes moved by gather_rows / scatter_rows.
constexpr int64_t kGrainCopyBytes = 65536;
// Token rows of quantize_v / dequantize_v (d <= 256 values each).
constexpr int64_t kGrainQuantRows = 64;
// Work units that are already large (an attention tile, a quantization
// group): one per task.
constexpr int64_t kGrainOneUnit = 1;

// ---- faults found by the workers --------------------------------------------------
// The CPU side of the kernels' status word (the CUDA side: aten/cuda_glue.h
// KernelStatus): the math::<Family>Status bits the workers of one call find,
// OR-ed together and handed to the family's raise_*_status helper.
class FaultBits {
 public:
  void add(int bits) {
    if (bits) bits_.fetch_or(bits, std::memory_order_relaxed);
  }
  int get() const { return bits_.load(); }

 private:
  std::atomic<int> bits_{0};
};

// Items per task for items of `work_per_item` (in the unit of `grain`).
inline int64_t grain_items(int64_t grain, int64_t work_per_item) {
  return std::max<int64_t>(1, grain / std::max<int64_t>(1, work_per_item));
}

}  // namespace cpu
}  // namespace dllm

// DLLM_ISA_CALL(isa, f(args...)): calls f of the copy for `isa` (a
// dllm::cpu::Isa), from the namespace that included the kernels header.
#if DLLM_ISA_X86
#define DLLM_ISA_CALL(isa, ...)                                 \
  do {                                                          \
    switch (isa) {                                              \
      case ::dllm::cpu::Isa::kAvx512Bf16:                       \
      case ::dllm::cpu::Isa::kAvx512: isa_avx512::__VA_ARGS__; break; \
      case ::dllm::cpu::Isa::kAvx2: isa_avx2::__VA_ARGS__; break;     \
      default: isa_generic::__VA_ARGS__; break;                 \
    }                                                           \
  } while (0)
#else
#define DLLM_ISA_CALL(isa, ...) \
  do {                          \
    (void)(isa);                \
    isa_generic::__VA_ARGS__;   \
  } while (0)
#endif

#endif  // DLLM_CPU_ISA_H_

// ---- the copies of a kernels header (re-entered with DLLM_ISA_KERNELS) ----------
#if defined(DLLM_ISA_KERNELS)
namespace isa_generic {
#define DLLM_VEC_FLOATS 4
#include DLLM_ISA_KERNELS
#undef DLLM_VEC_FLOATS
}  // namespace isa_generic
#if DLLM_ISA_X86
// Vector values only pass between inlined functions of one copy; the ABI
// note GCC gives for wide vector arguments does not apply.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
namespace isa_avx2 {
#define DLLM_VEC_FLOATS 8
#include DLLM_ISA_KERNELS
#undef DLLM_VEC_FLOATS
}  // namespace isa_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
namespace isa_avx512 {
#define DLLM_VEC_FLOATS 16
#include DLLM_ISA_KERNELS
#undef DLLM_VEC_FLOATS
}  // namespace isa_avx512
#pragma GCC pop_options
#pragma GCC diagnostic pop
#endif
#undef DLLM_ISA_KERNELS
#endif
