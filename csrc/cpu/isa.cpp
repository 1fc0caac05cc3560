// Reports the instruction set the CPU kernels run (csrc/cpu/isa.h), for
// `python -m bench ops` and the tests: torch.ops.dllm_cpu.isa() returns
// (the copy in use now, after DLLM_CPU_ISA; the widest this CPU runs).
#include <torch/library.h>

#include <string>
#include <tuple>

#include "cpu/isa.h"

namespace dllm {
namespace cpu {
namespace {

std::tuple<std::string, std::string> isa_report() {
  return {isa_name(active_isa("isa")), isa_name(best_isa())};
}

}  // namespace
}  // namespace cpu
}  // namespace dllm

// Not a dllm op (no tensors: nothing to check, fake or simulate), so it lives
// in a namespace of its own and torch.ops.dllm holds the ops alone.
TORCH_LIBRARY(dllm_cpu, m) { m.def("isa() -> (str active, str best)", &dllm::cpu::isa_report); }
