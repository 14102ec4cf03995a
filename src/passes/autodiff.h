// Reverse-mode automatic differentiation over a forward graph.
//
// Given a scalar loss and the values to differentiate with respect to (usually the params),
// appends the backward pass to the same graph, so forward and backward form ONE joint graph that
// later passes optimize as a whole. Gradient rules live with each op (OpDef::gradient in
// src/ops/; what a rule sees: ops/gradient.h); this pass only walks the graph in reverse, seeds
// d(loss) = 1, calls the rules, accumulates fan-out gradients by addition, and reports
// non-differentiable paths clearly.
//
// Expects: a verified graph, loss a float scalar. Guarantees: the returned graph is verified, its
// outputs are unchanged, and gradients[i] has the type of wrt[i] (zeros when the loss does not
// depend on it).
#pragma once

#include <vector>

#include "ir/graph.h"
#include "ops/gradient.h"

namespace kiln {

struct AutodiffResult {
  Graph graph;                     // forward + backward
  std::vector<ValueId> gradients;  // one per wrt value, same order
  // Per wrt value: whether the loss depends on it through differentiable ops (false: its
  // gradient is zeros, as for a parameter the loss never reads; torch's grad would be None).
  std::vector<bool> reached;
};

// Throws kiln::Error if loss is not a float scalar, a wrt value is not float, or the loss
// depends on a wrt value only through a non-differentiable op (naming the op and the node).
AutodiffResult autodiff(const Graph& forward, ValueId loss, const std::vector<ValueId>& wrt);

}  // namespace kiln
