#include "passes/pipeline.h"

#include <cstdlib>

#include "passes/align_matmul.h"
#include "passes/classifier.h"
#include "passes/classifier_chunks.h"
#include "passes/distributed/bucketing.h"
#include "passes/distributed/overlap.h"
#include "passes/fusion/fusion.h"
#include "passes/mixed_precision.h"
#include "passes/multi_tensor.h"
#include "passes/offload.h"
#include "passes/ones_column.h"
#include "passes/recompute.h"
#include "passes/remat.h"
#include "passes/overlap_updates.h"
#include "passes/schedule.h"
#include "passes/simplify/algebraic.h"
#include "passes/simplify/constant_fold.h"
#include "passes/simplify/cse.h"
#include "passes/simplify/dead_code.h"
#include "passes/simplify/recognize.h"
#include "passes/simplify/training_rewrites.h"
#include "support/error.h"

namespace kiln {
namespace {

// The device bytes offload's kAuto fits the step into: --memory-budget, else 90% of the device.
std::optional<size_t> offload_budget(const PassOptions& options) {
  if (options.memory_budget) return options.memory_budget;
  if (options.device_memory) return static_cast<size_t>(0.9 * static_cast<double>(*options.device_memory));
  return std::nullopt;
}

// One of every pass, made as make_pass says. Cheap: passes do their work in run().
std::vector<std::unique_ptr<Pass>> every_pass(const PassOptions& options) {
  MixedPrecisionOptions mixed_precision;
  mixed_precision.low = options.low_precision;
  std::vector<std::unique_ptr<Pass>> passes;
  passes.push_back(std::make_unique<RecognizeOps>());
  passes.push_back(std::make_unique<AlignMatmul>());
  passes.push_back(std::make_unique<MixedPrecisionPass>(mixed_precision));
  passes.push_back(std::make_unique<ClassifierPass>());
  passes.push_back(std::make_unique<ClassifierChunksPass>(options.logits_chunk_bytes));
  passes.push_back(std::make_unique<TrainingRewrites>());
  passes.push_back(std::make_unique<AlgebraicSimplifier>());
  passes.push_back(std::make_unique<ConstantFolding>());
  passes.push_back(std::make_unique<CommonSubexpressionElimination>());
  passes.push_back(std::make_unique<DeadCodeElimination>());
  passes.push_back(std::make_unique<RecomputePass>());
  passes.push_back(std::make_unique<FusionPass>());
  passes.push_back(std::make_unique<OnesColumnPass>());
  passes.push_back(std::make_unique<OffloadPass>(options.offload, offload_budget(options)));
  passes.push_back(std::make_unique<MultiTensorPass>());
  passes.push_back(std::make_unique<Rematerialize>(options.memory_budget, !options.disabled.count("schedule")));
  passes.push_back(std::make_unique<SchedulePass>());
  const CostModel costs = options.costs.value_or(CostModel::defaults(options.target));
  passes.push_back(std::make_unique<OverlapUpdates>(costs, options.memory_budget));
  passes.push_back(std::make_unique<BucketCollectives>(costs));
  passes.push_back(std::make_unique<OverlapCollectives>(costs, options.memory_budget));
  return passes;
}

}  // namespace

std::unique_ptr<Pass> make_pass(std::string_view name, const PassOptions& options) {
  for (std::unique_ptr<Pass>& pass : every_pass(options))
    if (pass->name() == name) return std::move(pass);
  fail("unknown pass '{}' (passes: {})", name, fmt::join(pass_names(), ", "));
}

std::vector<std::string> pass_names() {
  std::vector<std::string> names;
  for (const std::unique_ptr<Pass>& pass : every_pass({})) names.push_back(pass->name());
  return names;
}

namespace {

// The names of the forward pipeline's passes: --disable-pass and --print-after name passes of
// both pipelines, and each manager checks the names it is given.
bool is_forward_pass(const std::string& name) { return name == "recognize" || name == "align-matmul"; }

// `names` without (forward = false) or with only (forward = true) the forward passes; "all"
// stays in both.
std::set<std::string> names_of(const std::set<std::string>& names, bool forward) {
  std::set<std::string> out;
  for (const std::string& n : names)
    if (n == "all" || is_forward_pass(n) == forward) out.insert(n);
  return out;
}

}  // namespace

PassManager forward_pipeline(PassOptions options) {
  const Device target = options.target;
  options.disabled = names_of(options.disabled, true);
  options.print_after = names_of(options.print_after, true);
  PassManager pm(std::move(options));
  // The decomposed norms, activations, rotary embeddings and attention an export writes, as
  // kiln's composite ops: before autodiff, so the backward uses their gradient rules.
  pm.add(std::make_unique<RecognizeOps>());
  // After recognize (whose patterns read the plain products); CUDA only (align_matmul.h).
  if (target == Device::kCuda) pm.add(std::make_unique<AlignMatmul>());
  return pm;
}

PassManager default_pipeline(PassOptions options) {
  options.disabled = names_of(options.disabled, false);
  options.print_after = names_of(options.print_after, false);
  // On CUDA the decomposed LayerNorm gradient of training-rewrites costs more than it saves:
  // GPT-2 B=32 bf16 on an H100 ran 99.9 ms/step with it and 92.9 ms without (bench/log/sessions-1-12.md;
  // cuda-nn's layer_norm_grad kernel already does the whole row in one pass, and the decomposed
  // form leaves multiplies that fusion cannot place). On the CPU it is a win.
  if (options.target == Device::kCuda) options.disabled.insert("training-rewrites");
  const std::optional<size_t> memory_budget = options.memory_budget;
  const bool schedule_enabled = !options.disabled.count("schedule");
  const Device target = options.target;
  const size_t logits_chunk_bytes = options.logits_chunk_bytes;
  const CostModel costs = options.costs.value_or(CostModel::defaults(target));
  const OffloadMode offload = options.offload;
  const std::optional<size_t> budget_for_offload = offload_budget(options);
  // CUDA, asked for with KILN_OVERLAP_UPDATES=1: the updates beside the backward pass, on the
  // executor's update stream. Off by default: on an H200 it gained nothing on GPT-2 and
  // llama-160m and cost llama-1b 2% (passes/overlap_updates.h).
  const char* overlap_env = std::getenv("KILN_OVERLAP_UPDATES");
  const bool overlap_updates = target == Device::kCuda && overlap_env && std::string(overlap_env) == "1" &&
                               !options.disabled.count("overlap-updates");
  PassManager pm(std::move(options));
  // Passes are added here in order, one line each with a comment saying why it runs there.
  // (simplify, mixed precision, schedule: see their headers in src/passes/.)
  // First: decompose cross_entropy_grad / layer_norm_grad (f32/f64) into elementwise work, a
  // row softmax and column sums, which fusion below keeps in registers; the simplify passes
  // then share the parts common with the forward pass.
  // Before training-rewrites, which would decompose it: the loss and its gradient as one fused
  // node that hand-written kernels run in one pass, writing the gradient over the logits.
  pm.add(std::make_unique<ClassifierPass>());
  // On the fused classifier it made: the head's logits, loss and gradients in row chunks, so the
  // largest value of a language model's step is one chunk of logits (before simplify: its
  // leftover flat views die in dead-code; before fusion, which groups each chunk's GEMMs).
  pm.add(std::make_unique<ClassifierChunksPass>(logits_chunk_bytes));
  pm.add(std::make_unique<TrainingRewrites>());
  // Local exact rules (x*1, neg(neg), transpose/reshape/cast chains) to a fixed point.
  pm.add(std::make_unique<AlgebraicSimplifier>());
  // Evaluate small all-constant nodes (optimizer and loss-scale scalars) once, at compile time.
  pm.add(std::make_unique<ConstantFolding>());
  // Merge duplicates, including the splats and recomputations the passes above left equal.
  pm.add(std::make_unique<CommonSubexpressionElimination>());
  // Last of the simplify passes: drop everything the passes above (and autodiff) left unused.
  pm.add(std::make_unique<DeadCodeElimination>());
  // Elementwise activations the backward can recompute from values it keeps anyway (after CSE,
  // which would merge the clones back; before fusion, which puts them in the backward's kernels).
  pm.add(std::make_unique<RecomputePass>());
  // On the final node set: outline groups of nodes that run as one kernel over row tiles into
  // fused nodes (before remat and schedule, which then see the fused graph's true footprint).
  pm.add(std::make_unique<FusionPass>());
  // CUDA only: bias gradients as one more row of the weight-gradient GEMMs (on the fused nodes,
  // which it pads and slices; the CPU's fused kernels would copy the slices).
  if (target == Device::kCuda) pm.add(std::make_unique<OnesColumnPass>());
  // Optimizer state to host memory where the step does not fit otherwise (before multi-tensor,
  // which then groups the updates in chunks so that little of it is on the device at once).
  pm.add(std::make_unique<OffloadPass>(offload, budget_for_offload));
  // After fusion (the updates are opaque to it): all optimizer updates as multi-tensor nodes
  // (for overlap-updates: in chunks by the readiness of their gradients).
  pm.add(std::make_unique<MultiTensorPass>(true, overlap_updates ? update_chunk_bytes(costs) : 0));
  // With a memory budget: recompute activations to fit it (after CSE, which would merge the
  // clones back; right before schedule, whose order its peak is measured in).
  if (memory_budget) pm.add(std::make_unique<Rematerialize>(*memory_budget, schedule_enabled));
  // After the node set is final: reorder for fewer live bytes (the executor's memory plan
  // follows the node order).
  pm.add(std::make_unique<SchedulePass>());
  // On the final order, before the collectives' placement (which plans memory with the
  // updates' lifetimes): each update group moved up to where its gradients are ready and run
  // on the update stream, beside the rest of the backward pass, as far as the memory allows.
  if (target == Device::kCuda) pm.add(std::make_unique<OverlapUpdates>(costs, memory_budget, overlap_updates));
  // Sharded steps (the only ones with collectives), on the final order: merge collectives whose
  // latency dominates, then move starts and waits so communication runs beside the compute, as
  // far as the memory plan allows (passes/distributed/).
  pm.add(std::make_unique<BucketCollectives>(costs));
  pm.add(std::make_unique<OverlapCollectives>(costs, memory_budget));
  return pm;
}

}  // namespace kiln
