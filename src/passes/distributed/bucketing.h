// The bucketing pass ("bucket-collectives"): merges collectives of the same kind that run near
// each other into one collective over a concatenated buffer, so that a step of many small
// params pays one collective's latency per bucket instead of one per param (the sharding pass
// emits one collective per param and gradient).
//
// Which: walking the node order, a collective joins the open bucket of its kind (op, world
// size, reduction, dtype) when (DeepCompile's rule) the merged collective is predicted to take
// less than 1.2x the longer of the bucket and the newcomer alone, and stays under 1 GiB; when
// every member's input is ready before any member's output is first read (a param shard's cast
// moves up with the bucket); and, for reductions (whose start waits for the last member's
// input), when the compute between the first member's input and the newcomer's takes no longer
// than the latency the bucket saves. Times come from the cost model (analysis/cost_model.h).
//
// How, per bucket (copy in, one collective, copy out, as PyTorch's FSDP2 does):
//   all_reduce      x_i (any shape)  -> concat of the flat x_i -> all_reduce -> slices (views)
//   reduce_scatter  x_i [N*k_i]      -> concat of x_i as [N, k_i] on axis 1, flat -> reduce_scatter
//                                       -> [K]: slices [k_i] (views: rank r's part of every x_i)
//   all_gather      s_i [k_i]        -> concat -> all_gather [N*K] as [N, K] -> column slices
//                                       [N, k_i], flat: each s_i's gather (one copy each)
// The start goes where its last input is ready, the wait where the earliest member's was (but
// after the start), each member's copy-out before its own first read; the overlap pass (overlap.h) then moves
// starts and waits to hide the communication.
#pragma once

#include "analysis/cost_model.h"
#include "passes/pass.h"

namespace kiln {

class BucketCollectives : public Pass {
 public:
  explicit BucketCollectives(CostModel costs) : costs_(std::move(costs)) {}
  std::string name() const override { return "bucket-collectives"; }
  bool run(Graph& graph) override;
  std::vector<std::string> notes() const override { return notes_; }

 private:
  CostModel costs_;
  std::vector<std::string> notes_;
};

}  // namespace kiln
