#include "compile/training_graph.h"

#include <cmath>
#include <set>

#include "ir/builder.h"
#include "ir/verifier.h"
#include "ops/collective.h"
#include "ops/optimizer/optimizers.h"
#include "passes/autodiff.h"
#include "ops/fp8.h"
#include "passes/fp8_linear.h"
#include "support/error.h"

namespace kiln {
namespace {

// What one param's update uses: its group's learning rate (a multiple of the schedule's, so
// one lr input serves every group) and hyperparameters.
struct Setting {
  double lr_scale = 1.0;
  Attributes hyper;
};

// Per param input of `forward` (in input order): its setting from the config, its group and the
// decay exemption.
std::vector<Setting> param_settings(const Graph& forward, const OptimizerConfig& config) {
  const optim::OptimizerDef& def = optim::optimizer_def(config.name);
  std::set<ValueId> embeddings;  // tables that a gather reads
  for (const Node& node : forward.nodes)
    if (node.op == Op::kGather && !node.inputs.empty()) embeddings.insert(node.inputs[0]);
  std::map<std::string, const ParamGroup*> group_of;
  for (const ParamGroup& group : config.groups)
    for (const std::string& name : group.params) group_of[name] = &group;
  std::vector<Setting> settings;
  std::vector<std::string> names;
  for (const GraphInput& in : forward.inputs) {
    if (in.role != Role::kParam) continue;
    const Value& v = forward.value(in.value);
    names.push_back(v.name);
    std::map<std::string, double> hyper = config.hyper;
    double lr = config.lr;
    auto group = group_of.find(v.name);
    if (group != group_of.end()) {
      for (const auto& [name, value] : group->second->hyper) hyper[name] = value;
      lr = group->second->lr.value_or(config.lr);
      group_of.erase(group);
    }
    if (!config.decay_biases_norms_embeddings && def.find_hyper("weight_decay") &&
        (v.type.rank() < 2 || embeddings.count(in.value)))
      hyper["weight_decay"] = 0.0;
    settings.push_back(Setting{lr / config.lr, optim::hyper_attributes(def, hyper)});
  }
  KILN_CHECK(group_of.empty(), "a param group names '{}', which is no param of graph '{}' (its params: {})",
             group_of.begin()->first, forward.name, fmt::join(names, ", "));
  return settings;
}

}  // namespace

void validate(const OptimizerConfig& c) {
  const optim::OptimizerDef& def = optim::optimizer_def(c.name);
  KILN_CHECK(c.lr > 0 && std::isfinite(c.lr), "learning rate must be > 0, got {}", c.lr);
  optim::hyper_attributes(def, c.hyper);
  std::set<std::string> grouped;
  for (size_t i = 0; i < c.groups.size(); ++i) {
    const ParamGroup& group = c.groups[i];
    KILN_CHECK(!group.lr || (*group.lr > 0 && std::isfinite(*group.lr)), "param group {}: learning rate must be > 0, got {}",
               i, group.lr.value_or(0));
    std::map<std::string, double> merged = c.hyper;
    for (const auto& [name, value] : group.hyper) merged[name] = value;
    try {
      optim::hyper_attributes(def, merged);
    } catch (const Error& e) {
      fail("param group {}: {}", i, e.what());
    }
    for (const std::string& name : group.params)
      KILN_CHECK(grouped.insert(name).second, "param '{}' is in two param groups", name);
  }
  KILN_CHECK(c.grad_clip >= 0, "gradient clip must be >= 0 (0 = off), got {}", c.grad_clip);
  KILN_CHECK(c.warmup_steps >= 0 && c.decay_steps >= 0, "warmup and decay steps must be >= 0");
  KILN_CHECK(c.min_lr_ratio >= 0 && c.min_lr_ratio <= 1, "min lr ratio must be in [0, 1], got {}", c.min_lr_ratio);
  KILN_CHECK(c.amp == "off" || c.amp == "bf16" || c.amp == "f16" || c.amp == "fp8",
             "unknown amp mode '{}' (expected off, bf16, f16 or fp8)", c.amp);
  KILN_CHECK(fp8_format(c.fp8_grad) != Fp8Format::kNone, "the fp8 gradient format is empty (expected e4m3 or e5m2)");
  if (c.amp == "f16") validate(c.loss_scale);
}

double hyperparameter(const OptimizerConfig& c, const std::string& name) {
  auto it = c.hyper.find(name);
  if (it != c.hyper.end()) return it->second;
  const optim::HyperSpec* spec = optim::optimizer_def(c.name).find_hyper(name);
  KILN_CHECK(spec, "optimizer {} has no hyperparameter '{}'", c.name, name);
  return spec->default_value;
}

double learning_rate(const OptimizerConfig& c, int64_t step) {
  if (step < c.warmup_steps) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  if (c.decay_steps <= c.warmup_steps) return c.lr;
  if (step >= c.decay_steps) return c.lr * c.min_lr_ratio;
  double progress = static_cast<double>(step - c.warmup_steps) / static_cast<double>(c.decay_steps - c.warmup_steps);
  double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * cosine);
}

