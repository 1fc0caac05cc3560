// A kernel header that breaks the torch-free rule on purpose: it reaches ATen
// through csrc/aten/. CMakeLists.txt's ctest `torch_free_check_rejects_aten`
// compiles it the way the torch-free check compiles csrc/cuda/*.cuh and passes
// only when that fails on the ATen include, so the check is known to bite.
#pragma once

#include "cuda/device_utils.cuh"
#include "aten/checks.h"
