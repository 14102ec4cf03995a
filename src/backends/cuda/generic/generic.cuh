// Launchers of the "cuda" generic dialect (backends/cuda/generic/generic.cu): one simple, correct CUDA
// kernel per op, the fallback below every specialised CUDA dialect and the oracle for them.
// C++17-clean (nvcc compiles generic.cu as C++17): plain pointers, int64_t, cudaStream_t and
// small POD structs passed to the kernels by value. generic.cc maps KernelArgs onto these.
//
// Every launcher enqueues on `stream` and never synchronizes. Every launcher writes every
// element of its outputs. 16-bit floats are computed in f32, f64 in f64, integers in i64 with
// wrap-around (as the reference kernels define them).
//
// Kernel-time data errors (gather/scatter_add index out of range, cross_entropy label out of
// range, integer division by zero) cannot throw from the device. The kernel writes 0 for the
// bad element and records the error (device_errors.cuh); kiln::cuda::check_device_errors()
// (device_errors.h) reads it after the stream has synchronized and throws kiln::Error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/nn/nn.cuh"
#include "ir/dtype.h"
#include "ir/op.h"
#include "ops/elementwise_math.h"

namespace kiln::cuda::generic {

inline constexpr int kMaxRank = 8;
inline constexpr int kMaxOperands = 4;  // output + up to 3 inputs (where)

// An iteration space of `rank` dims and, for each operand, a base offset and strides in
// elements over those dims (0 along broadcast dims). Element i of the space is at
// offset[k] + sum_d index_d(i) * strides[k][d] in operand k. `contiguous`: every operand is
// element i at offset[k] + i (the fast path, no index arithmetic).
struct Layout {
  int rank = 0;
  bool contiguous = false;
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxOperands][kMaxRank] = {};
  int64_t offset[kMaxOperands] = {};
};

// ---- elementwise -----------------------------------------------------------------------------

// A line of ops/elementwise_math.h over one input (x and y contiguous) or two (layout operands:
// 0 = out (contiguous), 1 = a, 2 = b). The line's domain says which dtypes it takes;
// comparisons write bool.
void launch_unary(math::Fn fn, DType type, const void* x, void* y, int64_t n,
                  cudaStream_t stream);
void launch_binary(math::Fn fn, DType type, const void* a, const void* b, void* out,
                   const Layout& layout, int64_t n, cudaStream_t stream);

// where(cond, a, b): operands 0 = out, 1 = cond (bool), 2 = a, 3 = b; any element size.
void launch_where(int elem_size, const void* cond, const void* a, const void* b, void* out,
                  const Layout& layout, int64_t n, cudaStream_t stream);

// Any dtype to any dtype, the reference's rules (float->int truncates and saturates, NaN -> 0;
// int->int wraps; ->bool is x != 0; f64->f16/bf16 rounds through f32 as the host does).
void launch_cast(DType from, DType to, const void* x, void* y, int64_t n,
                 cudaStream_t stream);

// Philox dropout (support/philox.h): `offset` is a device i64 scalar or nullptr (offset 0).
void launch_dropout(DType type, const void* x, void* y, int64_t n, double p,
                    uint32_t threshold, uint64_t seed, const int64_t* offset,
                    cudaStream_t stream);

// ---- sources and data movement ----------------------------------------------------------------

// Every element = the `elem_size`-byte pattern in the low bytes of `bits`.
void launch_fill(int elem_size, uint64_t bits, void* out, int64_t n, cudaStream_t stream);
// out[i] = (i / inner) % dim, converted to `type`.
void launch_iota(DType type, void* out, int64_t n, int64_t dim, int64_t inner,
                 cudaStream_t stream);
// Strided copy over `layout`: operand 0 = out, 1 = in (transpose, broadcast_to, slice, concat,
// split are all this with different strides and offsets).
void launch_copy(int elem_size, const void* in, void* out, const Layout& layout, int64_t n,
                 cudaStream_t stream);
