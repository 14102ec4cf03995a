// The memory plan: liveness, arena offsets worked out by hand on small graphs, in-place reuse and
// the cases that must refuse it, reshape views (an alias shares its input's bytes; the buffer
// lives as long as every alias; which reshapes stay copies), slice views (a contiguous run of
// rows at its byte offset; which slices stay copies; chains whose offsets add up; no in-place
// reuse over a view at an offset), and on random and training graphs that no two values live at
// one node share bytes.
#include "analysis/memory_plan.h"

#include "analysis/plan_check.h"
#include "ir/text.h"
#include "passes/schedule.h"
#include "runtime/executor.h"

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

// Node indices:              0        1        2        3        4        5        6
const char* kViews = R"(
graph @views(%x: f32[4,16] data) {
  %a = exp(%x)
  %v = reshape(%a) {shape=[64]}
  %b = neg(%a)
  %c = tanh(%b)
  %r = reshape(%c) {shape=[64]}
  %d = mul(%v, %r)
  %s = sum(%d)
  return %s
}
)";

TEST(MemoryPlan, AViewSharesItsInputsBytesAndTheBufferOutlivesBoth) {
  Graph g = parse(kViews);
  MemoryPlan plan = plan_memory(g);
  // Every value is 64 f32 = 256 bytes. Views: v of a, r of c. Buffers (alias classes):
  // {a, v} [0, 5] (a is last read at 2, v at 5), {b} [2, 3], {c, r} [3, 5], {d} [5, 6]. By
  // start: {a, v} at 0; {b} clashes with it: 256; {c, r} with both: 512; {d} with {a, v} and
  // {c, r} only (b is dead by 5): the gap at 256.
  EXPECT_EQ(plan.views[id_of(g, "v")], id_of(g, "a"));
  EXPECT_EQ(plan.views[id_of(g, "r")], id_of(g, "c"));
  for (const char* name : {"x", "a", "b", "c", "d", "s"}) EXPECT_FALSE(plan.is_view(id_of(g, name))) << name;
  EXPECT_EQ(plan.view_count, 2u);
  EXPECT_EQ(plan.offsets[id_of(g, "a")], 0);
  EXPECT_EQ(plan.offsets[id_of(g, "v")], 0);
  EXPECT_EQ(plan.offsets[id_of(g, "b")], 256);
  EXPECT_EQ(plan.offsets[id_of(g, "c")], 512);
  EXPECT_EQ(plan.offsets[id_of(g, "r")], 512);
  // a's own last read is node 2, but its bytes are v's until node 5: d may not take them.
  EXPECT_EQ(plan.liveness.last[id_of(g, "a")], 2);
  EXPECT_EQ(plan.offsets[id_of(g, "d")], 256);
  EXPECT_EQ(plan.arena_bytes, 768u);
  EXPECT_EQ(plan.naive_bytes, 4 * 256u);     // a, b, c, d: the views have no bytes of their own
  EXPECT_EQ(plan.live_peak_bytes, 768u);     // nodes 2 to 5 each hold three buffers
  EXPECT_TRUE(testing::no_live_overlap(g, plan));

  // Without views every reshape is a copy with its own bytes: v [1, 5] and r [4, 5] besides
  // a [0, 2], b [2, 3], c [3, 4], d [5, 6]; node 4 holds v, c and r, node 5 v, r and d.
  MemoryPlan copies = plan_memory(g, {}, kNoViews);
  EXPECT_EQ(copies.view_count, 0u);
  for (ValueId v : copies.views) EXPECT_EQ(v, -1);
  EXPECT_NE(copies.offsets[id_of(g, "v")], copies.offsets[id_of(g, "a")]);
  EXPECT_EQ(copies.naive_bytes, 6 * 256u);
  EXPECT_EQ(copies.live_peak_bytes, 768u);
  EXPECT_TRUE(testing::no_live_overlap(g, copies));
}

