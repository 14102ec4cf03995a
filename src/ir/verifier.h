// The graph verifier: checks the structural invariants every pass and backend relies on.
// Run on every finished graph (the builder, the parser) and after every pass.
#pragma once

#include "ir/graph.h"

namespace kiln {

// Throws kiln::Error naming the first broken invariant:
// - every value id in range; every value defined exactly once (graph input or node output),
//   and defined before use (topological order);
// - every node's attributes match its op's schema and its output types equal what inference
//   gives for its input types;
// - value names, where given, are unique; graph outputs exist;
// - each update targets a distinct param/state input with a defined value of the same type;
// - only fused nodes have a body, and every fused node has one that verifies, whose input
//   types match the node's, with no updates and no fused node inside (ops/fused.cc).
void verify(const Graph& graph);

}  // namespace kiln
