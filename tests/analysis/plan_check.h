// Helpers for the memory-plan and executor tests: random graphs and a checker that no two values
// live at the same node share arena bytes.
#pragma once

#include <gtest/gtest.h>

#include <random>

#include "analysis/memory_plan.h"
#include "ir/graph.h"
#include "models/models.h"
#include "compile/training_graph.h"

namespace kiln::testing {

// Every arena value that is no view is 64-byte aligned, and every arena value inside the arena;
// two values live at one node (overlapping [def, last]) never share a byte, except
//   - two values of one alias class (a value and its views, memory_plan.h: one root), and
//   - a value and the input it overwrote in place (the plan says so in `reuses`): then every
//     value of that input's alias class dies at that very node, and the value sits exactly where
//     the input does (same type, same offset).
// A view is never a graph output nor an update value, and is the bytes its node names: a
// reshape's, its input's (same byte count, offset 0); a slice's (every step 1), the run of its
// input's elements from its first to its last element, when that run holds exactly its elements
// (row-major), at the first element's byte offset, a multiple of kViewOffsetAlignment. It sits
// at its root's offset plus the offsets along its chain (kNotInArena with a root outside the
// arena).
inline ::testing::AssertionResult no_live_overlap(const Graph& g, const MemoryPlan& plan) {
  const Liveness& l = plan.liveness;
  auto root = [&](ValueId v) { return view_root(plan.views, v); };
  std::vector<int> producer(g.values.size(), -1);
  for (size_t n = 0; n < g.nodes.size(); ++n)
    for (ValueId id : g.nodes[n].outputs) producer[static_cast<size_t>(id)] = static_cast<int>(n);
  for (size_t v = 0; v < g.values.size(); ++v) {
    const ValueId id = static_cast<ValueId>(v);
    if (!plan.is_view(id)) {
      if (plan.view_offsets[v] != 0)
        return ::testing::AssertionFailure() << "value " << v << " is no view but has view offset "
                                             << plan.view_offsets[v];
      continue;
    }
    const ValueId in = plan.views[v];
    if (producer[v] < 0) return ::testing::AssertionFailure() << "view " << v << " has no node";
    const Node& node = g.nodes[static_cast<size_t>(producer[v])];
    if (node.inputs.size() != 1 || node.inputs[0] != in)
      return ::testing::AssertionFailure() << "view " << v << " is not of its node's input";
    // The bytes the node names, from the graph alone.
    int64_t want_offset = 0;
    if (node.op == Op::kReshape) {
      if (g.type(in).bytes() != g.type(id).bytes())
        return ::testing::AssertionFailure() << "view " << v << " of " << in << " differs in bytes";
    } else if (node.op == Op::kSlice) {
      const Shape& dims = g.type(in).shape;
      const std::vector<int64_t> strides = strides_of(dims);
      int64_t first = 0, last = 0;
      for (size_t d = 0; d < dims.size(); ++d) {
        if (node.attrs.has("steps") && !node.attrs.ints("steps").empty() && node.attrs.ints("steps")[d] != 1)
          return ::testing::AssertionFailure() << "view " << v << " is a slice with a step";
        int64_t start = node.attrs.ints("starts")[d], end = node.attrs.ints("ends")[d];
        if (start < 0) start += dims[d];
        if (end < 0) end += dims[d];
        first += start * strides[d];
        last += (end - 1) * strides[d];
      }
      if (g.type(id).numel() == 0 || last - first + 1 != g.type(id).numel())
        return ::testing::AssertionFailure() << "view " << v << " is a slice that is no contiguous run";
      want_offset = first * static_cast<int64_t>(dtype_size(g.type(in).dtype));
      if (want_offset % kViewOffsetAlignment != 0)
        return ::testing::AssertionFailure() << "view " << v << " at unaligned offset " << want_offset;
    } else {
      return ::testing::AssertionFailure() << "view " << v << " of op " << op_name(node.op);
    }
    if (plan.view_offsets[v] != want_offset)
      return ::testing::AssertionFailure() << "view " << v << " at " << plan.view_offsets[v] << " bytes into "
                                           << in << ", its node says " << want_offset;
    int64_t in_root = 0;  // the view's offset in its root, summed along its chain
    for (ValueId u = id; plan.is_view(u); u = plan.views[static_cast<size_t>(u)])
      in_root += plan.view_offsets[static_cast<size_t>(u)];
    const ValueId r = root(id);
    const int64_t want = plan.in_arena(r) ? plan.offsets[static_cast<size_t>(r)] + in_root : MemoryPlan::kNotInArena;
    if (plan.offsets[v] != want)
      return ::testing::AssertionFailure() << "view " << v << " at " << plan.offsets[v] << ", its root " << r
                                           << " at " << plan.offsets[static_cast<size_t>(r)] << " + " << in_root;
    for (ValueId out : g.outputs)
      if (out == id) return ::testing::AssertionFailure() << "view " << v << " is a graph output";
    for (const Update& u : g.updates)
      if (u.value == id) return ::testing::AssertionFailure() << "view " << v << " is an update value";
  }
  for (size_t v = 0; v < g.values.size(); ++v) {
    const ValueId reused = plan.reuses[v];
    if (reused < 0) continue;
    if (g.type(reused) != g.type(static_cast<ValueId>(v)) || plan.offsets[v] != plan.offsets[static_cast<size_t>(reused)])
      return ::testing::AssertionFailure() << "value " << v << " at " << plan.offsets[v] << " overwrites " << reused
                                           << " at " << plan.offsets[static_cast<size_t>(reused)];
  }
  std::vector<ValueId> arena;
  for (size_t v = 0; v < g.values.size(); ++v) {
    if (!plan.in_arena(static_cast<ValueId>(v))) continue;
    arena.push_back(static_cast<ValueId>(v));
    const size_t offset = static_cast<size_t>(plan.offsets[v]);
    if (!plan.is_view(static_cast<ValueId>(v)) && offset % 64 != 0)
      return ::testing::AssertionFailure() << "value " << v << " at " << offset;
    if (offset + g.type(static_cast<ValueId>(v)).bytes() > plan.arena_bytes)
      return ::testing::AssertionFailure() << "value " << v << " ends past the arena";
  }
  // `b`'s alias class was written over `a`'s (its root reuses a value of a's class), and `a`
  // was dead by then.
  auto overwrote = [&](ValueId a, ValueId b) {
    const ValueId rb = root(b);
    const ValueId reused = plan.reuses[static_cast<size_t>(rb)];
    return reused >= 0 && root(reused) == root(a) && l.last[a] <= l.def[rb];
  };
  for (size_t i = 0; i < arena.size(); ++i) {
    for (size_t j = i + 1; j < arena.size(); ++j) {
      const ValueId a = arena[i], b = arena[j];
      if (l.def[a] > l.last[b] || l.def[b] > l.last[a]) continue;  // never live together
      const size_t a0 = static_cast<size_t>(plan.offsets[a]), a1 = a0 + g.type(a).bytes();
      const size_t b0 = static_cast<size_t>(plan.offsets[b]), b1 = b0 + g.type(b).bytes();
      if (a1 <= b0 || b1 <= a0) continue;  // disjoint bytes
      if (root(a) == root(b) || overwrote(a, b) || overwrote(b, a)) continue;
      return ::testing::AssertionFailure()
             << "values " << a << " [" << l.def[a] << ", " << l.last[a] << "] and " << b << " ["
             << l.def[b] << ", " << l.last[b] << "] share bytes [" << std::max(a0, b0) << ", "
             << std::min(a1, b1) << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// A random graph over f32 (k, 8) tensors: unary ops, binary ops (same shape or a (1, 8) row
// broadcast), concat, two-way split, keepdims sums, reshapes (through a (2k, 4) or (8k) shape
// and back, perhaps with a unary op in the other shape: views, views of views, views of graph
// inputs and of the updated param); a few outputs and one param update. `slices`: also slices of
// rows (f32 rows of 32 bytes: views at row offsets, of arena values and of graph inputs), of
// every other row (step 2: copies) and of the rows of a (2k, 4) reshape, reshaped back (a
// reshape of a slice of a reshape: a chain with an offset).
inline Graph random_graph(uint64_t seed, int nodes, bool slices = false) {
  std::mt19937_64 rng(seed);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  Graph g;
  g.name = "random";
  std::vector<ValueId> pool = {g.add_input("x0", {DType::kF32, {4, 8}}, Role::kData),
                               g.add_input("x1", {DType::kF32, {6, 8}}, Role::kData)};
  const ValueId p = g.add_input("p", {DType::kF32, {4, 8}}, Role::kParam);
  pool.push_back(p);
  auto rows = [&](ValueId v) { return g.type(v).shape[0]; };
  const Op unary[] = {Op::kTanh, Op::kNeg, Op::kSigmoid, Op::kRelu};
  const Op binary[] = {Op::kAdd, Op::kMul, Op::kSub, Op::kMaximum};
  for (int n = 0; n < nodes; ++n) {
    // Recent values are likelier operands, so chains form and values die at varied times.
    auto operand = [&] {
      size_t window = std::min<size_t>(pool.size(), 8);
      return rng() % 3 == 0 ? pool[pick(pool.size())] : pool[pool.size() - 1 - pick(window)];
    };
    const ValueId a = operand();
    switch (rng() % (slices ? 8 : 7)) {
      case 0:
      case 1:
        pool.push_back(g.add(unary[pick(4)], {a}));
        break;
      case 2: {
        std::vector<ValueId> partners;
        for (ValueId v : pool)
          if (rows(v) == rows(a) || rows(v) == 1) partners.push_back(v);
        pool.push_back(g.add(binary[pick(4)], {a, partners[pick(partners.size())]}));
        break;
      }
      case 3: {
        const ValueId b = operand();
        if (rows(a) + rows(b) <= 64) pool.push_back(g.add(Op::kConcat, {a, b}, {{"axis", int64_t{0}}}));
        else pool.push_back(g.add(Op::kSum, {a}, {{"axes", std::vector<int64_t>{0}}, {"keepdims", true}}));
        break;
      }
      case 4:
        if (rows(a) >= 2) {
          const int64_t first = 1 + static_cast<int64_t>(pick(static_cast<size_t>(rows(a) - 1)));
          for (ValueId v : g.add_node(Op::kSplit, {a}, {{"axis", int64_t{0}},
                                                        {"sizes", std::vector<int64_t>{first, rows(a) - first}}}))
            pool.push_back(v);
        } else {
          pool.push_back(g.add(unary[pick(4)], {a}));
        }
        break;
      case 5: {
        const Shape shape = g.type(a).shape;
        auto reshape = [&](ValueId v, Shape to) { return g.add(Op::kReshape, {v}, {{"shape", to}}); };
        ValueId mid = reshape(a, rng() % 2 ? Shape{rows(a) * 2, 4} : Shape{rows(a) * 8});
        if (rng() % 3 == 0) mid = g.add(unary[pick(4)], {mid});
        if (rng() % 3 == 0) mid = reshape(mid, Shape{rows(a) * 8});
        pool.push_back(reshape(mid, shape));
        break;
      }
      case 6:
        pool.push_back(g.add(Op::kSum, {a}, {{"axes", std::vector<int64_t>{0}}, {"keepdims", true}}));
        break;
      default: {  // 7: slices of rows
        const int64_t k = rows(a);
        const int64_t start = static_cast<int64_t>(pick(static_cast<size_t>(k)));
        const int64_t end = start + 1 + static_cast<int64_t>(pick(static_cast<size_t>(k - start)));
        using Ints = std::vector<int64_t>;
        switch (rng() % 3) {
          case 0:
            pool.push_back(g.add(Op::kSlice, {a}, {{"starts", Ints{start, 0}}, {"ends", Ints{end, 8}}}));
            break;
          case 1:
            pool.push_back(g.add(Op::kSlice, {a}, {{"starts", Ints{start, 0}}, {"ends", Ints{k, 8}},
                                                   {"steps", Ints{2, 1}}}));
            break;
          default: {
            const ValueId wide = g.add(Op::kReshape, {a}, {{"shape", Shape{2 * k, 4}}});
            const ValueId rows_of = g.add(Op::kSlice, {wide}, {{"starts", Ints{2 * start, 0}},
                                                               {"ends", Ints{2 * end, 4}}});
            pool.push_back(g.add(Op::kReshape, {rows_of}, {{"shape", Shape{end - start, 8}}}));
            break;
          }
        }
        break;
      }
    }
  }
  std::vector<ValueId> same_as_p;
  for (ValueId v : pool)
    if (g.type(v) == g.type(p) && v != p) same_as_p.push_back(v);
  const ValueId next_p = g.add(Op::kAdd, {p, same_as_p[pick(same_as_p.size())]});
  g.updates.push_back({p, next_p});
  g.outputs = {pool.back(), pool[pool.size() / 2], next_p};
  return g;
}

// The training graph of a zoo model (AdamW).
inline StepProgram training_graph(const std::string& model, int64_t batch) {
  return build_training_graph(models::by_name(model, batch), OptimizerConfig{});
}

// The slice-view graph of both executors' tests (CPU and CUDA). Slices the plan makes views:
// rows of an intermediate (rows 0..4 and row 5 of %a), of a graph input (%xs; %ys of a 3-D
// one, through a reshape), of a graph output that is also read (%os), of the param (%ws, read
// before its new value is made), and row 1..3 of %h, which dies at the neg that reads it (an in-place kernel must not write over it: it is 64 bytes into %h's buffer).
inline constexpr const char* kSliceViews = R"(
graph @slices(%x: f32[6,16] data, %y: f32[3,2,16] data, %w: f32[4,16] param) {
  %a = exp(%x)
  %top = slice(%a) {starts=[0,0], ends=[4,16]}
  %last = slice(%a) {starts=[5,0], ends=[6,16]}
  %ys = slice(%y) {starts=[1,1,0], ends=[2,2,16]}
  %yr = reshape(%ys) {shape=[1,16]}
  %o = tanh(%a)
  %os = slice(%o) {starts=[1,0], ends=[3,16]}
  %xs = slice(%x) {starts=[2,0], ends=[4,16]}
  %ws = slice(%w) {starts=[3,0], ends=[4,16]}
  %m = mul(%top, %w)
  %n = add(%xs, %os)
  %p = add(%last, %yr)
  %q = mul(%p, %ws)
  %h = sigmoid(%x)
  %h1 = slice(%h) {starts=[1,0], ends=[3,16]}
  %z = neg(%h1)
  %nw = sub(%w, %m)
  %s = sum(%n)
  update %w = %nw
  return %s, %o, %q, %n, %z
}
)";

}  // namespace kiln::testing
