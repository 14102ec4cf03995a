#include "passes/distributed/bucketing.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "ir/builder.h"
#include "passes/distributed/collectives.h"
#include "passes/uses.h"
#include "support/error.h"
#include "support/bytes.h"

namespace kiln {
namespace {

using distributed::Collective;

// DeepCompile's fusion rule: merging pays while the merged collective takes under 1.2x the
// longer part alone (the latency saved outweighs the wait for the later part), up to 1 GiB.
constexpr double kMergeRatio = 1.2;
constexpr double kMaxBucketBytes = double(size_t{1} << 30);

// Collectives merge only with their own kind: same op, group size, reduction and dtype.
using Signature = std::tuple<Op, int64_t, std::string, DType>;
Signature signature_of(const Graph& g, const Node& n) {
  return {n.op, n.attrs.i("world_size"), n.op == Op::kAllGather ? std::string() : n.attrs.s("reduce"),
          g.type(n.inputs[0]).dtype};
}

struct Bucket {
  std::vector<Collective> members;
  double bytes = 0;
  double seconds = 0;
  int ready = 0;                        // the start may go before node `ready` at the earliest
  int first_read = 0;                   // the first node reading any member's output
  int first_ready = 0;                  // the earliest member's own `ready`
};

// Where the bucket's start may go: after every member's input is made (its chain of casts and
// shape ops moves up with it). A gather's input (params) is ready from the start, but a bucket
// then spans only gathers started before any member's output is read (its own start counts):
// the overlap pass, not a bucket, decides how far ahead to gather.
int ready_of(const Graph& g, const Collective& c) {
  const Op op = g.nodes[static_cast<size_t>(c.start)].op;
  return op == Op::kAllGather ? std::max(c.ready, c.start) : distributed::hoists_producers(op) ? c.earliest : c.ready;
}

// What a collective communicates, up to a cast of a graph input: zero3 gathers each param shard
// once for the forward and again for the backward, so that nothing gathered lives across the
// loss; one bucket holding both would keep it alive, so they never share one.
ValueId root_of(const Graph& g, const Collective& c) {
  const ValueId in = g.nodes[static_cast<size_t>(c.start)].inputs[0];
  if (c.producer_movable && g.nodes[static_cast<size_t>(c.producer)].op == Op::kCast)
    return g.nodes[static_cast<size_t>(c.producer)].inputs[0];
  return in;
}

class Rewriter {
 public:
  Rewriter(Graph& graph) : graph_(graph), keys_(graph.nodes.size()) {
    for (size_t n = 0; n < keys_.size(); ++n) keys_[n] = static_cast<double>(n);
  }

  void merge(const Bucket& bucket) {
    const std::vector<Collective>& m = bucket.members;
    const Node& first = graph_.nodes[static_cast<size_t>(m[0].start)];
    const Op op = first.op;
    const Attributes attrs = first.attrs;
    const int64_t world = attrs.i("world_size");
    const int start_at = std::max(bucket.ready, m[0].start);
    for (const Collective& c : m) {
      if (distributed::hoists_producers(op))  // an all_reduce's producers (collectives.h), then its chain
        for (int p : c.producers)
          keys_[static_cast<size_t>(p)] = std::min(keys_[static_cast<size_t>(p)], start_at - 0.8 + 1e-7 * p);
      for (int p : c.chain)  // up only (a chain node may have readers before), in their order
        keys_[static_cast<size_t>(p)] = std::min(keys_[static_cast<size_t>(p)], start_at - 0.7 + 1e-7 * p);
    }

    Builder b(std::move(graph_));
    size_t mark = b.graph().nodes.size();
    auto place = [&](double key) {  // keys for the nodes appended since the last call
      for (; mark < b.graph().nodes.size(); ++mark) keys_.push_back(key + 1e-6 * static_cast<double>(keys_.size()));
    };
    // Copy in.
    std::vector<Expr> pieces;
    std::vector<int64_t> sizes;  // per member: elements of its piece of the bucket (per rank for reduce_scatter)
    for (const Collective& c : m) {
      Expr x = b.wrap(b.graph().nodes[static_cast<size_t>(c.start)].inputs[0]);
      const int64_t numel = x.type().numel();
      if (op == Op::kReduceScatter) {
        sizes.push_back(numel / world);
        pieces.push_back(reshape(x, {world, numel / world}));
      } else {
        sizes.push_back(numel);
        pieces.push_back(x.type().shape.size() == 1 ? x : reshape(x, {numel}));
      }
    }
    Expr in = concat(pieces, op == Op::kReduceScatter ? 1 : 0);
    if (op == Op::kReduceScatter) in = reshape(in, {in.type().numel()});
    Expr started = b.apply1(op, {in}, attrs);
    place(start_at - 0.5);
    Expr out = b.apply1(Op::kCollectiveWait, {started});
    if (op == Op::kAllGather) out = reshape(out, {world, out.type().numel() / world});
    // The wait where the first member's was (between the start and every read): no member's
    // input is kept alive longer than before, whatever pass follows.
    int wait_at = m[0].wait;
    for (const Collective& c : m) wait_at = std::min(wait_at, c.wait);
    place(std::max(start_at, wait_at) - 0.5);
    // Copy out, each member's before its first reader.
    int64_t offset = 0;
    for (size_t i = 0; i < m.size(); ++i) {
      const ValueId old = b.graph().nodes[static_cast<size_t>(m[i].wait)].outputs[0];
      const TensorType want = b.graph().type(old);
      Expr piece = slice_axis(out, op == Op::kAllGather ? 1 : 0, offset, offset + sizes[i]);
      offset += sizes[i];
      if (piece.type().shape != want.shape) piece = reshape(piece, want.shape);
      place(m[i].first_reader - 0.3);
      replaced_[old] = piece.id();
    }
    graph_ = b.take();
    for (const Collective& c : m) {
      dead_.push_back(c.start);
      dead_.push_back(c.wait);
    }
  }

