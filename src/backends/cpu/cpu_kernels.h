// Internal to the CPU backend: registration of its fast kernels.
#pragma once

#include "backends/backend.h"

namespace kiln::cpu {

inline constexpr int kFastPriority = 10;      // hand-written vectorized, multi-threaded loops
inline constexpr int kOpenBlasPriority = 20;  // GEMMs through OpenBLAS

void register_fast_kernels(KernelRegistry& registry);

}  // namespace kiln::cpu
