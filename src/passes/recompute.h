// Free recomputation ("recompute"): elementwise forward values that the backward pass reads are
// computed again in the backward from inputs it keeps anyway, instead of being kept alive from
// the forward to the backward.
//
// Why: a training step's memory peak is where the forward's saved activations all live (the
// start of the backward). Some of them are cheap elementwise functions of others that are saved
// too: SwiGLU's silu(x W1) is one of x W1 (saved for silu's gradient), and silu(x W1) * (x W3)
// one of both. Keeping only the inputs and recomputing the rest in the backward lowers the peak
// by the recomputed values' bytes and costs no extra kernel where the fusion pass (which runs
// next) puts the recomputation into the backward's GEMM epilogues that read those inputs anyway.
// It is the rule AOTAutograd's min-cut partitioner applies to pointwise ops, taken only where
// it never makes a value live longer: remat (passes/remat.h) handles budgets and trade-offs.
//
// The rule, in forward order: the forward is the loss's ancestors (graph.outputs[0]); a forward
// node is recomputed when it is elementwise with one output that a backward node reads, and each
// of its inputs is a graph input, a small value (a scalar or a table of at most kSmallBytes), a
// value recomputed already, or a value a backward node reads at or after the first backward
// reader of the output (so it is live there anyway). The clone reads the inputs' clones where
// they have one, and every backward reader reads the clone. A cast of a graph input (a param's
// 16-bit copy under mixed precision) is not recomputed: recomputing every weight's copy in the
// backward costs a full pass over the params, while keeping it costs their 16-bit bytes.
//
// Expects: a verified graph (after dead-code and CSE, which would merge the clones back; before
// fusion, which fuses them). Guarantees: the same inputs, outputs and updates; bit-identical
// results (a clone computes what its original did from the same values); a valid topological
// order with each clone just before its first reader, as far as that order allows.
#pragma once

#include <string>
#include <vector>

#include "passes/pass.h"

namespace kiln {

class RecomputePass : public Pass {
 public:
  // Values of at most this many bytes (scalars, small tables) may be kept alive longer by a
  // clone that reads them; activations never are (a small model's would pass a larger bound).
  static constexpr size_t kSmallBytes = 4096;

  std::string name() const override { return "recompute"; }
  bool run(Graph& graph) override;
  std::vector<std::string> notes() const override { return notes_; }

 private:
  std::vector<std::string> notes_;
};

}  // namespace kiln
