// Fast data movement on the GPU: copies, transposes, casts, column sums.
#include "backends/cuda/registration.h"

namespace kiln::cuda {

void register_movement_kernels(KernelRegistry&) {}  // stub: filled in by its owner

}  // namespace kiln::cuda
