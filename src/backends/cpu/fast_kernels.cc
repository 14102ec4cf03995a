// Fast CPU kernels (placeholder; filled in by the CPU fast-path work).
#include "backends/cpu/cpu_kernels.h"

namespace kiln::cpu {
void register_fast_kernels(KernelRegistry&) {}
}  // namespace kiln::cpu
