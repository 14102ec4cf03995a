#include "passes/simplify/compact.h"

#include <vector>

#include "support/error.h"

namespace kiln {

void replace_uses(Graph& graph, std::span<const ValueId> replacement) {
  KILN_CHECK(replacement.size() == graph.values.size(),
             "replace_uses: {} replacements for {} values", replacement.size(),
             graph.values.size());
  for (Node& node : graph.nodes)
    for (ValueId& id : node.inputs) id = replacement[id];
  for (ValueId& id : graph.outputs) id = replacement[id];
  for (Update& update : graph.updates) update.value = replacement[update.value];
}

void move_name(Graph& graph, ValueId from, ValueId to) {
  if (from == to || graph.values[from].name.empty() || !graph.values[to].name.empty()) return;
  if (graph.input_index(to) >= 0) return;
  graph.values[to].name = std::move(graph.values[from].name);
  graph.values[from].name.clear();
}

bool compact(Graph& graph) {
  const size_t n = graph.values.size();
  std::vector<char> defined(n, 0);
  for (const GraphInput& input : graph.inputs) defined.at(input.value) = 1;
  for (const Node& node : graph.nodes)
    for (ValueId id : node.outputs) defined.at(id) = 1;

  std::vector<ValueId> new_id(n, -1);
  std::vector<Value> kept;
  kept.reserve(n);
  for (size_t v = 0; v < n; ++v) {
    if (!defined[v]) continue;
    new_id[v] = static_cast<ValueId>(kept.size());
    kept.push_back(std::move(graph.values[v]));
  }
  const bool dropped = kept.size() != n;
  graph.values = std::move(kept);
  if (!dropped) return false;

  auto renumber = [&](ValueId& id, const char* where) {
    KILN_CHECK(id >= 0 && static_cast<size_t>(id) < n && new_id[id] >= 0,
               "compact: {} refers to value {}, which no input or node defines any more", where,
               id);
    id = new_id[id];
  };
  for (GraphInput& input : graph.inputs) renumber(input.value, "a graph input");
  for (Node& node : graph.nodes) {
    for (ValueId& id : node.inputs) renumber(id, "a node input");
    for (ValueId& id : node.outputs) renumber(id, "a node output");
  }
  for (ValueId& id : graph.outputs) renumber(id, "a graph output");
  for (Update& update : graph.updates) {
    renumber(update.target, "an update target");
    renumber(update.value, "an update value");
  }
  return true;
}

}  // namespace kiln
