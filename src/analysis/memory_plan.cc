#include "analysis/memory_plan.h"

#include <algorithm>
#include <numeric>

#include "ops/slice.h"
#include "ops/update_stream.h"

namespace kiln {
namespace {

// A run of bytes that one value, or a chain of values each written in place over the one
// before, occupies from node `start` to node `end` (inclusive).
struct Buffer {
  size_t size = 0;
  int start = 0;
  int end = 0;
  size_t offset = 0;
};

// Byte ranges as runs: disjoint, in order, each the union of the added ranges that overlap or
// touch. (A sorted vector: a segment's runs are few, as placement packs buffers.)
class ByteRuns {
 public:
  bool empty() const { return runs_.empty(); }
  void add(size_t begin, size_t end) {
    // The runs from the first that ends at or after `begin` to the last that starts at or before
    // `end` merge with [begin, end).
    auto first = std::lower_bound(runs_.begin(), runs_.end(), begin, [](const Run& r, size_t at) {
      return r.second < at;
    });
    auto last = first;
    for (; last != runs_.end() && last->first <= end; ++last) {
      begin = std::min(begin, last->first);
      end = std::max(end, last->second);
    }
    if (first == last) {
      runs_.insert(first, Run{begin, end});
    } else {
      *first = Run{begin, end};
      runs_.erase(first + 1, last);
    }
  }
  // The end of the lowest run that holds a byte of [begin, end), or 0 if none does.
  size_t end_of_run_within(size_t begin, size_t end) const {
    auto at = std::upper_bound(runs_.begin(), runs_.end(), begin, [](size_t b, const Run& r) {
      return b < r.second;
    });  // the first run ending after `begin`
    return at != runs_.end() && at->first < end ? at->second : 0;
  }

 private:
  using Run = std::pair<size_t, size_t>;  // begin, end
  std::vector<Run> runs_;
};

// The placed buffers, indexed by time and bytes, so that finding room for a buffer costs a few
// logarithms per run of bytes in its way, where a walk over every placed buffer in offset order
// grew with the square of the step's length (most of a deep model's compile time: the passes
// plan many candidate orders). The buffers live somewhere in a span [first, last] are those live
// at `first` and those starting after it, up to `last`. A segment tree over node positions holds
// both: a buffer's bytes go to `throughout_` of the largest segments inside its span
// (`for_span`), and to `starting_` of every segment holding its start (`for_path`); the buffers
// live at a position are then in `throughout_` of the segments holding it, and those starting
// in a span in `starting_` of the span's segments.
class PlacedBuffers {
 public:
  explicit PlacedBuffers(int positions) {
    while ((size_t{1} << levels_) < static_cast<size_t>(positions)) ++levels_;
    throughout_.resize(2 * leaves());
    starting_.resize(2 * leaves());
  }

  void add(const Buffer& b) {
    const size_t end = b.offset + b.size;
    for_span(b.start, b.end, [&](size_t segment) { throughout_[segment].add(b.offset, end); });
    for_path(b.start, [&](size_t segment) { starting_[segment].add(b.offset, end); });
  }

  // The lowest offset at which `size` bytes overlap no placed buffer live somewhere in [start,
  // end]: from 0, past each run of bytes in the way, until none is. (The walk over the placed
  // buffers in offset order that this replaces found the same offset: the lowest that is free.)
  size_t lowest_free_offset(int start, int end, size_t size) {
    in_span_.clear();
    // The largest segments first: the longest-lived buffers lie lowest in a stack of them, so
    // the walk below meets the sets of runs in about the order they block it.
    for_path(start, [&](size_t segment) {
      if (!throughout_[segment].empty()) in_span_.push_back(&throughout_[segment]);
    });
    if (start < end)
      for_span(start + 1, end, [&](size_t segment) {
        if (!starting_[segment].empty()) in_span_.push_back(&starting_[segment]);
      });
    // Each set in turn moves the offset past its runs in the way; done when none has moved it
    // for a whole round.
    size_t offset = 0;
    const size_t sets = in_span_.size();
    for (size_t i = 0, quiet = 0; quiet < sets; i = i + 1 < sets ? i + 1 : 0) {
      ++quiet;
      for (size_t past; (past = in_span_[i]->end_of_run_within(offset, offset + size)) > 0; quiet = 1) offset = past;
    }
    return offset;
  }

 private:
  size_t leaves() const { return size_t{1} << levels_; }
  size_t leaf(int position) const { return leaves() + static_cast<size_t>(position); }
  // Calls f on the largest segments inside [first, last] (bottom-up, as a segment tree does).
  template <class F>
  void for_span(int first, int last, F&& f) const {
    for (size_t lo = leaf(first), hi = leaf(last) + 1; lo < hi; lo /= 2, hi /= 2) {
      if (lo & 1) f(lo++);
      if (hi & 1) f(--hi);
    }
  }
  // Calls f on every segment holding `position`, the largest (the root) first.
  template <class F>
  void for_path(int position, F&& f) const {
    for (size_t shift = levels_ + 1; shift-- > 0;) f(leaf(position) >> shift);
  }

