// Internal to the CPU backend: registration of its fast kernels, and small helpers their
// supports() predicates share.
//   dialect "openblas" (gemm.cc): matmul in f32/f64 through cblas_sgemm/dgemm; (conv.cc) conv2d
//     and its gradients in f32 as im2col + cblas_sgemm.
//   dialect "cpu" (elementwise.cc, reduction.cc, nn.cc, conv.cc's pools): f32 loops written to
//     vectorize, multi-threaded with support/parallel.h.
// Each fast kernel accepts only the layouts it handles (supports()); the reference kernel
// serves the rest.
#pragma once

#include "backends/backend.h"

namespace kiln::cpu {

inline constexpr int kFastPriority = 10;      // hand-written vectorized, multi-threaded loops
inline constexpr int kOpenBlasPriority = 20;  // GEMMs through OpenBLAS

void register_fast_kernels(KernelRegistry& registry);  // all of the below
void register_gemm_kernels(KernelRegistry& registry);         // gemm.cc
void register_elementwise_kernels(KernelRegistry& registry);  // elementwise.cc
void register_reduction_kernels(KernelRegistry& registry);    // reduction.cc
void register_nn_kernels(KernelRegistry& registry);           // nn.cc
void register_conv_kernels(KernelRegistry& registry);         // conv.cc
void register_train_kernels(KernelRegistry& registry);        // train_kernels.cc
void register_classifier_kernels(KernelRegistry& registry);   // classifier.cc (fused loss)
void register_multi_tensor_kernels(KernelRegistry& registry); // multi_tensor.cc (grouped updates)

// True when every input and output of the node has dtype `dtype`.
inline bool all_dtype(const NodeView& node, DType dtype) {
  for (const TensorType& t : node.input_types)
    if (t.dtype != dtype) return false;
  for (const TensorType& t : node.output_types)
    if (t.dtype != dtype) return false;
  return true;
}

// Elements per thread below which a loop is not worth splitting, by cost per element.
inline constexpr int64_t kGrainCheap = 32768;      // add, mul, relu: memory bound
inline constexpr int64_t kGrainExpensive = 4096;   // exp, gelu, tanh: tens of flops each

}  // namespace kiln::cpu
