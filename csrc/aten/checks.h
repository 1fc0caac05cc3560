// Input validation shared by the CPU and CUDA glue. Every message starts with
// "dllm::<op>:" so a user can tell which op rejected which argument.
//
// Conventions of every check and raise helper under csrc/aten/:
//   check_<what>(op, value, name, ..., requirement): the op first, then each
//     checked value followed by the name the message gives it, then what it
//     must satisfy (check_dim(op, logits, "logits", 2)). Helpers for one op
//     (check_<op>) fix op themselves and take the op's arguments in order.
//   raise_<what>(op, status, context...): turns a fault a kernel reported
//     (a status word or record, 0 = none) into the error message; it returns
//     when there is no fault, so the glue calls it unconditionally.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>
#include <utility>

#define DLLM_CHECK(cond, op, ...) TORCH_CHECK((cond), "dllm::", op, ": ", __VA_ARGS__)

namespace dllm {

inline bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_floating(const char* op, const at::Tensor& t, const char* name) {
  DLLM_CHECK(is_float_type(t.scalar_type()), op, name,
             " must be float32, float16 or bfloat16, got ", t.scalar_type());
}

inline void check_dtype(const char* op, const at::Tensor& t, const char* name,
                        at::ScalarType want) {
  DLLM_CHECK(t.scalar_type() == want, op, name, " must be ", want, ", got ",
             t.scalar_type());
}

inline void check_dim(const char* op, const at::Tensor& t, const char* name, int64_t dim) {
  DLLM_CHECK(t.dim() == dim, op, name, " must have ", dim, " dims, got shape ", t.sizes());
}

inline void check_same_shape(const char* op, const at::Tensor& a, const char* an,
                             const at::Tensor& b, const char* bn) {
  DLLM_CHECK(a.sizes() == b.sizes(), op, an, " and ", bn, " must have the same shape, got ",
             a.sizes(), " and ", b.sizes());
}

inline void check_same_dtype(const char* op, const at::Tensor& a, const char* an,
                             const at::Tensor& b, const char* bn) {
  DLLM_CHECK(a.scalar_type() == b.scalar_type(), op, an, " and ", bn,
             " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
}

inline void check_same_device(const char* op, const at::Tensor& a, const char* an,
                              const at::Tensor& b, const char* bn) {
  DLLM_CHECK(a.device() == b.device(), op, an, " and ", bn,
             " must be on the same device, got ", a.device(), " and ", b.device());
}

// A string argument's value among `choices` ({spelling, value} pairs); any
// other string is an error that lists them ("mode must be 'a', 'b' or 'c',
// got 'x'"). E is given explicitly: parse_choice<math::ConfMode>(...).
template <typename E, size_t N>
inline E parse_choice(const char* op, const char* name, c10::string_view got,
                      const std::pair<const char*, E> (&choices)[N]) {
  for (const auto& choice : choices)
    if (got == choice.first) return choice.second;
  std::string list;
  for (size_t i = 0; i < N; ++i)
    list += std::string(i == 0 ? "'" : (i + 1 == N ? " or '" : ", '")) + choices[i].first + "'";
  DLLM_CHECK(false, op, name, " must be ", list, ", got '", std::string(got), "'");
  return choices[0].second;
}

// The selection ops' inputs: values [B, L] (float32, float16 or bfloat16) and
// a bool mask of the same shape on the same device (which positions count).
// `dims` names the two axes in messages, e.g. "[B, L]".
inline void check_values_and_mask(const char* op, const at::Tensor& values,
                                  const char* values_name, const at::Tensor& mask,
                                  const char* mask_name, const char* dims) {
  check_dim(op, values, (std::string(values_name) + " (" + dims + ")").c_str(), 2);
  check_floating(op, values, values_name);
  check_dtype(op, mask, mask_name, at::kBool);
  check_same_shape(op, values, values_name, mask, mask_name);
  check_same_device(op, values, values_name, mask, mask_name);
}

}  // namespace dllm
