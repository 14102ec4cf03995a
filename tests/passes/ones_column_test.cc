// The ones-column pass on whole training graphs prepared for CUDA (run here on the CPU's
// reference kernels): every qkv / fc bias gradient of gpt2-tiny comes out of its weight-gradient
// GEMM (no column sum left for them; each LayerNorm output feeding them padded with ones; the
// forward products read it through a prefix slice), and the step computes what it did without
// the pass: the loss bit for bit, every gradient (SGD without momentum hands out the gradient
// as the new momentum buffer) the same up to one 16-bit rounding of the bias gradients. An
// activation with a reader the pass cannot rewrite is left alone; the pad keeps rows 16-byte
// aligned.
#include "passes/ones_column.h"

#include <gtest/gtest.h>

#include "models/models.h"
#include "passes/pipeline.h"
#include "simplify/simplify_test_util.h"
#include "compile/training_graph.h"

namespace kiln {
namespace {

using testing::random_inputs;
using testing::relatively_close;
using testing::run_step;

struct Counts {
  int padded = 0;       // fused bodies writing concat(x, full(1))
  int sliced = 0;       // fused bodies reading x[..., :K]
  int column_sums = 0;  // standalone sums over every axis but the last
  int row_slices = 0;   // slices of a weight-gradient product (dW and db)
};

Counts count(const Graph& g) {
  Counts c;
  for (const Node& node : g.nodes) {
    if (node.op == Op::kSum && g.type(node.inputs[0]).rank() >= 2 &&
        g.type(node.outputs[0]).rank() == 1)
      ++c.column_sums;
    if (node.op == Op::kSlice) ++c.row_slices;
    if (node.op != Op::kFused || !node.body) continue;
    for (const Node& n : node.body->nodes) {
      c.padded += n.op == Op::kConcat;
      c.sliced += n.op == Op::kSlice;
    }
  }
  return c;
}

StepProgram training(const std::string& amp) {
  OptimizerConfig config;
  config.name = "sgd";
  config.hyper["momentum"] = 0.0;  // the new momentum buffer is the gradient itself
  config.amp = amp;
  return build_training_graph(models::by_name("gpt2-tiny", 4, 0), config);
}

Graph prepared(const StepProgram& program, bool with_pass) {
  PassOptions options;
  options.target = Device::kCuda;
  if (!with_pass) options.disabled = {"ones-column"};
  Graph g = program.graph;
  default_pipeline(options).run(g);
  return g;
}

// f16's loss scaling puts the unscaling multiplies after the weight-gradient products (and the
// sums): the pass does not match them, and the step must stay the same.
void check(const std::string& amp, bool rewritten) {
  SCOPED_TRACE("amp " + amp);
  const StepProgram program = training(amp);
  const Graph without = prepared(program, false), with_pass = prepared(program, true);
  const int layers = rewritten ? 2 : 0;  // gpt2-tiny's
  const Counts a = count(without), b = count(with_pass);
  // ln1 -> qkv and ln2 -> fc in each layer: padded once, sliced once, their sums gone, and two
  // slices (dW, db) of each weight-gradient product.
  EXPECT_EQ(b.padded - a.padded, 2 * layers);
  EXPECT_EQ(b.sliced - a.sliced, 2 * layers);
  EXPECT_EQ(a.column_sums - b.column_sums, 2 * layers);
  EXPECT_EQ(b.row_slices - a.row_slices, 4 * layers);

  const std::vector<Tensor> inputs = random_inputs(program.graph, 31, 0, 256);
  const std::vector<Tensor> want = run_step(without, inputs), got = run_step(with_pass, inputs);
  ASSERT_EQ(got.size(), want.size());
  // The loss: the forward products read exactly the activation they read before.
  EXPECT_EQ(got[0].get(0), want[0].get(0));
  if (!rewritten) {
    EXPECT_TRUE(testing::bitwise_equal(got, want));
    return;
  }
  // Then per param: the param, its momentum buffer (the gradient). A bias gradient summed in
  // f32 by the GEMM differs from the 16-bit sum by one rounding of it (2^-8 relative for bf16).
  const double rtol = amp == "off" ? 1e-5 : 1e-2;
  for (size_t i = 1; i < got.size(); ++i) {
    SCOPED_TRACE("result " + std::to_string(i));
    EXPECT_TRUE(relatively_close({got[i]}, {want[i]}, rtol));
  }
}

TEST(OnesColumnPass, Gpt2TinyBiasGradientsComeFromTheWeightGradientGemm) {
  check("off", true);
  check("bf16", true);
  check("f16", false);
}

TEST(OnesColumnPass, NotOnTheCpu) {
  const StepProgram program = training("bf16");
  Graph g = program.graph;
  default_pipeline().run(g);
  EXPECT_EQ(count(g).padded, 0);
}

// A LayerNorm output that is also a graph output keeps its shape: that layer keeps its sum.
TEST(OnesColumnPass, ActivationWithAnotherReaderIsLeftAlone) {
  const StepProgram program = training("bf16");
  // The graph as the pass sees it in the pipeline: right after fusion.
  PassOptions options;
  options.target = Device::kCuda;
  options.disabled = {"ones-column", "multi-tensor", "schedule"};
  Graph g = program.graph;
  default_pipeline(options).run(g);
  // The first padded-to-be activation: the first "rows" node's output (ln1 of layer 0).
  ValueId x = -1;
  for (const Node& node : g.nodes)
    if (node.op == Op::kFused && node.attrs.s("kind") == "rows") {
      x = node.outputs[0];
      break;
    }
  ASSERT_GE(x, 0);
  g.outputs.push_back(x);
  const Counts before = count(g);
  OnesColumnPass pass;
  EXPECT_TRUE(pass.run(g));
  const Counts after = count(g);
  EXPECT_EQ(after.padded - before.padded, 3);
  EXPECT_EQ(before.column_sums - after.column_sums, 3);
  EXPECT_EQ(g.type(g.outputs.back()).shape.back(), 64);  // gpt2-tiny's width, unpadded
}

TEST(OnesColumnPass, PadKeepsRowsSixteenByteAligned) {
  EXPECT_EQ(ones_column_pad(768, DType::kBF16), 8);
  EXPECT_EQ(ones_column_pad(768, DType::kF32), 4);
  EXPECT_EQ(ones_column_pad(1023, DType::kF16), 1);
  EXPECT_EQ(ones_column_pad(5, DType::kF32), 3);
  EXPECT_EQ(ones_column_pad(4, DType::kF64), 2);
}

}  // namespace
}  // namespace kiln
