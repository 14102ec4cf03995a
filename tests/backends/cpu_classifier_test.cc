// The fused classifier's CPU kernel (backends/cpu/classifier.cc) against the fused reference
// kernel (ops/fused.cc: the body's reference kernels in f64) on random inputs: vocabularies from
// 1 to 4099 (odd sizes included), f32/bf16/f16 logits, a 16-bit gradient from f32 logits, i32 and
// i64 labels, every reduction, ignored rows; also in place (the gradient over the logits, and
// "none"'s loss over dloss, as the memory plan may place them), a label out of range, and rows
// that are all ignored. Then gpt2-tiny training steps with the pass on and off.
//
// Tolerances: the kernel computes in f32 (exp_f32 within ~2 ulp, sums of f32 blocks in f64), the
// reference in f64. Loss: rtol 1e-5. Gradient: atol 1e-6 * max |gradient| (elements near 0 after
// the cancellation at the label) plus rtol 1e-5 in f32; a 16-bit gradient is rounded once by
// each side from values that differ in f32, so they may land one ulp apart: rtol 2^-7 (bf16),
// 2^-10 (f16).
#include <gtest/gtest.h>

#include <cmath>

#include "backends/backend.h"
#include "backends/classifier_test_util.h"
#include "models/models.h"
#include "test_util.h"
#include "train/trainer.h"

namespace kiln {
namespace {

using testing::ClassifierCase;
using testing::classifier_graph;
using testing::classifier_inputs;

const KernelImpl& cpu_kernel(const Graph& g) {
  const Node& node = g.nodes.at(0);
  std::vector<TensorType> in, out;
  for (ValueId id : node.inputs) in.push_back(g.type(id));
  for (ValueId id : node.outputs) out.push_back(g.type(id));
  return kernel_registry().select(NodeView{node, in, out}, Device::kCpu, {"cpu"});
}

std::vector<Tensor> outputs_of(const Graph& g) {
  std::vector<Tensor> out;
  for (ValueId id : g.nodes.at(0).outputs) out.emplace_back(g.type(id));
  return out;
}

std::vector<Tensor> run_reference(const Graph& g, const std::vector<Tensor>& inputs) {
  std::vector<Tensor> out = outputs_of(g);
  const Node& node = g.nodes.at(0);
  op_def(Op::kFused).reference(KernelArgs{node.attrs, inputs, out, nullptr, node.body.get()});
  return out;
}

double grad_rtol(DType d) {
  return d == DType::kBF16 ? 1.0 / 128 : d == DType::kF16 ? 1.0 / 1024 : 1e-5;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.get(i)));
  return m;
}

void expect_close(const std::vector<Tensor>& got, const std::vector<Tensor>& want,
                  const ClassifierCase& c) {
  ASSERT_EQ(got.size(), 2u);
  EXPECT_TRUE(testing::all_close(got[0], want[0], 1e-6, 1e-5)) << "loss, " << c.describe();
  EXPECT_TRUE(testing::all_close(got[1], want[1], 1e-6 * max_abs(want[1]), grad_rtol(c.grad)))
      << "gradient, " << c.describe();
}

std::vector<ClassifierCase> cases() {
  std::vector<ClassifierCase> out;
  const std::pair<DType, DType> types[] = {{DType::kF32, DType::kF32},
                                           {DType::kBF16, DType::kBF16},
                                           {DType::kF16, DType::kF16},
                                           {DType::kF32, DType::kBF16}};
  const int64_t vocabs[] = {1, 7, 33, 256, 1000, 4099};
  const char* reductions[] = {"mean", "sum", "none"};
  int k = 0;
  for (auto [logits, grad] : types)
    for (int64_t vocab : vocabs) {
      ClassifierCase c;
      c.logits = logits;
      c.grad = grad;
      c.vocab = vocab;
      c.labels = k % 2 ? DType::kI32 : DType::kI64;
      c.reduction = reductions[k % 3];
      c.rows = k % 2 ? Shape{2, 3} : Shape{7};
      ++k;
      out.push_back(c);
    }
  return out;
}

TEST(CpuClassifier, MatchesFusedReference) {
  uint64_t seed = 100;
  for (const ClassifierCase& c : cases()) {
    SCOPED_TRACE(c.describe());
    Graph g = classifier_graph(c);
    const KernelImpl& impl = cpu_kernel(g);
    EXPECT_EQ(impl.dialect, "cpu");
    EXPECT_TRUE(impl.in_place_ok);  // the classifier kernel, not the generic fused one
    const std::vector<Tensor> inputs = classifier_inputs(g, c, seed += 10);
    std::vector<Tensor> got = outputs_of(g);
    const Node& node = g.nodes[0];
    impl.kernel(KernelArgs{node.attrs, inputs, got, nullptr, node.body.get()});
    expect_close(got, run_reference(g, inputs), c);
  }
}

TEST(CpuClassifier, RunsInPlace) {
  for (ClassifierCase c : cases()) {
    if (c.grad != c.logits) continue;  // in place needs the same type
    c.reduction = "none";              // also the loss over dloss
    SCOPED_TRACE(c.describe());
    Graph g = classifier_graph(c);
    const std::vector<Tensor> inputs = classifier_inputs(g, c, 7);
    const std::vector<Tensor> want = run_reference(g, inputs);
    // Copies share storage: outputs[1] is the logits buffer, outputs[0] the dloss buffer.
    std::vector<Tensor> shared = {inputs[0].clone(), inputs[1], inputs[2].clone()};
    std::vector<Tensor> outs = {shared[2], shared[0]};
    const Node& node = g.nodes[0];
    cpu_kernel(g).kernel(KernelArgs{node.attrs, shared, outs, nullptr, node.body.get()});
    EXPECT_EQ(outs[1].raw(), shared[0].raw());
    expect_close(outs, want, c);
  }
}

