// Offloading optimizer state to host memory ("offload"): AdamW's moments (and SGD's momentum
// buffers) live in pinned host memory between steps, and come to the device only around their
// update, so the device holds params, gradients and activations, and one chunk of optimizer
// state at a time.
//
// Why: AdamW's two moments are 8 of the 16 bytes a param costs in f32 training (param, gradient,
// m, v); a model whose step does not fit a GPU often fits once they leave it. The step then
// pays for moving them: 2 x 8 bytes per param over the host link each step (PCIe 5: ~25 GB/s
// each way), which is why kAuto moves state only while the step does not fit, largest first.
//
// What it does, per chosen state input s (an f32 tensor, read only by optimizer updates, and the
// target of one): `d = reload(s)` just before s's first reader, which reads d instead; the
// update's new value u becomes `offload(u)` right after u is computed. The executor keeps an
// input read only through reload nodes in host memory (Executor::input_on_host; the trainer
// allocates it pinned), and writes each offload straight into its input. Both copies run on the
// step's stream (captured into its CUDA graph); the memory plan gives d and u arena bytes only
// from the reload to the offload, which the multi-tensor pass (after this one) keeps short by
// grouping the updates into chunks when one group would raise the peak.
//
// Choice (kAuto): the step's device bytes are its inputs' (params, state, data) plus the planned
// arena (updates written into their inputs, as the executor does; no other in-place reuse: an
// upper bound); while that is over the budget (memory_budget,
// else 90% of device_memory), the largest remaining state input moves. kAll moves every one.
//
// Expects: a training graph after autodiff and the optimizer (before multi-tensor). Guarantees:
// the same inputs, outputs and results (copies are exact); the updates of moved inputs are
// offload nodes.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "passes/pass.h"

namespace kiln {

class OffloadPass : public Pass {
 public:
  // `budget`: the device bytes the step may use (kAuto); without one kAuto does nothing.
  OffloadPass(OffloadMode mode, std::optional<size_t> budget) : mode_(mode), budget_(budget) {}
  std::string name() const override { return "offload"; }
  bool run(Graph& graph) override;
  std::vector<std::string> notes() const override { return notes_; }

 private:
  OffloadMode mode_;
  std::optional<size_t> budget_;
  std::vector<std::string> notes_;
};

}  // namespace kiln
