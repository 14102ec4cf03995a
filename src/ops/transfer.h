// offload and reload (ops/transfer.cc): where an input's bytes live. One rule for the executor
// (which takes such inputs as host tensors) and the compile report (which counts them apart).
#pragma once

#include <vector>

#include "ir/graph.h"

namespace kiln {

// Per graph input (in input order): host-resident, i.e. read by at least one node and by
// reload nodes only.
inline std::vector<bool> host_resident_inputs(const Graph& graph) {
  std::vector<int> readers(graph.values.size(), 0), reloads(graph.values.size(), 0);
  for (const Node& node : graph.nodes)
    for (ValueId in : node.inputs) {
      ++readers[static_cast<size_t>(in)];
      reloads[static_cast<size_t>(in)] += node.op == Op::kReload;
    }
  std::vector<bool> host;
  for (const GraphInput& in : graph.inputs) {
    const size_t v = static_cast<size_t>(in.value);
    host.push_back(readers[v] > 0 && readers[v] == reloads[v]);
  }
  return host;
}

}  // namespace kiln
