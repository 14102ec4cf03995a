#include "passes/recompute.h"

#include <algorithm>
#include <map>

#include "ir/op.h"
#include "support/error.h"
#include "support/bytes.h"

namespace kiln {
namespace {

// Whether the fusion pass can put a reader of a recomputed value in the same kernel as the
// recomputation (elementwise and row ops share a tile of rows with it).
bool fusable_reader(const Node& node) {
  if (has_flag(node.op, kElementwise)) return true;
  switch (node.op) {
    case Op::kSoftmax:
    case Op::kLayerNorm:
    case Op::kRmsNorm:
      return true;
    default:
      return false;
  }
}

}  // namespace

bool RecomputePass::run(Graph& graph) {
  notes_.clear();
  if (graph.outputs.empty()) return false;
  const size_t node_count = graph.nodes.size();
  const size_t value_count = graph.values.size();

  // The forward: every node the loss depends on.
  std::vector<char> needed(value_count, 0), forward(node_count, 0);
  needed[static_cast<size_t>(graph.outputs[0])] = 1;
  for (size_t n = node_count; n-- > 0;) {
    const Node& node = graph.nodes[n];
    for (ValueId o : node.outputs) forward[n] |= needed[static_cast<size_t>(o)];
    if (forward[n])
      for (ValueId in : node.inputs) needed[static_cast<size_t>(in)] = 1;
  }

  std::vector<std::vector<int>> readers(value_count);
  for (size_t n = 0; n < node_count; ++n)
    for (ValueId in : graph.nodes[n].inputs) readers[static_cast<size_t>(in)].push_back(static_cast<int>(n));
  std::vector<char> is_input(value_count, 0);
  for (const GraphInput& input : graph.inputs) is_input[static_cast<size_t>(input.value)] = 1;
  std::vector<char> external(value_count, 0);
  for (ValueId o : graph.outputs) external[static_cast<size_t>(o)] = 1;
  for (const Update& u : graph.updates) external[static_cast<size_t>(u.value)] = 1;
  // The last position at which a backward node (or a clone) reads each value; -1: none does.
  std::vector<int> last_backward(value_count, -1);
  for (size_t v = 0; v < value_count; ++v)
    for (int r : readers[v])
      if (!forward[static_cast<size_t>(r)]) last_backward[v] = std::max(last_backward[v], r);

  struct Clone {
    Node node;
    int position;  // inserted before the original node of this index
  };
  std::vector<Clone> clones;
  std::map<ValueId, size_t> clone_of;  // value -> index into clones
  std::map<std::string, int> counts;   // op name -> values recomputed
  size_t bytes = 0;
  for (size_t n = 0; n < node_count; ++n) {
    const Node& node = graph.nodes[n];
    if (!forward[n] || !has_flag(node.op, kElementwise) || has_flag(node.op, kRandom) || node.outputs.size() != 1)
      continue;
    const ValueId v = node.outputs[0];
    if (external[static_cast<size_t>(v)]) continue;
    std::vector<int> late;  // the backward readers
    bool joins_a_kernel = false;
    for (int r : readers[static_cast<size_t>(v)])
      if (!forward[static_cast<size_t>(r)]) {
        late.push_back(r);
        joins_a_kernel |= fusable_reader(graph.nodes[static_cast<size_t>(r)]);
      }
    if (late.empty()) continue;
    const int first = *std::min_element(late.begin(), late.end());
    bool inputs_kept = true, all_inputs_are_graph_inputs = true;
    for (ValueId in : node.inputs) {
      const size_t i = static_cast<size_t>(in);
      const bool graph_input = is_input[i];
      all_inputs_are_graph_inputs &= graph_input;
      if (clone_of.count(in)) joins_a_kernel = true;  // the chain goes on in the clone's kernel
      const bool kept = graph_input || clone_of.count(in) || last_backward[i] >= first ||
                        graph.type(in).bytes() <= kSmallBytes;
      inputs_kept &= kept;
    }
    // A param's 16-bit copy: see the header.
    if (!inputs_kept || !joins_a_kernel || (node.op == Op::kCast && all_inputs_are_graph_inputs)) continue;

    Clone clone{node, first};
    for (ValueId& in : clone.node.inputs) {
      auto it = clone_of.find(in);
      if (it != clone_of.end()) {
        in = clones[it->second].node.outputs[0];
      } else {  // a value of the original graph, now read at `first` too
        last_backward[static_cast<size_t>(in)] = std::max(last_backward[static_cast<size_t>(in)], first);
      }
    }
    const ValueId fresh = static_cast<ValueId>(graph.values.size());
    graph.values.push_back(Value{"", graph.type(v)});  // unnamed: names must be unique
    clone.node.outputs = {fresh};
    for (int r : late)
      for (ValueId& in : graph.nodes[static_cast<size_t>(r)].inputs)
        if (in == v) in = fresh;
    clone_of[v] = clones.size();
    clones.push_back(std::move(clone));
    ++counts[std::string(op_name(node.op))];
    bytes += graph.type(v).bytes();
  }
  if (clones.empty()) return false;

  // A clone reading another clone must come after it: move producers up to their readers.
  std::map<ValueId, size_t> made_by;  // clone output -> clone index
  for (size_t c = 0; c < clones.size(); ++c) made_by[clones[c].node.outputs[0]] = c;
  for (size_t c = clones.size(); c-- > 0;)
    for (ValueId in : clones[c].node.inputs) {
      auto it = made_by.find(in);
      if (it != made_by.end()) clones[it->second].position = std::min(clones[it->second].position, clones[c].position);
    }
  // Stable by position; clones of one position stay in creation (forward) order.
  std::stable_sort(clones.begin(), clones.end(),
                   [](const Clone& a, const Clone& b) { return a.position < b.position; });
  std::vector<Node> nodes;
  nodes.reserve(node_count + clones.size());
  size_t next = 0;
  for (size_t n = 0; n < node_count; ++n) {
    for (; next < clones.size() && clones[next].position == static_cast<int>(n); ++next)
      nodes.push_back(std::move(clones[next].node));
    nodes.push_back(std::move(graph.nodes[n]));
  }
  graph.nodes = std::move(nodes);

  std::vector<std::string> parts;
  for (const auto& [op, count] : counts) parts.push_back(fmt::format("{} {}", count, op));
  const std::string size = format_bytes(static_cast<double>(bytes));
  notes_.push_back(fmt::format("recomputed {} elementwise values in the backward ({}), {} no longer kept from the "
                               "forward",
                               made_by.size(), fmt::join(parts, ", "), size));
  return true;
}

}  // namespace kiln
