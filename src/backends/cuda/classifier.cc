// The fused classifier (loss and logits gradient in one pass) on the GPU.
#include "backends/cuda/registration.h"

namespace kiln::cuda {

void register_classifier_kernels(KernelRegistry&) {}  // stub: filled in by its owner

}  // namespace kiln::cuda
