// The contract between autodiff and each op's gradient rule (OpDef::gradient, ir/op_def.h):
// what a rule sees, and the helpers rules share. Rules live with their ops in src/ops/ and are
// written with the builder (ir/builder.h); the autodiff pass (passes/autodiff.h) walks the graph
// and calls them, so ops never depend on the pass.
#pragma once

#include <vector>

#include "ir/builder.h"
#include "ir/graph.h"

namespace kiln {

// What a gradient rule sees: the builder (to emit backward nodes), the node, its inputs and
// outputs as Exprs, and the gradient of each output (zeros where an output got none).
struct GradContext {
  Builder& builder;
  const Node& node;
  std::vector<Expr> inputs;
  std::vector<Expr> outputs;
  std::vector<Expr> output_grads;

  const Expr& x(size_t i = 0) const { return inputs.at(i); }
  const Expr& y(size_t i = 0) const { return outputs.at(i); }
  const Expr& dy(size_t i = 0) const { return output_grads.at(i); }
  const Attributes& attrs() const { return node.attrs; }
};

// Sums `grad` over the axes that broadcasting added or stretched so it has `shape` again:
// the gradient of an input that was broadcast in the forward pass.
Expr reduce_to_shape(Expr grad, const Shape& shape);

}  // namespace kiln
