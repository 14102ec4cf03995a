// The fused classifier (loss and logits gradient in one pass) on the CPU.
#include "backends/cpu/cpu_kernels.h"

namespace kiln::cpu {

void register_classifier_kernels(KernelRegistry&) {}  // stub: filled in by its owner

}  // namespace kiln::cpu