// one_hot: out[p * depth + c] = (c == indices[p]); indices outside [0, depth) give a zero row.
void launch_one_hot(DType index_type, const void* indices, DType out_type, void* out,
                    int64_t n_indices, int64_t depth, cudaStream_t stream);
// gather along an axis seen as (outer, dim, inner): out (outer, n_indices, inner).
void launch_gather(int elem_size, const void* table, DType index_type, const void* indices,
                   void* out, int64_t outer, int64_t dim, int64_t inner, int64_t n_indices,
                   cudaStream_t stream);
// scatter_add: out = base, then updates (outer, n_indices, inner) summed into rows with
// atomicAdd: the order of the sums varies, so float results are not bitwise deterministic.
// All dtypes but bool and u8 (no byte-wide atomics).
void launch_scatter_add(DType type, const void* base, DType index_type, const void* indices,
                        const void* updates, void* out, int64_t outer, int64_t dim,
                        int64_t inner, int64_t n_indices, cudaStream_t stream);

// gather_elements and scatter_elements along `axis` (ops/indexing.cc): indices (and updates, and
// gather's out) have shape index_shape (rank dims); position q of indices addresses data at
// q's coordinates with the one along `axis` replaced by indices[q] (in [0, dim), else a data
// error), through data's strides in elements.
struct ElementsLayout {
  int rank = 0, axis = 0;
  int64_t dim = 0;
  int64_t index_shape[kMaxRank] = {};
  int64_t data_strides[kMaxRank] = {};
};
// out (index_shape) = data at the addressed positions; any element size.
void launch_gather_elements(int elem_size, const void* data, DType index_type, const void* indices,
                            void* out, const ElementsLayout& layout, int64_t n, cudaStream_t stream);
// out = data (copied unless they alias), then each update combined into its position, reduction 0 none (the update
// replaces it), 1 add, 2 mul, 3 max, 4 min (NaN propagates). One thread per line of indices along
// the axis, in index order, so the result is the reference's (the last of repeated positions
// wins for none) and deterministic. All dtypes but bool.
void launch_scatter_elements(DType type, const void* data, int64_t data_n, DType index_type,
                             const void* indices, const void* updates, void* out,
                             const ElementsLayout& layout, int reduction, cudaStream_t stream);
// Inclusive or exclusive, forward or reverse sums along the middle of (outer, dim, inner): one
// thread per line, accumulating in f64 (floats) or wrapping i64 (integers) as the reference.
void launch_cumsum(DType type, const void* x, void* y, int64_t outer, int64_t dim, int64_t inner,
                   bool exclusive, bool reverse, cudaStream_t stream);
// The k largest (or smallest) along the middle of (outer, dim, inner), best first, ties to the
// lower index, NaN above every number: values (outer, k, inner) and i64 indices. One thread per
// line, each step scanning the line for the next in that order (O(k dim)).
void launch_topk(DType type, const void* x, void* values, int64_t* indices, int64_t outer,
                 int64_t dim, int64_t inner, int64_t k, bool largest, cudaStream_t stream);

// ---- reductions ---------------------------------------------------------------------------------

// Output element o covers the kept dims (kept_shape/kept_strides: o's multi-index -> input
// offset) and the reduced dims (reduced_shape/reduced_strides), `count` elements.
struct ReduceLayout {
  int kept_rank = 0, reduced_rank = 0;
  int64_t kept_shape[kMaxRank] = {}, kept_strides[kMaxRank] = {};
  int64_t reduced_shape[kMaxRank] = {}, reduced_strides[kMaxRank] = {};
  int64_t outputs = 0, count = 0;
};
// op: sum, mean, max or prod. Sums and products accumulate in f64 (floats) or wrapping i64
// (integers); max propagates NaN.
void launch_reduce(Op op, DType type, const void* x, void* out,
                   const ReduceLayout& layout, cudaStream_t stream);
// argmax along the middle of (outer, dim, inner): first index of the maximum, NaN is the max.
void launch_argmax(DType type, const void* x, int64_t* out, int64_t outer, int64_t dim,
                   int64_t inner, cudaStream_t stream);

