// Launch glue of the `sparse_kv` family: validation, dtype dispatch, launches.
#include "aten/cuda_glue.h"
#include "aten/dispatch.h"
#include "aten/sparse_kv_checks.h"
#include "cuda/sparse_kv.cuh"

namespace dllm {
namespace {

cuda::Strides4 strides4(const at::Tensor& t) {
  return cuda::Strides4{t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

cuda::Strides3 strides3(const at::Tensor& t) {
  return cuda::Strides3{t.stride(0), t.stride(1), t.stride(2)};
}

// Runs the validation kernel over idx [B, Q] (contiguous, on the device),
// reads its error record back (aten/cuda_glue.h KernelStatus) and raises the
// fault it names. Returns the record: the copy kernels take it as `fault`.
KernelStatus<int64_t> validate_on_device(const char* op, const at::Tensor& idx,
                                         const at::Tensor* positions, int64_t T,
                                         int64_t n_positions, bool unique) {
  const int64_t B = idx.size(0), Q = idx.size(1);
  KernelStatus<int64_t> record(idx, cuda::kIndexErrorWords);
  at::Tensor seen;
  if (unique) seen = at::zeros({B, T}, idx.options().dtype(at::kInt));
  cuda::launch_validate_indices(
      {.idx = idx.const_data_ptr<int64_t>(),
       .positions = positions ? positions->const_data_ptr<int64_t>() : nullptr,
       .B = B, .Q = Q, .T = T, .n_positions = n_positions,
       .seen = unique ? seen.mutable_data_ptr<int>() : nullptr,
       .err = reinterpret_cast<long long*>(record.data())},
      DLLM_CUDA_STREAM());
  DLLM_CUDA_LAUNCH_CHECK();
  const std::vector<int64_t> e = record.read();
  if ((e[0] & 0xffffffff) != 0)
    raise_index_error(op, IndexError{e[1], e[2], e[3], e[4]}, T, n_positions);
  return record;
}

const long long* fault_of(KernelStatus<int64_t>& record) {
  return reinterpret_cast<const long long*>(record.data());
}

void check_launch_dims(const char* op, int64_t B, int64_t rows, int64_t y) {
  DLLM_CHECK(B <= 65535 && y <= 65535 && rows <= INT32_MAX, op,
             "sizes too large for one launch (B = ", B, ", ", y, " by ", rows, ")");
}

void rope_scatter_kv_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& positions, const at::Tensor& cos_sin,
                          const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& idx) {
  constexpr const char* op = "rope_scatter_kv";
  check_rope_scatter_kv(q, k, v, positions, cos_sin, k_cache, v_cache, idx);
  DLLM_CUDA_ENTER(op, q, "q");
  const int64_t B = q.size(0), Q = q.size(1), T = k_cache.size(2), P = cos_sin.size(0);
  DLLM_CHECK(B * Q <= INT32_MAX, op, "too many tokens (", B * Q, ") for one launch");
  const auto pos_c = positions.contiguous();
  const auto idx_c = idx.contiguous();
  const auto table = cos_sin.contiguous();
  // Validate every index before writing anything: on error nothing changes.
  auto record = validate_on_device(op, idx_c, &pos_c, T, P, /*unique=*/true);
  DLLM_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dllm::rope_scatter_kv", [&] {
    cuda::launch_rope_scatter_kv<kernel_t<scalar_t>>(
        {.q = kernel_mut_ptr<scalar_t>(q), .k = kernel_ptr<scalar_t>(k),
         .v = kernel_ptr<scalar_t>(v), .positions = pos_c.const_data_ptr<int64_t>(),
         .cos_sin = table.const_data_ptr<float>(), .k_cache = kernel_mut_ptr<scalar_t>(k_cache),
         .v_cache = kernel_mut_ptr<scalar_t>(v_cache), .idx = idx_c.const_data_ptr<int64_t>(),
         .B = B, .Q = Q, .H = static_cast<int>(q.size(2)), .H_kv = static_cast<int>(k.size(2)),
         .d = static_cast<int>(q.size(3)), .q_strides = strides4(q), .k_strides = strides4(k),
         .v_strides = strides4(v), .k_cache_strides = strides4(k_cache),
         .v_cache_strides = strides4(v_cache), .fault = fault_of(record)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
}

// Per-row counts: each batch row's own plan (cuda::attention_row_plan, for the
// SM count the launch plans for) on q's device, and the split workspace for
// the most chunks of any row. The plans travel through pinned memory without
// a sync (the caching host allocator keeps the buffer until the copy ran), so
// a call under CUDA graph capture would replay a buffer reused since: such a
// call must not give counts.
struct RowPlans {
  at::Tensor on_device;  // [B] cuda::RowPlan as int32 [B, 4]
  SplitKvPlan split;
};

RowPlans plan_rows(const char* op, const at::Tensor& q, int64_t B, int64_t Q, int64_t H,
                   int64_t H_kv, int64_t T, int64_t d, const at::OptionalIntArrayRef& query_counts,
                   const at::OptionalIntArrayRef& key_counts) {
  static_assert(sizeof(cuda::RowPlan) == 4 * sizeof(int32_t), "RowPlan is four int32");
  const int sms = attention_sm_count(op, q);
  auto opts = at::TensorOptions().dtype(at::kInt);
#if !defined(CUDASIM)
  opts = opts.pinned_memory(true);
#endif
  at::Tensor host = at::empty({B, 4}, opts);
  auto* plans = reinterpret_cast<cuda::RowPlan*>(host.mutable_data_ptr<int32_t>());
  RowPlans r;
  for (int64_t b = 0; b < B; ++b) {
    plans[b] = cuda::attention_row_plan(row_count(query_counts, b, Q), H, H_kv,
                                        row_count(key_counts, b, T), static_cast<int>(d), sms);
    r.split.splits = std::max(r.split.splits, plans[b].chunks);
  }
  r.split.workspace = split_kv_workspace(q, r.split.splits, B * Q * H, d);
  r.on_device = host.to(q.device(), /*non_blocking=*/true);
  return r;
}

std::tuple<at::Tensor, at::Tensor> sparse_attention_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& key_valid, double scale, bool return_probs,
    at::OptionalIntArrayRef query_counts, at::OptionalIntArrayRef key_counts) {
  constexpr const char* op = "sparse_attention";
  check_sparse_attention(q, k_cache, v_cache, key_valid, scale, return_probs, query_counts,
                         key_counts);
  DLLM_CUDA_ENTER(op, q, "q");
  const int64_t B = q.size(0), Q = q.size(1), H = q.size(2), d = q.size(3);
  const int64_t H_kv = k_cache.size(1), T = k_cache.size(2);
  check_launch_dims(op, B, Q * (H / H_kv), H_kv);
  DLLM_CHECK(Q <= 4 * 65535 && T <= INT32_MAX && Q * H <= INT32_MAX, op,
             "sizes too large for one launch (Q = ", Q, ", T = ", T, ")");
  const auto qc = q.contiguous();
  const auto kc = k_cache.contiguous();
  const auto vc = v_cache.contiguous();
  at::Tensor valid_c;
  if (key_valid.has_value()) valid_c = key_valid->contiguous();
  const bool per_row = query_counts.has_value() || key_counts.has_value();
  // Per-row counts leave the rows past a row's queries unwritten: zeros.
  auto out = per_row ? at::zeros({B, Q, H, d}, q.options()) : at::empty({B, Q, H, d}, q.options());
  const auto f32 = q.options().dtype(at::kFloat);
  auto probs = return_probs ? at::empty({B, Q, T}, f32) : at::empty({0}, f32);
  at::Tensor stats;
  if (return_probs) stats = at::empty({B, Q, H, 2}, f32);
  RowPlans rows;
  if (per_row && B * Q > 0)
    rows = plan_rows(op, q, B, Q, H, H_kv, T, d, query_counts, key_counts);
  else
    rows.split = plan_split_kv(op, q, B, Q, H, H_kv, T, d);
  DLLM_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dllm::sparse_attention", [&] {
    cuda::launch_sparse_attention<kernel_t<scalar_t>>(
        {.q = kernel_ptr<scalar_t>(qc), .k_cache = kernel_ptr<scalar_t>(kc),
         .v_cache = kernel_ptr<scalar_t>(vc), .key_valid = optional_ptr<bool>(valid_c),
         .scale = static_cast<float>(scale), .out = kernel_mut_ptr<scalar_t>(out),
         .stats = optional_mut_ptr<float>(stats),
         .probs = return_probs ? probs.mutable_data_ptr<float>() : nullptr,
         .B = static_cast<int>(B), .Q = static_cast<int>(Q), .H = static_cast<int>(H),
         .H_kv = static_cast<int>(H_kv), .T = static_cast<int>(T), .d = static_cast<int>(d),
         .key_splits = rows.split.splits,
         .split_workspace = optional_mut_ptr<float>(rows.split.workspace),
         .row_plans = rows.on_device.defined()
                          ? reinterpret_cast<const cuda::RowPlan*>(rows.on_device.const_data_ptr<int32_t>())
                          : nullptr},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  return {out, probs};
}

// Element size -> the unsigned type the copy kernels move.
template <typename F>
void dispatch_element_size(int64_t size, const char* op, F&& f) {
  switch (size) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
    default: DLLM_CHECK(false, op, "unsupported element size ", size, " bytes");
  }
}

at::Tensor gather_rows_cuda(const at::Tensor& x, const at::Tensor& idx) {
  constexpr const char* op = "gather_rows";
  check_gather_rows(x, idx);
  DLLM_CUDA_ENTER(op, x, "x");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), Q = idx.size(1);
  check_launch_rows(op, B * Q);
  const auto idx_c = idx.contiguous();
  auto record = validate_on_device(op, idx_c, nullptr, T, 0, /*unique=*/false);
  auto out = at::empty({B, Q, C}, x.options());
  dispatch_element_size(x.element_size(), op, [&](auto tag) {
    using E = decltype(tag);
    cuda::launch_gather_rows<E>(
        {.x = static_cast<const E*>(x.const_data_ptr()), .idx = idx_c.const_data_ptr<int64_t>(),
         .out = static_cast<E*>(out.mutable_data_ptr()), .B = B, .Q = Q, .C = C,
         .x_strides = strides3(x), .fault = fault_of(record)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  return out;
}

void scatter_rows_cuda(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& idx) {
  constexpr const char* op = "scatter_rows";
  check_scatter_rows(dst, src, idx);
  DLLM_CUDA_ENTER(op, dst, "dst");
  const int64_t B = dst.size(0), T = dst.size(1), C = dst.size(2), Q = idx.size(1);
  check_launch_rows(op, B * Q);
  const auto idx_c = idx.contiguous();
  auto record = validate_on_device(op, idx_c, nullptr, T, 0, /*unique=*/true);
  dispatch_element_size(dst.element_size(), op, [&](auto tag) {
    using E = decltype(tag);
    cuda::launch_scatter_rows<E>(
        {.dst = static_cast<E*>(dst.mutable_data_ptr()),
         .src = static_cast<const E*>(src.const_data_ptr()),
         .idx = idx_c.const_data_ptr<int64_t>(), .B = B, .Q = Q, .C = C,
         .dst_strides = strides3(dst), .src_strides = strides3(src), .fault = fault_of(record)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
}

}  // namespace

DLLM_CUDA_LIBRARY(m) {
  DLLM_CUDA_REGISTER(m, "rope_scatter_kv", rope_scatter_kv_cuda);
  DLLM_CUDA_REGISTER(m, "sparse_attention", sparse_attention_cuda);
  DLLM_CUDA_REGISTER(m, "gather_rows", gather_rows_cuda);
  DLLM_CUDA_REGISTER(m, "scatter_rows", scatter_rows_cuda);
}

}  // namespace dllm
