#include "passes/simplify/dead_code.h"

#include <vector>

#include "passes/simplify/compact.h"

namespace kiln {

bool DeadCodeElimination::run(Graph& graph) {
  std::vector<char> live(graph.values.size(), 0);
  for (ValueId id : graph.outputs) live.at(id) = 1;
  for (const Update& update : graph.updates) live.at(update.value) = 1;

  // Reverse topological order: every use of a node's outputs is seen before the node itself.
  std::vector<char> keep(graph.nodes.size(), 0);
  for (size_t i = graph.nodes.size(); i-- > 0;) {
    const Node& node = graph.nodes[i];
    for (ValueId out : node.outputs) keep[i] |= live[out];
    if (!keep[i]) continue;
    for (ValueId in : node.inputs) live[in] = 1;
  }

  std::vector<Node> kept;
  kept.reserve(graph.nodes.size());
  for (size_t i = 0; i < graph.nodes.size(); ++i)
    if (keep[i]) kept.push_back(std::move(graph.nodes[i]));
  const bool removed = kept.size() != graph.nodes.size();
  graph.nodes = std::move(kept);
  const bool compacted = compact(graph);
  return removed || compacted;
}

}  // namespace kiln
