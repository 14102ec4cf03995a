// The multi-tensor pass ("multi-tensor"): groups the optimizer's per-parameter updates, and the
// per-gradient terms of the global gradient norm, into a few `fused` nodes that hand-written
// multi-tensor kernels run in one launch (GPT-2: 148 adamw_update nodes, 148 sum-of-squares
// reductions and 147 scalar adds otherwise).
//
// What it makes (bodies: backends/multi_tensor.h describes them exactly):
//   kind "multi-tensor-adamw" / "multi-tensor-sgd": adamw_update (sgd_update) nodes with equal
//     attributes, the same scalar operands (lr, step) and the same operand dtypes. The body
//     holds the nodes unchanged; the fused node's outputs are their results, each still the
//     value of its own Graph::update, so the executor still writes each one straight into its
//     param or state (KernelImpl::in_place_ok of the kernels).
//   kind "global-norm": the terms sum(square(x)) or sum(square(cast(x, f32))) (f32, full sums)
//     and the tree of f32 scalar adds combining them, as the optimizer's --grad-clip builds it.
//     Output: the sum of squares (the tree's root). Only an exact pattern: every intermediate
//     read by the next node of the pattern alone (no graph output, no update, no other reader).
//     The sqrt and the clip factor stay outside.
//
// Runs after fusion (the updates are opaque to it). Fusion may already have put parts of the
// norm pattern into fusion groups (a 1-D gradient's square and sum as a "rows" group, the add
// tree with the sqrt and the clip factor as an "elementwise" one): such groups are inlined, the
// pattern's nodes taken out, and the rest outlined again as the fusion pass would (same
// fusion::outline, same kinds).
//
// Memory. One node per kind would keep every gradient alive until the last of them is
// computed, where the scheduler would otherwise run each update right after its gradient. So
// the grouping is checked against the schedule pass's own measure (peak_live_bytes of the
// order memory_aware_order() picks, with the update values counted both as live to the end and
// as written straight into their targets): the updates are grouped per kind only if neither
// peak rises; otherwise into chunks of consecutive updates of the scheduled order under a byte
// cap, halving the cap until neither rises; otherwise not at all. (For GPT-2 the schedule keeps
// the builder's order, every update last, and one node per kind costs nothing.)
//
// Expects: a verified graph after fusion. Guarantees: the same inputs, outputs and updates;
// the same results (the bodies hold the same nodes: the fused reference kernel computes exactly
// what the nodes did); values compacted.
#pragma once

#include "passes/pass.h"

namespace kiln {

class MultiTensorPass : public Pass {
 public:
  std::string name() const override { return "multi-tensor"; }
  bool run(Graph& graph) override;
};

}  // namespace kiln
