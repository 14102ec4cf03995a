#include "passes/distributed/collectives.h"

#include <algorithm>
#include <numeric>

#include "support/error.h"

namespace kiln::distributed {

std::vector<Collective> find_collectives(const Graph& graph, const Uses& uses, const CostModel& costs) {
  std::vector<Collective> found;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (!has_flag(node.op, kCollective)) continue;
    Collective c;
    c.start = static_cast<int>(n);
    const auto& readers = uses.readers[static_cast<size_t>(node.outputs[0])];
    KILN_CHECK(readers.size() == 1 && graph.nodes[static_cast<size_t>(readers[0])].op == Op::kCollectiveWait,
               "internal: collective node {} is not read by exactly one wait", n);
    c.wait = readers[0];
    const ValueId out = graph.nodes[static_cast<size_t>(c.wait)].outputs[0];
    const auto& out_readers = uses.readers[static_cast<size_t>(out)];
    if (!uses.escapes[static_cast<size_t>(out)] && !out_readers.empty())
      c.first_reader = *std::min_element(out_readers.begin(), out_readers.end());
    c.producer = uses.producer[static_cast<size_t>(node.inputs[0])];
    if (c.producer >= 0) {
      const Node& p = graph.nodes[static_cast<size_t>(c.producer)];
      c.producer_movable = !p.inputs.empty() && !has_flag(p.op, kRandom) &&
                           std::all_of(p.inputs.begin(), p.inputs.end(),
                                       [&](ValueId in) { return uses.producer[static_cast<size_t>(in)] < 0; });
    }
    // The chain: walk up through casts and shape ops; anything else (or a graph input) ends it.
    std::vector<ValueId> stack{node.inputs[0]};
    while (!stack.empty()) {
      const ValueId v = stack.back();
      stack.pop_back();
      const int p = uses.producer[static_cast<size_t>(v)];
      if (p < 0) continue;
      const Op op = graph.nodes[static_cast<size_t>(p)].op;
      if (op != Op::kCast && !has_flag(op, kShape)) {
        c.ready = std::max(c.ready, p + 1);
        const Node& producer = graph.nodes[static_cast<size_t>(p)];
        // A producer reading a wait's output stays: the wait itself may move later (overlap.cc
        // places waits at their first reader), and the producer must not pass it.
        const bool reads_a_wait = std::any_of(producer.inputs.begin(), producer.inputs.end(), [&](ValueId in) {
          const int q = uses.producer[static_cast<size_t>(in)];
          return q >= 0 && graph.nodes[static_cast<size_t>(q)].op == Op::kCollectiveWait;
        });
        const bool movable = !has_flag(producer.op, kCollective) && producer.op != Op::kCollectiveWait &&
                             !has_flag(producer.op, kRandom) && !reads_a_wait;
        int inputs_ready = movable ? 0 : p + 1;  // an unmovable producer: after it
        if (movable)
          for (ValueId in : producer.inputs)
            inputs_ready = std::max(inputs_ready, uses.producer[static_cast<size_t>(in)] + 1);
        if (movable && std::find(c.producers.begin(), c.producers.end(), p) == c.producers.end())
          c.producers.push_back(p);
        c.earliest = std::max(c.earliest, inputs_ready);
        continue;
      }
      if (std::find(c.chain.begin(), c.chain.end(), p) != c.chain.end()) continue;
      c.chain.push_back(p);
      for (ValueId in : graph.nodes[static_cast<size_t>(p)].inputs) stack.push_back(in);
    }
    std::sort(c.chain.begin(), c.chain.end());
    std::sort(c.producers.begin(), c.producers.end());
    c.bytes = collective_bytes(graph, node);
    c.seconds = costs.collective_seconds(graph, node);
    found.push_back(c);
  }
  return found;
}

void reorder_by_keys(Graph& graph, const std::vector<double>& keys) {
  KILN_CHECK(keys.size() == graph.nodes.size(), "internal: {} keys for {} nodes", keys.size(), graph.nodes.size());
  std::vector<size_t> order(graph.nodes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return keys[a] < keys[b]; });
  std::vector<char> defined(graph.values.size(), 0);
  for (const GraphInput& in : graph.inputs) defined[static_cast<size_t>(in.value)] = 1;
  std::vector<Node> nodes;
  nodes.reserve(graph.nodes.size());
  for (size_t i : order) {
    Node& node = graph.nodes[i];
    for (ValueId in : node.inputs)
      KILN_CHECK(defined[static_cast<size_t>(in)], "internal: reordering puts node {} ({}) before its input %{}", i,
                 op_name(node.op), in);
    for (ValueId out : node.outputs) defined[static_cast<size_t>(out)] = 1;
    nodes.push_back(std::move(node));
  }
  graph.nodes = std::move(nodes);
}

std::vector<double> compute_start_times(const Graph& graph, const CostModel& costs) {
  std::vector<double> t(graph.nodes.size() + 1, 0.0);
  for (size_t n = 0; n < graph.nodes.size(); ++n) t[n + 1] = t[n] + costs.node_seconds(graph, n);
  return t;
}

}  // namespace kiln::distributed
