#include "analysis/cost_model.h"

#include <algorithm>

#include "ir/op_def.h"
#include "support/error.h"

namespace kiln {
namespace {

double numel_of(const Graph& g, ValueId id) { return static_cast<double>(g.type(id).numel()); }

double bytes_of(const Graph& g, ValueId id) { return static_cast<double>(g.type(id).bytes()); }

}  // namespace

double node_flops(const Graph& g, const Node& node) {
  if (node.op == Op::kFused && node.body) {
    double flops = 0;
    for (const Node& inner : node.body->nodes) flops += node_flops(*node.body, inner);
    return flops;
  }
  if (const auto& flops = op_def(node.op).traits.flops) return flops(g, node);
  double out_numel = 0;
  for (ValueId o : node.outputs) out_numel += numel_of(g, o);
  double in_numel = 0;
  for (ValueId i : node.inputs) in_numel += numel_of(g, i);
  if (has_flag(node.op, kElementwise) || has_flag(node.op, kShape) || has_flag(node.op, kSource))
    return out_numel;
  return 5.0 * in_numel;  // reductions, normalizations, gathers: a few passes over the input
}


double collective_bytes(const Graph& graph, const Node& node) {
  return std::max(bytes_of(graph, node.inputs[0]), bytes_of(graph, node.outputs[0]));
}

CostModel CostModel::defaults(Device device) {
  CostModel m;
  if (device == Device::kCuda) {
    // NCCL over NVLink between H100s inside a CUDA graph: ~20 us per collective, ~100-150 GB/s
    // of algorithm bandwidth for the sizes a step moves (all-reduce moves its bytes twice).
    m.all_gather = {20e-6, 120e9};
    m.reduce_scatter = {20e-6, 120e9};
    m.all_reduce = {25e-6, 60e9};
    m.source = "defaults for cuda";
  } else {
    // Gloo over loopback TCP, a few cores.
    m.flops_per_s = 50e9;
    m.bytes_per_s = 10e9;
    m.launch_s = 2e-6;
    m.all_gather = {100e-6, 1e9};
    m.reduce_scatter = {100e-6, 1e9};
    m.all_reduce = {150e-6, 0.5e9};
    m.source = "defaults for cpu";
  }
  return m;
}

double CostModel::node_seconds(const Graph& graph, size_t node) const {
  if (node < measured_node_seconds.size() && measured_node_seconds[node] >= 0) return measured_node_seconds[node];
  const Node& n = graph.nodes[node];
  // A collective's own node only records an event on the compute stream; a wait, a view.
  if (has_flag(n.op, kCollective) || n.op == Op::kCollectiveWait) return 0;
  double bytes = 0;
  for (ValueId id : n.inputs) bytes += bytes_of(graph, id);
  for (ValueId id : n.outputs) bytes += bytes_of(graph, id);
  return launch_s + std::max(node_flops(graph, n) / flops_per_s, bytes / bytes_per_s);
}

const CollectiveFit& CostModel::fit(Op collective) const {
  switch (collective) {
    case Op::kAllGather: return all_gather;
    case Op::kReduceScatter: return reduce_scatter;
    case Op::kAllReduce: return all_reduce;
    default: fail("internal: {} is not a collective", op_name(collective));
  }
}

double CostModel::collective_seconds(const Graph& graph, const Node& node) const {
  return fit(node.op).seconds(collective_bytes(graph, node));
}

}  // namespace kiln
