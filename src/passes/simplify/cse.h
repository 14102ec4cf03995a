// cse: common-subexpression elimination.
//
// What: two nodes with the same op, the same inputs (after earlier merges) and the same
// attributes (same_values: floats compared by bits, so 0.0 and -0.0 stay apart) compute the same
// values; the later one is deleted and its uses read the earlier one's outputs. For the
// commutative add, mul, eq and ne, add(a, b) and add(b, a) also match: IEEE addition and
// multiplication give the same result in either order (only a NaN's payload may differ).
// maximum and minimum are left out: max(+0, -0) returns its first operand, so the order matters.
// Why: autodiff recomputes things the forward already has (casts, transposes, broadcasts of the
// same scalar, softmax of the same logits), and the model builder repeats constants.
// Random ops (dropout) are merged too: the RNG is counter-based, so the same input, seed and
// offset give the same mask; that is what the IR promises (see ops/elementwise.cc). No op has
// side effects (optimizer updates are pure nodes whose outputs Graph::updates names), so nothing
// is excluded.
// Expects: a verified graph. Guarantees: bitwise-identical outputs and updates; the first node of
// each class is kept where it was; a merged value's name moves to the kept one when that one has
// none; values are compacted. One forward sweep with a hash table: linear in the graph size.
#pragma once

#include "passes/pass.h"

namespace kiln {

class CommonSubexpressionElimination : public Pass {
 public:
  std::string name() const override { return "cse"; }
  bool run(Graph& graph) override;
};

}  // namespace kiln
