// Registers every CUDA kernel family (backends/cuda/registration.h).
#include "backends/cuda/registration.h"

namespace kiln {

void register_cuda_kernels(KernelRegistry& registry) {
  cuda::register_generic_kernels(registry);
  cuda::register_nn_kernels(registry);
  cuda::register_cublaslt_kernels(registry);
  cuda::register_attention_kernels(registry);
  cuda::register_cudnn_attention_kernels(registry);
  cuda::register_nvrtc_kernels(registry);
  cuda::register_fused_body_kernels(registry);
  cuda::register_movement_kernels(registry);
  cuda::register_classifier_kernels(registry);
  cuda::register_multi_tensor_kernels(registry);
  cuda::register_conv_kernels(registry);
}

}  // namespace kiln
