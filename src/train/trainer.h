// The Trainer owns a compiled training step and the tensors it updates: step(batch) -> loss,
// with params and optimizer state updated in place by the graph's updates. It also evaluates
// the forward graph with the current params, and saves/loads exact checkpoints.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "passes/pass.h"
#include "runtime/executor.h"
#include "train/optimizer.h"

namespace kiln::train {

class Trainer {
 public:
  // `params` are the forward graph's param inputs, in order.
  // The training graph goes through the default pass pipeline (passes/pipeline.h) with
  // `pass_options` before it is bound to kernels.
  Trainer(const Graph& forward, OptimizerConfig config, std::vector<Tensor> params,
          ExecutorOptions executor_options = {}, PassOptions pass_options = {});

  // One training step on the forward's data inputs (in order); returns the forward's outputs
  // (loss first), computed before the update. Advances steps_done().
  std::vector<Tensor> step(const std::vector<Tensor>& data);
  // The forward graph with the current params (no update). Under amp it is still the f32 forward:
  // the master weights are f32, and evaluation is not where the speed of 16 bits matters.
  std::vector<Tensor> evaluate(const std::vector<Tensor>& data) const;

  int64_t steps_done() const { return steps_done_; }
  double current_lr() const { return learning_rate(config_, steps_done_); }
  const OptimizerConfig& config() const { return config_; }
  const TrainingGraph& program() const { return program_; }  // after the pipeline
  const std::vector<PassRecord>& pass_records() const { return pass_records_; }
  // Param and state tensors by graph-input name ("h0.attn.weight", "opt.m.wte", "opt.step").
  std::map<std::string, Tensor> named_tensors() const;
  std::vector<Tensor> params() const;

  // Checkpoint: every param and state tensor, the step count and `metadata`, in safetensors,
  // written atomically. load() checks names, types and shapes before touching anything.
  void save(const std::string& path, std::map<std::string, std::string> metadata = {}) const;
  // Returns the checkpoint's metadata.
  std::map<std::string, std::string> load(const std::string& path);

 private:
  OptimizerConfig config_;
  TrainingGraph program_;
  Graph forward_;
  std::unique_ptr<Executor> step_executor_;
  std::unique_ptr<Executor> eval_executor_;
  std::vector<Tensor> inputs_;  // training-graph inputs: params and state bound, data per step
  int64_t steps_done_ = 0;
  std::vector<PassRecord> pass_records_;
};

}  // namespace kiln::train
