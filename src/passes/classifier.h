// classifier: outlines the loss and its gradient into one fused "classifier" node.
#pragma once

#include "passes/pass.h"

namespace kiln {

class ClassifierPass : public Pass {
 public:
  std::string name() const override { return "classifier"; }
  bool run(Graph& graph) override;
};

}  // namespace kiln
