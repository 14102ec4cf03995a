// The memory plan: liveness, arena offsets worked out by hand on small graphs, in-place reuse and
// the cases that must refuse it, and on random and training graphs that no two values live at
// one node share bytes.
#include "runtime/memory_plan.h"

#include "ir/text.h"
#include "passes/schedule.h"
#include "runtime/executor.h"
#include "runtime/plan_check.h"

namespace kiln {
namespace {

ValueId id_of(const Graph& g, const std::string& name) {
  for (size_t v = 0; v < g.values.size(); ++v)
    if (g.values[v].name == name) return static_cast<ValueId>(v);
  ADD_FAILURE() << "no value named " << name;
  return -1;
}

const InPlacePredicate kAlways = [](size_t, size_t) { return true; };

// Node indices:          0      1      2      3       4      5
const char* kLivenessGraph = R"(
graph @live(%x: f32[16] data, %w: f32[16] param) {
  %a = exp(%x)
  %b = mul(%a, %w)
  %c = neg(%b)
  %unused = sqrt(%a)
  %d = add(%c, %a)
  %s = sum(%d)
  update %w = %c
  return %s
}
)";

TEST(Liveness, DefinitionAndLastUseOnAHandBuiltGraph) {
  Graph g = parse(kLivenessGraph);
  Liveness l = compute_liveness(g);
  struct Expected { const char* name; int def, last; };
  // Graph inputs: no definition; %c is an update value and %s an output: both live past the
  // last node (6); %unused is never read: it dies where it is made.
  for (Expected e : {Expected{"x", -1, 0}, {"w", -1, 1}, {"a", 0, 4}, {"b", 1, 2}, {"c", 2, 6},
                     {"unused", 3, 3}, {"d", 4, 5}, {"s", 5, 6}}) {
    EXPECT_EQ(l.def[id_of(g, e.name)], e.def) << e.name;
    EXPECT_EQ(l.last[id_of(g, e.name)], e.last) << e.name;
  }
}

TEST(MemoryPlan, OffsetsOnAHandBuiltGraph) {
  Graph g = parse(kLivenessGraph);
  MemoryPlan plan = plan_memory(g);
  // Every value is 16 f32 = 64 bytes. Lifetimes: a [0,4], b [1,2], c [2,6], unused [3,3],
  // d [4,5]. In order of start: a at 0; b clashes with a: 64; c with a, b: 128; unused with a
  // and c (b is dead by 3): 64; d with a (at 4) and c: 64 (unused ended at 3).
  EXPECT_EQ(plan.offsets[id_of(g, "a")], 0);
  EXPECT_EQ(plan.offsets[id_of(g, "b")], 64);
  EXPECT_EQ(plan.offsets[id_of(g, "c")], 128);
  EXPECT_EQ(plan.offsets[id_of(g, "unused")], 64);
  EXPECT_EQ(plan.offsets[id_of(g, "d")], 64);
  // Inputs are the caller's and outputs get their own buffers.
  for (const char* name : {"x", "w", "s"}) EXPECT_FALSE(plan.in_arena(id_of(g, name))) << name;
  EXPECT_EQ(plan.arena_bytes, 192u);
  EXPECT_EQ(plan.naive_bytes, 5 * 64u);
  EXPECT_EQ(plan.live_peak_bytes, 192u);  // nodes 2, 3 and 4 each hold three buffers
  EXPECT_EQ(plan.in_place_count, 0u);
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

TEST(MemoryPlan, InPlaceWhereTheInputDiesAtTheNode) {
  Graph g = parse(kLivenessGraph);
  MemoryPlan plan = plan_memory(g, kAlways);
  // neg(b): b dies there, so c takes b's bytes; add(c, a): a dies there (c lives on), so d
  // takes a's. mul(a, w) cannot: a lives on and w is a graph input.
  EXPECT_EQ(plan.reuses[id_of(g, "c")], id_of(g, "b"));
  EXPECT_EQ(plan.reuses[id_of(g, "d")], id_of(g, "a"));
  EXPECT_EQ(plan.reuses[id_of(g, "b")], -1);
  EXPECT_EQ(plan.in_place_count, 2u);
  EXPECT_EQ(plan.offsets[id_of(g, "c")], plan.offsets[id_of(g, "b")]);
  EXPECT_EQ(plan.offsets[id_of(g, "d")], plan.offsets[id_of(g, "a")]);
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

const char* kChain = R"(
graph @chain(%x: f32[64] data) {
  %a = exp(%x)
  %b = neg(%a)
  %c = tanh(%b)
  %s = sum(%c)
  return %s
}
)";

TEST(MemoryPlan, ChainAlternatesTwoBuffersOrRunsInOne) {
  Graph g = parse(kChain);
  // 256 bytes each; a [0,1], b [1,2], c [2,3]: a and c never meet, so they share offset 0.
  MemoryPlan plan = plan_memory(g);
  EXPECT_EQ(plan.arena_bytes, 512u);
  EXPECT_EQ(plan.naive_bytes, 768u);
  EXPECT_EQ(plan.offsets[id_of(g, "c")], plan.offsets[id_of(g, "a")]);
  // In place, the whole chain is one buffer.
  MemoryPlan in_place = plan_memory(g, kAlways);
  EXPECT_EQ(in_place.arena_bytes, 256u);
  EXPECT_EQ(in_place.in_place_count, 2u);
  EXPECT_TRUE(testing::no_live_overlap(g, in_place));
}

TEST(MemoryPlan, SizesAreRoundedToTheAlignment) {
  // 3 f32 = 12 bytes, rounded to 64: a [0,1] and b [1,2] side by side.
  Graph g = parse(R"(
graph @small(%x: f32[3] data) {
  %a = neg(%x)
  %b = exp(%a)
  %s = sum(%b)
  return %s
}
)");
  MemoryPlan plan = plan_memory(g);
  EXPECT_EQ(plan.arena_bytes, 128u);
  EXPECT_EQ(plan.naive_bytes, 128u);
  EXPECT_EQ(plan.offsets[id_of(g, "b")], 64);
}

TEST(MemoryPlan, NoInPlaceWhenTheInputIsReadLater) {
  Graph g = parse(R"(
graph @later(%x: f32[64] data) {
  %a = exp(%x)
  %b = neg(%a)
  %c = add(%a, %b)
  return %c
}
)");
  MemoryPlan plan = plan_memory(g, kAlways);
  EXPECT_EQ(plan.reuses[id_of(g, "b")], -1);  // a is still read by add
  EXPECT_NE(plan.offsets[id_of(g, "b")], plan.offsets[id_of(g, "a")]);
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

TEST(MemoryPlan, NoInPlaceWhenTypesDiffer) {
  // r (1, 16) dies at the add but the output is (4, 16); the broadcast operand cannot hold it.
  Graph g = parse(R"(
graph @broadcast(%x: f32[4,16] data) {
  %a = exp(%x)
  %r = sum(%a) {axes=[0], keepdims=true}
  %b = add(%r, %x)
  %c = cast(%b) {dtype=f64}
  %s = sum(%c)
  return %s, %a
}
)");
  MemoryPlan plan = plan_memory(g, kAlways);
  EXPECT_EQ(plan.in_place_count, 0u);  // nor can cast's f64 output take b's f32 bytes
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

TEST(MemoryPlan, NoInPlaceWhenTheKernelRefuses) {
  Graph g = parse(kChain);
  MemoryPlan plan = plan_memory(g, [](size_t, size_t) { return false; });
  EXPECT_EQ(plan.in_place_count, 0u);
  EXPECT_EQ(plan.arena_bytes, 512u);
}

TEST(MemoryPlan, InPlaceIsTheKernelsCall) {
  // softmax reads a whole row before writing it: its kernel decides whether it may run in place.
  Graph g = parse(R"(
graph @rows(%x: f32[4,16] data) {
  %a = exp(%x)
  %p = softmax(%a)
  %s = sum(%p)
  return %s
}
)");
  const size_t softmax_node = 1;
  MemoryPlan refused = plan_memory(g, [&](size_t n, size_t) { return n != softmax_node; });
  EXPECT_EQ(refused.reuses[id_of(g, "p")], -1);
  EXPECT_EQ(refused.arena_bytes, 512u);  // %a and %p (256 bytes each) live together
  MemoryPlan allowed = plan_memory(g, kAlways);
  EXPECT_EQ(allowed.reuses[id_of(g, "p")], id_of(g, "a"));
  EXPECT_EQ(allowed.arena_bytes, 256u);
}

TEST(MemoryPlan, RandomGraphsNeverShareBytesBetweenLiveValues) {
  size_t in_place_total = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    Graph g = testing::random_graph(seed, 80);
    for (bool in_place : {false, true}) {
      MemoryPlan plan = in_place ? plan_memory(g, kAlways) : plan_memory(g);
      ASSERT_TRUE(testing::no_live_overlap(g, plan)) << "seed " << seed << " in_place " << in_place;
      EXPECT_LE(plan.live_peak_bytes, plan.arena_bytes) << "seed " << seed;
      EXPECT_LE(plan.arena_bytes, plan.naive_bytes) << "seed " << seed;
      if (!in_place) EXPECT_EQ(plan.in_place_count, 0u);
      in_place_total += plan.in_place_count;
    }
  }
  EXPECT_GT(in_place_total, 0u);  // the in-place path was exercised
}

TEST(MemoryPlan, TrainingGraphsNeverShareBytesBetweenLiveValues) {
  for (auto [model, batch] : {std::pair<const char*, int64_t>{"mlp", 64}, {"gpt2-tiny", 4}}) {
    Graph g = testing::training_graph(model, batch).graph;
    Graph scheduled = g;
    SchedulePass().run(scheduled);
    for (const Graph* graph : {&g, &scheduled}) {
      for (bool in_place : {false, true}) {
        MemoryPlan plan = in_place ? plan_memory(*graph, kAlways) : plan_memory(*graph);
        EXPECT_TRUE(testing::no_live_overlap(*graph, plan)) << model;
        EXPECT_LE(plan.live_peak_bytes, plan.arena_bytes) << model;
        EXPECT_LE(plan.arena_bytes, plan.naive_bytes) << model;
      }
    }
  }
}

TEST(MemoryPlan, ArenaIsSmallerThanOneBufferPerValueOnGpt) {
  Graph g = testing::training_graph("gpt2-tiny", 4).graph;
  MemoryPlan plan = plan_memory(g);
  EXPECT_LT(plan.arena_bytes, plan.naive_bytes);
  // The update values (new params and AdamW moments) live to the end, in the arena.
  for (const Update& u : g.updates) EXPECT_TRUE(plan.in_arena(u.value));
}

}  // namespace
}  // namespace kiln
