// The "cudnn" dialect of attention and attention_grad (cudnn_attention.cc): cuDNN's fused SDPA
// kernels through the cuDNN frontend's graph API. Built only where CMake finds cuDNN and the
// frontend headers (KILN_HAVE_CUDNN); elsewhere the dialect is simply not registered.
#pragma once

#include <string>
#include <vector>

namespace kiln::cuda {

// Whether this build has the "cudnn" dialect.
bool built_with_cudnn();

// One line per cuDNN graph built so far (problem, then how it runs: "cudnn", "cudnn, packed
// stats" or "cuda-attention fallback: <why cuDNN refused>"), for tests and diagnostics.
std::vector<std::string> cudnn_attention_plans();

}  // namespace kiln::cuda
