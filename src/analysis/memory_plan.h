// Static memory planning: liveness of every value over the graph's node order, and one arena
// with a byte offset for every intermediate value, so a whole step runs out of a single
// allocation (llm.c's habit) instead of one malloc/free per value.
//
// What lives where:
//   graph inputs      caller-owned tensors; never in the arena.
//   graph outputs     their own buffer per run, so callers may keep them across runs; never in
//                     the arena.
//   everything else   (node outputs, update values included) in the arena, at a planned offset
//                     (a view: inside its root's bytes, see Views below).
// Update values live to the end of the run (the executor copies them over their targets last).
//
// Placement: buffers are sorted by size (largest first) and each goes to the lowest 64-byte-
// aligned offset that overlaps no already-placed buffer whose lifetime overlaps its own; two
// values may share bytes only when they are never live at the same node.
//
// In-place reuse: a node whose output has the same type as an input that dies at that node may
// write its output over that input, but only where the kernel chosen for the node says it can
// (KernelImpl::in_place_ok): the fast CPU kernels use __restrict__ loops and must
// never see aliased buffers. An input that is a view must start at its buffer's start (below).
//
// Collectives (ops/collective.h): a collective_wait is a view of its collective's output (the
// join adds no bytes), and a collective's inputs live until its wait, since the communication
// stream reads them until then.
//
// The update stream (ops/update_stream.h): a node there reads its inputs until the end of the
// step, where the compute stream joins it: those the step makes live to the end.
//
// Views: every IR tensor is dense row-major, so a reshape's output is exactly its input's bytes,
// and a slice with every step 1 whose output is one contiguous run of its input (some axis a:
// every dim before a has output extent 1, dim a any range [start, end), every dim after a whole)
// is a run of its input's bytes starting sum_d(start_d * stride_d) * element size bytes in. Such
// a reshape or slice whose output is neither a graph output nor an update value is a view: no
// kernel runs (the executors skip the node) and its output is its input's bytes (a reshape's)
// or a run of them (a slice's) at `view_offsets` bytes in (0 for a reshape). A slice view's
// offset must be a multiple of kViewOffsetAlignment (below); other slices stay copies. Views of
// views chain to one root value, their offsets adding up. For an arena root, the root and its
// views are one buffer (an alias class) whose lifetime is the union of theirs: its bytes are
// free only when every alias is dead, which is also what in-place reuse of any member of the
// class asks (a slice view therefore keeps its root's whole buffer alive: it adds no bytes of
// its own, but frees none of the root's either). A view sits at its root's offset plus its
// cumulative byte offset. A view of a value outside the arena (a graph input, a graph output) is
// outside it too: the executor hands the node's reader the caller's (or the output's) storage,
// re-viewed at the offset. A reshape or slice that is a graph output or an update value stays a
// copy (outputs get their own buffers; update values are copied over, or written straight into,
// their targets): simple, and such nodes are rare.
//
// In-place reuse over a view: the output of an in-place node is placed at its buffer's start,
// so it may only take an input whose bytes start there (a view at cumulative offset 0: a reshape
// chain, or a slice of leading rows). With the same type as the input it then covers exactly the
// input's bytes, even when the input (a slice) is shorter than the buffer: the rest of the buffer
// belongs to aliases that are all dead by then. An input at a nonzero offset is never reused
// (its output would land at the buffer's start, shifted against the bytes it reads; placing it
// at the input's offset instead would give one buffer values at several starts: not worth it).
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
// Whether reshape or slice node `node` may be a view of its input (it is already a candidate:
// see above).
using ViewPredicate = std::function<bool(size_t node)>;
// A ViewPredicate that allows none: every reshape and slice a copy.
inline const ViewPredicate kNoViews = [](size_t) { return false; };

// A slice view's byte offset in its input must be a multiple of this, so that a view of an
// aligned buffer (arena values, executor outputs and fresh tensors start 64-byte aligned) hands
// kernels pointers as aligned as 16-byte vector accesses need. Rows of a multiple of 16 bytes
// (a GEMM output's rows) always are; an unaligned slice stays a copy.
inline constexpr int64_t kViewOffsetAlignment = 16;

// What find_views returns, per value.
struct Views {
  // The value whose bytes it is as a view (its reshape's or slice's input), or -1.
  std::vector<ValueId> input;
  // Where its bytes start inside its input's bytes: 0 for a reshape (and for a value that is no
  // view), sum_d(start_d * stride_d) * element size for a slice.
  std::vector<int64_t> byte_offset;
};