  size_t levels_ = 0;  // below the root: 2^levels_ leaves
  std::vector<ByteRuns> throughout_, starting_;
  std::vector<const ByteRuns*> in_span_;  // lowest_free_offset's, kept to spare allocations
};

// Where a slice's output starts inside its input's bytes when it is one contiguous run of them
// (memory_plan.h: every step 1; some axis a with every dim before it of output extent 1 and
// every dim after it whole), or -1 when it is not (or the slice is empty).
int64_t contiguous_slice_offset(const Node& node, const TensorType& in, const TensorType& out) {
  const Shape& dims = in.shape;
  const size_t rank = dims.size();
  if (out.numel() == 0) return -1;
  const ops::SliceBounds b = ops::slice_bounds(dims, node.attrs);  // the graph is verified
  std::vector<int64_t> extent(rank);
  for (size_t d = 0; d < rank; ++d) {
    if (b.steps[d] != 1) return -1;
    extent[d] = b.ends[d] - b.starts[d];
  }
  const std::vector<int64_t>& start = b.starts;
  // a = the last dim not taken whole (0 if every dim is): every dim after it is whole, and
  // every dim before it must be a single index.
  size_t a = 0;
  for (size_t d = 0; d < rank; ++d)
    if (start[d] != 0 || extent[d] != dims[d]) a = d;
  for (size_t d = 0; d < a; ++d)
    if (extent[d] != 1) return -1;
  const std::vector<int64_t> strides = strides_of(dims);
  int64_t offset = 0;
  for (size_t d = 0; d < rank; ++d) offset += start[d] * strides[d];
  return offset * static_cast<int64_t>(dtype_size(in.dtype));
}

}  // namespace

Views find_views(const Graph& graph, const ViewPredicate& view_ok) {
  Views views;
  views.input.assign(graph.values.size(), -1);
  views.byte_offset.assign(graph.values.size(), 0);
  // A graph output needs its own buffer; an update value is copied over, or written straight
  // into, its target: both stay copies.
  std::vector<bool> keep(graph.values.size(), false);
  for (ValueId id : graph.outputs) keep[id] = true;
  for (const Update& u : graph.updates) keep[u.value] = true;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (node.op != Op::kReshape && node.op != Op::kSlice && node.op != Op::kCollectiveWait) continue;
    if (node.inputs.size() != 1 || node.outputs.size() != 1) continue;
    const ValueId in = node.inputs[0], out = node.outputs[0];
    if (keep[out]) continue;
    const TensorType& in_type = graph.type(in);
    const TensorType& out_type = graph.type(out);
    if (in_type.dtype != out_type.dtype) continue;
    int64_t offset = 0;
    if (node.op == Op::kReshape || node.op == Op::kCollectiveWait) {
      // Same dtype and element count, so the same bytes in the same (row-major) order.
      if (in_type.bytes() != out_type.bytes()) continue;
    } else {
      // A run of the input's bytes, at an offset that keeps the pointers aligned.
      offset = contiguous_slice_offset(node, in_type, out_type);
      if (offset < 0 || offset % kViewOffsetAlignment != 0) continue;
    }
    if (view_ok && !view_ok(n)) continue;
    views.input[out] = in;
    views.byte_offset[out] = offset;
  }
  return views;
}

Liveness compute_liveness(const Graph& graph) {
  Liveness l;
  l.def.assign(graph.values.size(), -1);
  l.last.assign(graph.values.size(), -1);
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const int index = static_cast<int>(n);
    for (ValueId id : graph.nodes[n].inputs) l.last[id] = index;
    for (ValueId id : graph.nodes[n].outputs) l.def[id] = l.last[id] = index;
  }
  // A collective reads its input on the communication stream until its wait, not just at its
  // own node (ops/collective.h): the input's bytes stay its own until then. (Its output is
  // written from the start on: defined at the collective's node, as every output.)
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& wait = graph.nodes[n];
    if (wait.op != Op::kCollectiveWait) continue;
    const int start = l.def[wait.inputs[0]];
    if (start < 0) continue;
    for (ValueId id : graph.nodes[start].inputs) l.last[id] = std::max(l.last[id], static_cast<int>(n));
  }
  const int end = static_cast<int>(graph.nodes.size());
  for (ValueId id : graph.outputs) l.last[id] = end;
  for (const Update& u : graph.updates) l.last[u.value] = end;
  // A node on the update stream (ops/update_stream.h) reads its inputs there until the compute
  // stream joins it, at the end of the step: the bytes of those the step makes stay theirs.
  // (Graph inputs are the caller's: their last read stays the node itself, which may then write
  // its results straight into them; its outputs are update values, kept to the end above.)
  for (const Node& node : graph.nodes)
    if (on_update_stream(node))
      for (ValueId id : node.inputs)
        if (l.def[id] >= 0) l.last[id] = end;
  return l;
}

