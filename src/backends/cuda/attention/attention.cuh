// Launchers of the flash-attention kernels (attention.cu), callable from C++20 code: plain
// pointers and sizes only. Layout with heads == 1 ("bhtd"): q (batch, tq, d), k (batch, tk, d),
// v (batch, tk, dv), out and dout (batch, tq, dv), lse (batch, tq) f32, all contiguous, `batch`
// the product of the leading dims. With heads == H ("bthd"): q (batch / H, tq, H, d), ...,
// lse (batch / H, tq, H): problem b is head b % H of leading index b / H. Causal masks key
// j > query i (top-left aligned), like the op's reference kernel.
// q, k, v and dq, dk, dv may have wider rows (qkv_row_stride): attention_qkv's packed
// (batch / H, T, 3, H, d) is read in place as q, k, v at element offsets 0, H * d, 2 * H * d,
// consecutive positions 3 * H * d elements apart (its gradient written likewise); out, dout and
// lse keep the plain layout. Element (problem b, position t, column c) of such a tensor is at
// (b / H * T + t) * stride + b % H * d + c. With group > 1, k, v, dk and dv have heads / group
// heads (rows (heads / group) * d apart in "bthd").
// key_bias (optional; q's dtype; null: none): problem b's scores of key j get
// key_bias[(b / bias_heads) * tk + j] added (a padding mask: one row of tk per batch entry, the
// bias_heads consecutive problems of its heads sharing it). Without it the kernels are the very
// ones they were (a template parameter), so the unbiased path keeps its speed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ir/dtype.h"

namespace kiln::cuda {

struct AttentionShape {
  int64_t batch = 0, tq = 0, tk = 0, d = 0, dv = 0;
  int64_t heads = 1;  // > 1: the "bthd" layout, heads between the sequence and head dims
  // Elements between consecutive positions of q, k, v, dq, dk, dv (those of different leading
  // indices included); 0: the plain layouts' heads * d (heads * dv for v and dv). Packed
  // attention_qkv: 3 * heads * d.
  int64_t qkv_row_stride = 0;
  // Grouped-query attention: query heads per key/value head. Problem b reads k and v of
  // key/value problem b / group, numbered like the query problems with heads / group heads
  // ("bthd"; 1 for "bhtd", whose kv problems are batch / group); dk and dv sum over the group's
  // query heads. 1: plain attention. The packed layout has group 1.
  int64_t group = 1;
  // Consecutive problems that share a row of key_bias (the heads of one batch entry).
  int64_t bias_heads = 1;
  bool causal = false;
  double scale = 1.0;
};

// Largest head dims the launchers take (the simple path keeps a row in 8 registers a lane).
inline constexpr int64_t kAttentionMaxHeadDim = 256;

// dtype: f32, f16 or bf16 (of q, k, v, out and their gradients).

// Whether the tensor-core (mma.sync) path serves these: 16-bit types, d == dv in {32, 64, 128}.
// Everything else with d, dv <= kAttentionMaxHeadDim takes a simple one-warp-per-row path.
bool attention_uses_tensor_cores(DType dtype, int64_t d, int64_t dv);

// out = softmax(q k^T * scale + key_bias + mask) v and lse = the natural log-sum-exp of each row's
// scaled scores (-inf for a row without keys, whose out is 0, or whose every score key_bias made
// -inf, whose out is NaN as softmax's).
// Enqueued on `stream`, never synchronizes.
void attention_forward(DType dtype, const void* q, const void* k, const void* v, const void* key_bias,
                       void* out, float* lse, const AttentionShape& shape, cudaStream_t stream);

// (dq, dk, dv) of attention for the output gradient dout, given the forward's out and lse
// (FlashAttention-2): a pre-pass of the row statistics (lse, D = rowsum(dout * out)) into 8 bytes
// a row of stream-ordered scratch (cudaMallocAsync), a dk/dv pass over key blocks, a dq pass
// over query blocks (no atomics: deterministic). Enqueued on `stream`, never synchronizes.
void attention_backward(DType dtype, const void* q, const void* k, const void* v, const void* key_bias,
                        const void* out, const void* dout, const float* lse, void* dq, void* dk,
                        void* dv, const AttentionShape& shape, cudaStream_t stream);

}  // namespace kiln::cuda
