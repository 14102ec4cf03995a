// Launchers of the multi-tensor kernels (backends/cuda/multi_tensor/multi_tensor.cu; registered by
// multi_tensor.cc): one launch updates, reduces or casts many tensors. C++17-clean: plain pointers,
// int64_t, cudaStream_t.
//
// How a launch covers many tensors: the kernel's parameter struct holds a table of up to
// kMaxTensorsPerLaunch tensors (pointers, sizes, and the prefix sum of their block counts;
// passed as a __grid_constant__ parameter, so indexing it reads the parameter bank and copies
// nothing), and each block takes kChunk elements of one tensor, found by a binary search of the
// prefix sums. More tensors than a table holds: several launches. Parameter structs of up to
// 32764 bytes need CUDA 12.1; the tables stay under that (static_asserts in the .cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/nn/nn.cuh"

namespace kiln::cuda::multi_tensor {

inline constexpr int kMaxTensorsPerLaunch = 256;

// ---- updates --------------------------------------------------------------------------------

// f32 master weights and state (param and state f32), grads f32, bf16 or f16.
bool update_types_supported(DType param, DType grad, DType state);
// The element update of rule `optimizer` (ops/optimizer/rules.h) over `count` tensors, as
// nn::optimizer_update computes it (per-step constants in the same order; measured on an H200
// for AdamW before the rules were shared: state bit for bit, the param within 2 ulp, presumably
// nvcc contracting the same expression into fmas differently in the two kernels). lr, step:
// device scalars of any float type.
void update(const char* optimizer, const optim::HyperValues& h, DType param_t, DType grad_t, DType state_t,
            const nn::UpdateTensor* tensors, int64_t count, DType lr_t, const void* lr, DType step_t,
            const void* step, cudaStream_t stream);

// ---- global norm ----------------------------------------------------------------------------

inline constexpr int kMaxNormTerms = 2048;

struct NormTensor {
  const void* x;
  DType t;  // f32, bf16 or f16
  int64_t n;
};
// out (a device f32 scalar) = the add tree over the terms t_i = sum over x_i of f32(x^2):
// `adds` holds 2 codes per add (a term index >= 0, or -1 - the index of an earlier add), in
// order; `result` is the code of the output. Stage 1: every block sums the squares of its
// chunk (each square rounded to f32, as the body's f32 square; the sum in f64) into an f64
// partial in scratch; stage 2 (one block): each term's partials summed in f64 in a fixed order,
// rounded to f32, then the add tree in f32. Deterministic (no atomics; fixed assignment and
// order). count <= kMaxNormTerms, num_adds < kMaxNormTerms.
void global_norm(const NormTensor* tensors, int64_t count, const int* adds, int64_t num_adds,
                 int result, void* out, cudaStream_t stream);

// ---- casts ----------------------------------------------------------------------------------

// One f32 tensor cast to bf16 or f16 (x and y never overlap: different element sizes).
struct CastTensor {
  const float* x;
  void* y;
  DType to;  // kBF16 or kF16
  int64_t n;
};
// y_i = x_i rounded to nearest even, NaNs as the host's and movement.cu's single cast: the same
// bits as the `cast` op on every backend. 8 elements per thread step (two 16-byte loads, one
// 16-byte store) where x and y are 16-byte aligned, else element by element.
void cast(const CastTensor* tensors, int64_t count, cudaStream_t stream);

}  // namespace kiln::cuda::multi_tensor