MemoryPlan plan_memory(const Graph& graph, const InPlacePredicate& in_place_ok,
                       const ViewPredicate& view_ok) {
  MemoryPlan plan;
  plan.liveness = compute_liveness(graph);
  const Liveness& live = plan.liveness;
  const size_t num_values = graph.values.size();
  plan.offsets.assign(num_values, MemoryPlan::kNotInArena);
  plan.reuses.assign(num_values, -1);
  Views views = find_views(graph, view_ok);
  plan.views = std::move(views.input);
  plan.view_offsets = std::move(views.byte_offset);

  std::vector<bool> is_output(num_values, false);
  for (ValueId id : graph.outputs) is_output[id] = true;

  // Buffers in node order; chains of in-place values and alias classes (a value and its views)
  // share one.
  std::vector<Buffer> buffers;
  std::vector<int> buffer_of(num_values, -1);
  // Per value in a buffer: where its bytes start in it. 0 but for views (their offsets in their
  // root, summed): a value written in place, and a view's root, start at the buffer's start.
  std::vector<int64_t> offset_in_buffer(num_values, 0);
  std::vector<int> taken;  // buffers claimed in place by the current node's outputs
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    const int index = static_cast<int>(n);
    if (node.outputs.size() == 1 && plan.is_view(node.outputs[0])) {
      // A view joins its input's buffer, which now lives as long as the longest-lived alias, at
      // its offset in its input; a view of a value outside the arena stays outside (buffer -1).
      const ValueId out = node.outputs[0];
      const int b = buffer_of[node.inputs[0]];
      buffer_of[out] = b;
      offset_in_buffer[out] = offset_in_buffer[node.inputs[0]] + plan.view_offsets[out];
      if (b >= 0) buffers[b].end = std::max(buffers[b].end, live.last[out]);
      ++plan.view_count;
      continue;
    }
    // The kernel decides (KernelImpl::in_place_ok): elementwise kernels, the in-place optimizer
    // updates and the fused classifier, which writes its logits' gradient over the logits.
    const bool may_reuse = static_cast<bool>(in_place_ok);
    taken.clear();
    for (ValueId out : node.outputs) {
      if (is_output[out]) continue;
      plan.naive_bytes += aligned_bytes(graph.type(out).bytes());
      int chosen = -1;
      for (size_t k = 0; may_reuse && k < node.inputs.size(); ++k) {
        const ValueId in = node.inputs[k];
        const int b = buffer_of[in];
        // The input must die here (so nothing reads it after the output is written) and be the
        // newest value of its buffer (so the buffer is free from here on).
        // With views, the buffer's end is its whole alias class's: no alias is read later.
        if (b < 0 || live.last[in] != index || buffers[b].end != index) continue;
        if (graph.type(in) != graph.type(out)) continue;
        // The output goes to the buffer's start: only an input starting there (no view at a
        // nonzero offset, a slice of later rows) has its bytes exactly where the output lands.
        // Same type, so the output covers the input's bytes and no more, even when the input is
        // a slice shorter than the buffer (the rest belongs to aliases, dead from here on).
        if (offset_in_buffer[in] != 0) continue;
        if (std::find(taken.begin(), taken.end(), b) != taken.end()) continue;
        // Nor may the node read the same bytes through another alias (a view of `in`, or the
        // value `in` is a view of), perhaps in another shape: a kernel that allows in place
        // expects to overwrite each element after reading it at the same position, through
        // one input.
        bool aliased_twice = false;
        for (ValueId other : node.inputs) aliased_twice |= other != in && buffer_of[other] == b;
        if (aliased_twice) continue;
        if (!in_place_ok(n, k)) continue;
        chosen = b;
        plan.reuses[out] = in;
        ++plan.in_place_count;
        break;
      }
      if (chosen < 0) {
        chosen = static_cast<int>(buffers.size());
        buffers.push_back(Buffer{aligned_bytes(graph.type(out).bytes()), index, live.last[out]});
      } else {
        buffers[chosen].end = std::max(buffers[chosen].end, live.last[out]);
        taken.push_back(chosen);
      }
      buffer_of[out] = chosen;
    }
  }

  // The live bytes at each node (difference array over [start, end]); ends reach nodes.size().
  std::vector<int64_t> delta(graph.nodes.size() + 2, 0);
  for (const Buffer& b : buffers) {
    delta[b.start] += static_cast<int64_t>(b.size);
    delta[b.end + 1] -= static_cast<int64_t>(b.size);
  }
  int64_t running = 0;
  for (int64_t d : delta) {
    running += d;
    plan.live_peak_bytes = std::max(plan.live_peak_bytes, static_cast<size_t>(running));
  }

  // Largest first (ties: earlier start, then creation order, so the plan is deterministic);
  // each at the lowest offset clear of every placed buffer that is live at the same time.
  std::vector<size_t> order(buffers.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (buffers[a].size != buffers[b].size) return buffers[a].size > buffers[b].size;
    if (buffers[a].start != buffers[b].start) return buffers[a].start < buffers[b].start;
    return a < b;
  });
  PlacedBuffers placed(static_cast<int>(graph.nodes.size()) + 1);
  for (size_t b : order) {
    Buffer& buffer = buffers[b];
    if (buffer.size == 0) continue;  // offset 0; overlaps nothing
    buffer.offset = placed.lowest_free_offset(buffer.start, buffer.end, buffer.size);
    plan.arena_bytes = std::max(plan.arena_bytes, buffer.offset + buffer.size);
    placed.add(buffer);
  }

  for (size_t v = 0; v < num_values; ++v)
    if (buffer_of[v] >= 0)
      plan.offsets[v] = static_cast<int64_t>(buffers[buffer_of[v]].offset) + offset_in_buffer[v];
  return plan;
}

