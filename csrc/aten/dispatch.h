// dtype dispatch for the floating types dllm_ops accepts (fp32, fp16, bf16).
// The default branch names the op, so an unsupported dtype is a clear error.
#pragma once

#include <ATen/Dispatch.h>

#define DLLM_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME,                      \
                     AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))
