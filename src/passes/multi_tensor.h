// The multi-tensor pass ("multi-tensor"): groups the optimizer's per-parameter updates, the
// per-gradient terms of the global gradient norm, and mixed precision's casts of the f32 master
// weights to 16 bits, into a few `fused` nodes that hand-written multi-tensor kernels run in one
// launch (GPT-2: 148 optimizer_update nodes, 148 sum-of-squares reductions, 147 scalar adds and,
// under --amp, ~74 casts otherwise: each a launch-bound kernel of a few microseconds).
//
// What it makes (bodies: their contracts in ops/fused/multi_tensor.h state them exactly):
//   kind "multi-tensor-update": optimizer_update nodes with equal attributes (one optimizer and
//     its hyperparameters: a parameter group of its own is a fused node of its own), the same scalar operands (lr, step) and the same operand dtypes. The body
//     holds the nodes unchanged; the fused node's outputs are their results, each still the
//     value of its own Graph::update, so the executor still writes each one straight into its
//     param or state (KernelImpl::in_place_ok of the kernels).
//   kind "global-norm": the terms sum(square(x)) or sum(square(cast(x, f32))) (f32, full sums)
//     and the tree of f32 scalar adds combining them, as the optimizer's --grad-clip builds it.
//     Output: the sum of squares (the tree's root). Only an exact pattern: every intermediate
//     read by the next node of the pattern alone (no graph output, no update, no other reader).
//     The sqrt and the clip factor stay outside.
//   kind "multi-tensor-cast": standalone cast nodes (not inside a fusion group) of a graph input
//     of role param, f32, to bf16 or f16: one node over all of them. The body holds the casts
//     unchanged; the fused node's outputs are their results. (Casts of other values, or to
//     other dtypes, are left alone: the kernels take f32 -> 16-bit only, and an activation's
//     cast belongs to its producer's fusion group.)
//
//   Before grouping: an update whose gradient is a standalone cast from bf16/f16 to f32/f64 read
//     by nothing else reads the 16-bit gradient itself (exact: the kernels widen on load; GPT-2
//     under amp: its 48 bias gradients, each a launch-bound cast otherwise).
//
// Runs after fusion (the updates are opaque to it). Fusion may already have put parts of the
// norm pattern into fusion groups (a 1-D gradient's square and sum as a "rows" group, the add
// tree with the sqrt and the clip factor as an "elementwise" one): such groups are inlined, the
// pattern's nodes taken out, and the rest outlined again as the fusion pass would (same
// fusion::outline, same kinds).
//
// Memory. One node per kind would keep every gradient alive until the last of them is
// computed, where the scheduler would otherwise run each update right after its gradient. So
// the grouping is checked against the schedule pass's own measure (peak_live_bytes of the
// order memory_aware_order() picks, with the update values counted both as live to the end and
// as written straight into their targets): the updates are grouped per kind only if neither
// peak rises; otherwise into chunks of consecutive updates of the scheduled order under a byte
// cap, halving the cap until neither rises; otherwise not at all. (For GPT-2 the schedule keeps
// the builder's order, every update last, and one node per kind costs nothing.) The casts get
// the same check, their chunks capped by the bytes of their results: one node makes every
// 16-bit weight live from the start of the step, where the schedule would make each just before
// its first reader; for GPT-2 they are all live at the forward pass's end (the peak) anyway,
// since the backward pass reads them again.
//
// Remat (after this pass, under a memory budget) can only recompute a grouped cast node as a
// whole; gpt2-tiny bf16 still fits every budget it did (2.8 MiB: 2.61 MiB planned, 2.75 without
// the grouping). MultiTensorPass(false) leaves the casts alone, for a caller that wants them
// one by one.
//
// Expects: a verified graph after fusion. Guarantees: the same inputs, outputs and updates;
// the same results (the bodies hold the same nodes: the fused reference kernel computes exactly
// what the nodes did); values compacted.
#pragma once

#include <cstddef>

#include "passes/pass.h"

namespace kiln {

class MultiTensorPass : public Pass {
 public:
  // overlap_chunk_bytes > 0: the updates are grouped for the update stream instead
  // (passes/overlap_updates.h): every update in chunks of updates whose gradients are ready one
  // after another (in the order memory_aware_order() runs their inputs' producers), each chunk
  // closed before its operand bytes exceed the cap, one update a chunk where one alone does. No
  // peak check: a chunk there keeps its gradients live to the end of the step anyway, which the
  // overlap pass weighs.
  explicit MultiTensorPass(bool group_casts = true, size_t overlap_chunk_bytes = 0)
      : group_casts_(group_casts), overlap_chunk_bytes_(overlap_chunk_bytes) {}
  std::string name() const override { return "multi-tensor"; }
  bool run(Graph& graph) override;

 private:
  bool group_casts_;
  size_t overlap_chunk_bytes_;
};

}  // namespace kiln
