// The fusion pass ("fusion"): groups nodes that can run as one kernel over tiles of whole rows,
// and outlines each group of two or more nodes into one `fused` node holding the group as its
// body (ops/fused.cc), so the values that never leave a group need no memory.
//
// How: one fusion::Item per node (classify_node), one ValueUse per node output (build_problem),
// a partitioner from passes/fusion/partition.h (optimal by default, greedy on request), readers
// merged into their producers' groups for the reads saved (absorb_readers), the groups that
// would raise the planned arena taken apart (unstretch_groups), then outline() with
// the partition's group ids.
//
// Iteration space. The fused CPU kernel tiles by rows: rows = product of all dimensions but the
// last, row length = the last dimension, of the item's full-size operand. Items of one group
// share (rows, row length); Item::space is a key for that pair (equal pairs, equal keys).
//
// Which op is which ItemKind: the op's role in a fusion group (ops/fused/group.h, group_role,
// which the fused kinds' body contracts use too), then the dtype rule below (failing it: kOpaque)
// and, for elementwise ops, the broadcast rule:
//   kElementwise   every kElementwise op of the op table except dropout (its counter-based
//                  mask is indexed by the element's global position: left to its own kernel);
//                  cast between float dtypes; where (its bool condition may come from outside).
//                  Space: the output's. Each input must be the full output shape, a single
//                  element, a row vector [1..., N] (a bias) or a per-row column [R..., 1]:
//                  whatever else broadcasts (e.g. (B,1,C) into (B,T,C)) is kOpaque, so a row
//                  tile always reads contiguous rows or one broadcast row of every input.
//   kRowOp         softmax, log_softmax, softmax_grad, log_softmax_grad on the last axis;
//                  layer_norm, rms_norm; layer_norm_grad, rms_norm_grad (dx per row, their
//                  dgamma / dbeta column values: OpDef::column_outputs_from, summed across
//                  tiles like a bias gradient); sum, mean, max over exactly the last axis (keepdims or
//                  not); cross_entropy and cross_entropy_grad with reduction "none" (their i64
//                  labels are allowed: the one non-float operand of a row op). Space: the
//                  (first) input's.
//   kColumnReduction  sum and mean over every axis but the last (rank >= 2): bias gradients,
//                  dgamma/dbeta after training-rewrites. Space: the input's.
//   kGemm          matmul of two 2-D operands (transposes allowed); space: the output (M, N).
//                  Batched matmul is kOpaque.
//   kOpaque        everything else: attention, gather, scatter_add, one_hot, sources, shape ops
//                  (reshape, transpose, slice, concat, split, broadcast_to), conv and pooling,
//                  argmax, full reductions (a loss mean: complete only after every tile and
//                  read as a scalar), cross-entropy with a "mean" or
//                  "sum" reduction, dropout, and the optimizer updates. optimizer_update nodes
//                  are elementwise over the param, but stay opaque: they have fast fused kernels
//                  of their own, their outputs are update values (written to memory whatever
//                  happens) and their grads mostly come from transposed weight-gradient GEMMs
//                  whose epilogue would have to carry the whole optimizer; the saving (one
//                  param-sized read) is small next to activation traffic.
// Per-row work: an elementwise item whose output is one value per row, [R..., 1] (every input
// the same shape or a single element), e.g. var + eps and rsqrt of a decomposed layer_norm_grad,
// is classified (R, 1) but build_problem gives it the space of the first fusable producer with
// the same R (else of the first such consumer), so it joins the row group it belongs to: the
// kernels compute it per row inside that group (the CPU tiles hold it as a rows value of length
// 1; the CUDA rows kernel as a per-row scalar). Without that, the centered and normalized rows
// of every decomposed norm backward were written out and read back.
// Dtypes: only f32, bf16 and f16 compute in a fused kernel. Every output of a fusable node must
// be one of those, and so must every input, except where's bool condition and the labels of
// the cross-entropy row ops. (f64 runs unfused: it is for checks, not speed.)
//
// Fused node kind (ops/fused/kind.h): gemm-epilogue when the group holds a matmul, else rows
// when it holds a row op, else elementwise. A body may also hold column reductions; they are
// never read inside it (partition legality). The verifier holds every fused node to its kind's
// contract (ops/fused/group.h), which states these guarantees.
//
// Expects: a verified graph after autodiff and simplification. Guarantees: the same inputs,
// outputs and updates; results equal up to nothing (the reference kernel of a fused node runs
// the same reference kernels in the same order); values compacted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "passes/fusion/partition.h"
#include "passes/pass.h"