// ---- nn ------------------------------------------------------------------------------------------

// C (batch..., m, n) = op(A) op(B), batch dims broadcast: a_batch_strides/b_batch_strides count
// whole matrices (0 where broadcast). Accumulates in f32 (f64 for f64).
struct MatmulLayout {
  int64_t m = 0, n = 0, k = 0;
  bool transpose_a = false, transpose_b = false;
  int batch_rank = 0;
  int64_t batch_shape[kMaxRank] = {};
  int64_t a_batch_strides[kMaxRank] = {}, b_batch_strides[kMaxRank] = {};
  int64_t batch = 1;
};
void launch_matmul(DType type, const void* a, const void* b, void* c,
                   const MatmulLayout& layout, cudaStream_t stream);

// softmax / log_softmax along the middle axis of (outer, dim, inner); one block per line.
void launch_softmax(DType type, bool log, const void* x, void* y, int64_t outer, int64_t dim,
                    int64_t inner, cudaStream_t stream);
void launch_softmax_grad(DType type, bool log, const void* y, const void* dy, void* dx,
                         int64_t outer, int64_t dim, int64_t inner, cudaStream_t stream);
// layer_norm (beta given) or rms_norm (beta == nullptr) over rows of `cols`.
void launch_norm(DType type, const void* x, const void* gamma, const void* beta, void* y,
                 int64_t rows, int64_t cols, double epsilon, cudaStream_t stream);
// layer_norm_grad (dbeta given) or rms_norm_grad (dbeta == nullptr). Uses a stream-ordered
// scratch buffer (cudaMallocAsync) for the per-row statistics.
void launch_norm_grad(DType type, const void* x, const void* gamma, const void* dy, void* dx,
                      void* dgamma, void* dbeta, int64_t rows, int64_t cols, double epsilon,
                      cudaStream_t stream);
// reduction: 0 mean, 1 sum, 2 none.
void launch_cross_entropy(DType type, const void* logits, DType label_type,
                          const void* labels, void* out, int64_t rows, int64_t vocab,
                          int64_t ignore_index, int reduction, cudaStream_t stream);
void launch_cross_entropy_grad(DType type, const void* logits, DType label_type,
                               const void* labels, const void* dloss, void* dlogits,
                               int64_t rows, int64_t vocab, int64_t ignore_index, int reduction,
                               cudaStream_t stream);

// The element update of rule `optimizer` (ops/optimizer/rules.h), param, gradient and slots all
// of `type`; lr and step are device scalars of their own float dtypes. Outputs may alias the
// matching inputs (each element is read before it is written).
void launch_optimizer_update(const char* optimizer, const optim::HyperValues& h, DType type,
                             const nn::UpdateTensor& x, DType lr_type, const void* lr, DType step_type,
                             const void* step, cudaStream_t stream);

// Naive attention: one block per (batch, query); scores live in shared memory, so tk is limited
// by attention_max_keys(). lse is f32 (f64 for f64 inputs), as the op defines it. attention_grad
// takes the forward's out and lse (P = exp(s - lse), D = rowsum(dout * out)) and accumulates dk
// and dv with atomicAdd (not bitwise deterministic) in an f32/f64 scratch buffer. key_bias
// (q's dtype, or null): problem b's scores of key j get key_bias[(b / bias_heads) * tk + j].
int64_t attention_max_keys();
void launch_attention(DType type, const void* q, const void* k, const void* v, const void* key_bias,
                      void* out, void* lse, int64_t batch, int64_t tq, int64_t tk, int64_t d, int64_t dv,
                      int64_t bias_heads, bool causal, double scale, cudaStream_t stream);
void launch_attention_grad(DType type, const void* q, const void* k, const void* v, const void* key_bias,
                           const void* out, const void* dout, const void* lse, void* dq, void* dk,
                           void* dv_out, int64_t batch,
                           int64_t tq, int64_t tk, int64_t d, int64_t dv, int64_t bias_heads, bool causal,
                           double scale, cudaStream_t stream);

}  // namespace kiln::cuda::generic
