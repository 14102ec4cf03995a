// Who reads each value of a graph: the table the rewrite passes match patterns with.
#pragma once

#include <vector>

#include "ir/graph.h"

namespace kiln {

struct Uses {
  std::vector<std::vector<int>> readers;  // per value: node indices, one per input slot reading it
  std::vector<int> producer;              // per value: the defining node, -1 for graph inputs
  std::vector<char> escapes;              // per value: a graph output or an update value

  explicit Uses(const Graph& graph)
      : readers(graph.values.size()), producer(graph.values.size(), -1),
        escapes(graph.values.size(), 0) {
    for (size_t n = 0; n < graph.nodes.size(); ++n) {
      for (ValueId in : graph.nodes[n].inputs) readers[static_cast<size_t>(in)].push_back(static_cast<int>(n));
      for (ValueId out : graph.nodes[n].outputs) producer[static_cast<size_t>(out)] = static_cast<int>(n);
    }
    for (ValueId id : graph.outputs) escapes[static_cast<size_t>(id)] = 1;
    for (const Update& u : graph.updates) escapes[static_cast<size_t>(u.value)] = 1;
  }
  // Read by exactly one node input, and not escaping.
  bool single(ValueId id) const {
    return readers[static_cast<size_t>(id)].size() == 1 && !escapes[static_cast<size_t>(id)];
  }
};

}  // namespace kiln