TEST(CpuClassifier, HandCheckedTwoClassRow) {
  // Logits (0, ln 3) with label 1: softmax (1/4, 3/4), loss -ln(3/4) = ln(4/3); a second row is
  // ignored (label -100). Mean over the one counted row with dloss 2: gradient of row 0 is
  // 2 * (1/4, 3/4 - 1) = (0.5, -0.5); row 1 is 0.
  ClassifierCase c;
  c.rows = {2};
  c.vocab = 2;
  Graph g = classifier_graph(c);
  const std::vector<Tensor> inputs = {
      testing::make(DType::kF32, {2, 2}, {0.0, std::log(3.0), 5.0, -5.0}),
      testing::make(DType::kI64, {2}, {1, -100}), testing::make(DType::kF32, {}, {2.0})};
  std::vector<Tensor> out = outputs_of(g);
  const Node& node = g.nodes[0];
  cpu_kernel(g).kernel(KernelArgs{node.attrs, inputs, out, nullptr, node.body.get()});
  EXPECT_NEAR(out[0].get(0), std::log(4.0 / 3.0), 1e-6);
  const double want[] = {0.5, -0.5, 0.0, 0.0};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[1].get(i), want[i], 1e-6) << i;
}

TEST(CpuClassifier, AllRowsIgnoredGiveZeroLossAndGradient) {
  ClassifierCase c;
  c.vocab = 9;
  Graph g = classifier_graph(c);
  std::vector<Tensor> inputs = classifier_inputs(g, c, 3);
  for (int64_t r = 0; r < inputs[1].numel(); ++r) inputs[1].set(r, -100);
  std::vector<Tensor> out = outputs_of(g);
  const Node& node = g.nodes[0];
  cpu_kernel(g).kernel(KernelArgs{node.attrs, inputs, out, nullptr, node.body.get()});
  EXPECT_EQ(out[0].get(0), 0.0);
  EXPECT_EQ(max_abs(out[1]), 0.0);
  expect_close(out, run_reference(g, inputs), c);
}

TEST(CpuClassifier, LabelOutOfRangeIsAnError) {
  ClassifierCase c;
  c.vocab = 10;
  c.logits = c.grad = DType::kBF16;
  Graph g = classifier_graph(c);
  std::vector<Tensor> inputs = classifier_inputs(g, c, 5);
  inputs[1].set(2, 10);
  std::vector<Tensor> out = outputs_of(g);
  const Node& node = g.nodes[0];
  EXPECT_KILN_ERROR(
      cpu_kernel(g).kernel(KernelArgs{node.attrs, inputs, out, nullptr, node.body.get()}),
      "label 10 (row 2)", "out of range [0, 10)", "ignore_index -100");
  // The reference says the same.
  EXPECT_KILN_ERROR(run_reference(g, inputs), "label 10 (row 2)", "out of range [0, 10)");
}

// Losses of `steps` training steps of gpt2-tiny (batch 2) on one batch with these pass options.
std::vector<double> gpt2_tiny_losses(const std::string& amp, PassOptions passes, int steps,
                                     int* classifier_nodes) {
  models::GptConfig config = models::gpt_config("gpt2-tiny");
  config.batch = 2;
  Graph forward = models::gpt(config);
  OptimizerConfig opt;
  opt.amp = amp;
  opt.lr = 1e-3;
  train::Trainer trainer(forward, opt, models::init_params(forward, 3, config.layers), {},
                         std::move(passes));
  *classifier_nodes = 0;
  for (const Node& node : trainer.program().graph.nodes)
    *classifier_nodes += node.op == Op::kFused && node.attrs.s("kind") == "classifier";
  // One batch every step: the model learns it, so the loss falls.
  const Shape bt = {config.batch, config.seq};
  const std::vector<Tensor> batch = {random_tensor({DType::kI64, bt}, 50, 0, config.vocab),
                                     random_tensor({DType::kI64, bt}, 60, 0, config.vocab)};
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(trainer.step(batch)[0].get(0));
  return losses;
}

TEST(CpuClassifier, Gpt2TinyTrainingMatchesTheUnfusedLoss) {
  // Four steps: the same losses with the classifier pass as without it (then training-rewrites
  // decomposes the loss's gradient and fusion runs it), up to f32 rounding that training carries
  // along: rtol 1e-5 in f32. Under bf16 the 16-bit gradients of the two paths may round one ulp
  // apart, which moves later steps a little more: rtol 1e-3.
  for (const std::string amp : {"off", "bf16"}) {
    SCOPED_TRACE(amp);
    int fused = 0, unfused = 0;
    PassOptions off;
    off.disabled = {"classifier"};
    const std::vector<double> with = gpt2_tiny_losses(amp, {}, 4, &fused);
    const std::vector<double> without = gpt2_tiny_losses(amp, off, 4, &unfused);
    EXPECT_EQ(fused, 1);
    EXPECT_EQ(unfused, 0);
    const double rtol = amp == "off" ? 1e-5 : 1e-3;
    for (size_t s = 0; s < with.size(); ++s) {
      EXPECT_TRUE(std::isfinite(with[s]));
      EXPECT_NEAR(with[s], without[s], rtol * std::abs(without[s])) << "step " << s;
    }
    EXPECT_LT(with.back(), with.front());  // it trains
  }
}

}  // namespace
}  // namespace kiln
