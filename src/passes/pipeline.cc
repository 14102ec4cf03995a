#include "passes/pipeline.h"

#include "passes/remat.h"
#include "passes/schedule.h"
#include "passes/simplify/algebraic.h"
#include "passes/simplify/constant_fold.h"
#include "passes/simplify/cse.h"
#include "passes/simplify/dead_code.h"
#include "passes/simplify/training_rewrites.h"

namespace kiln {

PassManager default_pipeline(PassOptions options) {
  const std::optional<size_t> memory_budget = options.memory_budget;
  const bool schedule_enabled = !options.disabled.count("schedule");
  PassManager pm(std::move(options));
  // Passes are added here in order, one line each with a comment saying why it runs there.
  // (simplify, mixed precision, schedule: see their headers in src/passes/.)
  // training-rewrites (decompose cross_entropy_grad / layer_norm_grad into elementwise work and
  // column sums) is NOT in the default list yet: it only pays off once a fusion pass keeps those
  // parts in registers; without fusion it adds logits-sized intermediates. It joins the list,
  // first, together with fusion. (Tests run it directly.)
  // Local exact rules (x*1, neg(neg), transpose/reshape/cast chains) to a fixed point.
  pm.add(std::make_unique<AlgebraicSimplifier>());
  // Evaluate small all-constant nodes (optimizer and loss-scale scalars) once, at compile time.
  pm.add(std::make_unique<ConstantFolding>());
  // Merge duplicates, including the splats and recomputations the passes above left equal.
  pm.add(std::make_unique<CommonSubexpressionElimination>());
  // Last: drop everything the passes above (and autodiff) left unused.
  pm.add(std::make_unique<DeadCodeElimination>());
  // With a memory budget: recompute activations to fit it (after CSE, which would merge the
  // clones back; right before schedule, whose order its peak is measured in).
  if (memory_budget) pm.add(std::make_unique<Rematerialize>(*memory_budget, schedule_enabled));
  // After the node set is final: reorder for fewer live bytes (the executor's memory plan
  // follows the node order).
  pm.add(std::make_unique<SchedulePass>());
  return pm;
}

}  // namespace kiln
