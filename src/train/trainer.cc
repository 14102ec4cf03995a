#include "train/trainer.h"
#include <cstring>

#include "passes/pipeline.h"
#include "support/error.h"
#include "train/checkpoint/safetensors.h"

namespace kiln::train {

Trainer::Trainer(const Graph& forward, OptimizerConfig config, std::vector<Tensor> params,
                 ExecutorOptions executor_options, PassOptions pass_options)
    : config_(std::move(config)), program_(build_training_graph(forward, config_)), forward_(forward) {
  // Passes keep graph inputs in place, so program_'s input indices stay valid.
  if (!pass_options.memory_budget && config_.memory_budget > 0) pass_options.memory_budget = config_.memory_budget;
  pass_records_ = default_pipeline(std::move(pass_options)).run(program_.graph);
  const Graph& g = program_.graph;
  KILN_CHECK(params.size() == program_.param_inputs.size(), "graph '{}' has {} params, {} initial values given",
             forward.name, program_.param_inputs.size(), params.size());
  inputs_.resize(g.inputs.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Value& v = g.value(g.inputs[program_.param_inputs[i]].value);
    KILN_CHECK(params[i].type() == v.type, "param '{}' must be {}, got {}", v.name, to_string(v.type),
               to_string(params[i].type()));
    inputs_[program_.param_inputs[i]] = params[i].clone();  // the trainer owns its params
  }
  for (int i : program_.state_inputs) {
    const Value& v = g.value(g.inputs[i].value);
    inputs_[i] = Tensor(v.type);  // zeros, unless the program says otherwise (amp.scale)
    auto initial = program_.state_initial_values.find(v.name);
    if (initial != program_.state_initial_values.end())
      for (int64_t k = 0; k < inputs_[i].numel(); ++k) inputs_[i].set(k, initial->second);
  }
  step_executor_ = std::make_unique<Executor>(g, executor_options);
  eval_executor_ = std::make_unique<Executor>(forward_, executor_options);
}

std::vector<Tensor> Trainer::step(const std::vector<Tensor>& data) {
  KILN_CHECK(data.size() == program_.data_inputs.size(), "a step takes {} data tensors, {} given",
             program_.data_inputs.size(), data.size());
  for (size_t i = 0; i < data.size(); ++i) inputs_[program_.data_inputs[i]] = data[i];
  Tensor lr(TensorType{DType::kF32, {}});
  lr.set(0, current_lr());
  inputs_[program_.lr_input] = lr;
  std::vector<Tensor> outputs = step_executor_->run(inputs_);
  for (int i : program_.data_inputs) inputs_[i] = Tensor();  // do not keep the batch alive
  ++steps_done_;
  return outputs;
}

std::vector<Tensor> Trainer::evaluate(const std::vector<Tensor>& data) const {
  std::vector<Tensor> inputs;
  size_t d = 0;
  for (size_t i = 0; i < forward_.inputs.size(); ++i) {
    if (forward_.inputs[i].role == Role::kData) {
      KILN_CHECK(d < data.size(), "evaluate takes {} data tensors, {} given", program_.data_inputs.size(), data.size());
      inputs.push_back(data[d++]);
    } else {
      inputs.push_back(inputs_[i]);  // forward inputs come first in the training graph
    }
  }
  KILN_CHECK(d == data.size(), "evaluate takes {} data tensors, {} given", d, data.size());
  return eval_executor_->run(inputs);
}

std::map<std::string, Tensor> Trainer::named_tensors() const {
  std::map<std::string, Tensor> out;
  const Graph& g = program_.graph;
  for (int i : program_.param_inputs) out[g.value(g.inputs[i].value).name] = inputs_[i];
  for (int i : program_.state_inputs) out[g.value(g.inputs[i].value).name] = inputs_[i];
  return out;
}

std::vector<Tensor> Trainer::params() const {
  std::vector<Tensor> out;
  for (int i : program_.param_inputs) out.push_back(inputs_[i]);
  return out;
}

void Trainer::save(const std::string& path, std::map<std::string, std::string> metadata) const {
  metadata["kiln.steps_done"] = std::to_string(steps_done_);
  metadata["kiln.graph"] = forward_.name;
  save_safetensors(path, named_tensors(), metadata);
}

std::map<std::string, std::string> Trainer::load(const std::string& path) {
  SafetensorsFile file = load_safetensors(path);
  std::map<std::string, Tensor> mine = named_tensors();
  // Check everything first, so a mismatched checkpoint leaves the trainer untouched.
  for (const auto& [name, tensor] : mine) {
    auto it = file.tensors.find(name);
    KILN_CHECK(it != file.tensors.end(), "checkpoint '{}' has no tensor '{}'", path, name);
    KILN_CHECK(it->second.type() == tensor.type(), "checkpoint '{}': '{}' is {}, the model needs {}", path,
               name, to_string(it->second.type()), to_string(tensor.type()));
  }
  auto steps = file.metadata.find("kiln.steps_done");
  KILN_CHECK(steps != file.metadata.end(), "checkpoint '{}' has no kiln.steps_done metadata", path);
  int64_t steps_done = 0;
  try {
    steps_done = std::stoll(steps->second);
  } catch (const std::exception&) {
    fail("checkpoint '{}': kiln.steps_done is '{}', expected an integer", path, steps->second);
  }
  for (auto& [name, tensor] : mine) std::memcpy(tensor.raw(), file.tensors[name].raw(), tensor.bytes());
  steps_done_ = steps_done;
  return file.metadata;
}

}  // namespace kiln::train
