// The CUDA backend's kernel families. Each registers its implementations with the dialect
// registry (backends/backend.h) at its own priority; cuda_backend.cc calls them all. One folder
// per family: <family>/<family>.cu holds the kernels and launchers (C++17, nvcc), <family>.cc the
// KernelImpl registrations (C++20). runtime/ and common/ hold what they all use.
#pragma once

#include "backends/backend.h"

namespace kiln::cuda {

// Priorities among CUDA dialects: libraries and specialised kernels above the generic ones.
inline constexpr int kGenericPriority = 10;     // "cuda": one simple kernel per op, every op
inline constexpr int kHandWrittenPriority = 20; // "cuda-nn": layer norm, softmax, loss, adamw...
inline constexpr int kLibraryPriority = 30;     // "cublaslt", "cuda-attention", "cuda-conv"
inline constexpr int kCudnnPriority = kLibraryPriority + 5;  // "cudnn" attention, over ours
inline constexpr int kGeneratedPriority = 40;   // "nvrtc": fused groups

void register_generic_kernels(KernelRegistry& registry);    // generic.cc
void register_nn_kernels(KernelRegistry& registry);         // nn.cc
void register_cublaslt_kernels(KernelRegistry& registry);   // cublaslt.cc
void register_attention_kernels(KernelRegistry& registry);  // attention.cc
// Whether cuda-attention's kernels take this attention (backward: attention_grad) node; the
// cudnn dialect falls back to them, so it asks too (attention.cc).
bool attention_supported(const NodeView& node, bool backward);
// Likewise for attention_qkv (backward: attention_qkv_grad) nodes.
bool attention_qkv_supported(const NodeView& node, bool backward);
void register_cudnn_attention_kernels(KernelRegistry& registry);  // cudnn_attention.cc
void register_nvrtc_kernels(KernelRegistry& registry);      // nvrtc.cc (fused nodes)
void register_fused_body_kernels(KernelRegistry& registry); // fused_body.cc (fused fallback)
void register_movement_kernels(KernelRegistry& registry);   // movement.cc (copies, casts, sums)
void register_classifier_kernels(KernelRegistry& registry); // classifier.cc (fused loss)
void register_multi_tensor_kernels(KernelRegistry& registry); // multi_tensor.cc (grouped updates)
void register_conv_kernels(KernelRegistry& registry);       // conv.cc (convolution, pooling)

}  // namespace kiln::cuda
