// Shared by the GPU tests that run a whole training step prepared for CUDA on the GPU and check
// it against the CPU reference kernels running the graph (or the graph another way, a pass
// off): a model's inputs, one step on either device, and the comparison of every result.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backends/cuda/runtime/memory.h"
#include "models/models.h"
#include "passes/pipeline.h"
#include "runtime/executor.h"
#include "test_util.h"
#include "compile/training_graph.h"

namespace kiln::testing {

// A model's training program with SGD without momentum: the new momentum buffer is the
// gradient itself, so every gradient is among the step's results.
inline StepProgram sgd_program(const Graph& forward, const std::string& amp) {
  OptimizerConfig config;
  config.name = "sgd";
  config.hyper["momentum"] = 0.0;
  config.amp = amp;
  return build_training_graph(forward, config);
}

// The program's inputs: `params` (the forward's, in order), random data (floats in [0.1, 1),
// integers, e.g. token ids or class labels, below `vocab`).
inline std::vector<Tensor> step_inputs(const StepProgram& program, const std::vector<Tensor>& params,
                                       int64_t vocab) {
  std::vector<Tensor> inputs;
  size_t p = 0;
  for (size_t i = 0; i < program.graph.inputs.size(); ++i) {
    const GraphInput& in = program.graph.inputs[i];
    const TensorType& t = program.graph.type(in.value);
    if (in.role == Role::kParam) inputs.push_back(params.at(p++));
    else if (is_float(t.dtype)) inputs.push_back(random_tensor(t, 50 + i, 0.1, 1.0));
    else inputs.push_back(random_tensor(t, 50 + i, 0, static_cast<double>(vocab)));
  }
  return inputs;
}

// The same with `forward`'s initial params (models::init_params, a language model's).
inline std::vector<Tensor> step_inputs(const StepProgram& program, const Graph& forward,
                                       int64_t layers, int64_t vocab) {
  return step_inputs(program, models::init_params(forward, 7, layers), vocab);
}

// The outputs, then every update target's new value (Graph::updates order), on the host.
inline std::vector<Tensor> run_step_on(const Graph& g, const std::vector<Tensor>& inputs, Device device) {
  std::vector<Tensor> fresh;
  for (const Tensor& t : inputs) fresh.push_back(device == Device::kCuda ? cuda::to_device(t) : t.clone());
  ExecutorOptions options{device, {}};
  if (device == Device::kCpu) options.dialects = {"reference"};
  Executor executor(g, options);
  std::vector<Tensor> results = executor.run(fresh);
  executor.synchronize();
  for (const Update& u : g.updates) results.push_back(fresh.at(g.input_index(u.target)));
  for (Tensor& t : results)
    if (t.device() == Device::kCuda) t = cuda::to_host(t);
  return results;
}

// The loss (result 0) within rtol of itself; every other result within rtol of its largest
// element.
inline void expect_step_close(const std::vector<Tensor>& got, const std::vector<Tensor>& want, double rtol) {
  ASSERT_EQ(got.size(), want.size());
  EXPECT_NEAR(got[0].get(0), want[0].get(0), rtol * std::abs(want[0].get(0)));
  for (size_t i = 1; i < got.size(); ++i) {
    double scale = 0;
    for (double v : want[i].to_f64()) scale = std::max(scale, std::abs(v));
    EXPECT_LE(max_scaled_error(got[i], want[i], rtol * scale, 0.0), 1.0)
        << "result " << i << " (max " << scale << ")";
  }
}

// `g` through the default pipeline prepared for CUDA, with `options` (their target set to cuda).
inline Graph prepared_for_cuda(const Graph& g, PassOptions options) {
  options.target = Device::kCuda;
  Graph out = g;
  default_pipeline(options).run(out);
  return out;
}

}  // namespace kiln::testing
