// Launchers of the "cuda-movement" dialect (backends/cuda/movement/movement.cu): fast kernels for pure
// data movement (strided row copies, tiled transposes, broadcasts), float casts and sums over
// the middle axis of (outer, reduced, inner). C++17-clean: plain pointers, int64_t, cudaStream_t
// and small POD structs passed by value. movement.cc turns nodes into these descriptions
// (reducing the dimensions first) and decides which nodes they serve.
//
// Every launcher enqueues on `stream`, never synchronizes, and writes every element of its
// output. Sizes: a RowCopy or TiledCopy moves fewer than 2^32 bytes (its indices are 32-bit;
// movement.cc falls back to the generic kernels above that).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ir/dtype.h"

namespace kiln::cuda::movement {

inline constexpr int kMaxDims = 8;
// The most bytes one RowCopy / TiledCopy may move (exclusive).
inline constexpr int64_t kMaxCopyBytes = int64_t{1} << 32;

// Rows of `run_bytes` contiguous bytes, indexed by `dims` nested loops (outermost first) of
// `size[d]` each; row (i_0, ..., i_{dims-1}) is read at src + src_offset + sum_d i_d *
// src_stride[d] and written at dst + dst_offset + sum_d i_d * dst_stride[d] (all in bytes).
// `replicate`: the source of each row is one element of `elem_bytes` bytes, repeated
// run_bytes / elem_bytes times (broadcast along the innermost axis). The launcher picks the
// widest access (16 bytes down to 1) that divides the run, every stride, both offsets and both
// pointers' addresses.
struct RowCopy {
  int dims = 0;
  int64_t size[kMaxDims] = {};
  int64_t src_stride[kMaxDims] = {};
  int64_t dst_stride[kMaxDims] = {};
  int64_t src_offset = 0, dst_offset = 0;
  int64_t run_bytes = 0;
  int elem_bytes = 1;
  bool replicate = false;
};
void copy_rows(const void* src, void* dst, const RowCopy& copy, cudaStream_t stream);

// A transpose of the two innermost axes of each matrix in a batch, through 32x32 tiles in
// shared memory: element (batch, ia, ib) is read at src + src_offset + batch_src +
// ia * src_stride_a + ib (ib is the source's contiguous axis) and written at dst + dst_offset +
// batch_dst + ia + ib * dst_stride_b (ia is the destination's contiguous axis). Strides and
// offsets in elements of `elem_bytes` (1, 2, 4 or 8) bytes; the batch is `batch_dims` nested
// loops with their own strides.
struct TiledCopy {
  int64_t size_a = 1, size_b = 1;
  int64_t src_stride_a = 0, dst_stride_b = 0;
  int batch_dims = 0;
  int64_t batch_size[kMaxDims] = {};
  int64_t batch_src_stride[kMaxDims] = {};
  int64_t batch_dst_stride[kMaxDims] = {};
  int64_t src_offset = 0, dst_offset = 0;
  int elem_bytes = 1;
};
void copy_tiled(const void* src, void* dst, const TiledCopy& copy, cudaStream_t stream);

// y[i] = x[i] converted, rounding to nearest even exactly as the CPU reference does
// (ir/dtype.h, NaN payloads included). `from` != `to`.
// `from` and `to`: f32, f16 or bf16.
void cast(DType from, DType to, const void* x, void* y, int64_t n, cudaStream_t stream);

// y (outer, inner) = sum over the middle axis of x (outer, reduced, inner), accumulated in f32
// and rounded once to the storage type. Deterministic: the summation order depends only on the
// shape (two passes through f32 partials in stream-ordered scratch; no atomics). inner == 1 is
// a row sum (a warp per row segment), inner > 1 a column sum (a block per strip of columns).
// reduced == 0 writes zeros. `type`: f32, f16 or bf16.
void sum_middle(DType type, const void* x, void* y, int64_t outer, int64_t reduced, int64_t inner,
                cudaStream_t stream);

}  // namespace kiln::cuda::movement
