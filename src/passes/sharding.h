// The sharding pass: data parallelism and ZeRO-1/2/3 as collectives in the training graph
// (ops/collective.h), so the compiler sees the communication, schedules it around the compute
// and plans its buffers (DeepCompile's premise). build_training_graph (compile/training_graph.h)
// applies it at three points of the step it builds; a forward step (evaluation) gets the first
// and the last.
//
// Every rank runs the same graph on its own slice of the global batch (the rank is not in the
// graph: a collective knows its place in the group), and the loss each rank computes is the mean
// over its slice, so the global mean is the average over ranks, and so is its gradient:
//
//   mode   params (f32 masters)     gradient reduction                      optimizer state
//   dp     full, every rank          all_reduce(avg)                        full
//   zero1  full, every rank          all_reduce(avg), this rank's shard     this rank's shard
//   zero2  full, every rank          reduce_scatter(avg): the shard only    this rank's shard
//   zero3  this rank's shard only    reduce_scatter(avg)                    this rank's shard
//
// A shard is a flat, zero-padded slice: a param of n elements is padded to world_size * k
// (k = ceil(n / world_size)) and rank r owns [r*k, (r+1)*k). ZeRO-1/2 update their shard with the
// same elementwise optimizer and all-gather the new params (the padding's zeros stay zeros:
// their gradient is zero and so is their decay); zero3 all-gathers each param before its
// forward use, from the 16-bit cast of the shard where mixed precision casts the param (half the
// bytes), and again before its backward use, so no gathered param stays resident between the
// two (the memory plan frees each after its last reader). Gradients are reduced in f32.
//
// Global-norm clipping sums the squares over shards with an all_reduce; the loss output is the
// all_reduce(avg) of the ranks' losses, so every rank reports the global mean.
#pragma once

#include <optional>
#include <string_view>
#include <vector>

#include "ir/builder.h"
#include "ir/graph.h"

namespace kiln {

enum class ShardMode { kNone, kDp, kZero1, kZero2, kZero3 };

struct ShardingOptions {
  ShardMode mode = ShardMode::kNone;
  int world_size = 1;
  bool enabled() const { return mode != ShardMode::kNone; }
  // The optimizer state and its update are per-shard (zero1/2/3).
  bool shards_optimizer() const { return mode == ShardMode::kZero1 || mode == ShardMode::kZero2 || mode == ShardMode::kZero3; }
};

// "none", "dp", "zero1", "zero2", "zero3".
std::string_view shard_mode_name(ShardMode mode);
// Throws kiln::Error naming the accepted modes.
ShardMode parse_shard_mode(std::string_view name);
// Throws kiln::Error: world_size < 1, or a mode other than none with... nothing else: any mode
// is valid for any world size >= 1 (world size 1 runs the collectives on a group of one).
void validate(const ShardingOptions& options);

// Where a param of `type` lives when sharded over `world_size` ranks.
struct ParamShard {
  TensorType full;           // the param's own type
  int64_t shard_numel = 0;   // k: the flat shard's length
  int64_t padded_numel() const { return shard_numel * world_size; }
  int world_size = 1;
};
ParamShard param_shard(const TensorType& full, int world_size);

// zero3, on a forward graph (after mixed precision, before autodiff): each param input becomes
// its flat f32 shard ([k]) and every reader of it reads an all-gathered full value instead: one
// gathered from the 16-bit cast of the shard for the readers that were casts to that dtype, one
// from the shard itself for the rest. The chains are placed right before their first reader.
// Returns, per param input (in input order), the gathered full-shape values the forward reads
// (autodiff differentiates with respect to them; their gradients, summed in f32, are the full
// param's gradient).
std::vector<std::vector<ValueId>> gather_sharded_params(Graph& forward, int world_size);

// zero3, on the joint graph autodiff built: every node from `forward_nodes` on (the backward)
// that reads a gathered param value reads a gather of its own instead, placed before the first
// such reader: no gathered param stays alive from the forward to the backward.
void regather_for_backward(Graph& graph, size_t forward_nodes);

// The gradient a rank's optimizer sees for a param, from this rank's full-shape f32 gradient of
// its local loss: averaged over ranks, and for the sharded modes this rank's flat shard of it.
Expr reduce_gradient(const Expr& full_grad, const ShardingOptions& options);
// This rank's flat shard of a full (replicated) param: zero1/2's optimizer input.
Expr shard_of(const Expr& full, int world_size);
// The full param from every rank's updated shard: all_gather, unpadded, reshaped.
Expr unshard(const Expr& shard, const ParamShard& where);
// The sum over ranks of a per-rank partial sum (a scalar): the global gradient norm's square.
Expr sum_over_ranks(const Expr& partial, int world_size);

// Nodes appended to a graph (by a builder) at [first, end), to go right before the graph's
// original node `position` (position == the original count: at the end).
struct AppendedRange {
  size_t first, end, position;
};
// Places every range (nodes [original, end) must all be in one) before its node, in one
// reordering; ranges for one position keep their order. Each range must read only graph
// inputs, values of nodes before its position and its own earlier nodes (or earlier ranges').
void place_appended(Graph& graph, size_t original, const std::vector<AppendedRange>& ranges);

}  // namespace kiln
