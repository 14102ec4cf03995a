// classifier-chunks: a language-model head's logits, loss and gradients computed a chunk of rows
// at a time, so only one chunk of logits is ever stored (Liger's fused linear cross-entropy, as
// a graph rewrite).
//
// Why: the logits of GPT-2 at B=32, T=1024 are 32768 x 50304 bf16, 3.3 GB: the largest value of
// the step, stored while every activation of the forward is still live; it is the step's peak.
// In chunks of at most `chunk_bytes` (default 2 GiB: GPT-2 B=32 in 2 chunks of 16384 rows) the
// peak drops by the rest (1.65 GB there; 1 GiB, 4 chunks, saves 2.5 GB but re-reads the f32
// weight-gradient sum twice more); each chunk's GEMMs are still large enough to run near
// the rate of the whole ones, and the weight gradient's partial sums add in the GEMM's epilogue.
//
// What: after ClassifierPass, a fused "classifier" node (loss, G) = classifier(L, labels, dloss)
// with reduction "mean" or "sum" whose logits L = matmul(X, W) (X of shape (rows..., C), no
// transpose of X) are read by nothing else, and whose gradient G is read only by
//   row readers     matmul(G, B) (G's rows stay the output's rows): the input gradient dX,
//   contractions    matmul(Gf, Xf) or matmul(Xf, Gf) with transpose_a, Gf and Xf the (N, .)
//                   flat views of G and X (reshapes, or the values themselves when of rank 2):
//                   the weight gradient G^T X (tied) or X^T G,
//   and reshapes of G to its flat view read only by those,
// becomes, for each chunk c of the N = prod(rows...) rows (slices of the flat X and labels:
// views, no copies; chunk rows are a multiple of 64 so every slice offset stays 16-byte aligned):
//   L_c = matmul(X_c, W)                   (W as before)
//   loss_c, G_c = classifier(L_c, labels_c, scale) {reduction = "sum"}
//   Y_c = matmul(G_c, B)                   each row reader; Y = concat(Y_c) reshaped back
//   K = K + f32(matmul(G_c, X_c))          each contraction, summed in f32
//   loss = sum_c loss_c (/ denom for "mean")
// where for "mean" denom = max(count, 1), count the labels that are not ignore_index (so the
// mean over zero counted rows stays 0) and scale = dloss / denom; for "sum" scale = dloss. A
// 16-bit contraction whose only reader is a cast to f32 hands that cast's readers the f32 sum
// directly; otherwise the sum is cast back.
// Numerics: the loss and the weight gradient are summed in a different order (per chunk, then
// over chunks), so results equal the unchunked ones up to float rounding, not bitwise.
// Expects: a verified graph, after ClassifierPass. Guarantees: the same inputs, outputs and
// updates; every other node untouched; values compacted; dead nodes left to dead-code.
#pragma once

#include <cstddef>
#include <string>

#include "passes/pass.h"

namespace kiln {

class ClassifierChunksPass : public Pass {
 public:
  static constexpr size_t kDefaultChunkBytes = kDefaultLogitsChunkBytes;
  // Logits of at most `chunk_bytes` per chunk; 0 never chunks.
  explicit ClassifierChunksPass(size_t chunk_bytes = kDefaultChunkBytes) : chunk_bytes_(chunk_bytes) {}
  std::string name() const override { return "classifier-chunks"; }
  bool run(Graph& graph) override;

 private:
  size_t chunk_bytes_;
};

}  // namespace kiln