std::vector<bool> direct_updates(const Graph& graph, const std::vector<ValueId>& views,
                                 const std::function<bool(size_t node)>& in_place_ok) {
  const size_t values = graph.values.size();
  const Liveness live = compute_liveness(graph);
  std::vector<int> last_read = live.last;  // per value: its last read, through itself or a view
  for (size_t v = 0; v < values; ++v) {
    if (views[v] < 0) continue;
    const ValueId root = view_root(views, static_cast<ValueId>(v));
    last_read[root] = std::max(last_read[root], live.last[v]);
  }
  std::vector<bool> is_output(values, false);
  for (ValueId id : graph.outputs) is_output[id] = true;
  // Per update: whether the node making its value reads its target (itself or through a view).
  // Found from the nodes' inputs once: a multi-tensor node makes thousands of update values and
  // reads as many targets, and a walk over its inputs per update grew with their square.
  std::vector<std::vector<size_t>> updates_of_target(values);
  for (size_t u = 0; u < graph.updates.size(); ++u) updates_of_target[graph.updates[u].target].push_back(u);
  std::vector<bool> reads_target(graph.updates.size(), false);
  for (size_t n = 0; n < graph.nodes.size(); ++n)
    for (ValueId in : graph.nodes[n].inputs)
      for (size_t u : updates_of_target[view_root(views, in)])
        reads_target[u] = reads_target[u] || live.def[graph.updates[u].value] == static_cast<int>(n);
  std::vector<bool> written(values, false);  // per value: written into a target already
  std::vector<bool> direct(graph.updates.size(), false);
  for (size_t u = 0; u < graph.updates.size(); ++u) {
    const Update& update = graph.updates[u];
    const int def = live.def[update.value];
    if (def < 0 || is_output[update.target] || is_output[update.value]) continue;
    if (written[update.value]) continue;  // one value, two targets: copy the second
    if (graph.type(update.value) != graph.type(update.target)) continue;
    if (last_read[update.target] > def) continue;  // a later node reads the old value
    if (reads_target[u] && !in_place_ok(static_cast<size_t>(def))) continue;
    written[update.value] = true;
    direct[u] = true;
  }
  return direct;
}

namespace {
void drop_updates(std::vector<Update>& updates, const std::vector<bool>& direct) {
  size_t kept = 0;
  for (size_t u = 0; u < updates.size(); ++u)
    if (!direct[u]) updates[kept++] = updates[u];
  updates.resize(kept);
}
std::vector<bool> direct_updates_before_kernels(const Graph& graph) {
  return direct_updates(graph, find_views(graph).input, [](size_t) { return true; });
}
}  // namespace

Graph without_updates(const Graph& graph, const std::vector<bool>& direct) {
  Graph planned = graph;
  drop_updates(planned.updates, direct);
  return planned;
}

MemoryPlan plan_step_memory(const Graph& graph) {
  const std::vector<bool> direct = direct_updates_before_kernels(graph);
  if (std::find(direct.begin(), direct.end(), true) == direct.end()) return plan_memory(graph);
  return plan_memory(without_updates(graph, direct));
}

void drop_direct_updates(Graph& graph) { drop_updates(graph.updates, direct_updates_before_kernels(graph)); }

MemoryPlan plan_step_memory(Graph&& graph) {
  drop_direct_updates(graph);
  return plan_memory(graph);
}

}  // namespace kiln
