// The training program: the forward graph, its backward pass (autodiff), optional global-norm
// gradient clipping and the optimizer update, as ONE graph whose Graph::updates write the new
// params and optimizer state over the old ones. compile_step (compile/compile_step.h) builds it
// before the pass pipeline; the trainer (train/trainer.h) runs it.
//
// Learning rate: a scalar data input ("lr"), computed each step on the host by
// learning_rate(). Why not in the graph: the host issues every step and already knows the step
// number, so the schedule costs nothing there, needs no device read, and needs no schedule ops
// (cos, min, ...) in the graph; changing the schedule never recompiles. The step counter that
// AdamW's bias correction needs IS graph state ("opt.step"), incremented in the graph, so a
// resumed run continues from its checkpointed value.
//
// The forward graph's own state inputs (zero-initialized) are carried along as state; one named
// "rng.offset" (i64 scalar, the dropout counter of models::gpt) is advanced by one every step.
//
// Mixed precision (amp = "bf16" or "f16"): the mixed-precision pass (passes/mixed_precision.h)
// rewrites the FORWARD graph before autodiff, so matmuls and attention run in 16 bits while
// params (master weights), gradients and optimizer state stay f32. "f16" adds dynamic loss
// scaling (compile/loss_scaling.h): the loss is scaled before autodiff, gradients are unscaled
// before clipping and the update, and a step whose gradients overflow updates nothing but the
// scale. "bf16" needs no scaling (f32's exponent range). "fp8" is "bf16" with the linear layers'
// products in fp8 (passes/fp8_linear.h, ops/fp8.h: per-tensor scales, no loss scaling).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "compile/loss_scaling.h"
#include "ir/graph.h"
#include "passes/mixed_precision.h"
#include "passes/sharding.h"

namespace kiln {

// A group of params with hyperparameters of their own, as PyTorch's param_groups: the group's
// lr and hyperparameters replace the config's for its params.
struct ParamGroup {
  std::vector<std::string> params;      // param (graph input) names
  std::optional<double> lr;             // peak learning rate; else the config's
  std::map<std::string, double> hyper;  // over the config's (booleans as 0 and 1)
};

struct OptimizerConfig {
  // An optimizer of the registry (ops/optimizer/optimizers.h): sgd, adamw, lion, adafactor.
  std::string name = "adamw";
  double lr = 1e-3;  // peak learning rate
  // Hyperparameters by name (booleans as 0 and 1); the optimizer's defaults for the others.
  std::map<std::string, double> hyper;
  // Params in no group take the values above.
  std::vector<ParamGroup> groups;
  // false: weight_decay 0 for biases and norm weights (params of rank < 2) and embedding tables
  // (params that a gather reads), the usual exemption (nanoGPT, Hugging Face's Trainer).
  bool decay_biases_norms_embeddings = true;
  double grad_clip = 0.0;      // max global gradient norm; 0 = no clipping
  int64_t warmup_steps = 0;    // linear warmup from lr/warmup to lr
  int64_t decay_steps = 0;     // cosine decay to min_lr_ratio * lr by this step; 0 = constant
  double min_lr_ratio = 0.1;
  std::string amp = "off";     // "off", "bf16", "f16" or "fp8" (see above)
  PrecisionPolicy amp_policy = default_precision_policy();  // per-op precision under amp
  // fp8: every linear layer the FP8 rules allow, not only those the cost model finds faster
  // (passes/fp8_linear.h): for tests on small models and for measurements.
  bool fp8_every_linear = false;
  // fp8: the incoming gradient's format in the backward products, "e4m3" (torchao's tensorwise
  // recipe) or "e5m2" (more range, less precision).
  std::string fp8_grad = "e4m3";
  LossScaleOptions loss_scale;  // f16 only
  // The step's outputs: false (default) only the loss; true every output of the forward graph
  // (loss first). An extra output such as GPT-2's logits is kept in its own buffer each step and
  // pins its producers: at B=32 that is 6.6 GB of f32 logits, and it stops the fused classifier
  // (passes/classifier.h) from writing the logits' gradient over the logits.
  bool keep_forward_outputs = false;
};

// Throws kiln::Error naming the bad field.
void validate(const OptimizerConfig& config);
// config.hyper[name], else the optimizer's default.
double hyperparameter(const OptimizerConfig& config, const std::string& name);
// The learning rate of 0-based step `step`: linear warmup, then cosine decay, then constant.
double learning_rate(const OptimizerConfig& config, int64_t step);

// A step's graph and the roles of its inputs: what build_training_graph builds, and what a
// forward step (compile_step with StepKind::kForward) is, with no lr and no added state.
struct StepProgram {
  Graph graph;  // outputs: the loss, or (keep_forward_outputs) all the forward's (loss first)
  std::vector<int> param_inputs;  // indices into graph.inputs, in forward order
  // The forward's state, then (f16) amp.scale and amp.good_steps, then per param its optimizer
  // state slots ("opt.<slot>.<param>": opt.m.wte, ...), then opt.step.
  std::vector<int> state_inputs;
  std::vector<int> data_inputs;   // the forward's data inputs, in order
  int lr_input = -1;              // the scalar learning-rate input; -1 in a forward step
  // State inputs (by name) that start at a value other than zero: amp.scale.
  std::map<std::string, double> state_initial_values;
};

// `forward` must have a scalar float loss as outputs[0] and at least one param. `sharding`:
// the step of one rank of a data-parallel group (passes/sharding.h): gradients averaged over
// ranks, the optimizer on shards for zero1/2/3, params sharded for zero3, the loss output the
// global mean. The optimizer state of a sharded mode is this rank's flat shard ([k]) per param.
StepProgram build_training_graph(const Graph& forward, const OptimizerConfig& config,
                                 const ShardingOptions& sharding = {});

// The mixed-precision pass as `config.amp` and `config.amp_policy` say (nothing when amp is
// "off"), on a forward graph: what build_training_graph does first, and a forward step too.
void apply_mixed_precision(Graph& forward, const OptimizerConfig& config);

// A forward step of one rank of a group (evaluation): zero3 gathers its sharded params before
// use, and outputs[0] (the loss) becomes the mean over ranks. Nothing for ShardMode::kNone.
void shard_forward_step(Graph& forward, const ShardingOptions& sharding);

}  // namespace kiln
