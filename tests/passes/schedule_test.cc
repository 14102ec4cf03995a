// The schedule pass: IR text in, IR text out on a graph built for it (two chains interleaved),
// the arena it saves worked out by hand, an unchanged case, and valid, deterministic, no-worse
// orders on training graphs.
#include "passes/schedule.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "analysis/memory_plan.h"
#include "analysis/plan_check.h"
#include "ir/text.h"

namespace kiln {
namespace {

// Every node reads only graph inputs and values defined by earlier nodes.
::testing::AssertionResult topological(const Graph& g) {
  std::set<ValueId> defined;
  for (const GraphInput& in : g.inputs) defined.insert(in.value);
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    for (ValueId id : g.nodes[n].inputs)
      if (!defined.count(id))
        return ::testing::AssertionFailure() << "node " << n << " reads value " << id << " early";
    for (ValueId id : g.nodes[n].outputs) defined.insert(id);
  }
  return ::testing::AssertionSuccess();
}

// Every node as (op, inputs, outputs), sorted: equal for two orders of the same nodes.
std::vector<std::string> node_keys(const Graph& g) {
  std::vector<std::string> keys;
  for (const Node& n : g.nodes)
    keys.push_back(fmt::format("{} {} -> {}", op_name(n.op), fmt::join(n.inputs, ","),
                               fmt::join(n.outputs, ",")));
  std::sort(keys.begin(), keys.end());
  return keys;
}

// Two chains of 1 KiB values, written alternately: each step keeps three big buffers live.
const char* kInterleaved = R"(graph @two_chains(%x: f32[256] data, %y: f32[256] data) {
  %a1 = exp(%x) : f32[256]
  %b1 = exp(%y) : f32[256]
  %a2 = neg(%a1) : f32[256]
  %b2 = neg(%b1) : f32[256]
  %a3 = tanh(%a2) : f32[256]
  %b3 = tanh(%b2) : f32[256]
  %sa = sum(%a3) : f32[]
  %sb = sum(%b3) : f32[]
  %out = add(%sa, %sb) : f32[]
  return %out
}
)";

TEST(Schedule, RunsInterleavedChainsOneAfterTheOther) {
  Graph g = parse(kInterleaved);
  // Interleaved (hand-placed, largest first by start): a1 0, b1 1024, a2 2048, b2 0, a3 1024,
  // b3 2048; sa [6,8] clashes with a3 and b3: 0; sb [7,8] with b3 and sa: 64. 3 KiB.
  EXPECT_EQ(plan_memory(g).arena_bytes, 3072u);
  EXPECT_TRUE(SchedulePass().run(g));
  // Greedy: a1 (tie with b1, earlier); a2 and a3 free what they replace (net 0) and beat b1
  // (-1024); sa frees 1024 for 64; then the b chain.
  EXPECT_EQ(print(g), R"(graph @two_chains(%x: f32[256] data, %y: f32[256] data) {
  %a1 = exp(%x) : f32[256]
  %a2 = neg(%a1) : f32[256]
  %a3 = tanh(%a2) : f32[256]
  %sa = sum(%a3) : f32[]
  %b1 = exp(%y) : f32[256]
  %b2 = neg(%b1) : f32[256]
  %b3 = tanh(%b2) : f32[256]
  %sb = sum(%b3) : f32[]
  %out = add(%sa, %sb) : f32[]
  return %out
}
)");
  // Now a1 0, a2 1024, a3 0, b1 0, b2 1024, b3 0 (two big buffers); sa [3,8] clashes with a3,
  // b1, b2, b3: 2048; sb [7,8] with b3 and sa: 1024. 2 KiB + 64.
  EXPECT_EQ(plan_memory(g).arena_bytes, 2112u);
}

TEST(Schedule, UnchangedWhenTheOrderIsAlreadyBest) {
  const char* chain = R"(graph @chain(%x: f32[64] data) {
  %a = exp(%x) : f32[64]
  %b = neg(%a) : f32[64]
  %s = sum(%b) : f32[]
  return %s
}
)";
  Graph g = parse(chain);
  EXPECT_FALSE(SchedulePass().run(g));
  EXPECT_EQ(print(g), chain);
}

TEST(Schedule, UnchangedWhenGreedyWouldBeWorse) {
  // Greedy runs the small chain first (c1 costs 64, b1 1024), then holds its sum %cs while the
  // big chain runs: b1 + bs + cs = 1152 bytes at %bs. The original order peaks at b1 + bs =
  // 1088. The pass keeps the original order unless its own has a strictly lower peak.
  const char* text = R"(graph @keep(%x: f32[256] data, %y: f32[16] data) {
  %b1 = exp(%x) : f32[256]
  %bs = sum(%b1) : f32[]
  %c1 = exp(%y) : f32[16]
  %cs = sum(%c1) : f32[]
  %out = add(%bs, %cs) : f32[]
  return %out
}
)";
  Graph g = parse(text);
  EXPECT_EQ(peak_live_bytes(g, {2, 3, 0, 1, 4}), 1152u);
  EXPECT_EQ(peak_live_bytes(g, {0, 1, 2, 3, 4}), 1088u);
  EXPECT_FALSE(SchedulePass().run(g));
  EXPECT_EQ(print(g), text);
}

