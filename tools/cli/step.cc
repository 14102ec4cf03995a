// `kiln step MODEL --inputs IN.safetensors --out OUT.safetensors`: one training step of a model
// file (ONNX or IR text) on given inputs, writing what a user compares with another framework:
// `loss`, `grad.NAME` of every param (before the update), `param.NAME` after the update and
// `state.NAME` of the model's own state after it (BatchNorm's running statistics).
//
// IN holds the graph's data inputs by name (ONNX names or kiln's), and may hold params or state
// to start from (an IR-text model has no initial values of its own). The gradients come from a
// forward step of the autodiff graph (the training step keeps them inside); the update from a
// training session's step (train/session.h), so both are what `kiln train` computes.
#include "compile/compile_step.h"
#include "device/device_runtime.h"
#include "options.h"
#include "passes/autodiff.h"
#include "train/checkpoint/safetensors.h"
#include "train/session.h"
#include "train/trainer.h"

namespace kiln::cli {
namespace {

struct StepOptions {
  std::string file, inputs_path, out_path;
  onnx::ImportOptions onnx;
  OptimizerConfig optimizer;
  Device device = Device::kCpu;
  PassOptions passes;
};

// The tensor for graph input `name` in IN: by its kiln name or its ONNX one.
const Tensor* find_input(const std::map<std::string, Tensor>& given, const std::string& name) {
  for (const std::string& key : {name}) {
    auto it = given.find(key);
    if (it != given.end()) return &it->second;
  }
  for (const auto& [key, t] : given)
    if (onnx::kiln_name(key) == name) return &t;
  return nullptr;
}

void step(StepOptions o) {
  ModelFile model = load_model_file(o.file, o.onnx);
  const Graph& forward = model.graph;
  const std::map<std::string, Tensor> given = train::load_safetensors(o.inputs_path).tensors;
  validate(o.optimizer);

  // Every graph input's value, in order: given, else the model's own; data must be given.
  std::vector<Tensor> values;
  std::vector<ValueId> params;
  std::vector<std::string> missing;
  for (const GraphInput& in : forward.inputs) {
    const Value& v = forward.value(in.value);
    const Tensor* t = find_input(given, v.name);
    if (!t && in.role != Role::kData) {
      auto it = model.initial_values.find(v.name);
      if (it != model.initial_values.end()) t = &it->second;
    }
    if (!t) {
      missing.push_back(fmt::format("{} {} {}", role_name(in.role), v.name, to_string(v.type)));
      values.emplace_back();
      continue;
    }
    KILN_CHECK(t->type() == v.type, "{}: input '{}' is {}, the model wants {}", o.inputs_path, v.name,
               to_string(t->type()), to_string(v.type));
    values.push_back(*t);
    if (in.role == Role::kParam) params.push_back(in.value);
  }
  KILN_CHECK(missing.empty(), "{} has no value for {}", o.inputs_path, fmt::join(missing, ", "));
  KILN_CHECK(!forward.outputs.empty(), "{}: the model has no outputs", o.file);

  std::map<std::string, Tensor> out;
  // The gradients: the loss and d loss / d param from a forward step of the autodiff graph
  // (without the state's updates, which the training step below makes).
  Graph for_grads = forward;
  for_grads.updates.clear();
  AutodiffResult joint = autodiff(for_grads, for_grads.outputs[0], params);
  joint.graph.outputs = {for_grads.outputs[0]};
  joint.graph.outputs.insert(joint.graph.outputs.end(), joint.gradients.begin(), joint.gradients.end());
  CompileOptions grad_options;
  grad_options.kind = StepKind::kForward;
  grad_options.executor.device = o.device;
  grad_options.passes = o.passes;
  const std::unique_ptr<DeviceRuntime> runtime = device_runtime(o.device);
  {
    const CompiledStep grads = compile_step(joint.graph, grad_options);
    std::vector<Tensor> device_values;
    for (const Tensor& t : values) device_values.push_back(runtime->to_device(t.clone()));
    std::vector<Tensor> results = grads.executor->run(device_values);
    grads.executor->synchronize();
    out["loss"] = runtime->to_host(results[0]).clone();
    for (size_t i = 0; i < params.size(); ++i)
      out["grad." + forward.value(params[i]).name] = runtime->to_host(results[1 + i]).clone();
  }

  // The update: a training session's step, from the given params and state.
  train::Model start;
  start.forward = forward;
  std::vector<Tensor> data;
  for (size_t i = 0; i < forward.inputs.size(); ++i) {
    const GraphInput& in = forward.inputs[i];
    if (in.role == Role::kParam) start.params.push_back(values[i]);
    if (in.role == Role::kState) start.initial_state[forward.value(in.value).name] = values[i];
    if (in.role == Role::kData) data.push_back(values[i]);
  }
  train::SessionOptions options;
  options.device = std::string(device_name(o.device));
  options.optimizer = o.optimizer;
  options.passes = o.passes;
  train::TrainingSession session(std::move(start), options);
  train::Trainer& trainer = session.trainer();
  trainer.step(data);
  trainer.synchronize();
  const std::map<std::string, Tensor> after = trainer.host_tensors();
  for (const GraphInput& in : forward.inputs) {
    if (in.role == Role::kData) continue;
    const std::string& name = forward.value(in.value).name;
    out[(in.role == Role::kParam ? "param." : "state.") + name] = after.at(name).clone();
  }
  train::save_safetensors(o.out_path, out);
  fmt::print("step of {}: loss {:.6g}, {} params, wrote {}\n", o.file, out["loss"].get(0), params.size(), o.out_path);
}

}  // namespace

void add_step_command(CLI::App& app) {
  CLI::App* command = app.add_subcommand(
      "step", "One training step of a model file on given inputs; write the loss, gradients, updated params and state");
  auto o = std::make_shared<StepOptions>();
  command->add_option("MODEL", o->file, "An ONNX model (.onnx) or a forward graph's IR text")->required();
  command->add_option("--inputs", o->inputs_path,
                      "safetensors file: the graph's data inputs by name (and params or state to start from)")
      ->required();
  command->add_option("--out", o->out_path, "safetensors file to write: loss, grad.NAME, param.NAME, state.NAME")
      ->required();
  add_optimizer_options(command, o->optimizer);
  add_device_option(command, o->device, "cpu | cuda");
  add_onnx_options(command, o->onnx);
  add_pass_options(command, o->passes);
  command->callback([o] { step(*o); });
}

}  // namespace kiln::cli