  void finish() {
    for (Node& node : graph_.nodes)
      for (ValueId& in : node.inputs)
        if (auto it = replaced_.find(in); it != replaced_.end()) in = it->second;
    // The merged collectives' nodes go in one sweep (one erase each was quadratic).
    std::vector<char> dead(graph_.nodes.size(), 0);
    for (int n : dead_) dead[static_cast<size_t>(n)] = 1;
    size_t kept = 0;
    for (size_t n = 0; n < graph_.nodes.size(); ++n) {
      if (dead[n]) continue;
      if (kept != n) {
        graph_.nodes[kept] = std::move(graph_.nodes[n]);
        keys_[kept] = keys_[n];
      }
      ++kept;
    }
    graph_.nodes.resize(kept);
    keys_.resize(kept);
    distributed::reorder_by_keys(graph_, keys_);
  }

 private:
  Graph& graph_;
  std::vector<double> keys_;
  std::map<ValueId, ValueId> replaced_;
  std::vector<int> dead_;
};

}  // namespace

bool BucketCollectives::run(Graph& graph) {
  notes_.clear();
  const Uses uses(graph);
  const std::vector<Collective> collectives = distributed::find_collectives(graph, uses, costs_);
  if (collectives.empty()) return false;

  // Greedy over the node order: one open bucket per kind.
  const std::vector<double> t = distributed::compute_start_times(graph, costs_);
  std::vector<Bucket> closed;
  std::map<Signature, Bucket> open;
  for (const Collective& c : collectives) {
    const Node& node = graph.nodes[static_cast<size_t>(c.start)];
    if (c.first_reader < 0) continue;  // its result escapes or is unread: left as it is
    const CollectiveFit& fit = costs_.fit(node.op);
    Bucket& bucket = open[signature_of(graph, node)];
    if (!bucket.members.empty()) {
      const double bytes = bucket.bytes + c.bytes;
      const double merged = fit.seconds(bytes);
      const bool fits_in_time = merged <= kMergeRatio * std::max(bucket.seconds, c.seconds);
      // The merged start (after every input, not before the first member's) precedes every read.
      const bool in_order = std::max({bucket.ready, ready_of(graph, c), bucket.members[0].start}) <=
                            std::min(bucket.first_read, c.first_reader);
      const bool repeats = std::any_of(bucket.members.begin(), bucket.members.end(),
                                       [&](const Collective& m) { return root_of(graph, m) == root_of(graph, c); });
      // A reduction waits for its last member's input: the earliest member's communication is
      // delayed by the compute in between, which may not exceed the latency the bucket saves (or
      // a growing bucket would swallow the whole backward and reduce it all at the end).
      // Gathers read params, ready from the start: nothing waits.
      const int ready = std::max(bucket.ready, ready_of(graph, c));
      const bool reduction = node.op != Op::kAllGather;
      const bool prompt = !reduction || t[static_cast<size_t>(ready)] - t[static_cast<size_t>(bucket.first_ready)] <=
                                            fit.latency_s * static_cast<double>(bucket.members.size());
      if (fits_in_time && in_order && prompt && !repeats && bytes <= kMaxBucketBytes) {
        bucket.members.push_back(c);
        bucket.bytes = bytes;
        bucket.seconds = merged;
        bucket.ready = std::max(bucket.ready, ready_of(graph, c));
        bucket.first_read = std::min(bucket.first_read, c.first_reader);
        continue;
      }
      closed.push_back(std::move(bucket));
    }
    bucket = Bucket{{c}, c.bytes, c.seconds, ready_of(graph, c), c.first_reader, ready_of(graph, c)};
  }
  for (auto& [sig, bucket] : open) closed.push_back(std::move(bucket));

  Rewriter rewriter(graph);
  int merged_collectives = 0, buckets = 0;
  double saved_s = 0, bytes = 0;
  for (const Bucket& bucket : closed) {
    if (bucket.members.size() < 2) continue;
    double alone = 0;
    for (const Collective& c : bucket.members) alone += c.seconds;
    saved_s += alone - bucket.seconds;
    bytes += bucket.bytes;
    merged_collectives += static_cast<int>(bucket.members.size());
    ++buckets;
    rewriter.merge(bucket);
  }
  if (buckets == 0) return false;
  rewriter.finish();
  notes_.push_back(fmt::format("{} collectives merged into {} bucket{} ({} moved), {} collectives now; predicted "
                               "{:.3f} ms of communication saved ({})",
                               merged_collectives, buckets, buckets == 1 ? "" : "s", format_bytes(bytes),
                               collectives.size() - static_cast<size_t>(merged_collectives - buckets), 1e3 * saved_s,
                               costs_.source));
  return true;
}

}  // namespace kiln
