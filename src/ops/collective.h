// The collective ops: communication over the process group as graph ops, so the compiler sees,
// schedules and plans it (DeepCompile's premise). The sharding pass (passes/sharding.h) and the
// collectives' own gradient rules insert them.
//
//   all_reduce(x) {world_size, reduce}      every rank's x reduced (sum, avg or max), any shape
//   all_gather(s) {world_size}              1-D [k] -> [world_size * k]: rank r's s at [r*k, (r+1)*k)
//   reduce_scatter(x) {world_size, reduce}  1-D [world_size * k] -> [k]: this rank's slice of
//                                           the reduction of every rank's x
//   collective_wait(c)                      c, once the collective that made it is done: the
//                                           join. A collective's output is read only through one.
//   local_shard(x) {world_size}             1-D [world_size * k] -> [k]: this rank's slice of x
//                                           (no communication)
//
// Start and wait are separate nodes so the schedule can move work between them (a gradient's
// reduction overlaps the rest of the backward). The executor runs a collective on its
// communication stream after an event from the compute stream, and the compute stream waits for
// its end at the collective_wait; the memory plan keeps the collective's input alive to the wait
// and its output from the start (it is written asynchronously), and makes the wait a view of
// the collective's output (no copy). Gradients: all_gather's is a reduce_scatter(sum) of the
// output's gradient, reduce_scatter's an all_gather, all_reduce's an all_reduce; the wait passes
// its gradient through. `world_size` is an attribute because shapes depend on it; the rank is
// not, so every rank runs the same graph.
#pragma once

#include "device/communicator.h"
#include "ir/builder.h"

namespace kiln {

// Each emits the collective and its wait, and returns the wait's output.
Expr all_reduce(const Expr& x, int world_size, ReduceOp reduce = ReduceOp::kSum);
Expr all_gather(const Expr& shard, int world_size);
Expr reduce_scatter(const Expr& x, int world_size, ReduceOp reduce = ReduceOp::kSum);
Expr local_shard(const Expr& x, int world_size);

}  // namespace kiln
