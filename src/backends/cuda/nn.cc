// Placeholder: this family's kernels are not written yet.
#include "backends/cuda/registration.h"

namespace kiln::cuda {

void register_nn_kernels(KernelRegistry&) {}

}  // namespace kiln::cuda
