// training-rewrites: decomposes the fused backward ops of losses and norms into elementwise work
// plus reductions (EVT's reassociation), so fusion can put them into GEMM epilogues and
// elementwise groups. A second rule table, run by the same fixed-point driver as algebraic.
//
// What:
//   cross_entropy_grad(logits, labels, dloss) -> (softmax(logits) - one_hot(labels, V)) * scale,
//     scale = dloss / count ("mean"), dloss ("sum") or dloss per row ("none"), and rows whose
//     label is ignore_index set to 0 by where(labels != ignore_index, ..., 0). count is the
//     number of such rows, sum(cast(labels != ignore_index)), or the static row count when the
//     labels provably never equal ignore_index (integer_range). With no counted row the where
//     selects 0 everywhere, as the op does.
//   layer_norm_grad(x, gamma, dy) -> dx by its formula (row means of g = dy * gamma and of
//     g * xhat), dgamma = sum(dy * xhat) and dbeta = sum(dy) over the leading axes: column sums
//     that can ride the epilogue of the GEMM producing dy.
// Why: the fused ops are opaque to fusion; decomposed, the cross-entropy backward is pure
// elementwise work after one row softmax, and the norm's parameter gradients are column sums.
// Conditions: f32 and f64 only (in f16/bf16 the op's single rounding of a double computation is
// worth more than fusion; mixed precision keeps those fused). cross_entropy_grad only when the
// graph also computes cross_entropy of the same logits and labels with the same ignore_index
// earlier: the op rejects out-of-range labels at run time while one_hot silently gives a zero
// row, so the forward op must remain to keep that check.
// Expects: a verified graph. Guarantees: outputs and updates equal to the fused ops' up to
// rounding (1e-10 relative in f64, tested); values compacted. More nodes, not fewer: it is for
// fusion, and dead-code/cse afterwards share the common parts.
#pragma once

#include <map>
#include <span>

#include "passes/pass.h"
#include "passes/simplify/rewrite.h"

namespace kiln {

std::span<const RewriteRule> training_rewrite_rules();

class TrainingRewrites : public Pass {
 public:
  std::string name() const override { return "training-rewrites"; }
  bool run(Graph& graph) override;
  const std::map<std::string, int>& fired() const { return fired_; }

 private:
  std::map<std::string, int> fired_;
};

}  // namespace kiln
