// CNNs training on the GPU (the cuda-conv dialect's kernels in whole steps; the kernels alone are
// conv_test.cc's):
//   - every node of the steps below has a CUDA kernel (selection reads only types and
//     attributes: this runs in a CUDA build without a GPU), the convolutions and pools
//     cuda-conv's;
//   - kiln's cnn: one training step prepared for CUDA against the same graph through the CPU
//     reference kernels (f32 and bf16), and the Trainer over several steps (a captured, replayed
//     CUDA graph) against the CPU trainer;
//   - an ONNX CNN as PyTorch exports them (built here with the ONNX library's classes): a grouped,
//     dilated convolution with asymmetric pads, BatchNormalization in training mode (running
//     statistics as state), max pooling in ceil mode, average pooling with asymmetric pads
//     counted, imported and trained on the GPU against the CPU trainer.
// Tolerances: f32 (TF32 off) 2e-3 of each result's largest element for one step against the
// reference kernels, 1e-3 relative over several steps against the CPU trainer; bf16 5e-2.
#include <optional>
#include <random>

#include "compile/compile_step.h"
#include "frontend/onnx/onnx_import.h"
#include "gpu_test_util.h"
#include "train/trainer.h"
#include "training_step_util.h"

#ifdef KILN_HAVE_ONNX
#include <onnx/onnx_pb.h>
#endif

