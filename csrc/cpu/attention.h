// One tile of softmax attention on the CPU: the unit sparse_attention runs
// (csrc/cpu/sparse_kv.cpp, which defines it and explains the three steps), and
// the one quant_attention runs over the K and V it has just dequantized
// (csrc/cpu/quant.cpp). One definition, so quant_attention on the CPU equals
// sparse_attention on the dequantized cache bit for bit.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu/isa.h"

namespace dllm {
namespace cpu {

// q [B, Q, H, d], the caches [B, H_kv, T, d], G = H / H_kv query heads per KV head.
struct AttnShape {
  int64_t B, Q, H, H_kv, G, T, d;
};

// Query lanes of the bf16 dot-product tiles (sparse_kv_kernels.h): the
// tile's M query rows rounded up to whole registers of 16.
inline int64_t pair_lanes(int64_t M) { return (M + 15) / 16 * 16; }

// Per-thread scratch of one work unit (sized for the largest tile).
template <typename T_>
struct AttnScratch {
  std::vector<T_> q_rows, qt, p;  // q_rows: the tile's query rows, [M, d]
  std::vector<float> st, pf, o, mx, sum, inv;  // pf: fp32 P, only with probabilities
  // bf16 only: Q and V laid out in pairs for AVX512-BF16's dot products
  // (sparse_kv_kernels.h: pack_query_pairs, pack_value_pairs).
  std::vector<uint32_t> q_pairs, v_pairs;
  AttnScratch(int64_t M, int64_t T, int64_t d, bool with_probs)
      : q_rows(M * d), qt(d * M), p(M * T), st(T * M), pf(with_probs ? M * T : 0), o(M * d),
        mx(M), sum(M), inv(M) {
    if constexpr (std::is_same_v<T_, c10::BFloat16>) {
      q_pairs.resize((d / 2) * pair_lanes(M));
      v_pairs.resize((T + 1) / 2 * d);
    }
  }
};

// The largest buffer ThreadScratch keeps for its thread between calls.
constexpr size_t kKeptScratchBytes = size_t{16} << 20;

// n elements of T_ of scratch (contents undefined) for the calling thread.
// Up to kKeptScratchBytes it is the thread's kept buffer, reused by the next
// call instead of freshly allocated and page-faulted in; larger requests
// allocate their own. One live ThreadScratch per thread at a time.
template <typename T_>
class ThreadScratch {
 public:
  explicit ThreadScratch(int64_t n) {
    const size_t bytes = static_cast<size_t>(n) * sizeof(T_);
    if (bytes <= kKeptScratchBytes) {
      static thread_local std::vector<char> kept;
      if (kept.size() < bytes) kept.resize(bytes);
      p_ = kept.data();
    } else {
      own_.reset(new char[bytes]);
      p_ = own_.get();
    }
  }
  T_* get() const { return reinterpret_cast<T_*>(p_); }

