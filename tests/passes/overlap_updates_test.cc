// The overlap-updates pass (passes/overlap_updates.h) on training steps compiled for CUDA (no
// GPU needed: the pipeline only): the updates come in chunks by the readiness of their
// gradients, each moves up into the backward pass and is marked for the update stream; the step
// computes the same bits as without the pass (reference kernels), every update is still written
// in place, the marked nodes' inputs live to the end of the step in the memory plan, the planned
// arena does not grow, and under global-norm clipping no update runs beside the backward's products. The fused op takes the
// stream attribute on a multi-tensor-update only.
#include "passes/overlap_updates.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>

#include "analysis/memory_plan.h"
#include "compile/compile_step.h"
#include "ir/verifier.h"
#include "models/models.h"
#include "ops/fused/kind.h"
#include "ops/update_stream.h"
#include "simplify/simplify_test_util.h"

namespace kiln {
namespace {

using testing::bitwise_equal;
using testing::random_inputs;
using testing::run_step;

// gpt2-tiny's AdamW step through the CUDA pipeline, with a cost model whose chunks hold a few
// thousand bytes (the defaults' ~260 MB would make the whole tiny model one chunk), at a batch
// whose activations outweigh the gradients, as a real model's do (else the pass rightly keeps
// most gradients from living to the end).
// KILN_OVERLAP_UPDATES=1 while it lives (the pass is off by default).
struct OverlapOn {
  OverlapOn() { ::setenv("KILN_OVERLAP_UPDATES", "1", 1); }
  ~OverlapOn() { ::unsetenv("KILN_OVERLAP_UPDATES"); }
};

StepProgram cuda_step(bool overlap, double grad_clip = 0) {
  std::optional<OverlapOn> on;
  if (overlap) on.emplace();
  CompileOptions options;
  options.optimizer.name = "adamw";
  options.optimizer.grad_clip = grad_clip;
  options.executor.device = Device::kCuda;
  options.bind_kernels = false;
  CostModel costs = CostModel::defaults(Device::kCuda);
  costs.bytes_per_s = 4e3 / (25 * costs.launch_s);  // update_chunk_bytes: 4 kB
  options.passes.costs = costs;
  if (!overlap) options.passes.disabled = {"overlap-updates"};
  return compile_step(models::by_name("gpt2-tiny", 8, 64), options).program;
}

std::vector<size_t> marked_nodes(const Graph& graph) {
  std::vector<size_t> out;
  for (size_t n = 0; n < graph.nodes.size(); ++n)
    if (on_update_stream(graph.nodes[n])) out.push_back(n);
  return out;
}

bool is_product(const Node& node) {
  if (node.op == Op::kMatmul) return true;
  if (node.body)
    for (const Node& inner : node.body->nodes)
      if (inner.op == Op::kMatmul) return true;
  return false;
}

TEST(OverlapUpdates, UpdatesRunBesideTheBackwardAndComputeTheSame) {
  const StepProgram on = cuda_step(true), off = cuda_step(false);
  const Graph& g = on.graph;
  verify(g);
  const std::vector<size_t> marked = marked_nodes(g);
  // Several chunks, each a multi-tensor-update, several with products of the backward pass after
  // them (the last layer's weights are final long before the embeddings' are).
  ASSERT_GE(marked.size(), 3u);
  size_t beside_products = 0;
  for (size_t n : marked) {
    EXPECT_TRUE(is_fused(g.nodes[n], FusedKind::kMultiTensorUpdate)) << n;
    bool product_after = false;
    for (size_t k = n + 1; k < g.nodes.size(); ++k) product_after = product_after || is_product(g.nodes[k]);
    beside_products += product_after;
  }
  EXPECT_GE(beside_products, 3u);
  EXPECT_LT(marked.front(), g.nodes.size() * 2 / 3);
  EXPECT_TRUE(marked_nodes(off.graph).empty());
  // Off by default: without the variable the pipeline marks nothing either.
  CompileOptions plain;
  plain.executor.device = Device::kCuda;
  plain.bind_kernels = false;
  EXPECT_TRUE(marked_nodes(compile_step(models::by_name("gpt2-tiny", 8, 64), plain).program.graph).empty());

  // The same step, bit for bit: outputs and every updated param and moment.
  const std::vector<Tensor> inputs = random_inputs(g, 11, 0, 50);
  EXPECT_TRUE(bitwise_equal(run_step(g, inputs), run_step(off.graph, inputs)));

  // Every update still written straight into its param or state (the moves kept each read of
  // an old value before its update), and the arena no larger than without the pass.
  Executor executor(g, ExecutorOptions{Device::kCpu}), without(off.graph, ExecutorOptions{Device::kCpu});
  EXPECT_EQ(executor.direct_update_count(), without.direct_update_count());
  EXPECT_GE(executor.direct_update_count(), g.updates.size() - 1);  // all but the step count's
  EXPECT_LE(plan_step_memory(g).arena_bytes, plan_step_memory(off.graph).arena_bytes);

  // A marked node's inputs that the step makes (its gradients) live to the end of the step (the
  // compute stream joins it there); graph inputs (params, moments, lr) are last read by it.
  const Liveness live = compute_liveness(g);
  for (size_t n : marked)
    for (ValueId id : g.nodes[n].inputs)
      if (g.input_index(id) >= 0)
        EXPECT_LT(live.last[id], static_cast<int>(g.nodes.size())) << "node " << n << " input %" << g.value(id).name;
      else
        EXPECT_EQ(live.last[id], static_cast<int>(g.nodes.size())) << "node " << n << " input %" << g.value(id).name;
}

TEST(OverlapUpdates, GlobalNormClippingLeavesNothingToOverlap) {
  // Every update is scaled by a factor of all the gradients: none is ready before the backward
  // pass ends, so none runs beside a product of it (at most beside the other gradients' scaling).
  const Graph g = cuda_step(true, 1.0).graph;
  for (size_t n : marked_nodes(g))
    for (size_t k = n + 1; k < g.nodes.size(); ++k) EXPECT_FALSE(is_product(g.nodes[k])) << "node " << n << ", product " << k;
  const std::vector<Tensor> inputs = random_inputs(g, 12, 0, 50);
  EXPECT_TRUE(bitwise_equal(run_step(g, inputs), run_step(cuda_step(false, 1.0).graph, inputs)));
}

TEST(OverlapUpdates, OnlyAMultiTensorUpdateTakesTheStreamAttribute) {
  Graph g = cuda_step(true).graph;
  const std::vector<size_t> marked = marked_nodes(g);
  ASSERT_FALSE(marked.empty());
  // Another stream name.
  Graph other = g;
  other.nodes[marked[0]].attrs.set("stream", std::string("side"));
  EXPECT_THROW(verify(other), Error);
  // Another fused kind.
  Graph gemm = g;
  for (Node& node : gemm.nodes)
    if (node.op == Op::kFused && !is_fused(node, FusedKind::kMultiTensorUpdate)) {
      node.attrs.set("stream", std::string(kUpdateStream));
      break;
    }
  EXPECT_THROW(verify(gemm), Error);
}

}  // namespace
}  // namespace kiln