// The views of `graph` (see above). Candidates are the reshape nodes, and the slice nodes whose
// output is a contiguous run of their input at a kViewOffsetAlignment multiple, whose output is
// neither a graph output nor an update value; `view_ok` empty: all of them.
Views find_views(const Graph& graph, const ViewPredicate& view_ok = {});
// The value that owns the bytes of `id`: follows `views` (Views::input) to its end.
inline ValueId view_root(const std::vector<ValueId>& views, ValueId id) {
  while (views[static_cast<size_t>(id)] >= 0) id = views[static_cast<size_t>(id)];
  return id;
}
// Where `id`'s bytes start inside its root's (view_root): the byte offsets along the chain,
// summed (0 for a value that is no view).
inline int64_t view_root_offset(const std::vector<ValueId>& views, const std::vector<int64_t>& byte_offsets,
                                ValueId id) {
  int64_t offset = 0;
  for (; views[static_cast<size_t>(id)] >= 0; id = views[static_cast<size_t>(id)])
    offset += byte_offsets[static_cast<size_t>(id)];
  return offset;
}

struct MemoryPlan {
  static constexpr size_t kAlignment = 64;
  static constexpr int64_t kNotInArena = -1;

  Liveness liveness;
  // Per value: its byte offset in the arena, or kNotInArena (graph inputs and outputs, values
  // no node defines, views of those). A view's is its root's plus view_root_offset.
  std::vector<int64_t> offsets;
  // Per value: the input whose buffer it overwrites in place, or -1.
  std::vector<ValueId> reuses;
  // Per value: the value whose bytes it is as a view (Views::input), or -1. A view has no bytes
  // of its own: it sits at its root's offset plus its offset in the root (kNotInArena for a
  // root outside the arena).
  std::vector<ValueId> views;
  // Per value: where its bytes start inside those of views[v] (Views::byte_offset): 0 for a
  // reshape view and for a value that is no view.
  std::vector<int64_t> view_offsets;
  size_t arena_bytes = 0;      // the arena's size: the planned peak
  size_t naive_bytes = 0;      // one buffer per arena value that is no view: the sum of their
                               // aligned sizes
  size_t live_peak_bytes = 0;  // the most aligned bytes live at one node (an alias class live
                               // from its first definition to its last read): no plan of this
                               // order with these views (without in-place reuse) can use fewer
  size_t in_place_count = 0;   // values written over their input
  size_t view_count = 0;       // reshapes and slices planned as views (no kernel, no bytes)

  bool is_view(ValueId id) const { return views[static_cast<size_t>(id)] >= 0; }
  // Where `id`'s bytes start inside its root's (0 for a value that is no view).
  int64_t root_offset(ValueId id) const { return view_root_offset(views, view_offsets, id); }

  bool in_arena(ValueId id) const { return offsets[static_cast<size_t>(id)] != kNotInArena; }
};

// Plans `graph` in its current node order. `in_place_ok` empty: no in-place reuse. `view_ok`
// empty: every candidate reshape and slice is a view (kNoViews: none is).
MemoryPlan plan_memory(const Graph& graph, const InPlacePredicate& in_place_ok = {},
                       const ViewPredicate& view_ok = {});

// Which of graph.updates are written straight into their target input by the node making the
// value (no copy at the end of the run, no arena bytes held to its end): the value is no graph
// output and its target none either, both have one type, one value feeds one target (a second
// is copied), nothing reads the target's old value (itself or through a view: `views`, from
// find_views, or all -1) after that node, and where the node reads the target itself its kernel
// may write over its input (`in_place_ok(node)`). The executor's rule (runtime/executor.h).
std::vector<bool> direct_updates(const Graph& graph, const std::vector<ValueId>& views,
                                 const std::function<bool(size_t node)>& in_place_ok);
// `graph` without the updates `direct` names: what the memory plan must keep to the end.
Graph without_updates(const Graph& graph, const std::vector<bool>& direct);
// The arena the passes plan against, before kernels are chosen: `graph` planned as the executor
// will run it, its updates written straight into their targets where direct_updates allows
// (every kernel taken to be able to write in place: the optimizer updates' can), no in-place
// reuse of intermediates (which kernels decide). What the step allocates, not counting updates
// that leave no bytes behind. The second form drops the updates from `graph` itself (no copy:
// the passes plan many candidate orders).
MemoryPlan plan_step_memory(const Graph& graph);
MemoryPlan plan_step_memory(Graph&& graph);
// Drops from `graph` the updates plan_step_memory leaves out (before kernels are chosen).
void drop_direct_updates(Graph& graph);

// Bytes rounded up to the arena alignment.
inline size_t aligned_bytes(size_t bytes) {
  return (bytes + MemoryPlan::kAlignment - 1) / MemoryPlan::kAlignment * MemoryPlan::kAlignment;
}

}  // namespace kiln
