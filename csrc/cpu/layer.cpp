// CPU kernels of the `layer` family: the fused epilogues of a pre-norm layer,
// residual add + RMSNorm (add_rms_norm_) and SiLU-and-multiply (silu_mul).
// Rows split over ATen's thread pool; each row is one call of the row loop of
// the copy for this CPU (cpu/layer_kernels.h), so a row's bits do not depend
// on how many rows share the call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "aten/dispatch.h"
#include "aten/layer_checks.h"
#include "cpu/elem.h"
#include "cpu/isa.h"
#include "math/layer_math.h"

namespace dllm {
namespace {

// The row loops, one copy per instruction set (cpu/isa.h).
#define DLLM_ISA_KERNELS "cpu/layer_kernels.h"
#include "cpu/isa.h"

template <typename T>
using Bits = typename cpu::Elem<T>::Bits;

void add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                      double eps) {
  constexpr const char* op = "add_rms_norm_";
  check_add_rms_norm(x, residual, weight, eps);
  if (x.numel() == 0) return;
  const int64_t C = x.size(-1), rows = x.numel() / C;
  // Written tensors: in place when contiguous, else through a copy put back.
  at::Tensor xc = x.contiguous(), rc = residual.contiguous();
  const at::Tensor wc = weight.contiguous();
  const cpu::Isa isa = cpu::active_isa(op);
  DLLM_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dllm::add_rms_norm_", [&] {
    auto* xp = reinterpret_cast<Bits<scalar_t>*>(xc.mutable_data_ptr<scalar_t>());
    auto* rp = reinterpret_cast<Bits<scalar_t>*>(rc.mutable_data_ptr<scalar_t>());
    const auto* wp = reinterpret_cast<const Bits<scalar_t>*>(wc.const_data_ptr<scalar_t>());
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, cpu::grain_items(cpu::kGrainStreamElems, 3 * C),
                     [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        DLLM_ISA_CALL(isa, add_rms_norm_row<scalar_t>(xp + r * C, rp + r * C, wp, C, e));
    });
  });
  if (!xc.is_same(x)) x.copy_(xc);
  if (!rc.is_same(residual)) residual.copy_(rc);
}

at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  constexpr const char* op = "silu_mul";
  check_silu_mul(gate, up);
  auto out = at::empty(gate.sizes(), gate.options());
  if (out.numel() == 0) return out;
  const int64_t I = gate.size(-1), rows = gate.numel() / I;
  const at::Tensor g = as_rows(gate), u = as_rows(up);
  const int64_t gs = g.stride(0), us = u.stride(0);
  const cpu::Isa isa = cpu::active_isa(op);
  DLLM_DISPATCH_FLOATING_TYPES(gate.scalar_type(), "dllm::silu_mul", [&] {
    const auto* gp = reinterpret_cast<const Bits<scalar_t>*>(g.const_data_ptr<scalar_t>());
    const auto* up_ = reinterpret_cast<const Bits<scalar_t>*>(u.const_data_ptr<scalar_t>());
    auto* op_ = reinterpret_cast<Bits<scalar_t>*>(out.mutable_data_ptr<scalar_t>());
    at::parallel_for(0, rows, cpu::grain_items(cpu::kGrainStreamElems, 3 * I),
                     [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        DLLM_ISA_CALL(isa, silu_mul_row<scalar_t>(gp + r * gs, up_ + r * us, op_ + r * I, I));
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dllm, CPU, m) {
  m.impl("add_rms_norm_", &add_rms_norm_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
}

}  // namespace dllm