TEST(Schedule, PeakLiveBytesCountsBuffersFromNodeToLastReader) {
  Graph g = parse(kInterleaved);
  std::vector<int> identity(g.nodes.size());
  std::iota(identity.begin(), identity.end(), 0);
  // Interleaved: at a2 (node 2) a1, b1, a2 are live: 3 KiB. The output %out (64) is counted
  // too but never at the same time as three big ones.
  EXPECT_EQ(peak_live_bytes(g, identity), 3072u);
  // Chains one after the other (a1 a2 a3 sa b1 b2 b3 sb out): two 1 KiB buffers plus sa.
  EXPECT_EQ(peak_live_bytes(g, {0, 2, 4, 6, 1, 3, 5, 7, 8}), 2048u + 64u);
}

// A reshape the memory plan makes a view has no bytes of its own: its input lives until the
// view's last reader instead. %a (1 KiB) is read through %r by %s and directly by %u:
// a [0, 3], s [2, 5], u [3, 5], out (an output, 64) from 5 to the end; at node 3 a + s + u =
// 1152. (Counting %r as a 1 KiB buffer of its own gave a + r + s = 2112 at node 2.)
TEST(Schedule, PeakLiveBytesGivesViewsNoBytes) {
  Graph g = parse(R"(graph @views(%x: f32[256] data) {
  %a = exp(%x) : f32[256]
  %r = reshape(%a) {shape=[16, 16]} : f32[16,16]
  %s = sum(%r) : f32[]
  %u = sum(%a) : f32[]
  %out = add(%s, %u) : f32[]
  return %out
}
)");
  EXPECT_EQ(peak_live_bytes(g, {0, 1, 2, 3, 4}), 1152u);
  EXPECT_EQ(planned_arena_bytes(g, {0, 1, 2, 3, 4}), plan_step_memory(g).arena_bytes);
}

// The pass ranks orders by the arena the executor plans (plan_step_memory: updates written
// straight into their targets hold no bytes to the end): never above the original order's, and
// planned_arena_bytes is that plan of the reordered graph.
TEST(Schedule, NeverRaisesThePlannedArena) {
  std::vector<Graph> graphs;
  for (uint64_t seed = 1; seed <= 30; ++seed) graphs.push_back(testing::random_graph(seed, 80));
  for (const char* model : {"mlp", "gpt2-tiny", "cnn"})
    graphs.push_back(testing::training_graph(model, 4).graph);
  for (const Graph& g : graphs) {
    Graph scheduled = g;
    SchedulePass().run(scheduled);
    EXPECT_LE(plan_step_memory(scheduled).arena_bytes, plan_step_memory(g).arena_bytes) << g.name;
    const std::vector<int> order = memory_aware_order(g);
    EXPECT_EQ(planned_arena_bytes(g, order), plan_step_memory(scheduled).arena_bytes) << g.name;
  }
}

TEST(Schedule, TrainingGraphsGetValidDeterministicNoWorseOrders) {
  for (auto [model, batch] : {std::pair<const char*, int64_t>{"mlp", 64}, {"gpt2-tiny", 4},
                              {"cnn", 8}}) {
    Graph g = testing::training_graph(model, batch).graph;
    std::vector<int> identity(g.nodes.size());
    std::iota(identity.begin(), identity.end(), 0);
    std::vector<int> order = memory_aware_order(g);
    EXPECT_EQ(order, memory_aware_order(g)) << model;
    EXPECT_LE(planned_arena_bytes(g, order), planned_arena_bytes(g, identity)) << model;
    Graph scheduled = g;
    SchedulePass().run(scheduled);
    EXPECT_TRUE(topological(scheduled)) << model;
    EXPECT_EQ(scheduled.nodes.size(), g.nodes.size()) << model;
    EXPECT_EQ(node_keys(scheduled), node_keys(g)) << model;
  }
}

TEST(Schedule, RandomGraphsGetValidOrders) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    Graph g = testing::random_graph(seed, 80);
    Graph scheduled = g;
    SchedulePass().run(scheduled);
    EXPECT_TRUE(topological(scheduled)) << "seed " << seed;
    std::vector<int> identity(g.nodes.size());
    std::iota(identity.begin(), identity.end(), 0);
    EXPECT_LE(peak_live_bytes(scheduled, identity), peak_live_bytes(g, identity)) << seed;
  }
}

}  // namespace
}  // namespace kiln