namespace kiln {
namespace fusion {

// The item a node is to the partitioner. Item::space is left -1; build_problem assigns keys.
struct NodeClass {
  ItemKind kind = ItemKind::kOpaque;
  int64_t rows = 0;        // product of all dimensions but the last
  int64_t row_length = 0;  // the last dimension
};
NodeClass classify_node(const Graph& graph, const Node& node);

// One item per node (in order) and one value per node output: bytes = its size, consumers = the
// nodes reading it, external = a graph output or an update value.
Problem build_problem(const Graph& graph);

// Outlines every group of two or more nodes (group_of: one group id per node, any integers)
// into one fused node, placed in a topological order of the contracted graph that keeps the
// original order as far as possible. Body inputs: the values the group reads from outside, in
// order of first use; body outputs: the values it produces that a node outside the group reads,
// that are graph outputs or update values, or that nothing reads. Needs only acyclicity of the
// contraction (throws kiln::Error naming the groups otherwise); the partitioner's other rules
// are for the kernels. Returns the number of fused nodes made.
int outline(Graph& graph, const std::vector<int>& group_of);

// Takes apart the groups whose outlining raises the step's planned arena. A fused node runs
// once all of its inputs exist, so a group whose members read values early and whose other
// members need a value made much later (a weight-gradient GEMM with an epilogue adding a
// gradient made at the end of the backward pass) keeps the early values alive in between: the
// partition objective (bytes kept out of memory) does not see that. The groups with such
// stretched inputs (bytes times positions, in the graph's order), at most `max_candidates` of
// them, the most stretched first, are measured with the real scheduler and memory plan
// (SchedulePass, plan_memory without in-place reuse): if taking all of them apart lowers the
// arena by 1% or more, each is put back, least stretched first, unless that raises the arena
// again. (Smaller gains are placement luck, not worth the kernels' speed.) Returns
// the number of groups taken apart (their items get group ids of their own in `group_of`).
// Costs two schedules and plans, plus one per candidate when some group is taken apart.
int unstretch_groups(const Graph& graph, std::vector<int>& group_of, int max_candidates);

// Per fused node of a graph: what `kiln compile --report` lists.
struct FusedNodeReport {
  size_t node = 0;  // index in graph.nodes
  std::string kind;
  std::vector<std::string> ops;  // the body's ops in order
  int64_t bytes_kept = 0;        // body values produced and read only inside: never in memory
};
std::vector<FusedNodeReport> report(const Graph& graph);

}  // namespace fusion

struct FusionOptions {
  bool optimal = true;  // false: the greedy partitioner
  fusion::OptimalOptions optimal_options = {};
  // Then merge consumers into their producers' groups for the reads it saves
  // (fusion::absorb_readers), before the arena check below.
  bool absorb_readers = true;
  // Groups checked against the planned arena after partitioning (fusion::unstretch_groups);
  // 0: none.
  int max_unstretch_candidates = 16;
};

class FusionPass : public Pass {
 public:
  explicit FusionPass(FusionOptions options = {}) : options_(options) {}
  std::string name() const override { return "fusion"; }
  bool run(Graph& graph) override;
  // The partition of the last run (group ids per node of the graph as it was given).
  const fusion::Partition& last_partition() const { return last_; }

 private:
  FusionOptions options_;
  fusion::Partition last_;
};

}  // namespace kiln
