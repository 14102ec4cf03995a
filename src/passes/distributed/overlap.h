// The overlap pass ("overlap-collectives"): moves each collective's start and wait so that the
// communication runs beside the compute instead of between it, as far as the memory allows.
//
// The schedule pass orders for memory alone, so a collective starts right before the node
// that waits for it and the compute stream idles through every transfer. With predicted times
// (analysis/cost_model.h) this pass places, on the compute order:
//   - reductions (reduce_scatter, all_reduce of gradients): the start right after its input is
//     made; the wait where the communication stream, running the collectives one after another
//     in start order, is predicted to have finished it (no stall), or before its first reader.
//     A reduce-scatter's readers that feed nothing else in the step (a gradient's optimizer
//     update) move with the wait instead of bounding it: on LLaMA-8B zero3 (2 x H200) the
//     reduce-scatters went from all exposed (54 ms of a 769 ms step) to mostly beside the
//     backward (744-750 ms). Not dp's all-reduces: GPT-2 medium's dp step was slower so;
//   - gathers (all_gather of zero3's params): the prefetch. The start moves up, with the
//     param-only work feeding it (the shard's cast, a bucket's copy-in), until the compute
//     between it and its first reader covers its time and the collectives queued before it;
//     the wait goes right before the first reader.
// Both cost memory: a reduction's input stays live until its wait, a gather's output from its
// start. The placement is scaled by a factor (8, 4, 2, 1, 1/2, 1/4, 1/8; else the order as it
// came) and the largest whose planned arena (analysis/memory_plan.h) stays within the limit
// wins: the memory budget when one is given, else 5% above the arena of the order as it came.
// (Above 1: a collective beside the compute runs slower than it was measured alone.)
#pragma once

#include <optional>

#include "analysis/cost_model.h"
#include "passes/pass.h"

namespace kiln {

// Predicted time of one step in the graph's node order: the compute stream runs the nodes back
// to back, the communication stream runs the collectives in start order once their start is
// reached, and a wait holds the compute stream until its collective is done.
struct OverlapPrediction {
  double step_s = 0;     // the compute stream's end
  double compute_s = 0;  // the sum of the nodes' times
  double exposed_s() const { return step_s - compute_s; }  // time the compute stream waited
};
OverlapPrediction predict_step(const Graph& graph, const CostModel& costs);

class OverlapCollectives : public Pass {
 public:
  OverlapCollectives(CostModel costs, std::optional<size_t> memory_budget)
      : costs_(std::move(costs)), memory_budget_(memory_budget) {}
  std::string name() const override { return "overlap-collectives"; }
  bool run(Graph& graph) override;
  std::vector<std::string> notes() const override { return notes_; }

 private:
  CostModel costs_;
  std::optional<size_t> memory_budget_;
  std::vector<std::string> notes_;
};

}  // namespace kiln