void apply_mixed_precision(Graph& forward, const OptimizerConfig& config) {
  validate(config);
  if (config.amp == "off") return;
  MixedPrecisionOptions options;
  options.low = config.amp == "f16" ? DType::kF16 : DType::kBF16;
  options.policy = config.amp_policy;
  MixedPrecisionPass(options).run(forward);
  if (config.amp == "fp8") {  // bf16, and the linear layers in fp8 where that is faster
    Fp8LinearOptions fp8;
    fp8.every_linear = config.fp8_every_linear;
    fp8.grad = fp8_format(config.fp8_grad);
    Fp8Linear(fp8).run(forward);
  }
  verify(forward);
}

void shard_forward_step(Graph& forward, const ShardingOptions& sharding) {
  validate(sharding);
  if (!sharding.enabled()) return;
  if (sharding.mode == ShardMode::kZero3) gather_sharded_params(forward, sharding.world_size);
  KILN_CHECK(!forward.outputs.empty(), "graph '{}' has no outputs (the loss must be the first)", forward.name);
  Builder b(std::move(forward));
  b.graph().outputs[0] = all_reduce(b.wrap(b.graph().outputs[0]), sharding.world_size, ReduceOp::kAvg).id();
  forward = b.take();
  verify(forward);
}

StepProgram build_training_graph(const Graph& forward, const OptimizerConfig& config, const ShardingOptions& sharding) {
  validate(config);
  validate(sharding);
  const int world = sharding.world_size;
  KILN_CHECK(!forward.outputs.empty(), "graph '{}' has no outputs (the loss must be the first)", forward.name);
  StepProgram out;
  std::vector<ValueId> params;
  for (size_t i = 0; i < forward.inputs.size(); ++i) {
    if (forward.inputs[i].role == Role::kParam) {
      out.param_inputs.push_back(static_cast<int>(i));
      params.push_back(forward.inputs[i].value);
    } else if (forward.inputs[i].role == Role::kData) {
      out.data_inputs.push_back(static_cast<int>(i));
    } else {
      out.state_inputs.push_back(static_cast<int>(i));
    }
  }
  KILN_CHECK(!params.empty(), "graph '{}' has no param inputs to train", forward.name);
  const std::vector<Setting> settings = param_settings(forward, config);

  // The pass keeps the inputs in order (so the input indices above stay valid) and the outputs'
  // types, but renumbers values: from here on ids refer to `amp_forward`.
  Graph amp_forward = forward;
  apply_mixed_precision(amp_forward, config);
  for (size_t i = 0; i < params.size(); ++i) params[i] = amp_forward.inputs[out.param_inputs[i]].value;
  // The full types of the params, before zero3 makes the inputs shards.
  std::vector<TensorType> full_types;
  for (ValueId p : params) full_types.push_back(amp_forward.type(p));
  // zero3: the params become shards, gathered before use; autodiff differentiates with respect
  // to the gathered values (passes/sharding.h).
  std::vector<std::vector<ValueId>> gathered;
  if (sharding.mode == ShardMode::kZero3) gathered = gather_sharded_params(amp_forward, world);
  // f16: the loss scale is state of the graph and multiplies the loss before autodiff.
  const bool scaled = config.amp == "f16";
  Builder forward_builder(amp_forward);
  LossScaleState loss_scale;
  ValueId loss = amp_forward.outputs[0];
  if (scaled) {
    loss_scale = add_loss_scale_state(forward_builder);
    const int inputs = static_cast<int>(forward_builder.graph().inputs.size());
    out.state_inputs.push_back(inputs - 2);  // amp.scale
    out.state_inputs.push_back(inputs - 1);  // amp.good_steps
    out.state_initial_values[kLossScaleName] = config.loss_scale.initial_scale;
    loss = scale_loss(forward_builder.wrap(forward_builder.graph().outputs[0]), loss_scale).id();
  }
  const ValueId local_loss = forward_builder.graph().outputs[0];
  const size_t forward_nodes = forward_builder.graph().nodes.size();
  std::vector<ValueId> wrt = params;
  if (!gathered.empty()) {
    wrt.clear();
    for (const auto& uses : gathered) wrt.insert(wrt.end(), uses.begin(), uses.end());
  }
  AutodiffResult joint = autodiff(forward_builder.take(), loss, wrt);
  if (!gathered.empty()) regather_for_backward(joint.graph, forward_nodes);

  Builder b(std::move(joint.graph));
  // Per param: this rank's full-shape gradient of its local loss, averaged over ranks (and for
  // zero1/2/3, this rank's shard of it).
  std::vector<Expr> grads;
  // zero2/3 reduce each gradient right after the backward makes it, as FSDP does: the f32 full
  // gradient becomes a 1/world shard at once, instead of every layer's 16-bit gradient living
  // to the end of the backward (where appending put the reductions, and where the schedule
  // left them: the cast alone allocates, so a greedy order defers it). dp and zero1 keep
  // theirs at the end: reduced, the gradient is no smaller, and the overlap pass hoists them.
  const bool reduce_early = sharding.mode == ShardMode::kZero2 || sharding.mode == ShardMode::kZero3;
  const size_t joint_nodes = b.graph().nodes.size();
  std::vector<int> producer(b.graph().values.size(), -1);
  for (size_t n = 0; n < joint_nodes; ++n)
    for (ValueId v : b.graph().nodes[n].outputs) producer[static_cast<size_t>(v)] = static_cast<int>(n);
  std::vector<AppendedRange> placed;  // the appended nodes, in ranges, and where each goes
  std::vector<size_t> reduced_at;     // per param: where its reduction went
  size_t next = 0;
  // Per param: whether the loss reaches it (an unreached one is left as it is, with its state,
  // as torch.optim skips a parameter whose grad is None: no weight decay, no moments).
  std::vector<bool> reached(params.size(), false);
  for (size_t i = 0; i < params.size(); ++i) {
    const size_t first = b.graph().nodes.size();
    // zero3: the param's gathered uses each have a gradient; summed in f32.
    const size_t uses = gathered.empty() ? 1 : gathered[i].size();
    Expr total;
    size_t after = 0;  // one past the last node making one of them
    for (size_t u = 0; u < uses; ++u) {
      reached[i] = reached[i] || joint.reached[next];
      const ValueId id = joint.gradients[next++];
      if (producer[static_cast<size_t>(id)] >= 0) after = std::max(after, static_cast<size_t>(producer[static_cast<size_t>(id)]) + 1);
      Expr g = b.wrap(id);
      if (!gathered.empty() && g.dtype() != DType::kF32) g = cast(g, DType::kF32);
      total = total.id() < 0 ? g : total + g;
    }
    if (sharding.enabled()) total = reduce_gradient(total, sharding);
    grads.push_back(total);
    reduced_at.push_back(reduce_early ? after : joint_nodes);
    placed.push_back({first, b.graph().nodes.size(), reduced_at.back()});
  }
  // What is appended from here on goes at the end, in a range opened at `tail`; zero3 without
  // clipping or loss scaling (which read every gradient first) updates each param right after
  // its reduction too, so its f32 gradient shard is freed at once as well. (zero2's update
  // would gather the new full param early, to live to the end beside the old.)
  const bool update_early = sharding.mode == ShardMode::kZero3 && !scaled && config.grad_clip <= 0;
  size_t tail = b.graph().nodes.size();
  auto close_range = [&](size_t position) {
    placed.push_back({tail, b.graph().nodes.size(), position});
    tail = b.graph().nodes.size();
  };
  Expr overflow;
  if (scaled) {
    loss_scale = LossScaleState{b.wrap(loss_scale.scale.id()), b.wrap(loss_scale.good_steps.id())};
    // Of the scaled gradients (unscaling keeps inf and NaN); over every rank's shard, so that
    // every rank skips the same steps.
    overflow = gradients_overflow(grads, sharding.shards_optimizer() ? world : 1);
    grads = unscale_gradients(grads, loss_scale);
  }

  if (config.grad_clip > 0) {
    // Global-norm clipping, all on device: scale = min(1, max_norm / (norm + 1e-6)).
    Expr total;
    for (const Expr& g : grads) {
      Expr s = sum(square(cast(g, DType::kF32)));
      total = total.id() < 0 ? s : total + s;
    }
    if (sharding.shards_optimizer()) total = sum_over_ranks(total, world);  // shards are disjoint
    Expr norm = sqrt(total).named("grad_norm");
    Expr scale = minimum(b.scalar(1.0), b.scalar(config.grad_clip) / (norm + 1e-6));
    for (Expr& g : grads) g = g * cast(scale, g.dtype());
  }

  auto add_state = [&](const std::string& name, const TensorType& type) {
    Expr e = b.state(name, type.shape, type.dtype);
    out.state_inputs.push_back(static_cast<int>(b.graph().inputs.size() - 1));
    return e;
  };
  // Per param: its optimizer's state slots, in the entry's order (shards, for zero1/2/3; an Expr
  // with id -1 where the slot has no tensor for this param's shape).
  const optim::OptimizerDef& def = optim::optimizer_def(config.name);
  if (sharding.shards_optimizer())
    for (const optim::StateSlot& slot : def.slots)
      KILN_CHECK(slot.shardable, "optimizer {} keeps state ({}) that cannot be sharded flat over ranks: use "
                 "--shard dp, or another optimizer for {}", def.name, slot.name, shard_mode_name(sharding.mode));
  std::vector<std::vector<Expr>> slots(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Value v = b.graph().value(params[i]);  // a copy: add_state() grows the graph's values
    const TensorType type = grads[i].type().shape == v.type.shape ? v.type : TensorType{v.type.dtype, grads[i].type().shape};
    for (const optim::StateSlot& slot : def.slots) {
      const std::optional<Shape> shape = optim::slot_shape(slot, type.shape);
      slots[i].push_back(shape ? add_state("opt." + slot.name + "." + v.name, TensorType{type.dtype, *shape}) : Expr());
    }
  }
  Expr step = add_state("opt.step", TensorType{DType::kF32, {}});
  Expr lr = b.data("lr", {}, DType::kF32);
  out.lr_input = static_cast<int>(b.graph().inputs.size() - 1);
  Expr next_step = step + 1.0;
  b.graph().updates.push_back(Update{step.id(), next_step.id()});
  for (const GraphInput& in : amp_forward.inputs) {
    const Value& v = amp_forward.value(in.value);
    if (in.role == Role::kState && v.name == "rng.offset") {
      KILN_CHECK(v.type == (TensorType{DType::kI64, {}}), "rng.offset must be i64[], got {}", to_string(v.type));
      Expr offset = b.wrap(in.value);
      b.graph().updates.push_back(Update{in.value, (offset + b.scalar(1, DType::kI64)).id()});
    }
  }

  // The step counter and the rng offset read only inputs: at the start when updates go early.
  close_range(update_early ? 0 : joint_nodes);
  for (size_t i = 0; i < params.size(); ++i) {
    const Expr param = b.wrap(params[i]);
    // What the optimizer updates: the param, or (zero1/2) this rank's shard of it; zero3's
    // param input is its shard already.
    const bool gather_after = sharding.mode == ShardMode::kZero1 || sharding.mode == ShardMode::kZero2;
    Expr p = gather_after ? shard_of(param, world) : param;
    // The new value of the param input from the optimizer's result.
    auto param_update = [&](const Expr& updated) {
      return gather_after ? unshard(updated, param_shard(full_types[i], world)) : updated;
    };
    Expr g = grads[i].dtype() == p.dtype() ? grads[i] : cast(grads[i], p.dtype());
    const Setting& setting = settings[i];
    Expr lr_p = cast(lr, p.dtype());
    if (setting.lr_scale != 1.0) lr_p = lr_p * setting.lr_scale;
    if (reached[i]) {
      const std::vector<Expr> r = def.build({p, g, slots[i], lr_p, cast(next_step, p.dtype()), setting.hyper});
      b.graph().updates.push_back(Update{param.id(), param_update(r[0]).id()});
      for (size_t j = 0; j < slots[i].size(); ++j)
        if (slots[i][j].id() >= 0) b.graph().updates.push_back(Update{slots[i][j].id(), r[1 + j].id()});
    }
    close_range(update_early ? reduced_at[i] : joint_nodes);
  }
  if (scaled) {
    // Every param and optimizer state update is skipped on overflow; rng.offset still advances.
    std::set<ValueId> skipped(params.begin(), params.end());
    for (const std::vector<Expr>& own : slots)
      for (const Expr& slot : own)
        if (slot.id() >= 0) skipped.insert(slot.id());
    skipped.insert(step.id());
    skip_updates_on_overflow(b, overflow, skipped);
    update_loss_scale(b, loss_scale, overflow, config.loss_scale);
  }
  close_range(joint_nodes);
  place_appended(b.graph(), joint_nodes, placed);
  // The reported loss: the mean over ranks of their slices' means, the global batch's mean.
  if (sharding.enabled()) b.graph().outputs[0] = all_reduce(b.wrap(local_loss), world, ReduceOp::kAvg).id();
  out.graph = b.take();
  if (!config.keep_forward_outputs) out.graph.outputs.resize(1);  // dead-code drops what only they needed
  out.graph.name = forward.name + ".train";
  verify(out.graph);
  return out;
}

}  // namespace kiln
