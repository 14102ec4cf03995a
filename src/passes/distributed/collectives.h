// What the distribution passes (bucketing.h, overlap.h) share: the step's collectives as start /
// wait pairs with where their data is ready and first read, and a reorder of the nodes by keys.
#pragma once

#include <optional>
#include <vector>

#include "analysis/cost_model.h"
#include "ir/graph.h"
#include "passes/uses.h"

namespace kiln::distributed {

// One collective of the node order: its start, its wait, and the span it may live in.
struct Collective {
  int start = -1;         // node index of all_gather / reduce_scatter / all_reduce
  int wait = -1;          // node index of its collective_wait
  int producer = -1;      // the node making its input (-1: a graph input)
  // The producer reads only graph inputs (a param shard's cast): it can move up with the start.
  bool producer_movable = false;
  // The data movement feeding it (casts and shape ops: a gradient's f32 cast, a bucket's
  // copy-in, a param shard's cast), which may run as soon as its own inputs are made: the
  // schedule pass, ordering for memory alone, leaves such nodes as late as it can. Node indices,
  // ascending; `ready`: the earliest index the chain (and the start) may go before.
  std::vector<int> chain;
  int ready = 0;
  // The nodes that make the chain's inputs (a gradient's GEMM): the memory-ordered schedule
  // leaves a gradient's producer as late as it can too (its output lives to the optimizer, so
  // making it early only adds live bytes), which would leave every reduction to the step's end.
  // `earliest`: the index the chain could start at were these hoisted to right after their own
  // inputs are made (their own inputs stay where they are).
  std::vector<int> producers;
  int earliest = 0;
  int first_reader = -1;  // the first node reading the wait's output (-1: none, or it escapes)
  double bytes = 0;       // collective_bytes
  double seconds = 0;     // CostModel::collective_seconds
};

// Whether a collective's producers move up with it (Collective::producers): all_reduce's (dp's
// and zero1's gradients). Not reduce_scatter's: zero2/3's schedule already makes those early
// (a reduce_scatter frees its full input for a shard), and earlier reductions there would queue
// ahead of the backward's gathers on the one communication stream (predicted slower on GPT-2).
inline bool hoists_producers(Op collective) { return collective == Op::kAllReduce; }

// Every collective start of `graph` in node order (each has exactly one wait: the verifier's rule).
std::vector<Collective> find_collectives(const Graph& graph, const Uses& uses, const CostModel& costs);

// Reorders graph.nodes by `keys` (one per node; equal keys keep their order). Throws kiln::Error
// if a node would come before a producer of its inputs (a bug of the caller).
void reorder_by_keys(Graph& graph, const std::vector<double>& keys);

// The start time of each node when the compute stream runs the nodes back to back (entry n) and
// the end of the last (entry nodes.size()).
std::vector<double> compute_start_times(const Graph& graph, const CostModel& costs);

}  // namespace kiln::distributed
