// The schedule pass ("schedule"): reorders the nodes into another topological order that keeps
// fewer bytes live at once, so the memory plan (analysis/memory_plan.h) needs a smaller arena.
//
// Why: a graph's node order is whatever its builder produced (autodiff appends the backward in
// reverse, the optimizer appends every update last). An order that runs each consumer soon
// after its producer, and defers big allocations until they are needed, frees buffers sooner.
//
// How: greedy list scheduling. Among the nodes whose inputs are all computed, run next the one
// with the best net effect on live bytes (bytes it frees, because it is the last reader of an
// input, minus bytes it allocates); ties go to the earlier node of the original order, so the
// result is deterministic. Gains only grow (a value's last remaining reader gains its bytes), so
// a heap with lazy re-insertion keeps this O(E log N). Two variants are tried: one counting the
// values that live to the end of the step (graph outputs, update values) as allocations, one
// not (they stay live to the end whenever they are made, so deferring them may not pay); the
// order with the smallest planned arena (planned_arena_bytes; then the lower peak of live bytes)
// wins, and the original order is kept unless one is strictly lower.
//
// Expects: a verified graph. Guarantees: the same nodes, values, inputs, outputs and updates, in
// a valid topological order; results are unchanged (kernels are deterministic and the random
// ops are counter-based, so no order dependence exists).
#pragma once

#include <cstddef>
#include <vector>

#include "passes/pass.h"

namespace kiln {

class SchedulePass : public Pass {
 public:
  std::string name() const override { return "schedule"; }
  bool run(Graph& graph) override;
};

// The most bytes live at once when the nodes run in `order` (indices into graph.nodes), each
// buffer counted from its node to its last reader (graph outputs and update values: to the
// end); graph inputs are not counted. Sizes are rounded up to 64 bytes, like the arena's.
size_t peak_live_bytes(const Graph& graph, const std::vector<int>& order);
// A copy of `graph` with its nodes in `order` (indices into graph.nodes).
Graph in_order(const Graph& graph, const std::vector<int>& order);
// The arena plan_step_memory (updates written straight into their targets where the executor
// can, no other in-place reuse) gives `graph` with its nodes run in `order`.
size_t planned_arena_bytes(const Graph& graph, const std::vector<int>& order);
// The order SchedulePass picks (the identity when it finds nothing better). `arena_bytes`, when
// given, gets planned_arena_bytes of that order: the pass plans it to choose, so a caller that
// wants the arena of the scheduled graph need not plan it again.
std::vector<int> memory_aware_order(const Graph& graph, size_t* arena_bytes = nullptr);

}  // namespace kiln
