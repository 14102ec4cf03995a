// The source of the kernels a backend generates for a fused node, for reading: what
// `kiln compile --dump-kernels` writes. Only CUDA generates kernels (the nvrtc dialect,
// backends/cuda/nvrtc/nvrtc.h), and writing their source needs no GPU.
#pragma once

#include <string>

#include "ir/graph.h"
#include "ops/fused/kind.h"
#include "tensor/tensor.h"

namespace kiln {

// The listing of the fused node of `kind` with `body` for `device`: on CUDA the generated
// source, the cuBLASLt product a "gemm-epilogue" body binds to, or a comment saying why the
// body is not generated (cuda::fused_kernel_listing). Throws kiln::Error for the CPU, which
// generates none, and in a build without CUDA.
std::string generated_kernel_source(Device device, const Graph& body, FusedKind kind);

}  // namespace kiln
