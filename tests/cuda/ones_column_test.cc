// The ones-column pass on the GPU (passes/ones_column.h): a gpt2-tiny training step prepared for
// CUDA, with every qkv / fc bias gradient taken from its weight-gradient GEMM (LayerNorm rows
// kernels writing padded rows, cuBLASLt reading them through lda, dW and db as offset views of
// one product), against the CPU reference kernels running the graph without the pass. SGD
// without momentum hands the gradient out as the new momentum buffer, so every gradient is
// compared, scaled by its largest element: f32 (TF32 off) 2e-3, 16 bits 5e-2 (the GPU's fused
// kernels skip the reference's intermediate roundings). A wrong row of the product would be off
// by its whole size.
#include <cmath>

#include "backends/cuda/memory.h"
#include "gpu_test_util.h"
#include "models/models.h"
#include "passes/pipeline.h"
#include "runtime/executor.h"
#include "train/optimizer.h"

namespace kiln {
namespace {

// The outputs, then every update target's new value (Graph::updates order), on the host.
std::vector<Tensor> step(const Graph& g, const std::vector<Tensor>& inputs, Device device) {
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

void check(const std::string& amp, double rtol) {
  SCOPED_TRACE("amp " + amp);
  train::OptimizerConfig config;
  config.name = "sgd";
  config.momentum = 0.0;
  config.amp = amp;
  const Graph forward = models::by_name("gpt2-tiny", 4, 0);
  const train::TrainingGraph program = train::build_training_graph(forward, config);
  PassOptions on, off;
  on.target = off.target = Device::kCuda;
  off.disabled = {"ones-column"};
  Graph with_pass = program.graph, without = program.graph;
  default_pipeline(on).run(with_pass);
  default_pipeline(off).run(without);
  int padded = 0;
  for (const Node& node : with_pass.nodes)
    if (node.op == Op::kFused && node.body)
      for (const Node& n : node.body->nodes) padded += n.op == Op::kConcat;
  ASSERT_EQ(padded, 4);  // ln1 and ln2 of both layers

  const std::vector<Tensor> params = models::init_params(forward, 7, 2);
  std::vector<Tensor> inputs;
  size_t p = 0;
  for (size_t i = 0; i < program.graph.inputs.size(); ++i) {
    const GraphInput& in = program.graph.inputs[i];
    const TensorType& t = program.graph.type(in.value);
    if (in.role == Role::kParam) inputs.push_back(params.at(p++));
    else if (is_float(t.dtype)) inputs.push_back(random_tensor(t, 50 + i, 0.1, 1.0));
    else inputs.push_back(random_tensor(t, 50 + i, 0, 256));
  }
  const std::vector<Tensor> want = step(without, inputs, Device::kCpu);
  const std::vector<Tensor> got = step(with_pass, inputs, Device::kCuda);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_NEAR(got[0].get(0), want[0].get(0), rtol * std::abs(want[0].get(0)));
  for (size_t i = 1; i < got.size(); ++i) {
    double scale = 0;
    for (double v : want[i].to_f64()) scale = std::max(scale, std::abs(v));
    EXPECT_LE(max_scaled_error(got[i], want[i], rtol * scale, 0.0), 1.0)
        << "result " << i << " (max " << scale << ")";
  }
}

TEST(CudaOnesColumn, Gpt2TinyStepMatchesTheReferenceWithoutThePass) {
  KILN_REQUIRE_GPU();
  check("off", 2e-3);
  check("bf16", 5e-2);
}

}  // namespace
}  // namespace kiln