 private:
  char* p_ = nullptr;
  std::unique_ptr<char[]> own_;
};

// Queries per tile: enough rows (M = Qt * G ~ 64) for the gemms to run at
// speed, few enough that the fp32 score block stays within ~4 MB of cache.
int64_t query_tile(const AttnShape& s);

// One (b, kv head kvh, queries q0 .. q0 + Qt) unit over that head's keys and
// values K, V [T, d] (contiguous): writes its rows of out [B, Q, H, d] and,
// with probs_acc, writes (first_head) or adds the tile's probabilities summed
// over the head's G query heads (row stride T). valid: the batch row's key
// mask [T] or null; the caller handles a row without any valid key.
template <typename T_>
void attend_tile(Isa isa, const AttnShape& s, int64_t b, int64_t kvh, int64_t q0, int64_t Qt,
                 const T_* q, const T_* K, const T_* V, const bool* valid, float scale, T_* out,
                 AttnScratch<T_>& w, float* probs_acc, bool first_head);

// Runs attention with head-averaged probabilities (probs [B, Q, T], fp32)
// over every (b, query tile, KV head): tile(w, b, kvh, q0, Qt, probs_acc,
// first_head) runs one head's tile (attend_tile with probs_acc), and this
// function sums the heads into probs and scales by 1 / H in a fixed order
// that depends only on the shape and the thread count, so two callers over the
// same keys get the same bits. Rows of a batch row without any valid key
// (n_valid[b] == 0) get zero outputs and probabilities without a call.
template <typename T_>
using ProbsTileFn = std::function<void(AttnScratch<T_>& w, int64_t b, int64_t kvh, int64_t q0,
                                       int64_t Qt, float* probs_acc, bool first_head)>;
template <typename T_>
void attend_with_probs(Isa isa, const AttnShape& s, const int64_t* n_valid, T_* out, float* probs,
                       const ProbsTileFn<T_>& tile);
extern template void attend_with_probs<float>(Isa, const AttnShape&, const int64_t*, float*,
                                              float*, const ProbsTileFn<float>&);
extern template void attend_with_probs<c10::Half>(Isa, const AttnShape&, const int64_t*,
                                                  c10::Half*, float*,
                                                  const ProbsTileFn<c10::Half>&);
extern template void attend_with_probs<c10::BFloat16>(Isa, const AttnShape&, const int64_t*,
                                                      c10::BFloat16*, float*,
                                                      const ProbsTileFn<c10::BFloat16>&);

// attend_tile's two halves, for a caller that produces V only after the
// scores (quant_attention, which dequantizes V into the buffer K used):
// attend_scores runs steps 1-2 (and the probabilities) and returns P [M, T];
// attend_values runs step 3 over V and writes the tile's output rows.
// V_ahead: the V that step 3 will read, if it exists yet (else null): bf16
// dot-product tiles prefetch it while they score.
template <typename T_>
const T_* attend_scores(Isa isa, const AttnShape& s, int64_t b, int64_t kvh, int64_t q0,
                        int64_t Qt, const T_* q, const T_* K, const bool* valid, float scale,
                        AttnScratch<T_>& w, float* probs_acc, bool first_head,
                        const T_* V_ahead);
template <typename T_>
void attend_values(Isa isa, const AttnShape& s, int64_t b, int64_t kvh, int64_t q0, int64_t Qt,
                   const T_* p, const T_* V, T_* out, AttnScratch<T_>& w);
#define DLLM_ATTEND_PHASES(T_)                                                                 \
  extern template const T_* attend_scores<T_>(Isa, const AttnShape&, int64_t, int64_t, int64_t, \
                                              int64_t, const T_*, const T_*, const bool*, float, \
                                              AttnScratch<T_>&, float*, bool, const T_*);       \
  extern template void attend_values<T_>(Isa, const AttnShape&, int64_t, int64_t, int64_t,       \
                                         int64_t, const T_*, const T_*, T_*, AttnScratch<T_>&);
DLLM_ATTEND_PHASES(float)
DLLM_ATTEND_PHASES(c10::Half)
DLLM_ATTEND_PHASES(c10::BFloat16)
#undef DLLM_ATTEND_PHASES

extern template void attend_tile<float>(Isa, const AttnShape&, int64_t, int64_t, int64_t, int64_t,
                                        const float*, const float*, const float*, const bool*,
                                        float, float*, AttnScratch<float>&, float*, bool);
extern template void attend_tile<c10::Half>(Isa, const AttnShape&, int64_t, int64_t, int64_t,
                                            int64_t, const c10::Half*, const c10::Half*,
                                            const c10::Half*, const bool*, float, c10::Half*,
                                            AttnScratch<c10::Half>&, float*, bool);
extern template void attend_tile<c10::BFloat16>(Isa, const AttnShape&, int64_t, int64_t, int64_t,
                                                int64_t, const c10::BFloat16*,
                                                const c10::BFloat16*, const c10::BFloat16*,
                                                const bool*, float, c10::BFloat16*,
                                                AttnScratch<c10::BFloat16>&, float*, bool);

}  // namespace cpu
}  // namespace dllm
