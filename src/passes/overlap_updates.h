// The overlap-updates pass ("overlap-updates", CUDA): the optimizer's updates beside the backward
// pass. Each parameter's update is memory-bound and final as soon as its gradient is; the
// backward's GEMMs that follow are compute-bound. So each group of updates runs on the
// executor's update stream (ops/update_stream.h), forked where its gradients are ready, and
// fills the compute stream's gaps (a GEMM's last partial wave, the launches between kernels)
// instead of running after the whole backward pass.
//
// The multi-tensor pass (passes/multi_tensor.h) groups the updates for it: in chunks of updates
// whose gradients are made one after another, each about update_chunk_bytes of operands. On the
// final order (after the schedule pass), this pass
//   1. moves each multi-tensor-update node up to right after the last of its inputs is made and
//      the last node reading the old value of a param or state it updates has run (so the
//      executor still writes each result straight into its target);
//   2. marks it for the update stream (attribute stream = "update") where compute follows it
//      (the cost model's predicted time after it is more than a launch) and nothing but the
//      step's updates read its results (offloaded state's `offload` nodes do: not those);
//   3. keeps the memory: a marked node's inputs that the step makes (its gradients) stay live to
//      the end of the step (the join), so the marks are taken from the latest chunk back only
//      while the planned arena stays within the memory budget if one is given, else within the
//      arena of the order as it came (the small producers hoisted). For GPT-2 and LLaMA every
//      chunk with compute after it is marked at no cost: the arena's peak is where the backward
//      pass starts, before most gradients exist.
// Global-norm clipping scales every gradient by a factor of all of them: every update waits for
// the whole backward pass, and nothing moves (what remains then is the norm's own partial sums).
//
// Off by default (KILN_OVERLAP_UPDATES=1 turns it on in the CUDA pipeline, with the multi-tensor
// pass's chunks): measured on an H200 in one call (bf16, AdamW), the updates beside the backward
// ran GPT-2 124M (32 x 1024) at 56.10 vs 55.85 ms, llama-160m (16 x 2048) at 57.00 vs 56.94 and
// llama-1b (4 x 2048) at 109.91 vs 107.78: the backward pass leaves the updates few idle SMs,
// and where they ran beside it they took its memory bandwidth (their kernels' time rose from
// 7.3 to 8.8 ms). Kept for the cases where it pays: a backward pass with idle gaps.
//
// Expects: a verified, scheduled graph. Guarantees: the same nodes and results (a move keeps a
// topological order and every read of an old value before its update); marks only
// multi-tensor-update nodes whose results nothing reads.
#pragma once

#include <optional>

#include "analysis/cost_model.h"
#include "passes/pass.h"

namespace kiln {

// The operand bytes of one chunk of updates: long enough that its launch and its fork onto the
// update stream cost little (25 launches' worth of the cost model's bandwidth: ~260 MB, about
// 16M f32 params with their gradient and AdamW's two moments, at the CUDA defaults).
size_t update_chunk_bytes(const CostModel& costs);

class OverlapUpdates : public Pass {
 public:
  // enabled = false: the pass changes nothing (the pipeline's default, see below).
  OverlapUpdates(CostModel costs, std::optional<size_t> memory_budget, bool enabled = true)
      : costs_(std::move(costs)), memory_budget_(memory_budget), enabled_(enabled) {}
  std::string name() const override { return "overlap-updates"; }
  bool run(Graph& graph) override;
  std::vector<std::string> notes() const override { return notes_; }

 private:
  CostModel costs_;
  std::optional<size_t> memory_budget_;
  bool enabled_;
  std::vector<std::string> notes_;
};

}  // namespace kiln
