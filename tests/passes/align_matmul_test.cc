// align-matmul (passes/align_matmul.h): a product of 1030 output columns becomes one of 1032 and a
// slice, for either weight layout; the loss and every gradient (autodiff of the rewritten graph)
// are those of the original graph (reference kernels, f64); narrow and aligned products
// are left alone; the CUDA forward pipeline runs it and the CPU's does not.
#include "passes/align_matmul.h"

#include <gtest/gtest.h>

#include "ir/text.h"
#include "passes/autodiff.h"
#include "passes/pipeline.h"
#include "simplify/simplify_test_util.h"

namespace kiln {
namespace {

using testing::contains;
using testing::expect_unchanged;
using testing::random_inputs;
using testing::relatively_close;
using testing::run_step;

// The loss and the gradients of every float input: autodiff of `g`, run on the reference kernels.
std::vector<Tensor> loss_and_gradients(const Graph& g, const std::vector<Tensor>& inputs) {
  std::vector<ValueId> wrt;
  for (const GraphInput& in : g.inputs)
    if (is_float(g.type(in.value).dtype)) wrt.push_back(in.value);
  AutodiffResult r = autodiff(g, g.outputs[0], wrt);
  r.graph.outputs = {g.outputs[0]};
  r.graph.outputs.insert(r.graph.outputs.end(), r.gradients.begin(), r.gradients.end());
  return run_step(r.graph, inputs);
}

// A head of `columns` outputs in the layout `weight` (w^T under transpose_b, or w), then a loss
// that weighs every logit differently (so each gradient entry differs).
std::string head(int64_t columns, bool transpose_b, const std::string& dtype = "f64") {
  const std::string w = transpose_b ? fmt::format("{}[{},16]", dtype, columns) : fmt::format("{}[16,{}]", dtype, columns);
  return fmt::format(
      "graph @g(%x: {0}[2,3,16] data, %w: {1} param, %s: {0}[2,3,{2}] data) {{\n"
      "  %y = matmul(%x, %w) {{transpose_b={3}}} : {0}[2,3,{2}]\n"
      "  %t = tanh(%y) : {0}[2,3,{2}]\n"
      "  %m = mul(%t, %s) : {0}[2,3,{2}]\n"
      "  %loss = sum(%m) : {0}[]\n"
      "  return %loss\n"
      "}}\n",
      dtype, w, columns, transpose_b ? "true" : "false");
}

TEST(AlignMatmul, PadsTheColumnsAndKeepsLossAndGradients) {
  for (bool transpose_b : {true, false}) {
    SCOPED_TRACE(transpose_b ? "w^T" : "w");
    const std::string text = head(1030, transpose_b);
    const Graph before = parse(text);
    Graph after = parse(text);
    AlignMatmul pass;
    ASSERT_TRUE(pass.run(after));
    verify(after);
    const std::string printed = print(after);
    EXPECT_TRUE(contains(printed, transpose_b ? "f64[1032,16]" : "f64[16,1032]"));
    EXPECT_TRUE(contains(printed, "f64[2,3,1032]"));
    EXPECT_TRUE(contains(printed, "slice("));
    EXPECT_EQ(pass.notes(), std::vector<std::string>{"1 product padded to a multiple of 8 columns"});
    const std::vector<Tensor> inputs = random_inputs(before, 11, 0, 1);
    EXPECT_TRUE(relatively_close(loss_and_gradients(after, inputs), loss_and_gradients(before, inputs), 1e-14));
  }
}

TEST(AlignMatmul, LeavesNarrowAndAlignedProductsAlone) {
  AlignMatmul pass;
  expect_unchanged(pass, head(1000, true));   // below 1024 columns
  expect_unchanged(pass, head(1032, true));   // aligned already
  expect_unchanged(pass, head(2048, false));
}

TEST(AlignMatmul, RunsInTheForwardPipelineOnCudaOnly) {
  PassOptions options;
  options.target = Device::kCuda;
  EXPECT_EQ(forward_pipeline(options).names(), (std::vector<std::string>{"recognize", "align-matmul"}));
  options.target = Device::kCpu;
  EXPECT_EQ(forward_pipeline(options).names(), std::vector<std::string>{"recognize"});
  // --disable-pass align-matmul reaches it.
  options.target = Device::kCuda;
  options.disabled = {"align-matmul"};
  Graph g = parse(head(1030, true));
  const std::string before = print(g);
  forward_pipeline(options).run(g);
  EXPECT_EQ(print(g), before);
}

}  // namespace
}  // namespace kiln