namespace kiln {
namespace {

models::CnnConfig small_cnn() {
  models::CnnConfig config;
  config.batch = 8;
  return config;
}

bool is_window_op(Op op) {
  return op == Op::kConv2d || op == Op::kConv2dGradInput || op == Op::kConv2dGradWeight ||
         op == Op::kMaxPool2d || op == Op::kMaxPool2dGrad || op == Op::kAvgPool2d ||
         op == Op::kAvgPool2dGrad;
}

// Compiles `forward`'s training step for CUDA (no kernels bound, no device needed) and selects a
// CUDA kernel for every node, as the executor will; returns how many nodes were window ops.
int expect_every_node_has_a_cuda_kernel(const Graph& forward, const OptimizerConfig& optimizer) {
  CompileOptions options;
  options.optimizer = optimizer;
  options.executor.device = Device::kCuda;
  options.bind_kernels = false;
  const Graph g = compile_step(forward, options).program.graph;
  int window_ops = 0;
  for (const Node& node : g.nodes) {
    std::vector<TensorType> in, out;
    for (ValueId id : node.inputs) in.push_back(g.type(id));
    for (ValueId id : node.outputs) out.push_back(g.type(id));
    try {
      const KernelImpl& impl = kernel_registry().select(NodeView{node, in, out}, Device::kCuda, {});
      if (is_window_op(node.op)) {
        EXPECT_EQ(impl.dialect, "cuda-conv") << op_name(node.op);
        ++window_ops;
      }
    } catch (const Error& e) {
      ADD_FAILURE() << "amp " << optimizer.amp << ": " << e.what();
    }
  }
  return window_ops;
}

TEST(CudaCnn, EveryStepNodeHasACudaKernel) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  for (const char* amp : {"off", "bf16", "f16"}) {
    OptimizerConfig optimizer;
    optimizer.amp = amp;
    // Two convolutions, two pools, their gradients (the first convolution's input needs none).
    EXPECT_EQ(expect_every_node_has_a_cuda_kernel(models::cnn(small_cnn()), optimizer), 9) << amp;
  }
}

// One SGD step of the cnn prepared for CUDA (every dialect), against the same graph through the
// CPU reference kernels: the loss, every gradient (SGD without momentum hands each out as its
// new buffer) and every updated param, scaled by each one's largest element. f32 (TF32 off) to
// 2e-3; bf16 (convolutions, matmul and their gradients in bf16, as --amp bf16 runs them) to 5e-2.
TEST(CudaCnn, TrainingStepMatchesTheCpuReference) {
  KILN_REQUIRE_GPU();
  const Graph forward = models::cnn(small_cnn());
  for (auto [amp, rtol] : {std::pair{"off", 2e-3}, std::pair{"bf16", 5e-2}}) {
    SCOPED_TRACE(std::string("amp ") + amp);
    const StepProgram program = testing::sgd_program(forward, amp);
    const Graph g = testing::prepared_for_cuda(program.graph, {});
    const std::vector<Tensor> inputs =
        testing::step_inputs(program, models::init_params_fan_in(forward, 3), 10);
    testing::expect_step_close(testing::run_step_on(g, inputs, Device::kCuda),
                               testing::run_step_on(g, inputs, Device::kCpu), rtol);
  }
}

// `gpu` tracks `cpu` over `batches` (the same on both): every loss within 1e-3 relative, every
// param and state tensor within 1e-4 + 1e-3 relative at the end; the GPU's step was captured
// into a CUDA graph once (the third step; the column matrices' scratch allocated inside it) and
// replayed after.
void expect_trainers_agree(train::Trainer& cpu, train::Trainer& gpu,
                           const std::vector<std::vector<Tensor>>& batches) {
  for (const std::vector<Tensor>& batch : batches) {
    cpu.step(batch);
    gpu.step(batch);
  }
  const std::vector<double> want = cpu.take_losses(), got = gpu.take_losses();
  ASSERT_EQ(got.size(), batches.size());
  ASSERT_EQ(want.size(), batches.size());
  for (size_t s = 0; s < want.size(); ++s)
    EXPECT_NEAR(got[s], want[s], 1e-3 * std::abs(want[s])) << "step " << s;
  EXPECT_EQ(gpu.step_executor().graph_captures(), 1);
  EXPECT_GE(gpu.step_executor().graph_replays(), 1);
  const auto host = gpu.host_tensors();
  for (const auto& [name, t] : cpu.host_tensors())
    EXPECT_LE(max_scaled_error(host.at(name), t, 1e-4, 1e-3), 1.0) << name;
}

ExecutorOptions on_gpu() {
  ExecutorOptions options;
  options.device = Device::kCuda;
  return options;
}

TEST(CudaCnn, TrainerStepsMatchTheCpuTrainer) {
  KILN_REQUIRE_GPU();
  const models::CnnConfig config = small_cnn();
  const Graph forward = models::cnn(config);
  const std::vector<Tensor> init = models::init_params_fan_in(forward, 5);
  OptimizerConfig sgd;
  sgd.name = "sgd";
  sgd.lr = 0.05;
  train::Trainer cpu(forward, sgd, init), gpu(forward, sgd, init, on_gpu());
  std::vector<std::vector<Tensor>> batches;
  for (int s = 0; s < 5; ++s)
    batches.push_back({random_tensor({DType::kF32, {config.batch, 1, 28, 28}}, 40 + s, 0.0, 1.0),
                       random_tensor({DType::kI64, {config.batch}}, 50 + s, 0, 10)});
  expect_trainers_agree(cpu, gpu, batches);
}

// ---- an imported ONNX CNN ------------------------------------------------------------------

#ifdef KILN_HAVE_ONNX
// x (4, 4, 11, 10) -> Conv (6 out, 3x3, group 2, dilation 2, pads top 1 left 0 bottom 2 right 1)
// -> BatchNormalization (training) -> Relu -> MaxPool (3x3, stride 2, ceil mode) -> Conv (4 out,
// 3x3, stride (2, 1), pads 1) -> AveragePool (2x2, stride 1, pads top 1 right 1, pads counted)
// -> Flatten -> Gemm (transB) -> SoftmaxCrossEntropyLoss against labels (4,). Opset 17.
std::string onnx_cnn_bytes() {
  ::onnx::ModelProto model;
  model.set_ir_version(8);
  model.set_producer_name("kiln-test");
  auto* opset = model.add_opset_import();
  opset->set_domain("");
  opset->set_version(17);
  ::onnx::GraphProto* g = model.mutable_graph();
  g->set_name("onnx_cnn");
  std::mt19937 rng(11);
  auto value_info = [](::onnx::ValueInfoProto* v, const std::string& name, int type, const Shape& shape) {
    v->set_name(name);
    auto* tensor = v->mutable_type()->mutable_tensor_type();
    tensor->set_elem_type(type);
    auto* dims = tensor->mutable_shape();
    for (int64_t d : shape) dims->add_dim()->set_dim_value(d);
  };
  value_info(g->add_input(), "x", ::onnx::TensorProto::FLOAT, {4, 4, 11, 10});
  value_info(g->add_input(), "labels", ::onnx::TensorProto::INT64, {4});
  value_info(g->add_output(), "loss", ::onnx::TensorProto::FLOAT, {});
  auto initializer = [&](const std::string& name, const Shape& shape, double lo, double hi) {
    ::onnx::TensorProto* t = g->add_initializer();
    t->set_name(name);
    t->set_data_type(::onnx::TensorProto::FLOAT);
    for (int64_t d : shape) t->add_dims(d);
    std::uniform_real_distribution<float> uniform(static_cast<float>(lo), static_cast<float>(hi));
    for (int64_t i = 0; i < numel(shape); ++i) t->add_float_data(uniform(rng));
  };
  initializer("conv1.weight", {6, 2, 3, 3}, -0.4, 0.4);
  initializer("conv1.bias", {6}, -0.1, 0.1);
  initializer("bn.weight", {6}, 0.8, 1.2);
  initializer("bn.bias", {6}, -0.1, 0.1);
  initializer("bn.running_mean", {6}, -0.1, 0.1);
  initializer("bn.running_var", {6}, 0.9, 1.1);
  initializer("conv2.weight", {4, 6, 3, 3}, -0.2, 0.2);
  initializer("fc.weight", {10, 36}, -0.2, 0.2);
  initializer("fc.bias", {10}, -0.1, 0.1);
  auto node = [&](const std::string& op, std::vector<std::string> in, std::vector<std::string> out) {
    ::onnx::NodeProto* n = g->add_node();
    n->set_op_type(op);
    n->set_name(op + "_" + out[0]);
    for (const std::string& s : in) n->add_input(s);
    for (const std::string& s : out) n->add_output(s);
    return n;
  };
  auto ints = [](::onnx::NodeProto* n, const std::string& name, std::vector<int64_t> values) {
    ::onnx::AttributeProto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(::onnx::AttributeProto::INTS);
    for (int64_t v : values) a->add_ints(v);
  };
  auto integer = [](::onnx::NodeProto* n, const std::string& name, int64_t value) {
    ::onnx::AttributeProto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(::onnx::AttributeProto::INT);
    a->set_i(value);
  };
  ::onnx::NodeProto* conv1 = node("Conv", {"x", "conv1.weight", "conv1.bias"}, {"c1"});  // (4, 6, 10, 7)
  ints(conv1, "kernel_shape", {3, 3});
  ints(conv1, "dilations", {2, 2});
  ints(conv1, "pads", {1, 0, 2, 1});
  integer(conv1, "group", 2);
  ::onnx::NodeProto* bn = node("BatchNormalization",
                               {"c1", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"},
                               {"b1", "bn.mean_out", "bn.var_out"});
  integer(bn, "training_mode", 1);
  node("Relu", {"b1"}, {"r1"});
  ::onnx::NodeProto* max_pool = node("MaxPool", {"r1"}, {"p1"});  // (4, 6, 5, 3)
  ints(max_pool, "kernel_shape", {3, 3});
  ints(max_pool, "strides", {2, 2});
  integer(max_pool, "ceil_mode", 1);
  ::onnx::NodeProto* conv2 = node("Conv", {"p1", "conv2.weight"}, {"c2"});  // (4, 4, 3, 3)
  ints(conv2, "kernel_shape", {3, 3});
  ints(conv2, "strides", {2, 1});
  ints(conv2, "pads", {1, 1, 1, 1});
  ::onnx::NodeProto* avg_pool = node("AveragePool", {"c2"}, {"p2"});  // (4, 4, 3, 3)
  ints(avg_pool, "kernel_shape", {2, 2});
  ints(avg_pool, "pads", {1, 0, 0, 1});
  integer(avg_pool, "count_include_pad", 1);
  node("Flatten", {"p2"}, {"flat"});  // (4, 36)
  integer(node("Gemm", {"flat", "fc.weight", "fc.bias"}, {"logits"}), "transB", 1);
  node("SoftmaxCrossEntropyLoss", {"logits", "labels"}, {"loss"});
  return model.SerializeAsString();
}
#endif

// The imported model, or a skip reason.
std::optional<onnx::ImportedModel> import_onnx_cnn(std::string& why_not) {
#ifdef KILN_HAVE_ONNX
  if (onnx::onnx_available()) return onnx::import_onnx_bytes(onnx_cnn_bytes(), ".", {}, "onnx_cnn");
#endif
  why_not = "kiln is built without the ONNX front end (libonnx-dev)";
  return std::nullopt;
}

TEST(CudaCnn, ImportedOnnxCnnStepNodesHaveCudaKernels) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  std::string why_not;
  const std::optional<onnx::ImportedModel> m = import_onnx_cnn(why_not);
  if (!m) GTEST_SKIP() << why_not;
  for (const char* amp : {"off", "bf16"}) {
    OptimizerConfig optimizer;
    optimizer.amp = amp;
    // Two conv2d (the grouped one is one node with groups), their weight gradients, the second's
    // input gradient (the first's input is data), the two pools and their gradients (the
    // average pool's divisors, a pool of constants, are folded at compile time).
    EXPECT_EQ(expect_every_node_has_a_cuda_kernel(m->graph, optimizer), 2 + 2 + 1 + 4) << amp;
  }
}

// Four SGD steps (with momentum) of the imported CNN on the GPU and on the CPU, from the file's
// initial params and running statistics: the losses, params, momentum buffers and BatchNorm's
// running statistics agree. Not AdamW: the bias of the convolution before BatchNorm has a zero
// gradient in exact arithmetic, which AdamW's normalization would turn into updates of +-lr in
// the direction of each device's rounding noise.
TEST(CudaCnn, ImportedOnnxCnnTrainsAsOnTheCpu) {
  KILN_REQUIRE_GPU();
  std::string why_not;
  const std::optional<onnx::ImportedModel> m = import_onnx_cnn(why_not);
  if (!m) GTEST_SKIP() << why_not;
  std::vector<Tensor> params;
  for (const GraphInput& in : m->graph.inputs)
    if (in.role == Role::kParam) params.push_back(m->initial_values.at(m->graph.value(in.value).name));
  OptimizerConfig sgd;
  sgd.name = "sgd";
  sgd.lr = 0.05;
  train::Trainer cpu(m->graph, sgd, params), gpu(m->graph, sgd, params, on_gpu());
  int state = 0;
  for (const GraphInput& in : m->graph.inputs) {
    if (in.role != Role::kState) continue;
    const std::string& name = m->graph.value(in.value).name;
    cpu.set_initial_value(name, m->initial_values.at(name));
    gpu.set_initial_value(name, m->initial_values.at(name));
    ++state;
  }
  EXPECT_EQ(state, 2);  // the running mean and variance
  std::vector<std::vector<Tensor>> batches;
  for (int s = 0; s < 4; ++s)
    batches.push_back({random_tensor({DType::kF32, {4, 4, 11, 10}}, 70 + s, -1.0, 1.0),
                       random_tensor({DType::kI64, {4}}, 80 + s, 0, 10)});
  expect_trainers_agree(cpu, gpu, batches);
}

}  // namespace
}  // namespace kiln
