// dead-code: removes the nodes whose results nobody needs.
//
// What: a node is live when one of its outputs is a graph output, an update value, or an input
// of a live node; every other node is deleted, then compact() drops the values they defined.
// Why: autodiff and the other rewrites leave work behind (zeros for outputs that got no
// gradient, the forward halves of decomposed ops, nodes a rule replaced); computing it would
// cost time and memory for nothing.
// Expects: a verified graph. Guarantees: outputs, updates and graph inputs (even unused ones:
// they are the graph's interface) are unchanged; the surviving nodes keep their order; values
// are renumbered with no orphans. One backward sweep: linear in the graph size. There are no
// side-effecting ops in the IR (optimizer updates are ordinary nodes reached through
// Graph::updates), so liveness is all that decides.
#pragma once

#include "passes/pass.h"

namespace kiln {

class DeadCodeElimination : public Pass {
 public:
  std::string name() const override { return "dead-code"; }
  bool run(Graph& graph) override;
};

}  // namespace kiln
