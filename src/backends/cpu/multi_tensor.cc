// Grouped optimizer updates and the global gradient norm on the CPU.
#include "backends/cpu/cpu_kernels.h"

namespace kiln::cpu {

void register_multi_tensor_kernels(KernelRegistry&) {}  // stub: filled in by its owner

}  // namespace kiln::cpu
