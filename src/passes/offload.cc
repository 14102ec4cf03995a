#include "passes/offload.h"

#include <algorithm>

#include "analysis/memory_plan.h"
#include "support/error.h"
#include "support/bytes.h"

namespace kiln {
namespace {


}  // namespace

bool OffloadPass::run(Graph& graph) {
  notes_.clear();
  if (mode_ == OffloadMode::kOff || (mode_ == OffloadMode::kAuto && !budget_)) return false;
  const size_t value_count = graph.values.size();
  std::vector<std::vector<int>> readers(value_count);
  for (size_t n = 0; n < graph.nodes.size(); ++n)
    for (ValueId in : graph.nodes[n].inputs) readers[static_cast<size_t>(in)].push_back(static_cast<int>(n));
  std::vector<int> update_of(value_count, -1);  // target -> index into graph.updates
  for (size_t u = 0; u < graph.updates.size(); ++u) update_of[static_cast<size_t>(graph.updates[u].target)] = static_cast<int>(u);
  std::vector<int> producer(value_count, -1);
  for (size_t n = 0; n < graph.nodes.size(); ++n)
    for (ValueId out : graph.nodes[n].outputs) producer[static_cast<size_t>(out)] = static_cast<int>(n);

  // Candidates: state tensors read only by optimizer updates, each updated by a node's output.
  std::vector<ValueId> candidates;
  size_t input_bytes = 0;
  for (const GraphInput& in : graph.inputs) {
    const size_t v = static_cast<size_t>(in.value);
    const TensorType& type = graph.type(in.value);
    input_bytes += type.bytes();
    if (in.role != Role::kState || type.rank() == 0 || readers[v].empty() || update_of[v] < 0) continue;
    const bool optimizer_only = std::all_of(readers[v].begin(), readers[v].end(), [&](int r) {
      return has_flag(graph.nodes[static_cast<size_t>(r)].op, kOptimizer);
    });
    if (optimizer_only && producer[static_cast<size_t>(graph.updates[static_cast<size_t>(update_of[v])].value)] >= 0)
      candidates.push_back(in.value);
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](ValueId a, ValueId b) { return graph.type(a).bytes() > graph.type(b).bytes(); });

  std::vector<ValueId> chosen;
  size_t need = 0, moved = 0;
  if (mode_ == OffloadMode::kAll) {
    chosen = candidates;
  } else {
    // The arena as the executor plans it: updates written straight into their inputs hold no
    // arena bytes to the end of the step.
    need = input_bytes + plan_step_memory(graph).arena_bytes;
    for (ValueId s : candidates) {
      if (need - moved <= *budget_) break;
      chosen.push_back(s);
      moved += graph.type(s).bytes();
    }
  }
  if (chosen.empty()) {
    if (mode_ == OffloadMode::kAuto)
      notes_.push_back(fmt::format("nothing moved: the step needs {} of the device, within its budget {}", format_bytes(need),
                                   format_bytes(*budget_)));
    return false;
  }

  // Insertion points: reload before the state's first reader, offload after the update's producer.
  std::vector<std::vector<Node>> before(graph.nodes.size()), after(graph.nodes.size());
  moved = 0;
  for (ValueId s : chosen) {
    const size_t v = static_cast<size_t>(s);
    const TensorType type = graph.type(s);
    moved += type.bytes();
    const ValueId device_copy = static_cast<ValueId>(graph.values.size());
    graph.values.push_back(Value{"", type});
    const int first = *std::min_element(readers[v].begin(), readers[v].end());
    before[static_cast<size_t>(first)].push_back(Node{Op::kReload, {s}, {device_copy}, {}, nullptr});
    for (int r : readers[v])
      for (ValueId& in : graph.nodes[static_cast<size_t>(r)].inputs)
        if (in == s) in = device_copy;
    Update& update = graph.updates[static_cast<size_t>(update_of[v])];
    const ValueId host_copy = static_cast<ValueId>(graph.values.size());
    graph.values.push_back(Value{"", type});
    after[static_cast<size_t>(producer[static_cast<size_t>(update.value)])].push_back(
        Node{Op::kOffload, {update.value}, {host_copy}, {}, nullptr});
    update.value = host_copy;
  }
  std::vector<Node> nodes;
  nodes.reserve(graph.nodes.size() + 2 * chosen.size());
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    for (Node& node : before[n]) nodes.push_back(std::move(node));
    nodes.push_back(std::move(graph.nodes[n]));
    for (Node& node : after[n]) nodes.push_back(std::move(node));
  }
  graph.nodes = std::move(nodes);
  notes_.push_back(
      mode_ == OffloadMode::kAll
          ? fmt::format("moved {} optimizer state tensors ({}) to host memory", chosen.size(), format_bytes(moved))
          : fmt::format("moved {} optimizer state tensors ({}) to host memory: the step's device need {} -> {} "
                        "(budget {})",
                        chosen.size(), format_bytes(moved), format_bytes(need), format_bytes(need - moved), format_bytes(*budget_)));
  return true;
}

}  // namespace kiln