TEST(MemoryPlan, ViewsOfViewsAreOneAliasClass) {
  Graph g = parse(R"(
graph @chain(%x: f32[4,16] data) {
  %a = exp(%x)
  %v1 = reshape(%a) {shape=[64]}
  %v2 = reshape(%v1) {shape=[2,32]}
  %v3 = reshape(%v2) {shape=[8,8]}
  %b = neg(%x)
  %c = tanh(%v3)
  %s = sum(%c)
  %t = sum(%b)
  %u = add(%s, %t)
  return %u
}
)");
  MemoryPlan plan = plan_memory(g);
  EXPECT_EQ(plan.views[id_of(g, "v2")], id_of(g, "v1"));
  EXPECT_EQ(view_root(plan.views, id_of(g, "v3")), id_of(g, "a"));
  EXPECT_EQ(plan.view_count, 3u);
  for (const char* name : {"v1", "v2", "v3"}) EXPECT_EQ(plan.offsets[id_of(g, name)], plan.offsets[id_of(g, "a")]);
  // a is last read at node 1, but v3 at node 5: b (node 4) may not take a's bytes.
  EXPECT_NE(plan.offsets[id_of(g, "b")], plan.offsets[id_of(g, "a")]);
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

TEST(MemoryPlan, NoInPlaceWhileAnAliasIsAlive) {
  Graph g = parse(R"(
graph @alias_alive(%x: f32[4,16] data) {
  %a = exp(%x)
  %v = reshape(%a) {shape=[64]}
  %b = neg(%a)
  %r = reshape(%b) {shape=[64]}
  %d = add(%v, %r)
  %s = sum(%d)
  return %s
}
)");
  MemoryPlan plan = plan_memory(g, kAlways);
  // neg(a) is a's last read, but its view v is read at node 4: b may not write over a.
  EXPECT_EQ(plan.reuses[id_of(g, "b")], -1);
  EXPECT_NE(plan.offsets[id_of(g, "b")], plan.offsets[id_of(g, "a")]);
  // add(v, r): v and a, and r and b, are all dead after it: d takes the first input's bytes.
  EXPECT_EQ(plan.reuses[id_of(g, "d")], id_of(g, "v"));
  EXPECT_EQ(plan.offsets[id_of(g, "d")], plan.offsets[id_of(g, "a")]);
  EXPECT_EQ(plan.in_place_count, 1u);
  EXPECT_EQ(plan.arena_bytes, 512u);
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

TEST(MemoryPlan, NoInPlaceOverBytesTheNodeReadsTwice) {
  // add(a, v) reads the same bytes as (1, 64) and as (64): its output may take neither.
  Graph g = parse(R"(
graph @twice(%x: f32[1,64] data) {
  %a = exp(%x)
  %v = reshape(%a) {shape=[64]}
  %d = add(%a, %v)
  %s = sum(%d)
  return %s
}
)");
  MemoryPlan plan = plan_memory(g, kAlways);
  EXPECT_EQ(plan.view_count, 1u);
  EXPECT_EQ(plan.reuses[id_of(g, "d")], -1);
  EXPECT_EQ(plan.in_place_count, 0u);
  EXPECT_NE(plan.offsets[id_of(g, "d")], plan.offsets[id_of(g, "a")]);
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

TEST(MemoryPlan, ReshapesOfGraphInputsAndOutputsAndUpdateValues) {
  Graph g = parse(R"(
graph @edges(%x: f32[4,16] data, %w: f32[4,16] param) {
  %xv = reshape(%x) {shape=[64]}
  %a = exp(%xv)
  %o = reshape(%a) {shape=[4,16]}
  %ov = reshape(%o) {shape=[64]}
  %t = sum(%ov)
  %wv = reshape(%w) {shape=[64]}
  %n = neg(%wv)
  %u = reshape(%n) {shape=[4,16]}
  update %w = %u
  return %t, %o
}
)");
  MemoryPlan plan = plan_memory(g);
  // Views of a graph input and of a graph output: their root's bytes, outside the arena.
  EXPECT_EQ(plan.views[id_of(g, "xv")], id_of(g, "x"));
  EXPECT_EQ(plan.views[id_of(g, "wv")], id_of(g, "w"));
  EXPECT_EQ(plan.views[id_of(g, "ov")], id_of(g, "o"));
  for (const char* name : {"xv", "wv", "ov"}) EXPECT_FALSE(plan.in_arena(id_of(g, name))) << name;
  // A graph output and an update value stay copies: o gets its own buffer, u arena bytes.
  EXPECT_FALSE(plan.is_view(id_of(g, "o")));
  EXPECT_FALSE(plan.is_view(id_of(g, "u")));
  EXPECT_TRUE(plan.in_arena(id_of(g, "u")));
  EXPECT_EQ(plan.view_count, 3u);
  // In the arena: a (256 bytes, [1, 2]), n ([6, 7]) and u ([7, 8]): a and n share offset 0.
  EXPECT_EQ(plan.naive_bytes, 3 * 256u);
  EXPECT_EQ(plan.arena_bytes, 512u);
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

TEST(MemoryPlan, FindViewsHonoursThePredicate) {
  Graph g = parse(kViews);
  const size_t second_reshape = 4;
  const Views views = find_views(g, [&](size_t n) { return n != second_reshape; });
  EXPECT_EQ(views.input[id_of(g, "v")], id_of(g, "a"));
  EXPECT_EQ(views.input[id_of(g, "r")], -1);
  for (int64_t offset : views.byte_offset) EXPECT_EQ(offset, 0);  // reshapes: no offsets
  MemoryPlan plan = plan_memory(g, {}, [&](size_t n) { return n != second_reshape; });
  EXPECT_EQ(plan.view_count, 1u);
  EXPECT_FALSE(plan.is_view(id_of(g, "r")));
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

// Rows of one GEMM-sized output: rows 0..768 (a weight gradient) and row 768 (a bias gradient).
TEST(MemoryPlan, FirstAxisSlicesAreViewsAtTheirRowsOffset) {
  Graph g = parse(R"(
graph @rows(%x: f32[776,2304] data, %w: f32[768,2304] param, %b: f32[1,2304] param) {
  %y = exp(%x)
  %dw = slice(%y) {starts=[0,0], ends=[768,2304]}
  %db = slice(%y) {starts=[768,0], ends=[769,2304]}
  %last = slice(%y) {starts=[-1,0], ends=[776,2304]}
  %nw = sub(%w, %dw)
  %nb = sub(%b, %db)
  %t = sum(%last)
  update %w = %nw
  update %b = %nb
  return %t
}
)");
  MemoryPlan plan = plan_memory(g);
  const int64_t row = 2304 * 4;  // bytes of one f32 row
  const ValueId y = id_of(g, "y");
  for (const char* name : {"dw", "db", "last"}) EXPECT_EQ(plan.views[id_of(g, name)], y) << name;
  EXPECT_EQ(plan.view_count, 3u);
  EXPECT_EQ(plan.view_offsets[id_of(g, "dw")], 0);
  EXPECT_EQ(plan.view_offsets[id_of(g, "db")], 768 * row);
  EXPECT_EQ(plan.view_offsets[id_of(g, "last")], 775 * row);
  ASSERT_TRUE(plan.in_arena(y));
  EXPECT_EQ(plan.offsets[id_of(g, "dw")], plan.offsets[y]);
  EXPECT_EQ(plan.offsets[id_of(g, "db")], plan.offsets[y] + 768 * row);
  EXPECT_EQ(plan.offsets[id_of(g, "last")], plan.offsets[y] + 775 * row);
  // No bytes of their own: the arena holds y (its buffer lives until its last alias is read)
  // and the two update values.
  const size_t y_bytes = aligned_bytes(776 * row), nw_bytes = aligned_bytes(768 * row);
  const size_t nb_bytes = aligned_bytes(row);
  EXPECT_EQ(plan.naive_bytes, y_bytes + nw_bytes + nb_bytes);
  EXPECT_EQ(plan.live_peak_bytes, y_bytes + nw_bytes + nb_bytes);  // at the sum: y, nw, nb
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
  // As copies, each slice has its bytes besides y's.
  MemoryPlan copies = plan_memory(g, {}, kNoViews);
  EXPECT_EQ(copies.view_count, 0u);
  EXPECT_EQ(copies.naive_bytes, y_bytes + 2 * nw_bytes + 3 * nb_bytes);
  EXPECT_TRUE(testing::no_live_overlap(g, copies));
}

TEST(MemoryPlan, SlicesThatAreOneRunOfBytesAreViews) {
  // Any rank: leading dims single indices, then a range, then whole dims.
  Graph g = parse(R"(
graph @runs(%x: f32[2,3,16] data, %y: f32[4,16] data) {
  %a = exp(%x)
  %mid = slice(%a) {starts=[1,1,0], ends=[2,3,16]}
  %one = slice(%a) {starts=[0,2,4], ends=[1,3,8]}
  %all = slice(%a) {starts=[0,0,0], ends=[2,3,16]}
  %part = slice(%y) {starts=[2,4], ends=[3,12]}
  %s1 = sum(%mid)
  %s2 = sum(%one)
  %s3 = sum(%all)
  %s4 = sum(%part)
  return %s1, %s2, %s3, %s4
}
)");
  MemoryPlan plan = plan_memory(g);
  const int64_t f = 4;  // bytes of an f32
  // Row-major strides of (2, 3, 16): 48, 16, 1; of (4, 16): 16, 1.
  EXPECT_EQ(plan.view_offsets[id_of(g, "mid")], (1 * 48 + 1 * 16) * f);
  EXPECT_EQ(plan.view_offsets[id_of(g, "one")], (0 * 48 + 2 * 16 + 4) * f);
  EXPECT_EQ(plan.view_offsets[id_of(g, "all")], 0);
  EXPECT_EQ(plan.view_offsets[id_of(g, "part")], (2 * 16 + 4) * f);
  for (const char* name : {"mid", "one", "all"}) {
    EXPECT_EQ(plan.views[id_of(g, name)], id_of(g, "a")) << name;
    EXPECT_EQ(plan.offsets[id_of(g, name)], plan.offsets[id_of(g, "a")] + plan.view_offsets[id_of(g, name)]) << name;
  }
  // A view of a graph input: outside the arena.
  EXPECT_EQ(plan.views[id_of(g, "part")], id_of(g, "y"));
  EXPECT_FALSE(plan.in_arena(id_of(g, "part")));
  EXPECT_EQ(plan.view_count, 4u);
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

TEST(MemoryPlan, SlicesThatAreNoRunOfBytesStayCopies) {
  Graph g = parse(R"(
graph @copies(%x: f32[2,4,16] data, %y: f32[8,16] data, %z: f32[4,3] data) {
  %a = exp(%x)
  %middle = slice(%a) {starts=[0,1,0], ends=[2,3,16]}
  %b = exp(%y)
  %strided = slice(%b) {starts=[0,0], ends=[8,16], steps=[2,1]}
  %columns = slice(%b) {starts=[0,0], ends=[8,8]}
  %c = exp(%z)
  %unaligned = slice(%c) {starts=[1,0], ends=[2,3]}
  %aligned = slice(%c) {starts=[0,0], ends=[1,3]}
  %out = slice(%b) {starts=[2,0], ends=[4,16]}
  %s1 = sum(%middle)
  %s2 = sum(%strided)
  %s3 = sum(%columns)
  %s4 = sum(%unaligned)
  %s5 = sum(%aligned)
  return %s1, %s2, %s3, %s4, %s5, %out
}
)");
  MemoryPlan plan = plan_memory(g);
  // A middle-axis range under a leading extent of 2, every other row, the first half of every
  // row (a last-axis slice of a 2-D value), row 1 of 3-float rows (12 bytes in: not 16-byte
  // aligned), a graph output: copies, with bytes of their own.
  for (const char* name : {"middle", "strided", "columns", "unaligned"}) {
    EXPECT_FALSE(plan.is_view(id_of(g, name))) << name;
    EXPECT_EQ(plan.view_offsets[id_of(g, name)], 0) << name;
    EXPECT_TRUE(plan.in_arena(id_of(g, name))) << name;
  }
  EXPECT_FALSE(plan.is_view(id_of(g, "out")));
  EXPECT_FALSE(plan.in_arena(id_of(g, "out")));
  // Row 0 of the same value starts at its start: a view.
  EXPECT_EQ(plan.views[id_of(g, "aligned")], id_of(g, "c"));
  EXPECT_EQ(plan.view_count, 1u);
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

TEST(MemoryPlan, SliceOfAReshapeOfASliceChainsAndOffsetsAddUp) {
  Graph g = parse(R"(
graph @chain(%x: f32[8,16] data) {
  %a = exp(%x)
  %s1 = slice(%a) {starts=[2,0], ends=[6,16]}
  %r = reshape(%s1) {shape=[8,8]}
  %s2 = slice(%r) {starts=[4,0], ends=[6,8]}
  %t = tanh(%s2)
  %s = sum(%t)
  return %s
}
)");
  MemoryPlan plan = plan_memory(g);
  const int64_t f = 4;
  const ValueId a = id_of(g, "a"), s2 = id_of(g, "s2");
  EXPECT_EQ(plan.views[id_of(g, "s1")], a);
  EXPECT_EQ(plan.views[id_of(g, "r")], id_of(g, "s1"));
  EXPECT_EQ(plan.views[s2], id_of(g, "r"));
  EXPECT_EQ(view_root(plan.views, s2), a);
  EXPECT_EQ(plan.view_count, 3u);
  // s1: rows 2.. of 16 floats; r: the same bytes; s2: rows 4.. of 8 floats of r.
  const int64_t s1_in_a = 2 * 16 * f, s2_in_r = 4 * 8 * f;
  EXPECT_EQ(plan.view_offsets[id_of(g, "s1")], s1_in_a);
  EXPECT_EQ(plan.view_offsets[id_of(g, "r")], 0);
  EXPECT_EQ(plan.view_offsets[s2], s2_in_r);
  EXPECT_EQ(plan.root_offset(s2), s1_in_a + s2_in_r);
  EXPECT_EQ(plan.offsets[id_of(g, "r")], plan.offsets[a] + s1_in_a);
  EXPECT_EQ(plan.offsets[s2], plan.offsets[a] + s1_in_a + s2_in_r);
  EXPECT_EQ(plan.naive_bytes, 512u + 64u);  // a and t: the views have no bytes of their own
  // a's buffer lives until tanh reads s2 (node 4): t may not take any of a's bytes.
  const int64_t a0 = plan.offsets[a], t0 = plan.offsets[id_of(g, "t")];
  EXPECT_TRUE(t0 >= a0 + 512 || t0 + 64 <= a0);
  EXPECT_TRUE(testing::no_live_overlap(g, plan));
}

TEST(MemoryPlan, NoInPlaceOverAViewAtAnOffset) {
  // neg(b): b (and a, its root) die there, and neg may run in place. Over row 1 (64 bytes into
  // a's buffer) it may not: its output would land on row 0, 64 bytes before what it reads. Over
  // row 0 it may: the output lands exactly on b's bytes.
  for (auto [row, in_place] : {std::pair{1, false}, {0, true}, {3, false}}) {
    Graph g = parse(fmt::format(R"(
graph @tempting(%x: f32[4,16] data) {{
  %a = exp(%x)
  %b = slice(%a) {{starts=[{},0], ends=[{},16]}}
  %c = neg(%b)
  %s = sum(%c)
  return %s
}}
)", row, row + 1));
    MemoryPlan plan = plan_memory(g, kAlways);
    const ValueId b = id_of(g, "b"), c = id_of(g, "c");
    ASSERT_TRUE(plan.is_view(b)) << row;
    EXPECT_EQ(plan.offsets[b], plan.offsets[id_of(g, "a")] + row * 64) << row;
    EXPECT_EQ(plan.reuses[c], in_place ? b : -1) << row;
    EXPECT_EQ(plan.in_place_count, in_place ? 1u : 0u) << row;
    if (in_place) {
      EXPECT_EQ(plan.offsets[c], plan.offsets[b]) << row;
    } else {
      // c gets bytes of its own, clear of all of a's (the alias class is live at neg).
      const int64_t a0 = plan.offsets[id_of(g, "a")];
      EXPECT_TRUE(plan.offsets[c] >= a0 + 256 || plan.offsets[c] + 64 <= a0) << row;
    }
    EXPECT_TRUE(testing::no_live_overlap(g, plan)) << row;
  }
}

TEST(MemoryPlan, RandomGraphsNeverShareBytesBetweenLiveValues) {
  size_t in_place_total = 0, view_total = 0, input_views = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    Graph g = testing::random_graph(seed, 80);
    const MemoryPlan copies = plan_memory(g, {}, kNoViews);
    ASSERT_TRUE(testing::no_live_overlap(g, copies)) << "seed " << seed << " without views";
    for (bool in_place : {false, true}) {
      MemoryPlan plan = in_place ? plan_memory(g, kAlways) : plan_memory(g);
      ASSERT_TRUE(testing::no_live_overlap(g, plan)) << "seed " << seed << " in_place " << in_place;
      EXPECT_LE(plan.live_peak_bytes, plan.arena_bytes) << "seed " << seed;
      EXPECT_LE(plan.arena_bytes, plan.naive_bytes) << "seed " << seed;
      if (!in_place) {
        EXPECT_EQ(plan.in_place_count, 0u);
        // An alias class is live exactly where one of its values is, and holds one value's
        // bytes: never more live bytes than the copies would hold.
        EXPECT_LE(plan.live_peak_bytes, copies.live_peak_bytes) << "seed " << seed;
        // The copies' one-buffer-each bytes are the views' bytes more.
        size_t view_bytes = 0;
        for (size_t v = 0; v < g.values.size(); ++v) {
          const ValueId id = static_cast<ValueId>(v);
          if (!plan.is_view(id)) continue;
          view_bytes += aligned_bytes(g.type(id).bytes());
          input_views += g.input_index(view_root(plan.views, id)) >= 0;
        }
        EXPECT_EQ(plan.naive_bytes + view_bytes, copies.naive_bytes) << "seed " << seed;
        view_total += plan.view_count;
      }
      in_place_total += plan.in_place_count;
    }
  }
  EXPECT_GT(in_place_total, 0u);  // the in-place path was exercised
  EXPECT_GT(view_total, 0u);      // and views, of arena values and of graph inputs
  EXPECT_GT(input_views, 0u);
}

TEST(MemoryPlan, RandomGraphsWithSlicesNeverShareBytesBetweenLiveValues) {
  size_t in_place_total = 0, slice_views = 0, offset_views = 0, slice_copies = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    Graph g = testing::random_graph(seed, 80, /*slices=*/true);
    const MemoryPlan copies = plan_memory(g, {}, kNoViews);
    ASSERT_TRUE(testing::no_live_overlap(g, copies)) << "seed " << seed << " without views";
    for (bool in_place : {false, true}) {
      MemoryPlan plan = in_place ? plan_memory(g, kAlways) : plan_memory(g);
      ASSERT_TRUE(testing::no_live_overlap(g, plan)) << "seed " << seed << " in_place " << in_place;
      EXPECT_LE(plan.live_peak_bytes, plan.arena_bytes) << "seed " << seed;
      EXPECT_LE(plan.arena_bytes, plan.naive_bytes) << "seed " << seed;
      // Not live_peak <= the copies' live peak: a slice view keeps its root's whole buffer
      // alive, where a copy would hold only its rows.
      size_t view_bytes = 0;
      for (size_t v = 0; v < g.values.size(); ++v) {
        const ValueId id = static_cast<ValueId>(v);
        if (plan.is_view(id)) view_bytes += aligned_bytes(g.type(id).bytes());
        if (in_place) continue;
        for (const Node& node : g.nodes)
          if (node.op == Op::kSlice && node.outputs[0] == id) {
            slice_views += plan.is_view(id);
            slice_copies += !plan.is_view(id);
          }
        offset_views += plan.is_view(id) && plan.root_offset(id) > 0;
      }
      // The views' bytes are what the copies have more.
      EXPECT_EQ(plan.naive_bytes + view_bytes, copies.naive_bytes) << "seed " << seed;
      in_place_total += plan.in_place_count;
    }
  }
  EXPECT_GT(in_place_total, 0u);
  EXPECT_GT(slice_views, 0u);
  EXPECT_GT(offset_views, 0u);
  EXPECT_GT(slice_copies, 0u);  // step-2 slices and graph outputs
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
        if (std::string(model) == "gpt2-tiny") {
          EXPECT_GT(plan.view_count, 0u);  // attention heads, logits
        }
        EXPECT_LE(plan.live_peak_bytes, plan_memory(*graph, {}, kNoViews).live_peak_bytes) << model;
      }
    }
  }
}

// The placement rule read directly: largest first (ties: the earlier start, then the order
// made), each at the lowest offset where it overlaps no placed buffer live at the same time.
// Copies only (no views, no in-place reuse), so that each arena value is one buffer, live from
// its node to its last read. The graphs are long and their values varied in size and lifetime,
// so that a placed buffer the plan's index misses (or finds where it is not live) moves a value.
TEST(MemoryPlan, EachValueGoesToTheLowestFreeOffsetLargestFirst) {
  struct Buffer {
    ValueId value;
    size_t size;
    int start, end;
    size_t offset = 0;
  };
  auto check = [](const Graph& g, const std::string& what) {
    const MemoryPlan plan = plan_memory(g, {}, kNoViews);
    std::vector<Buffer> buffers;  // in the order made: by node, then by output
    for (const Node& node : g.nodes)
      for (ValueId id : node.outputs)
        if (plan.in_arena(id))
          buffers.push_back({id, aligned_bytes(g.type(id).bytes()), plan.liveness.def[id], plan.liveness.last[id]});
    std::stable_sort(buffers.begin(), buffers.end(), [](const Buffer& a, const Buffer& b) {
      return a.size != b.size ? a.size > b.size : a.start < b.start;
    });
    std::vector<Buffer> placed;
    size_t arena = 0, moved = 0;
    for (Buffer b : buffers) {
      std::vector<const Buffer*> live;  // placed buffers live at the same time
      for (const Buffer& p : placed)
        if (p.start <= b.end && b.start <= p.end) live.push_back(&p);
      std::vector<size_t> candidates = {0};  // the lowest free offset is 0 or a live buffer's end
      for (const Buffer* p : live) candidates.push_back(p->offset + p->size);
      std::sort(candidates.begin(), candidates.end());
      for (size_t c : candidates) {
        if (std::all_of(live.begin(), live.end(),
                        [&](const Buffer* p) { return p->offset >= c + b.size || p->offset + p->size <= c; })) {
          b.offset = c;
          break;
        }
      }
      ASSERT_EQ(plan.offsets[b.value], static_cast<int64_t>(b.offset)) << what << ": value " << b.value;
      moved += b.offset > 0 && b.offset < arena;  // placed in a gap below the top
      arena = std::max(arena, b.offset + b.size);
      placed.push_back(b);
    }
    EXPECT_EQ(plan.arena_bytes, arena) << what;
    EXPECT_GT(moved, 0u) << what;  // the gaps below the top were used: the rule was exercised
  };
  for (uint64_t seed = 1; seed <= 20; ++seed) check(testing::random_graph(seed, 300, seed % 2 == 0), fmt::format("seed {}", seed));
  for (const char* model : {"gpt2-tiny", "llama-tiny"}) {
    Graph g = testing::training_graph(model, 4).graph;
    check(g, model);
    SchedulePass().run(g);
    check(g, fmt::format("{} scheduled", model));
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
