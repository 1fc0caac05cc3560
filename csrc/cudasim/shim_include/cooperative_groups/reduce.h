// Shadows <cooperative_groups/reduce.h> in the CPU simulation; cg::reduce
// lives in ../cooperative_groups.h there.
#pragma once
#if defined(__CUDACC__)
#include_next <cooperative_groups/reduce.h>
#else
#include "../cooperative_groups.h"
#endif
