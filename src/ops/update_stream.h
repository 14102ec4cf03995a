// The update stream: where an optimizer's updates run beside the backward pass.
//
// A fused multi-tensor-update node (ops/fused/multi_tensor.h) with the attribute
// stream = "update" (set by the overlap-updates pass, passes/overlap_updates.h) runs on a second,
// background stream of the executor's (runtime/executor.h): forked from the compute stream where
// the node stands in the order, joined back at the end of the step. So its inputs (gradients,
// scalars) are read there until the end of the step, and the memory plan keeps them to the end
// (analysis/memory_plan.h); nothing but the step's updates may read its outputs. On a device
// without streams (the CPU) it runs where it stands, like any node.
#pragma once

#include "ir/graph.h"

namespace kiln {

inline constexpr const char* kUpdateStream = "update";

inline bool on_update_stream(const Node& node) {
  return node.op == Op::kFused && node.attrs.has("stream") && node.attrs.s("stream") == kUpdateStream;
}

}  // namespace kiln
