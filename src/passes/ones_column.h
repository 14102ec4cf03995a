// ones-column: a linear layer's bias gradient as one more row of its weight-gradient GEMM.
//
// For y = x W + b over the rows x of an activation X (..., K): dW = X^T dY is a GEMM over every
// row, and db, the column sums of dY, is a second pass over dY, which the GEMM reads anyway.
// With columns of ones appended to X, X' = [X | 1 ... 1] (..., K + p), the product X'^T dY
// (K + p, N) holds dW in its rows [0, K) and db in row K: the sum comes out of the tensor cores,
// nearly free where the extra rows fit the GEMM's tiles. (GPT-2 on an H100, measured as logged in
// bench/log/sessions-1-12.md: the qkv weight gradient with 776 rows instead of 768 costs nothing, fc's +29 us,
// the forward product reading X' with a row stride of 776 +6/+10 us, against column sums of
// 56-79 us per layer.)
//
// What it matches (after fusion, where every piece is one fused node):
//   P  a fused node whose body has a row op (a LayerNorm: a "rows" node, or a gemm-epilogue
//      node whose epilogue is a generated rows kernel) and computes X as a body output, or a
//      lone row op (f32's LayerNorm), outlined into a "rows" node of its own;
//   F  fused gemm-epilogue nodes whose body's one matmul reads X, untransposed, as A, and
//      nothing else in the body reads it (the forward products x W + b, with their epilogues);
//   D  a fused gemm-epilogue node whose body is exactly matmul(A, B) {transpose_a} [then a cast
//      to f32], with A = reshape(X) to (M, K) and B a reshape of dY to (M, N) (the weight
//      gradient);
//   S  sum(dY') over every axis but the last, dY' a reshape of the same bytes as B, [then a
//      cast to D's output dtype], read by nothing else (the bias gradient).
// and rewrites it to
//   P  writes X' = concat(X, full(1, (..., p)), axis -1): its rows kernel stores each row and
//      then its p ones (backends/cuda/nvrtc/codegen.cc, emit_concat); p is the fewest columns that
//      keep every row 16-byte aligned (bf16 768 + 8, f32 + 4);
//   F  reads X' and slices x[..., :K] in its body: cuBLASLt reads A in place with lda K + p
//      (backends/cuda/nvrtc/nvrtc.cc, gemm_core);
//   D  multiplies reshape(X') (M, K + p): dW = slice of rows [0, K), db = reshape of the slice
//      of row K: views at an offset in the memory plan (analysis/memory_plan.h), no copies;
//   S  is gone.
// Every reader of X must be an F or the reshape of a D (one X may feed several layers' worth:
// separate q, k, v products); otherwise the activation is left alone. Every reader of the old
// bias gradient must come after D (the slices are placed right after it).
//
// Numerics: db is summed in f32 by the GEMM's accumulator and rounded once to D's output dtype
// (the sum node summed in f32 too, but rounded to dY's 16 bits before the cast to f32: one
// rounding less now). dW is unchanged.
//
// Why after fusion: the pieces are whole fused nodes there, and the fusion partitioner needs no
// notion of a padded value; before multi-tensor, which groups the updates reading the
// gradients. For CUDA only (pipeline.cc): the CPU's fused kernels would copy the slices.
// Expects: a verified graph after fusion. Guarantees: the same inputs, outputs and updates;
// values compacted.
#pragma once

#include "passes/pass.h"

namespace kiln {

class OnesColumnPass : public Pass {
 public:
  std::string name() const override { return "ones-column"; }
  bool run(Graph& graph) override;
};

// The columns appended to rows of `k` elements of `dtype` so every row starts 16-byte aligned
// (at least one: the ones column).
int64_t ones_column_pad(int64_t k, DType dtype);

}  // namespace kiln
