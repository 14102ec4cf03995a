// Grouped optimizer updates and the global gradient norm on the GPU.
#include "backends/cuda/registration.h"

namespace kiln::cuda {

void register_multi_tensor_kernels(KernelRegistry&) {}  // stub: filled in by its owner

}  // namespace kiln::cuda
