// Registers every CUDA kernel family (backends/cuda/registration.h).
#include "backends/cuda/registration.h"

namespace kiln {

void register_cuda_kernels(KernelRegistry& registry) {
  cuda::register_generic_kernels(registry);
  cuda::register_nn_kernels(registry);
  cuda::register_cublaslt_kernels(registry);
  cuda::register_attention_kernels(registry);
  cuda::register_nvrtc_kernels(registry);
  cuda::register_fused_body_kernels(registry);
}

}  // namespace kiln
