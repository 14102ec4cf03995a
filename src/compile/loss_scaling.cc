#include "compile/loss_scaling.h"

#include "ops/collective.h"

#include <cmath>

#include "support/error.h"

namespace kiln {
namespace {

Expr as_f32(Expr x) { return x.dtype() == DType::kF32 ? x : cast(x, DType::kF32); }

// The largest power of two an f32 holds: the scale's ceiling, so doubling never gives inf.
constexpr double kMaxScale = 1.7014118346046923e38;  // 2^127

}  // namespace

void validate(const LossScaleOptions& o) {
  KILN_CHECK(o.initial_scale > 0 && o.initial_scale <= kMaxScale,
             "initial loss scale must be in (0, 2^127], got {}", o.initial_scale);
  KILN_CHECK(o.growth_interval >= 1 && o.growth_interval <= (int64_t{1} << 24),
             "loss scale growth interval must be in [1, 2^24] (counted in f32), got {}",
             o.growth_interval);
}

LossScaleState add_loss_scale_state(Builder& b) {
  return LossScaleState{b.state(kLossScaleName, {}, DType::kF32),
                        b.state(kGoodStepsName, {}, DType::kF32)};
}

Expr scale_loss(Expr loss, const LossScaleState& state) { return as_f32(loss) * state.scale; }

std::vector<Expr> unscale_gradients(const std::vector<Expr>& gradients,
                                    const LossScaleState& state) {
  Expr inverse = reciprocal(state.scale);
  std::vector<Expr> out;
  for (const Expr& g : gradients) {
    Expr unscaled = as_f32(g) * inverse;
    out.push_back(g.dtype() == DType::kF32 ? unscaled : cast(unscaled, g.dtype()));
  }
  return out;
}

Expr gradients_overflow(const std::vector<Expr>& gradients, int world_size) {
  KILN_CHECK(!gradients.empty(), "gradients_overflow: no gradients given");
  Expr total;
  for (const Expr& g : gradients) {
    // 0 when every element is finite, NaN when one is inf or NaN (inf * 0 = NaN).
    Expr poisoned = as_f32(sum(g * 0.0));
    total = total.id() < 0 ? poisoned : total + poisoned;
  }
  if (world_size > 1) total = all_reduce(total, world_size, ReduceOp::kSum);  // NaN anywhere: NaN
  return ne(total, total).named("amp.overflow");  // only NaN differs from itself
}

void skip_updates_on_overflow(Builder& b, Expr overflow, const std::set<ValueId>& targets) {
  // Index loop: where() appends nodes, never updates, but keep no reference across builder calls.
  for (size_t i = 0; i < b.graph().updates.size(); ++i) {
    Update u = b.graph().updates[i];
    if (!targets.count(u.target)) continue;
    Expr kept = where(overflow, b.wrap(u.target), b.wrap(u.value));
    b.graph().updates[i].value = kept.id();
  }
}

void update_loss_scale(Builder& b, const LossScaleState& state, Expr overflow,
                       const LossScaleOptions& options) {
  validate(options);
  Expr zero = b.scalar(0.0);
  Expr counted = state.good_steps + 1.0;
  Expr grow = ge(counted, b.scalar(static_cast<double>(options.growth_interval)));
  Expr grown = minimum(state.scale * 2.0, b.scalar(kMaxScale));
  Expr new_scale = where(overflow, state.scale * 0.5, where(grow, grown, state.scale));
  Expr new_good_steps = where(overflow, zero, where(grow, zero, counted));
  b.graph().updates.push_back(Update{state.scale.id(), new_scale.id()});
  b.graph().updates.push_back(Update{state.good_steps.id(), new_good_steps.id()});
}

}  // namespace kiln
