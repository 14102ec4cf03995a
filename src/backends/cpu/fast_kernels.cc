// The CPU backend's fast paths, one file per family (gemm.cc, elementwise.cc, reduction.cc,
// nn.cc); this file only collects their registrations.
#include "backends/cpu/cpu_kernels.h"

namespace kiln::cpu {

void register_fast_kernels(KernelRegistry& registry) {
  register_gemm_kernels(registry);
  register_elementwise_kernels(registry);
  register_reduction_kernels(registry);
  register_nn_kernels(registry);
  register_conv_kernels(registry);
  register_train_kernels(registry);
  register_classifier_kernels(registry);
  register_multi_tensor_kernels(registry);
}

}  // namespace kiln::cpu
