// multi-tensor: groups the optimizer updates (and the global norm) into multi-tensor fused nodes.
#pragma once

#include "passes/pass.h"

namespace kiln {

class MultiTensorPass : public Pass {
 public:
  std::string name() const override { return "multi-tensor"; }
  bool run(Graph& graph) override;
};

}  // namespace kiln
