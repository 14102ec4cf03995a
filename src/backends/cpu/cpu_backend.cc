// The CPU backend: every op's reference kernel as the fallback dialect "reference", plus the
// fast paths (dialects "cpu" and "openblas") registered by the files beside this one.
#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/fused.h"

namespace kiln {

void register_cpu_kernels(KernelRegistry& registry) {
  for (int i = 0; i < kNumOps; ++i) {
    Op op = static_cast<Op>(i);
    if (!has_op_def(op)) continue;  // a half-added op; tests/op_table_test.cc reports it
    // The elementwise reference kernels write out[i] from the inputs' element i (through
    // Tensor::get/set, no __restrict__), so they may run in place.
    registry.add(op, KernelImpl{"reference", Device::kCpu, kReferencePriority, {},
                                op_def(op).reference, has_flag(op, kElementwise)});
  }
  cpu::register_fast_kernels(registry);
  cpu::register_fused_kernels(registry);  // fused.cc: fusion groups as one pass over row tiles
}

}  // namespace kiln
