// Dynamic loss scaling for f16 training, entirely in the graph: the host never reads a flag.
//
// f16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large
// scale before autodiff shifts every gradient into range; the gradients are unscaled (times
// 1/scale, in f32) before the optimizer sees them. When the scale is too large some gradient
// overflows to inf (or becomes NaN); that step's update is then skipped and the scale halved.
// After `growth_interval` overflow-free steps in a row the scale doubles again. (bf16 has f32's
// exponent range and needs none of this.)
//
// State (f32 scalars, graph state inputs, so checkpoints carry them):
//   amp.scale       the current scale, starts at LossScaleOptions::initial_scale
//   amp.good_steps  overflow-free steps since the last change of the scale
//
// The overflow flag is built from existing ops: s = sum(g * 0) over every gradient is 0 when all
// elements are finite and NaN when any is inf or NaN (inf * 0 = NaN, and NaN propagates through
// the sum); then overflow = (s != s). (A simplifier must never fold x * 0 to 0 for floats: that
// rewrite is wrong under IEEE arithmetic anyway.) Skipping is predication: each update of a param
// or optimizer state (opt.step included, so AdamW's bias correction does not advance) becomes
// where(overflow, old, new). The scale update:
//   overflow:  scale = scale / 2, good_steps = 0
//   otherwise: good_steps += 1; when it reaches growth_interval, scale = min(2 * scale, 2^127)
//              (capped so that it stays finite and can still be halved) and good_steps = 0.
#pragma once

#include <set>
#include <vector>

#include "ir/builder.h"

namespace kiln {

inline constexpr const char* kLossScaleName = "amp.scale";
inline constexpr const char* kGoodStepsName = "amp.good_steps";

struct LossScaleOptions {
  double initial_scale = 65536.0;  // 2^16, as PyTorch's GradScaler
  int64_t growth_interval = 2000;  // overflow-free steps before the scale doubles
};

// Throws kiln::Error naming the bad field.
void validate(const LossScaleOptions& options);

struct LossScaleState {
  Expr scale;       // amp.scale
  Expr good_steps;  // amp.good_steps
};

// Adds the amp.scale and amp.good_steps state inputs to the builder's graph.
LossScaleState add_loss_scale_state(Builder& b);
// loss * scale, in f32 (the loss is cast up if it is not f32).
Expr scale_loss(Expr loss, const LossScaleState& state);
// Each gradient times 1/scale, computed in f32, returned in the gradient's dtype.
std::vector<Expr> unscale_gradients(const std::vector<Expr>& gradients,
                                    const LossScaleState& state);
// A bool scalar: true when some element of some gradient is inf or NaN. `world_size` > 1: the
// gradients are this rank's shards, and the answer is every rank's (an all_reduce), so that all
// ranks skip the same steps.
Expr gradients_overflow(const std::vector<Expr>& gradients, int world_size = 1);
// Replaces the value of every update in the graph whose target is in `targets` by
// where(overflow, target, value): the step leaves those inputs unchanged on overflow.
void skip_updates_on_overflow(Builder& b, Expr overflow, const std::set<ValueId>& targets);
// Appends the updates of amp.scale and amp.good_steps described above.
void update_loss_scale(Builder& b, const LossScaleState& state, Expr overflow,
                       const LossScaleOptions& options);

}  // namespace kiln
