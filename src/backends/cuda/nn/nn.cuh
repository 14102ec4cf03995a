// Launchers of the "cuda-nn" dialect (backends/cuda/nn/nn.cu): hand-written kernels for the
// memory-bound ops of transformer training. C++17-clean (nvcc compiles nn.cu as C++17): plain
// pointers, int64_t, cudaStream_t. nn.cc maps KernelArgs onto these.
//
// Storage f32, bf16 or f16 (f64 is left to the generic dialect); arithmetic in f32. Row ops
// reduce over the last axis of a (rows, cols) view. Every launcher enqueues on `stream`, never
// synchronizes, and writes every element of its outputs. Launchers that need scratch memory
// (layer_norm_grad's dgamma/dbeta partials, cross_entropy's per-row losses, scatter_add's
// sort) take it from the stream-ordered allocator (cudaMallocAsync / cudaFreeAsync on
// `stream`), which is also legal inside a CUDA graph capture.
//
// Reductions are deterministic: fixed thread-to-data assignment and fixed combination order,
// no floating-point atomics (same inputs, same device: bitwise the same outputs).
//
// Kernel-time data errors cannot throw from the device without a synchronization, so the
// kernel records the error (device_errors.cuh; kiln::cuda::check_device_errors() throws it
// after the stream has synchronized) and writes a defined output:
//   cross_entropy(_grad): a label outside [0, V) that is not ignore_index gives a NaN loss
//     (NaN in that row's dlogits);
//   gather: an index outside [0, dim) gives a row of 0xFF bytes (NaN for float tables);
//   scatter_add: an index outside [0, dim) adds nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ir/dtype.h"
#include "ops/optimizer/rules.h"

namespace kiln::cuda::nn {

// Whether the row/elementwise kernels here store this type (f32, f16, bf16).
inline bool is_storage_float(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16;
}

// ---- row ops over the last axis: x is (rows, cols) ----------------------------------------------

// y = (x - mean) / sqrt(var + eps) * gamma + beta, biased variance (two-pass, f32).
void layer_norm(DType t, const void* x, const void* gamma, const void* beta, void* y, int64_t rows,
                int64_t cols, float eps, cudaStream_t stream);
// dx, and dgamma/dbeta summed over rows. cols <= kLayerNormGradMaxCols.
inline constexpr int64_t kLayerNormGradMaxCols = 6144;
void layer_norm_grad(DType t, const void* x, const void* gamma, const void* dy, void* dx,
                     void* dgamma, void* dbeta, int64_t rows, int64_t cols, float eps,
                     cudaStream_t stream);
// softmax (log = false) or log_softmax (log = true).
void softmax(DType t, const void* x, void* y, int64_t rows, int64_t cols, bool log,
             cudaStream_t stream);
// softmax_grad(y, dy) (log = false) or log_softmax_grad(y, dy) (log = true).
void softmax_grad(DType t, const void* y, const void* dy, void* dx, int64_t rows, int64_t cols,
                  bool log, cudaStream_t stream);

enum class Reduction : int { kMean, kSum, kNone };
// logits (rows, vocab) of type t, labels (rows) i32 or i64. out: rows losses (kNone) or one.
void cross_entropy(DType t, const void* logits, DType label_t, const void* labels, void* out,
                   int64_t rows, int64_t vocab, int64_t ignore_index, Reduction reduction,
                   cudaStream_t stream);
// dloss: rows values (kNone) or one, of type t.
void cross_entropy_grad(DType t, const void* logits, DType label_t, const void* labels,
                        const void* dloss, void* dlogits, int64_t rows, int64_t vocab,
                        int64_t ignore_index, Reduction reduction, cudaStream_t stream);

// ---- elementwise --------------------------------------------------------------------------------

void gelu(DType t, const void* x, void* y, int64_t n, bool tanh_form, cudaStream_t stream);
void gelu_grad(DType t, const void* x, const void* dy, void* dx, int64_t n, bool tanh_form,
               cudaStream_t stream);

// rotary_embedding: x (rows, d) whose row r is at position (r / heads) % positions; rotate-half
// pairs (i, i + d/2) by position * base^(-2i/d) (negated when inverse). d even.
void rotary_embedding(DType t, const void* x, void* y, int64_t rows, int64_t positions,
                      int64_t heads, int64_t d, double base, bool inverse, cudaStream_t stream);

// ---- optimizer updates --------------------------------------------------------------------------

// The (param, grad, state) type combinations the updates support: all three equal (f32, bf16,
// f16), or 16-bit param and grad with f32 state, or f32 param and state with a 16-bit grad.
bool update_types_supported(DType param, DType grad, DType state);
// One tensor of an optimizer update: param, gradient and the optimizer's state slots, and the
// results (each may be its operand: every element is read before it is written, by one thread).
struct UpdateTensor {
  const void* param;
  const void* grad;
  const void* slots[optim::kMaxSlots];
  void* param_out;
  void* slots_out[optim::kMaxSlots];
  int64_t n;
};
// The element update of rule `optimizer` (ops/optimizer/rules.h) with hyperparameters h; lr and
// step are device scalars of any float type, read by the kernel.
void optimizer_update(const char* optimizer, const optim::HyperValues& h, DType param_t, DType grad_t,
                      DType state_t, const UpdateTensor& x, DType lr_t, const void* lr, DType step_t,
                      const void* step, cudaStream_t stream);

// ---- embedding ----------------------------------------------------------------------------------

// table seen as (outer, dim, inner) elements of elem_bytes each; indices (n) i32/i64;
// out (outer, n, inner): out[o, p, :] = table[o, indices[p], :]. Any element type.
void gather(const void* table, int64_t elem_bytes, DType index_t, const void* indices, void* out,
            int64_t outer, int64_t dim, int64_t inner, int64_t n, cudaStream_t stream);
// out = base, then out[o, indices[p], :] += updates[o, p, :] for p in order (deterministic: the
// (index, position) pairs are radix-sorted stably, and each distinct index's rows are summed in
// position order by one block, starting from base). t: f32, bf16, f16 (f32 accumulation).
void scatter_add(DType t, const void* base, DType index_t, const void* indices, const void* updates,
                 void* out, int64_t outer, int64_t dim, int64_t inner, int64_t n,
                 cudaStream_t stream);

}  // namespace kiln::cuda::nn
