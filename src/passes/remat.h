// Rematerialization under a memory budget ("remat"): keeps the planned arena of a training step
// under a given number of bytes by recomputing some forward activations in the backward pass
// instead of keeping them alive across the step's memory peak.
//
// The quantity budgeted: the arena's planned peak as the executor's plan would compute it after
// the rest of the pipeline, i.e. plan_memory(graph after the schedule pass).arena_bytes, WITHOUT
// in-place reuse (the same number `kiln compile` reports). Why without: the pass runs before
// kernels are chosen, so it cannot know which kernels allow in-place writes; in-place reuse only
// merges buffers, so the executor's real arena is almost always the same or smaller. Graph
// inputs and outputs are not in the arena and are not budgeted.
//
// What recomputing a value v means: v is defined before the peak node p and read again after it.
// The node producing v is cloned just before v's first reader after p, and every reader after p
// reads the clone; the original then dies before p. A clone reads the same inputs as its original,
// so it computes the same bits (kernels are deterministic; the random ops are counter-based
// Philox keyed by their attributes and the rng.offset state input, which a clone reads too). An
// input of the cloned node that is dead at p is either recomputed too (a chain of clones) or kept
// alive longer, which costs its bytes at p.
//
// The formulation: a greedy knapsack over candidates, by cost per byte saved, with exact
// re-planning after every choice (not a min-cut). Each round:
//   1. schedule + plan the current graph; p = the node with the most live bytes;
//   2. candidates = the values live across p (defined before p, read after it, not read at p,
//      not a graph output or update value), each in up to two variants: its producer alone or
//      with a chain through dead inputs (light: the chain stops at GEMMs/attention/conv and keeps
//      their outputs instead), and the full chain (may recompute heavy ops);
//      benefit = bytes(v) - bytes of inputs kept alive longer; cost = FLOPs of the cloned nodes;
//   3. try candidates in order (light before heavy: GEMMs, attention and convolutions are the last
//      resort; then lowest FLOPs per byte saved) and accept the first whose re-plan is strictly
//      better, by (arena bytes, live-peak bytes, live bytes summed over nodes); the last two
//      break ties so the search moves along a plateau of equal peaks;
//   4. stop when the arena fits the budget, or no candidate improves.
// Why not min-cut: the min-cut rule (AOTAutograd's partitioner) minimizes the bytes saved between
// forward and backward for a fixed set of recomputable ops; it has no budget and no FLOPs
// trade-off, and kiln's peak is that of one joint graph after scheduling, which only re-planning
// measures exactly. The greedy stops at the first plan that fits, so it adds no recomputation the
// budget does not need, and every choice is checked against the real plan.
//
// Errors: when no plan it finds fits, kiln::Error says so with the smallest plan found, e.g.
// "memory budget 100.0 MiB is too small for this step: the smallest plan found needs 123.4 MiB
// (129394688 bytes) (without remat: 456.7 MiB)". The search does not depend on the budget except
// where it stops, so that smallest budget then succeeds.
//
// Expects: a verified graph, as the pipeline leaves it (remat runs after dead-code and CSE, which
// would merge the clones back, and right before schedule). Guarantees: the same inputs, outputs
// and updates, bit-identical results; the planned arena after the schedule pass is <= budget.
#pragma once

#include "support/bytes.h"

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "passes/pass.h"

namespace kiln {

struct RematStats {
  size_t peak_before = 0;      // planned arena bytes without remat
  size_t peak_after = 0;       // planned arena bytes of the result
  int values_recomputed = 0;   // accepted choices
  int nodes_cloned = 0;
  int heavy_nodes_cloned = 0;  // GEMMs, attention, convolutions among them
  double flops_added = 0;      // estimated FLOPs of the cloned nodes
};

class Rematerialize : public Pass {
 public:
  // Without a budget the pass does nothing. `schedule_after`: whether the schedule pass runs
  // after this one (the pipeline's default); the peak is measured after it when it does.
  explicit Rematerialize(std::optional<size_t> budget_bytes, bool schedule_after = true)
      : budget_(budget_bytes), schedule_after_(schedule_after) {}
  std::string name() const override { return "remat"; }
  bool run(Graph& graph) override;
  const RematStats& stats() const { return stats_; }

 private:
  std::optional<size_t> budget_;
  bool schedule_after_;
  RematStats stats_;
};

// The planned arena bytes of `graph` as remat measures it: plan_memory (no in-place reuse) of
// the graph after the schedule pass (or in its own order when `schedule_after` is false).
size_t planned_peak_bytes(const Graph& graph, bool schedule_after = true);

// GEMMs, attention and convolutions (and their gradients): recomputed only as a last resort
// (OpTraits::recompute kHeavy).
bool is_heavy_op(Op op);

// "512MiB", "2GiB", "1.5GB", "100KiB", "4096" (bytes): binary (KiB MiB GiB TiB) and decimal (kB MB
// GB TB) units, optional space, case-insensitive; throws kiln::Error on anything else.
size_t parse_byte_size(std::string_view text);

}  // namespace kiln
