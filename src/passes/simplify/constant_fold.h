// constant-fold: evaluates small nodes whose inputs are all known at compile time.
//
// What: a node (not itself a source) whose inputs all come from constant, full or iota nodes,
// whose outputs hold at most kMaxFoldedElements elements in all and whose inputs at most
// kMaxFoldInputElements each, is run through its op's reference kernel (op_def(op).reference,
// the test oracle, computing in double) and replaced by a `full` (when every element has the
// same bits) or a `constant` holding the result; the output value ids and names stay. Folded
// results feed later folds in the same sweep, so whole constant chains collapse.
// Why: the builder, autodiff and the optimizer create scalar arithmetic on constants (1 - beta,
// loss scales, reciprocal counts); evaluating it once at compile time removes kernel launches.
// Not folded: a node whose kernel throws (e.g. integer division by zero: the error must stay a
// run-time error); an i64 result beyond 2^53 (constants store doubles and would round it);
// anything larger than the limits (the IR would carry big literal tensors).
// Expects: a verified graph. Guarantees: outputs and updates equal what the reference kernels
// compute (a fast kernel may round differently from the reference; the reference is the
// oracle); values compacted. One forward sweep.
#pragma once

#include <cstdint>

#include "passes/pass.h"

namespace kiln {

class ConstantFolding : public Pass {
 public:
  static constexpr int64_t kMaxFoldedElements = 4096;
  static constexpr int64_t kMaxFoldInputElements = 1 << 16;
  std::string name() const override { return "constant-fold"; }
  bool run(Graph& graph) override;
};

}  // namespace kiln
