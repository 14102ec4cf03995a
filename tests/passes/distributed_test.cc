// The distribution passes (passes/distributed/): bucket-collectives and overlap-collectives on
// whole sharded steps. That they change no result is tests/distributed/sharded_training_test.cc
// (DistributionPasses, bitwise with the passes on and off, Gloo); the IR-text tests of each
// pass on its own are tests/passes/kir/{bucket,overlap}_collectives_*.kir.
#include <map>

#include "analysis/cost_model.h"
#include "analysis/memory_plan.h"
#include "compile/training_graph.h"
#include "ir/verifier.h"
#include "models/models.h"
#include "ops/collective.h"
#include "passes/distributed/bucketing.h"
#include "passes/distributed/overlap.h"
#include "passes/pipeline.h"
#include "test_util.h"

namespace kiln {
namespace {

std::map<Op, size_t> collective_counts(const Graph& g) {
  std::map<Op, size_t> n;
  for (const Node& node : g.nodes)
    if (has_flag(node.op, kCollective)) ++n[node.op];
  return n;
}

// Bytes moved per kind of collective.
std::map<Op, double> collective_bytes_by_op(const Graph& g) {
  std::map<Op, double> bytes;
  for (const Node& node : g.nodes)
    if (has_flag(node.op, kCollective)) bytes[node.op] += collective_bytes(g, node);
  return bytes;
}

// A sharded GPT-2 step through the pipeline up to (not including) the distribution passes.
Graph scheduled_step(ShardMode mode, Device target, const std::string& model = "gpt2-tiny") {
  OptimizerConfig config;
  config.amp = target == Device::kCuda ? "bf16" : "off";
  StepProgram p = build_training_graph(models::by_name(model, 4), config, ShardingOptions{mode, 2});
  PassOptions options;
  options.target = target;
  options.disabled = {"bucket-collectives", "overlap-collectives"};
  default_pipeline(options).run(p.graph);
  return p.graph;
}

TEST(BucketCollectives, MergesEveryModesCollectivesKeepingTheBytesMoved) {
  for (Device target : {Device::kCpu, Device::kCuda}) {
    for (ShardMode mode : {ShardMode::kDp, ShardMode::kZero1, ShardMode::kZero2, ShardMode::kZero3}) {
      SCOPED_TRACE(fmt::format("{} {}", shard_mode_name(mode), target == Device::kCuda ? "cuda" : "cpu"));
      Graph g = scheduled_step(mode, target);
      const std::map<Op, size_t> before = collective_counts(g);
      const std::map<Op, double> bytes = collective_bytes_by_op(g);
      BucketCollectives pass(CostModel::defaults(target));
      EXPECT_TRUE(pass.run(g));
      verify(g);
      const std::map<Op, size_t> after = collective_counts(g);
      size_t total_before = 0, total_after = 0;
      for (auto [op, n] : before) total_before += n;
      for (auto [op, n] : after) total_after += n;
      EXPECT_LT(total_after, total_before);
      // Merging concatenates: every kind moves exactly the bytes it moved before.
      EXPECT_EQ(collective_bytes_by_op(g), bytes);
      ASSERT_EQ(pass.notes().size(), 1u);
      EXPECT_NE(pass.notes()[0].find("collectives merged into"), std::string::npos);
    }
  }
}

TEST(BucketCollectives, LeavesBandwidthBoundCollectivesApart) {
  // Two 64 MiB gathers: merged they would take ~2x one alone (DeepCompile's 1.2x rule says no);
  // two 4 KiB ones are latency: merged.
  for (int64_t n : {int64_t{8} << 20, int64_t{512}}) {
    Builder b("gathers");
    Expr x = b.data("x", {2 * n});
    Expr a = all_gather(b.param("a", {n}), 2), c = all_gather(b.param("c", {n}), 2);
    b.graph().outputs.push_back(sum(x * a + x * c).id());
    Graph g = b.take();
    BucketCollectives pass(CostModel::defaults(Device::kCuda));
    EXPECT_EQ(pass.run(g), n < 1024) << n;
    EXPECT_EQ(collective_counts(g)[Op::kAllGather], n < 1024 ? 1u : 2u) << n;
  }
}

TEST(BucketCollectives, NeverBucketsAParamsForwardAndBackwardGathers) {
  // zero3 gathers each shard before the forward and again before the backward; a bucket holding
  // both would keep the gathered value alive across the loss.
  Graph g = scheduled_step(ShardMode::kZero3, Device::kCpu);
  BucketCollectives(CostModel::defaults(Device::kCpu)).run(g);
  for (const Node& node : g.nodes) {
    if (node.op != Op::kConcat) continue;
    std::vector<ValueId> ins = node.inputs;
    std::sort(ins.begin(), ins.end());
    EXPECT_EQ(std::adjacent_find(ins.begin(), ins.end()), ins.end());
  }
}

TEST(OverlapCollectives, HidesCommunicationWithinTheMemoryLimit) {
  for (ShardMode mode : {ShardMode::kDp, ShardMode::kZero2, ShardMode::kZero3}) {
    SCOPED_TRACE(std::string(shard_mode_name(mode)));
    Graph g = scheduled_step(mode, Device::kCuda);
    const CostModel costs = CostModel::defaults(Device::kCuda);
    const OverlapPrediction scheduled = predict_step(g, costs);
    BucketCollectives(costs).run(g);
    const OverlapPrediction before = predict_step(g, costs);
    const size_t arena = plan_memory(g).arena_bytes;
    OverlapCollectives(costs, std::nullopt).run(g);  // (bucketing may have left nothing to move)
    verify(g);
    const OverlapPrediction after = predict_step(g, costs);
    EXPECT_LE(after.exposed_s(), before.exposed_s());
    EXPECT_LT(after.exposed_s(), scheduled.exposed_s());  // the two passes together hide some
    EXPECT_NEAR(after.compute_s, before.compute_s, 1e-12);  // the same nodes
    EXPECT_LE(plan_memory(g).arena_bytes, arena + arena / 20);
  }
}

TEST(OverlapCollectives, AMemoryBudgetAtTheArenaKeepsTheArena) {
  Graph g = scheduled_step(ShardMode::kZero3, Device::kCuda);
  const CostModel costs = CostModel::defaults(Device::kCuda);
  BucketCollectives(costs).run(g);
  const size_t arena = plan_memory(g).arena_bytes;
  OverlapCollectives(costs, arena).run(g);
  verify(g);
  EXPECT_LE(plan_memory(g).arena_bytes, arena);
}

TEST(OverlapCollectives, PredictionCountsWaitsOnTheCommunicationStream) {
  // x -> exp -> all_reduce, then a wait right away: the compute stream waits the whole transfer.
  Builder b("one");
  Expr x = b.data("x", {1 << 20});
  Expr y = all_reduce(exp(x), 2);
  b.graph().outputs.push_back(sum(y).id());
  const Graph g = b.take();
  const CostModel costs = CostModel::defaults(Device::kCuda);
  const OverlapPrediction p = predict_step(g, costs);
  double comm = 0;
  for (const Node& node : g.nodes)
    if (has_flag(node.op, kCollective)) comm += costs.collective_seconds(g, node);
  EXPECT_GT(comm, 0);
  EXPECT_NEAR(p.exposed_s(), comm, 1e-12);
}

}  // namespace
}  // namespace kiln
