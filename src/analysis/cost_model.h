// Predicted times of a step's nodes and collectives: what the distribution passes
// (passes/distributed/) weigh when they bucket collectives and move them around the compute.
//
// A node's device time is a roofline: its FLOPs at the device's matrix rate or its bytes (inputs
// and outputs) at its memory bandwidth, whichever is longer, plus a launch cost. Measured times
// replace it where a profile gives them (CostModel::measured_node_seconds). A collective's time
// is a latency-bandwidth fit per kind, t(bytes) = latency + bytes / bandwidth, where bytes are
// the larger of its input and output (the gathered or scattered full buffer): measured by the
// size sweep of distributed/comm_profile.h (cached per machine and world size), or the defaults
// below until one has run.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "tensor/tensor.h"

namespace kiln {

// Estimated FLOPs of one node: its op's OpTraits::flops where it has one (2MNK for matmul,
// 4BHTSD for attention and about twice that for its gradient, 2 * out * C*KH*KW for
// convolutions), else ~5 per input element for reductions and normalizations and one per output
// element for elementwise, shape and source ops; a fused node's, its body's sum.
double node_flops(const Graph& graph, const Node& node);

// t(bytes) = latency_s + bytes / bytes_per_s.
struct CollectiveFit {
  double latency_s = 20e-6;
  double bytes_per_s = 100e9;
  double seconds(double bytes) const { return latency_s + bytes / bytes_per_s; }
};

struct CostModel {
  // Device rates of the roofline (defaults: an H100's dense bf16 at the ~60% kiln's GEMMs reach,
  // its HBM at ~80%; a CPU's a few cores' worth).
  double flops_per_s = 600e12;
  // FP8 products (ops/fp8.h): an H100's dense FP8 rate at the share cuBLASLt's FP8 GEMMs reach.
  double fp8_flops_per_s = 1000e12;
  double bytes_per_s = 2.6e12;
  double launch_s = 4e-6;
  CollectiveFit all_gather, reduce_scatter, all_reduce;
  // Where this model came from: "defaults for cuda", "measured (…)": shown by reports.
  std::string source = "defaults";
  // Per node index of the graph being planned: its measured seconds (empty or < 0: the roofline).
  std::vector<double> measured_node_seconds;

  // The defaults for a device kind (CUDA: an H100 over NVLink; CPU: Gloo over loopback TCP).
  static CostModel defaults(Device device);

  double node_seconds(const Graph& graph, size_t node) const;
  // A collective start node's time on the communication stream.
  double collective_seconds(const Graph& graph, const Node& node) const;
  const CollectiveFit& fit(Op collective) const;
};

// The bytes a collective start moves: the larger of its input and output.
double collective_bytes(const Graph& graph, const Node& node);

}  // namespace kiln
