// Static memory planning: liveness of every value over the graph's node order, and one arena
// with a byte offset for every intermediate value, so a whole step runs out of a single
// allocation (llm.c's habit) instead of one malloc/free per value.
//
// What lives where:
//   graph inputs      caller-owned tensors; never in the arena.
//   graph outputs     their own buffer per run, so callers may keep them across runs; never in
//                     the arena.
//   everything else   (node outputs, update values included) in the arena, at a planned offset.
// Update values live to the end of the run (the executor copies them over their targets last).
//
// Placement: buffers are sorted by size (largest first) and each goes to the lowest 64-byte-
// aligned offset that overlaps no already-placed buffer whose lifetime overlaps its own; two
// values may share bytes only when they are never live at the same node.
//
// In-place reuse: a node whose output has the same type as an input that dies at that node may
// write its output over that input, but only where the kernel chosen for the node says it can
// (KernelImpl::in_place_ok): the fast CPU kernels use __restrict__ loops and must
// never see aliased buffers.
//
// Views: every IR tensor is dense row-major, so a reshape's output is exactly its input's bytes.
// A reshape whose output is neither a graph output nor an update value is a view: no kernel runs
// (the executors skip the node) and its output shares its input's bytes. Views of views chain
// to one root value. For an arena root, the root and its views are one buffer (an alias class)
// whose lifetime is the union of theirs: its bytes are free only when every alias is dead, which
// is also what in-place reuse of any member of the class asks. A view of a value outside the
// arena (a graph input, a graph output) is outside it too: the executor hands the node's reader
// the caller's (or the output's) storage, re-viewed. A reshape that is a graph output or an
// update value stays a copy (outputs get their own buffers; update values are copied over, or
// written straight into, their targets): simple, and such reshapes are rare.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "ir/graph.h"

namespace kiln {

// Per value, over the current node order.
struct Liveness {
  // The node index that defines the value; -1 for graph inputs (and values no node defines).
  std::vector<int> def;
  // The last node index that reads the value; nodes.size() for graph outputs and update values
  // (they live past the last node); def when nothing reads it; -1 for an unread graph input.
  std::vector<int> last;
};
Liveness compute_liveness(const Graph& graph);

// Whether node `node`'s kernel may write its output over its input number `input`.
using InPlacePredicate = std::function<bool(size_t node, size_t input)>;
// Whether reshape node `node` may be a view of its input (it is already a candidate: see above).
using ViewPredicate = std::function<bool(size_t node)>;
// A ViewPredicate that allows none: every reshape a copy.
inline const ViewPredicate kNoViews = [](size_t) { return false; };

// Per value: the value whose bytes it is as a view (its reshape's input), or -1. Candidates are
// the reshape nodes whose output is neither a graph output nor an update value; `view_ok`
// empty: all of them.
std::vector<ValueId> find_views(const Graph& graph, const ViewPredicate& view_ok = {});
// The value that owns the bytes of `id`: follows `views` (as find_views returns) to its end.
inline ValueId view_root(const std::vector<ValueId>& views, ValueId id) {
  while (views[static_cast<size_t>(id)] >= 0) id = views[static_cast<size_t>(id)];
  return id;
}

struct MemoryPlan {
  static constexpr size_t kAlignment = 64;
  static constexpr int64_t kNotInArena = -1;

  Liveness liveness;
  // Per value: its byte offset in the arena, or kNotInArena (graph inputs and outputs, values
  // no node defines).
  std::vector<int64_t> offsets;
  // Per value: the input whose buffer it overwrites in place, or -1.
  std::vector<ValueId> reuses;
  // Per value: the value whose bytes it is as a view (find_views), or -1. A view has its root's
  // offset (kNotInArena for a root outside the arena) and no bytes of its own.
  std::vector<ValueId> views;
  size_t arena_bytes = 0;      // the arena's size: the planned peak
  size_t naive_bytes = 0;      // one buffer per arena value that is no view: the sum of their
                               // aligned sizes
  size_t live_peak_bytes = 0;  // the most aligned bytes live at one node (an alias class live
                               // from its first definition to its last read): no plan of this
                               // order with these views (without in-place reuse) can use fewer
  size_t in_place_count = 0;   // values written over their input
  size_t view_count = 0;       // reshapes planned as views (no kernel, no bytes)

  bool is_view(ValueId id) const { return views[static_cast<size_t>(id)] >= 0; }

  bool in_arena(ValueId id) const { return offsets[static_cast<size_t>(id)] != kNotInArena; }
};

// Plans `graph` in its current node order. `in_place_ok` empty: no in-place reuse. `view_ok`
// empty: every candidate reshape is a view (kNoViews: none is).
MemoryPlan plan_memory(const Graph& graph, const InPlacePredicate& in_place_ok = {},
                       const ViewPredicate& view_ok = {});

// Bytes rounded up to the arena alignment.
inline size_t aligned_bytes(size_t bytes) {
  return (bytes + MemoryPlan::kAlignment - 1) / MemoryPlan::kAlignment * MemoryPlan::kAlignment;
}

}  // namespace kiln
