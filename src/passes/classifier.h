// classifier: outlines a language-model loss and its gradient into one fused "classifier" node
// (llm.c's fused classifier), so a hand-written kernel computes the loss and the logits'
// gradient in one pass over the logits, writing the gradient over them, and neither the
// normalized logits (softmax) nor an f32 copy of the logits nor an f32 gradient is ever stored.
//
// What: a cross_entropy(L, labels) and THE cross_entropy_grad(L, labels, dloss) of the same L,
// labels, ignore_index and reduction, with L of dtype f32, become
//     %loss, %dlogits = fused(%X, %labels, %dloss) {kind="classifier"} { body }
// whose body holds exactly the matched ops, in this order (the kind's contract,
// ops/fused/classifier.h, which the verifier and the kernels read it back with):
//     [%L = cast(%X) {dtype=f32}]                     absorbed when L = cast(X) of a bf16/f16 X
//     %loss = cross_entropy(%L, %labels) {ignore_index, reduction}
//     %g = cross_entropy_grad(%L, %labels, %dloss) {ignore_index, reduction}
//     [%gc = cast(%g) {dtype=bf16|f16}]               absorbed when g's only user is that cast
//     return %loss, %g (or %gc)
// The cast of the logits is absorbed only when L is read by nothing but the two loss ops (not a
// graph output, no other node): otherwise L is stored anyway and the node reads it. The cast back
// is absorbed only when it is the gradient's only reader (and the gradient is no graph output).
// Why first in the pipeline: training-rewrites would decompose cross_entropy_grad (f32/f64)
// into softmax and elementwise work; outlined, the pair is opaque to every later pass (fusion
// leaves fused nodes alone: classify_node makes them opaque).
// Conditions (otherwise the graph is left alone): exactly one cross_entropy_grad of that
// (L, labels, attributes); the node placed after what it reads and before what reads its
// outputs must be possible (no path from the loss back into dloss: checked, not assumed).
// Reshapes between the logits and the loss are not looked through (GPT-2's graph has none).
// Expects: a verified graph (after autodiff). Guarantees: the same inputs, outputs and updates;
// results equal to the unfused ops' (the fused reference kernel runs the same reference kernels
// in the same order); values compacted.
#pragma once

#include <string>

#include "passes/pass.h"

namespace kiln {

class ClassifierPass : public Pass {
 public:
  std::string name() const override { return "classifier"; }
  bool run(Graph& graph) override;
};

}  // namespace kiln
