// The fusion partitioners: the legality check and objective (is_legal, saved_bytes), a greedy
// partitioner with incremental acyclicity checks, and an exact one (branch and bound per connected
// component of fusable items, seeded with greedy's answer).
//
// Acyclicity is checked on the whole quotient graph (every group contracted at once), which is
// what outlining all groups needs: two groups that are each fine alone may still form a cycle
// together (A -> B through one item pair, B -> A through another).
//
// A value with no consumers is never counted as saved: there is nothing to fuse it into.
#include "passes/fusion/partition.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <unordered_map>
#include <utility>

#include "support/error.h"

namespace kiln::fusion {
namespace {

// Item-level adjacency built from the values, after checking the Problem is well formed.
struct Adjacency {
  int n = 0;
  std::vector<std::vector<int>> succ;        // item -> consumer items (deduplicated)
  std::vector<std::vector<int>> pred;        // item -> producer items (deduplicated)
  std::vector<std::vector<int>> out_values;  // item -> values it produces
  std::vector<std::vector<int>> in_values;   // item -> values it reads (deduplicated)
  // item -> consumers of its column values (deduplicated): never in its group.
  std::vector<std::vector<int>> column_succ;
};

bool is_column_value(const Problem& problem, const ValueUse& use) {
  return use.column || problem.items[use.producer].kind == ItemKind::kColumnReduction;
}

Adjacency build_adjacency(const Problem& problem) {
  Adjacency a;
  a.n = static_cast<int>(problem.items.size());
  a.succ.resize(a.n);
  a.pred.resize(a.n);
  a.out_values.resize(a.n);
  a.in_values.resize(a.n);
  a.column_succ.resize(a.n);
  for (size_t v = 0; v < problem.values.size(); ++v) {
    const ValueUse& use = problem.values[v];
    KILN_CHECK(use.producer >= 0 && use.producer < a.n,
               "fusion partition: value {} has producer {}, expected an item index in [0, {})", v,
               use.producer, a.n);
    KILN_CHECK(use.bytes >= 0, "fusion partition: value {} has {} bytes, expected >= 0", v,
               use.bytes);
    a.out_values[use.producer].push_back(static_cast<int>(v));
    for (int c : use.consumers) {
      KILN_CHECK(c >= 0 && c < a.n,
                 "fusion partition: value {} has consumer {}, expected an item index in [0, {})",
                 v, c, a.n);
      KILN_CHECK(c > use.producer,
                 "fusion partition: value {} is produced by item {} and read by item {}: items "
                 "must be in topological order (consumers after their producer)",
                 v, use.producer, c);
      a.succ[use.producer].push_back(c);
      if (is_column_value(problem, use)) a.column_succ[use.producer].push_back(c);
      a.pred[c].push_back(use.producer);
      a.in_values[c].push_back(static_cast<int>(v));
    }
  }
  auto dedup = [](std::vector<int>& xs) {
    std::sort(xs.begin(), xs.end());
    xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
  };
  for (int i = 0; i < a.n; ++i) {
    dedup(a.succ[i]);
    dedup(a.pred[i]);
    dedup(a.in_values[i]);
    dedup(a.column_succ[i]);
  }
  return a;
}

// Group ids remapped to 0..groups-1 in order of first appearance; throws on a malformed vector.
std::vector<int> dense_groups(const Problem& problem, const std::vector<int>& group_of,
                              int* groups) {
  KILN_CHECK(group_of.size() == problem.items.size(),
             "fusion partition: group_of has {} entries, expected one per item ({})",
             group_of.size(), problem.items.size());
  std::unordered_map<int, int> remap;  // ids may be anything >= 0, not only 0..groups-1
  std::vector<int> dense(group_of.size());
  int next = 0;
  for (size_t i = 0; i < group_of.size(); ++i) {
    int g = group_of[i];
    KILN_CHECK(g >= 0, "fusion partition: item {} has group id {}, expected >= 0", i, g);
    auto [it, inserted] = remap.try_emplace(g, next);
    if (inserted) ++next;
    dense[i] = it->second;
  }
  *groups = next;
  return dense;
}

std::string item_list(const std::vector<int>& items) {
  constexpr size_t kShown = 8;
  std::string s = "{";
  for (size_t i = 0; i < items.size() && i < kShown; ++i)
    s += (i ? ", " : "") + std::to_string(items[i]);
  if (items.size() > kShown) s += fmt::format(", ... ({} items)", items.size());
  return s + "}";
}

bool fusable_kind(ItemKind k) { return k != ItemKind::kOpaque; }

bool reads_column_of(const Adjacency& adj, int producer, int consumer) {
  const std::vector<int>& cs = adj.column_succ[producer];
  return std::binary_search(cs.begin(), cs.end(), consumer);
}

// Whether the edge producer -> consumer may lie inside one legal group at all: both fusable, in
// one iteration space, the consumer reading no column value of the producer and no GEMM.
bool fusable_edge(const Problem& problem, const Adjacency& adj, int producer, int consumer) {
  const Item& p = problem.items[producer];
  const Item& c = problem.items[consumer];
  return fusable_kind(p.kind) && fusable_kind(c.kind) && p.space == c.space &&
         !reads_column_of(adj, producer, consumer) && c.kind != ItemKind::kGemm;
}

bool counts_as_saved(const ValueUse& use, const std::vector<int>& group_of) {
  if (use.external || use.consumers.empty()) return false;
  for (int c : use.consumers)
    if (group_of[c] != group_of[use.producer]) return false;
  return true;
}

// ------------------------------------------------------------------------------------------
// Greedy.
//
// Values largest first, in passes until a pass merges nothing (at most Greedy::kMaxPasses).
// Union-find over items; every root keeps its members, its space, whether it holds an opaque
// item, its GEMM, the items it may never share a group with (a GEMM's producers, a column
// reduction's consumers) and `ord`, its position in a topological order of the quotient graph.
// Merging a set S of groups creates a cycle iff some path leaves S and comes back; every group on
// such a path has ord strictly between lo = min ord(S) and hi = max ord(S), so the forward search
// from S stops at ord >= hi. When the merge is legal, the topological order is repaired as in
// Pearce and Kelly's dynamic topological sort: the groups reached forward from S (ord < hi) and
// backward (ord > lo) are given the pooled ord slots of S and both sets, the backward set first,
// then the merged group, then the forward set (each keeping its relative order).
// Cost: sorting values O(V log V); per attempted merge, the cheap rules in O(|S| + forbidden
// items) and the cycle search in O(items and edges of the groups with ord in (lo, hi)). In the
// worst case O(V * (N + E)); on training graphs the windows are short and the whole is near
// linear.
class Greedy {
 public:
  static constexpr int kMaxPasses = 4;

  Greedy(const Problem& problem, const Adjacency& adj) : problem_(problem), adj_(adj) {
    int n = adj.n;
    parent_.resize(n);
    std::iota(parent_.begin(), parent_.end(), 0);
    members_.resize(n);
    forbid_.resize(n);
    ord_.resize(n);
    gemm_.assign(n, -1);
    mark_.assign(n, 0);
    reads_.resize(n);
    writes_.resize(n);
    for (size_t v = 0; v < problem.values.size(); ++v) {
      writes_[problem.values[v].producer].push_back(static_cast<int>(v));
      for (int c : problem.values[v].consumers) reads_[c].push_back(static_cast<int>(v));
    }
    for (int i = 0; i < n; ++i) {
      members_[i] = {i};
      ord_[i] = i;
      ItemKind k = problem.items[i].kind;
      if (k == ItemKind::kGemm) {
        gemm_[i] = i;
        for (int p : adj.pred[i]) forbid_[i].push_back(p);
      }
      for (int c : adj.column_succ[i]) forbid_[i].push_back(c);
    }
  }

  void run() {
    const std::vector<int> order = values_largest_first(/*external=*/false);
    // Passes until nothing merges: a merge refused because a path left the groups and came
    // back (a value read both before and after a row statistic of its consumers' chain) is
    // often legal once that chain has merged into one group, later in the same pass.
    for (int pass = 0; pass < kMaxPasses; ++pass) {
      bool merged = false;
      for (int v : order) {
        const ValueUse& use = problem_.values[v];
        std::vector<int> roots = {find(use.producer)};
        for (int c : use.consumers) roots.push_back(find(c));
        std::sort(roots.begin(), roots.end());
        roots.erase(std::unique(roots.begin(), roots.end()), roots.end());
        if (roots.size() > 1) merged |= try_merge(roots);
      }
      if (!merged) break;
    }
  }

  // Takes over a legal partition: each group merged in one step (merging a group piecewise
  // could pass through a cyclic contraction: {a1, a3} with a1 -> a2 -> a3 before a2 joins).
  // False if some group is refused (only possible for an illegal partition).
  bool adopt(const std::vector<int>& group_of) {
    std::unordered_map<int, std::vector<int>> groups;
    std::vector<int> first_seen;
    for (int i = 0; i < adj_.n; ++i) {
      auto [it, inserted] = groups.try_emplace(group_of[i]);
      if (inserted) first_seen.push_back(group_of[i]);
      it->second.push_back(i);
    }
    for (int g : first_seen) {
      const std::vector<int>& items = groups[g];  // sorted: pushed in item order
      if (items.size() > 1 && !try_merge(items)) return false;
    }
    return true;
  }

  // The reads phase (absorb_readers): values largest first, each consumer's group merged into
  // the producer's group when legal, in passes until nothing merges.
  void absorb() {
    const std::vector<int> order = values_largest_first(/*external=*/true);
    for (int pass = 0; pass < kMaxPasses; ++pass) {
      bool merged = false;
      for (int v : order) {
        const ValueUse& use = problem_.values[v];
        for (int c : use.consumers) {
          std::vector<int> roots = {find(use.producer), find(c)};
          if (roots[0] == roots[1]) continue;
          // A row op joining a GEMM's group makes the epilogue one no library fuses (the
          // product then goes through memory anyway): nothing saved. A column reduction joining
          // one becomes a cuBLASLt BGRAD epilogue, measured far slower than the product and a
          // separate column sum (H100, GPT-2's fc: DGELU_BGRAD 916 us against 281 + 97).
          // Neither applies to a GEMM group that already holds a row op: its epilogue is a
          // generated rows kernel over the product, which takes both at no extra pass (GPT-2's
          // backward: dX GEMM, LayerNorm gradient, residual add, cast, bias-gradient sum).
          // Nor to a GEMM group whose epilogue adds a value wider than the product (below):
          // its product goes through memory already, so a row op joins at no cost.
          auto refused = [&](int gemm_root, int other) {
            if (gemm_[gemm_root] < 0 || has_kind(gemm_root, {ItemKind::kRowOp})) return false;
            if (has_kind(other, {ItemKind::kColumnReduction})) return true;
            return has_kind(other, {ItemKind::kRowOp}) && !adds_wider_value(gemm_root);
          };
          if (refused(roots[0], roots[1]) || refused(roots[1], roots[0])) continue;
          std::sort(roots.begin(), roots.end());
          merged |= try_merge(roots);
        }
      }
      if (!merged) break;
    }
  }

  std::vector<int> group_of() {
    std::vector<int> g(adj_.n);
    for (int i = 0; i < adj_.n; ++i) g[i] = find(i);
    return g;
  }

 private:
  int find(int x) {
    while (parent_[x] != x) {
      parent_[x] = parent_[parent_[x]];
      x = parent_[x];
    }
    return x;
  }

  // Values with bytes and readers (graph outputs and updates too if `external`), largest first.
  std::vector<int> values_largest_first(bool external) const {
    std::vector<int> order;
    for (size_t v = 0; v < problem_.values.size(); ++v) {
      const ValueUse& use = problem_.values[v];
      if ((external || !use.external) && use.bytes > 0 && !use.consumers.empty())
        order.push_back(static_cast<int>(v));
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return problem_.values[a].bytes > problem_.values[b].bytes;
    });
    return order;
  }

  // Whether a member of GEMM group `root` other than the GEMM reads, from outside the group, a
  // value of more bytes than the GEMM's product: GPT-2's residual projection under mixed
  // precision, the f32 residual stream added to a bf16 product. No library epilogue takes
  // such an addend on a 16-bit product (cuBLASLt's C has D's dtype), so the product goes through
  // memory to a generated epilogue, which takes a row op after it (the next LayerNorm) at no
  // extra pass: the residual sum is not read back. (A same-width addend rides in cuBLASLt's C:
  // a row op would push that product through memory.)
  bool adds_wider_value(int root) {
    const int g = gemm_[root];
    int64_t product = 0;
    for (int v : writes_[g]) product = std::max(product, problem_.values[v].bytes);
    for (int u : members_[root]) {
      if (u == g) continue;
      for (int v : reads_[u])
        if (find(problem_.values[v].producer) != root && problem_.values[v].bytes > product)
          return true;
    }
    return false;
  }

  bool has_kind(int root, std::initializer_list<ItemKind> kinds) const {
    for (int u : members_[root])
      if (std::find(kinds.begin(), kinds.end(), problem_.items[u].kind) != kinds.end())
        return true;
    return false;
  }

  bool try_merge(const std::vector<int>& roots) {
    int64_t space = problem_.items[roots[0]].space;
    int gemms = 0;
    for (int r : roots) {
      if (members_[r].size() == 1 && !fusable_kind(problem_.items[r].kind)) return false;
      if (problem_.items[r].space != space) return false;
      if (gemm_[r] >= 0) ++gemms;
    }
    if (gemms > 1) return false;
    ++stamp_;
    const int in_s = stamp_;
    for (int r : roots) mark_[r] = in_s;
    for (int r : roots)
      for (int f : forbid_[r])
        if (mark_[find(f)] == in_s) return false;

    int lo = ord_[roots[0]], hi = lo;
    for (int r : roots) {
      lo = std::min(lo, ord_[r]);
      hi = std::max(hi, ord_[r]);
    }
    // Forward: groups reachable from S through groups outside S with ord < hi.
    ++stamp_;
    const int seen_f = stamp_;
    std::vector<int> fwd, stack;
    auto push_succs = [&](int r) -> bool {
      for (int u : members_[r])
        for (int w : adj_.succ[u]) {
          int q = find(w);
          if (mark_[q] == in_s) {
            if (!std::binary_search(roots.begin(), roots.end(), r)) return false;  // came back
            continue;
          }
          if (mark_[q] != seen_f && ord_[q] < hi) {
            mark_[q] = seen_f;
            fwd.push_back(q);
            stack.push_back(q);
          }
        }
      return true;
    };
    for (int r : roots) push_succs(r);
    while (!stack.empty()) {
      int r = stack.back();
      stack.pop_back();
      if (!push_succs(r)) {
        for (int q : fwd) mark_[q] = 0;
        return false;
      }
    }
    // Backward: groups reaching S with ord > lo (disjoint from the forward set: no cycle).
    ++stamp_;
    const int seen_b = stamp_;
    std::vector<int> bwd;
    for (int r : roots) stack.push_back(r);
    while (!stack.empty()) {
      int r = stack.back();
      stack.pop_back();
      for (int u : members_[r])
        for (int w : adj_.pred[u]) {
          int q = find(w);
          if (mark_[q] == in_s || mark_[q] == seen_b || ord_[q] <= lo) continue;
          mark_[q] = seen_b;
          bwd.push_back(q);
          stack.push_back(q);
        }
    }
    // Reorder: pooled slots; backward set, then the merged group, then the forward set.
    std::vector<int> pool;
    for (int r : roots) pool.push_back(ord_[r]);
    for (int q : fwd) pool.push_back(ord_[q]);
    for (int q : bwd) pool.push_back(ord_[q]);
    std::sort(pool.begin(), pool.end());
    auto by_ord = [&](int a, int b) { return ord_[a] < ord_[b]; };
    std::sort(fwd.begin(), fwd.end(), by_ord);
    std::sort(bwd.begin(), bwd.end(), by_ord);
    for (size_t i = 0; i < bwd.size(); ++i) ord_[bwd[i]] = pool[i];
    for (size_t i = 0; i < fwd.size(); ++i) ord_[fwd[i]] = pool[pool.size() - fwd.size() + i];
    const int merged_ord = pool[bwd.size()];

    int root = roots[0];
    for (int r : roots)
      if (members_[r].size() > members_[root].size()) root = r;
    for (int r : roots) {
      if (r == root) continue;
      parent_[r] = root;
      members_[root].insert(members_[root].end(), members_[r].begin(), members_[r].end());
      members_[r].clear();
      members_[r].shrink_to_fit();
      forbid_[root].insert(forbid_[root].end(), forbid_[r].begin(), forbid_[r].end());
      forbid_[r].clear();
      forbid_[r].shrink_to_fit();
      if (gemm_[r] >= 0) gemm_[root] = gemm_[r];
    }
    ord_[root] = merged_ord;
    for (int r : roots) mark_[r] = 0;
    return true;
  }

  const Problem& problem_;
  const Adjacency& adj_;
  std::vector<int> parent_;
  std::vector<std::vector<int>> members_;  // valid at roots
  std::vector<std::vector<int>> forbid_;   // valid at roots: items never to share the group
  std::vector<int> ord_;                   // valid at roots: topological position
  std::vector<int> gemm_;                  // valid at roots: the group's GEMM item or -1
  std::vector<int> mark_;                  // per root: stamp of the search that last saw it
  std::vector<std::vector<int>> reads_;    // per item: the values it reads
  std::vector<std::vector<int>> writes_;   // per item: the values it produces
  int stamp_ = 0;
};

Partition finish(const Problem& problem, std::vector<int> group_of) {
  Partition p;
  int groups = 0;
  p.group_of = dense_groups(problem, group_of, &groups);
  p.saved_bytes = saved_bytes(problem, p.group_of);
  return p;
}

// ------------------------------------------------------------------------------------------
// Optimal.
//
// Components: items joined by the edges that may lie inside a legal group (fusable_edge). Any
// legal partition stays legal, with the same saved bytes, when each group is cut along the
// components: a saved value lies within one component, the rules other than acyclicity hold for
// subsets, and the cut pieces share no edge, so a cycle through two of them would already have
// been a path leaving the uncut group and coming back. So some optimal partition has every group
// inside one component.
//
// Each component is solved against a fixed context (the other items' groups), reduced to a
// small graph over the component's items: `reach[a]` holds the component items reachable from a
// by an edge or a path through context groups only, `outside[a]` those reachable by such a path
// of at least one context group. A partition of the component is acyclic with the context iff
// the quotient of this small graph is acyclic with no group reaching itself through `outside`.
// Contracting groups only adds paths, so a component's best against singletons is an upper bound
// on its part in any partition; when the components' bests together are legal they are optimal.

constexpr int kMaxSearchItems = 64;  // one bit per item in a uint64_t

std::vector<std::vector<int>> fusable_components(const Problem& problem, const Adjacency& adj) {
  std::vector<int> parent(adj.n);
  std::iota(parent.begin(), parent.end(), 0);
  std::function<int(int)> find = [&](int x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  };
  for (int u = 0; u < adj.n; ++u)
    for (int w : adj.succ[u])
      if (fusable_edge(problem, adj, u, w)) parent[find(u)] = find(w);
  std::vector<std::vector<int>> by_root(adj.n);
  for (int i = 0; i < adj.n; ++i) by_root[find(i)].push_back(i);
  std::vector<std::vector<int>> comps;
  for (std::vector<int>& c : by_root)
    if (c.size() >= 2) comps.push_back(std::move(c));
  std::sort(comps.begin(), comps.end(), [](const auto& a, const auto& b) { return a[0] < b[0]; });
  return comps;
}

// A partition's groups with the items of `split` taken out as singletons, and a topological
// order (`ord`) of the quotient graph.
struct Context {
  std::vector<int> group_of;
  std::vector<std::vector<int>> members;
  std::vector<int> ord;
};

Context make_context(const Adjacency& adj, const std::vector<int>& group_of,
                     const std::vector<int>& split) {
  Context ctx;
  std::vector<int> g = group_of;
  int big = 0;
  for (int x : g) big = std::max(big, x + 1);
  for (int i : split) g[i] = big++;
  std::vector<int> remap(big, -1);
  int groups = 0;
  ctx.group_of.resize(adj.n);
  for (int i = 0; i < adj.n; ++i) {
    if (remap[g[i]] < 0) remap[g[i]] = groups++;
    ctx.group_of[i] = remap[g[i]];
  }
  ctx.members.resize(groups);
  for (int i = 0; i < adj.n; ++i) ctx.members[ctx.group_of[i]].push_back(i);
  std::vector<int> indegree(groups, 0);
  for (int u = 0; u < adj.n; ++u)
    for (int w : adj.succ[u])
      if (ctx.group_of[u] != ctx.group_of[w]) ++indegree[ctx.group_of[w]];
  std::vector<int> ready;
  for (int q = 0; q < groups; ++q)
    if (indegree[q] == 0) ready.push_back(q);
  ctx.ord.assign(groups, -1);
  int next = 0;
  while (!ready.empty()) {
    int q = ready.back();
    ready.pop_back();
    ctx.ord[q] = next++;
    for (int u : ctx.members[q])
      for (int w : adj.succ[u])
        if (ctx.group_of[w] != q && --indegree[ctx.group_of[w]] == 0)
          ready.push_back(ctx.group_of[w]);
  }
  KILN_CHECK(next == groups, "fusion partition: internal error: the context is not acyclic");
  return ctx;
}

struct LocalValue {
  int producer = 0;
  std::vector<int> consumers;  // local indices, deduplicated
  int64_t bytes = 0;
};

struct LocalProblem {
  int k = 0;
  std::vector<uint64_t> reach, outside, forbid;
  std::vector<char> gemm;
  std::vector<LocalValue> values;
  std::vector<std::vector<int>> produced, consumed, last;  // per local item: value indices
};

// `items` sorted by index; `comps` (empty, or one id per item) forbids groups across components.
LocalProblem build_local(const Problem& problem, const Adjacency& adj, const Context& ctx,
                         const std::vector<int>& items, const std::vector<int>& comps) {
  LocalProblem lp;
  lp.k = static_cast<int>(items.size());
  lp.reach.assign(lp.k, 0);
  lp.outside.assign(lp.k, 0);
  lp.forbid.assign(lp.k, 0);
  lp.gemm.assign(lp.k, 0);
  lp.produced.resize(lp.k);
  lp.consumed.resize(lp.k);
  lp.last.resize(lp.k);
  std::vector<int> local(adj.n, -1);
  int max_ord = 0;
  for (int a = 0; a < lp.k; ++a) {
    local[items[a]] = a;
    max_ord = std::max(max_ord, ctx.ord[ctx.group_of[items[a]]]);
  }
  std::vector<int> seen(ctx.members.size(), -1), stack;
  for (int a = 0; a < lp.k; ++a) {
    const int u = items[a];
    const ItemKind kind = problem.items[u].kind;
    lp.gemm[a] = kind == ItemKind::kGemm;
    for (int w : adj.succ[u]) {
      if (local[w] >= 0) {
        lp.reach[a] |= uint64_t{1} << local[w];
        if (reads_column_of(adj, u, w) || problem.items[w].kind == ItemKind::kGemm) {
          lp.forbid[a] |= uint64_t{1} << local[w];
          lp.forbid[local[w]] |= uint64_t{1} << a;
        }
      } else if (int q = ctx.group_of[w]; ctx.ord[q] < max_ord && seen[q] != a) {
        seen[q] = a;
        stack.push_back(q);
      }
    }
    while (!stack.empty()) {
      int q = stack.back();
      stack.pop_back();
      for (int x : ctx.members[q])
        for (int w : adj.succ[x]) {
          if (local[w] >= 0) {
            lp.outside[a] |= uint64_t{1} << local[w];
          } else if (int r = ctx.group_of[w]; r != q && ctx.ord[r] < max_ord && seen[r] != a) {
            seen[r] = a;
            stack.push_back(r);
          }
        }
    }
    lp.reach[a] |= lp.outside[a];
    if (!comps.empty())
      for (int b = 0; b < lp.k; ++b)
        if (comps[b] != comps[a]) lp.forbid[a] |= uint64_t{1} << b;
  }
  for (int a = 0; a < lp.k; ++a)
    for (int v : adj.out_values[items[a]]) {
      const ValueUse& use = problem.values[v];
      if (use.external || use.bytes <= 0 || use.consumers.empty()) continue;
      LocalValue lv{a, {}, use.bytes};
      bool savable = true;
      for (int c : use.consumers) {
        if (local[c] < 0 || !fusable_edge(problem, adj, items[a], c)) savable = false;
        if (local[c] >= 0) lv.consumers.push_back(local[c]);
      }
      if (!savable) continue;
      std::sort(lv.consumers.begin(), lv.consumers.end());
      lv.consumers.erase(std::unique(lv.consumers.begin(), lv.consumers.end()),
                         lv.consumers.end());
      const int id = static_cast<int>(lp.values.size());
      lp.produced[a].push_back(id);
      for (int c : lv.consumers) lp.consumed[c].push_back(id);
      lp.last[lv.consumers.back()].push_back(id);
      lp.values.push_back(std::move(lv));
    }
  return lp;
}

// The groups of `items` in `group_of`, as local ids 0.. in order of first appearance.
std::vector<int> restrict_to(const std::vector<int>& items, const std::vector<int>& group_of) {
  std::vector<int> local(items.size());
  std::vector<std::pair<int, int>> seen;  // (global id, local id); components are small
  for (size_t a = 0; a < items.size(); ++a) {
    int g = group_of[items[a]];
    auto it = std::find_if(seen.begin(), seen.end(), [&](auto& p) { return p.first == g; });
    if (it == seen.end()) {
      seen.push_back({g, static_cast<int>(seen.size())});
      local[a] = seen.back().second;
    } else {
      local[a] = it->second;
    }
  }
  return local;
}

// Branch and bound over group assignments in topological order (restricted growth: an item
// joins one of the groups opened before it or opens the next one). Bound: saved so far plus the
// bytes of every value not yet decided and not yet broken (an assigned consumer outside its
// producer's group breaks a value); a branch that cannot beat the incumbent is cut. An item only
// joins a group that still has an undecided, unbroken value: growing a "closed" group can save
// nothing more, and the grown part can always be moved to a group of its own (it has no edge
// back into the closed part, items being in topological order). Worst case exponential (the
// Bell number of the component's size); the time limit bounds it.
class Search {
 public:
  Search(const LocalProblem& lp, std::chrono::steady_clock::time_point deadline)
      : lp_(lp), deadline_(deadline), assign_(lp.k, -1), dead_(lp.values.size(), 0) {
    for (const LocalValue& v : lp.values) alive_ += v.bytes;
  }

  // Returns whether the search finished (the answer is optimal); `best` holds the incumbent.
  bool run(std::vector<int>* best) {
    best_assign_ = *best;
    best_ = value_of(*best);
    dfs(0);
    *best = best_assign_;
    return !timed_out_;
  }

 private:
  int64_t value_of(const std::vector<int>& assign) const {
    int64_t total = 0;
    for (const LocalValue& v : lp_.values) {
      bool saved = true;
      for (int c : v.consumers) saved = saved && assign[c] == assign[v.producer];
      if (saved) total += v.bytes;
    }
    return total;
  }

  uint64_t expand(uint64_t items) const {
    uint64_t out = 0;
    while (items) {
      int a = std::countr_zero(items);
      items &= items - 1;
      out |= assign_[a] >= 0 ? groups_[assign_[a]] : uint64_t{1} << a;
    }
    return out;
  }

  // Whether item i may join group g: the GEMM, column-reduction and acyclicity rules.
  bool may_join(int i, int g) const {
    const uint64_t grown = groups_[g] | uint64_t{1} << i;
    if (lp_.forbid[i] & groups_[g]) return false;
    if (lp_.gemm[i] && gemms_[g]) return false;
    uint64_t out = 0, via_outside = 0;
    for (uint64_t m = grown; m; m &= m - 1) {
      int a = std::countr_zero(m);
      out |= lp_.reach[a];
      via_outside |= lp_.outside[a];
    }
    if (via_outside & grown) return false;
    uint64_t reached = expand(out & ~grown), frontier = reached;
    while (frontier) {
      uint64_t next = 0;
      for (uint64_t m = frontier; m; m &= m - 1) next |= lp_.reach[std::countr_zero(m)];
      if (next & grown) return false;
      next = expand(next & ~reached) & ~reached;
      reached |= next;
      frontier = next;
    }
    return true;
  }

  struct Change {
    int value;
    bool decided;  // saved (else broken)
  };

  void place(int i, int g, std::vector<Change>* changes) {
    if (g == static_cast<int>(groups_.size())) {
      groups_.push_back(0);
      gemms_.push_back(0);
      open_.push_back(0);
    }
    groups_[g] |= uint64_t{1} << i;
    gemms_[g] += lp_.gemm[i];
    assign_[i] = g;
    for (int v : lp_.consumed[i]) {
      int pg = assign_[lp_.values[v].producer];
      if (!dead_[v] && pg != g) {
        dead_[v] = 1;
        alive_ -= lp_.values[v].bytes;
        --open_[pg];
        changes->push_back({v, false});
      }
    }
    for (int v : lp_.last[i])
      if (!dead_[v]) {
        dead_[v] = 2;
        alive_ -= lp_.values[v].bytes;
        saved_ += lp_.values[v].bytes;
        --open_[g];
        changes->push_back({v, true});
      }
    open_[g] += static_cast<int>(lp_.produced[i].size());
  }

  void unplace(int i, int g, const std::vector<Change>& changes) {
    open_[g] -= static_cast<int>(lp_.produced[i].size());
    for (auto it = changes.rbegin(); it != changes.rend(); ++it) {
      const LocalValue& v = lp_.values[it->value];
      dead_[it->value] = 0;
      alive_ += v.bytes;
      if (it->decided) saved_ -= v.bytes;
      ++open_[assign_[v.producer]];
    }
    assign_[i] = -1;
    groups_[g] &= ~(uint64_t{1} << i);
    gemms_[g] -= lp_.gemm[i];
    if (g + 1 == static_cast<int>(groups_.size()) && groups_[g] == 0) {
      groups_.pop_back();
      gemms_.pop_back();
      open_.pop_back();
    }
  }

  void dfs(int i) {
    if (timed_out_) return;
    if ((++nodes_ & 1023) == 0 && std::chrono::steady_clock::now() > deadline_) {
      timed_out_ = true;
      return;
    }
    if (i == lp_.k) {
      if (saved_ > best_) {
        best_ = saved_;
        best_assign_ = assign_;
      }
      return;
    }
    // Options: groups holding producers of i's unbroken inputs (most bytes first), a new
    // group, then the other open groups.
    const int groups = static_cast<int>(groups_.size());
    std::vector<std::pair<int64_t, int>> options;
    for (int g = 0; g < groups; ++g) {
      if (open_[g] == 0) continue;
      int64_t gain = 0;
      for (int v : lp_.consumed[i])
        if (!dead_[v] && assign_[lp_.values[v].producer] == g) gain += lp_.values[v].bytes;
      options.push_back({gain, g});
    }
    std::stable_sort(options.begin(), options.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    auto at = std::find_if(options.begin(), options.end(), [](auto& o) { return o.first == 0; });
    options.insert(at, {0, groups});
    std::vector<Change> changes;
    for (auto [gain, g] : options) {
      if (g < groups && !may_join(i, g)) continue;
      changes.clear();
      place(i, g, &changes);
      if (saved_ + alive_ > best_) {
        std::vector<Change> mine = changes;
        dfs(i + 1);
        changes = std::move(mine);
      }
      unplace(i, g, changes);
      if (timed_out_) return;
    }
  }

  const LocalProblem& lp_;
  std::chrono::steady_clock::time_point deadline_;
  std::vector<int> assign_;
  std::vector<uint64_t> groups_;
  std::vector<int> gemms_, open_;
  std::vector<char> dead_;  // 0 undecided, 1 broken, 2 saved
  int64_t alive_ = 0, saved_ = 0, best_ = 0;
  std::vector<int> best_assign_;
  int64_t nodes_ = 0;
  bool timed_out_ = false;
};

// Solves one local problem; `incumbent` is a legal assignment (greedy's or the current one).
bool solve(const LocalProblem& lp, std::vector<int> incumbent,
           std::chrono::duration<double> budget, std::vector<int>* out) {
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(budget);
  Search search(lp, deadline);
  bool finished = search.run(&incumbent);
  *out = std::move(incumbent);
  return finished;
}

}  // namespace

bool is_legal(const Problem& problem, const std::vector<int>& group_of, std::string* why) {
  Adjacency adj = build_adjacency(problem);
  int groups = 0;
  std::vector<int> g = dense_groups(problem, group_of, &groups);
  auto fail_with = [&](std::string text) {
    if (why) *why = std::move(text);
    return false;
  };
  std::vector<std::vector<int>> members(groups);
  for (int i = 0; i < adj.n; ++i) members[g[i]].push_back(i);
  for (int k = 0; k < groups; ++k) {
    const std::vector<int>& m = members[k];
    int gemm = -1;
    for (int i : m) {
      const Item& it = problem.items[i];
      if (it.space != problem.items[m[0]].space)
        return fail_with(fmt::format(
            "rule 'one iteration space per group': items {} and {} share group {} but have "
            "spaces {} and {}",
            m[0], i, k, problem.items[m[0]].space, it.space));
      if (it.kind == ItemKind::kOpaque && m.size() > 1)
        return fail_with(fmt::format(
            "rule 'an opaque item is alone in its group': opaque item {} shares group {} {}", i,
            k, item_list(m)));
      if (it.kind == ItemKind::kGemm) {
        if (gemm >= 0)
          return fail_with(fmt::format(
              "rule 'at most one GEMM per group': items {} and {} are both GEMMs in group {}",
              gemm, i, k));
        gemm = i;
      }
    }
  }
  for (size_t v = 0; v < problem.values.size(); ++v) {
    const ValueUse& use = problem.values[v];
    const int p = use.producer;
    for (int c : use.consumers) {
      if (g[c] != g[p]) continue;
      if (problem.items[c].kind == ItemKind::kGemm)
        return fail_with(fmt::format(
            "rule 'a GEMM reads nothing computed in its group': GEMM item {} reads value {} "
            "produced by item {} in its group {}",
            c, v, p, g[c]));
      if (is_column_value(problem, use))
        return fail_with(fmt::format(
            "rule 'a column value has no consumer in its group': item {} produces column value "
            "{} read by item {} in its group {}",
            p, v, c, g[p]));
    }
  }
  // Acyclic quotient: Kahn's algorithm over the groups; what is left holds a cycle.
  std::vector<std::vector<std::pair<int, int>>> in_edges(groups);  // (from item, to item)
  std::vector<std::vector<int>> out_groups(groups);
  std::vector<int> indegree(groups, 0);
  for (int u = 0; u < adj.n; ++u)
    for (int w : adj.succ[u])
      if (g[u] != g[w]) {
        out_groups[g[u]].push_back(g[w]);
        in_edges[g[w]].push_back({u, w});
        ++indegree[g[w]];
      }
  std::vector<int> ready;
  for (int k = 0; k < groups; ++k)
    if (indegree[k] == 0) ready.push_back(k);
  int done = 0;
  while (!ready.empty()) {
    int k = ready.back();
    ready.pop_back();
    ++done;
    for (int q : out_groups[k])
      if (--indegree[q] == 0) ready.push_back(q);
  }
  if (done == groups) return true;
  // Every group left has a predecessor left: walk backwards until a group repeats.
  int start = 0;
  while (indegree[start] == 0) ++start;
  std::vector<int> pos(groups, -1);
  std::vector<std::pair<int, int>> walk;  // edges, walked backwards
  std::vector<int> at;
  int k = start;
  while (pos[k] < 0) {
    pos[k] = static_cast<int>(at.size());
    at.push_back(k);
    for (auto [u, w] : in_edges[k])
      if (indegree[g[u]] > 0) {
        walk.push_back({u, w});
        k = g[u];
        break;
      }
  }
  // The cycle is at[pos[k]..] with edges walk[pos[k]..], reversed to read forwards.
  std::vector<std::pair<int, int>> cycle(walk.begin() + pos[k], walk.end());
  std::reverse(cycle.begin(), cycle.end());
  std::string text = fmt::format(
      "rule 'contracting the groups leaves the graph acyclic': the groups form a cycle: group {} "
      "{}",
      g[cycle[0].first], item_list(members[g[cycle[0].first]]));
  for (auto [u, w] : cycle)
    text += fmt::format(" -(item {} -> item {})-> group {} {}", u, w, g[w], item_list(members[g[w]]));
  return fail_with(std::move(text));
}

int64_t saved_bytes(const Problem& problem, const std::vector<int>& group_of) {
  build_adjacency(problem);  // validates
  KILN_CHECK(group_of.size() == problem.items.size(),
             "fusion partition: group_of has {} entries, expected one per item ({})",
             group_of.size(), problem.items.size());
  int64_t saved = 0;
  for (const ValueUse& use : problem.values)
    if (counts_as_saved(use, group_of)) saved += use.bytes;
  return saved;
}

Partition partition_greedy(const Problem& problem) {
  Adjacency adj = build_adjacency(problem);
  Greedy greedy(problem, adj);
  greedy.run();
  return finish(problem, greedy.group_of());
}

Partition absorb_readers(const Problem& problem, const Partition& partition) {
  Adjacency adj = build_adjacency(problem);
  Greedy greedy(problem, adj);
  if (!greedy.adopt(partition.group_of)) return partition;
  greedy.absorb();
  std::vector<int> absorbed = greedy.group_of();
  // Merging keeps every saved value saved; checked anyway (the answer must never be worse).
  if (!is_legal(problem, absorbed) || saved_bytes(problem, absorbed) < partition.saved_bytes)
    return partition;
  Partition p = finish(problem, absorbed);
  p.components_exact = partition.components_exact;
  p.components_greedy = partition.components_greedy;
  p.groups_dropped = partition.groups_dropped;
  return p;
}

Partition partition_optimal(const Problem& problem, const OptimalOptions& options) {
  Adjacency adj = build_adjacency(problem);
  Greedy greedy(problem, adj);
  greedy.run();
  const std::vector<int> greedy_groups = greedy.group_of();
  const int64_t greedy_saved = saved_bytes(problem, greedy_groups);
  const int n = adj.n;
  const int limit = std::clamp(options.max_component_items, 0, kMaxSearchItems);
  const auto budget = std::chrono::duration<double>(std::max(0.0, options.time_limit_seconds));

  const std::vector<std::vector<int>> components = fusable_components(problem, adj);
  std::vector<int> identity(n);
  std::iota(identity.begin(), identity.end(), 0);

  // Phase 1: every component against all other items alone (its largest feasible set).
  Partition result;
  std::vector<int> combined = identity;
  int next_id = n;
  {
    Context singles = make_context(adj, identity, {});
    for (const std::vector<int>& comp : components) {
      std::vector<int> local;
      bool exact = false;
      if (static_cast<int>(comp.size()) <= limit) {
        LocalProblem lp = build_local(problem, adj, singles, comp, {});
        exact = solve(lp, restrict_to(comp, greedy_groups), budget, &local);
      } else {
        local = restrict_to(comp, greedy_groups);
      }
      ++(exact ? result.components_exact : result.components_greedy);
      for (size_t a = 0; a < comp.size(); ++a) combined[comp[a]] = next_id + local[a];
      next_id += static_cast<int>(comp.size());
    }
  }
  if (is_legal(problem, combined) && saved_bytes(problem, combined) >= greedy_saved) {
    Partition p = finish(problem, combined);
    p.components_exact = result.components_exact;
    p.components_greedy = result.components_greedy;
    return p;
  }

  // Phase 2: the components' answers form a cycle together. Small problems: one joint search
  // over all fusable items (groups still within components). Otherwise each component in turn,
  // against the others as they stand (greedy's answer at first), keeping what improves.
  result.components_exact = result.components_greedy = 0;
  std::vector<int> all, comp_of;
  for (size_t c = 0; c < components.size(); ++c)
    for (int i : components[c]) {
      all.push_back(i);
      comp_of.push_back(static_cast<int>(c));
    }
  if (static_cast<int>(all.size()) <= limit) {
    std::vector<int> order(all.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return all[a] < all[b]; });
    std::vector<int> items, comps;
    for (int o : order) {
      items.push_back(all[o]);
      comps.push_back(comp_of[o]);
    }
    Context singles = make_context(adj, identity, {});
    LocalProblem lp = build_local(problem, adj, singles, items, comps);
    std::vector<int> local;
    bool exact = solve(lp, restrict_to(items, greedy_groups), budget, &local);
    std::vector<int> joint = identity;
    for (size_t a = 0; a < items.size(); ++a) joint[items[a]] = n + local[a];
    (exact ? result.components_exact : result.components_greedy) =
        static_cast<int>(components.size());
    Partition p = finish(problem, joint);
    p.components_exact = result.components_exact;
    p.components_greedy = result.components_greedy;
    return p;
  }
  std::vector<int> current = greedy_groups;
  next_id = n;
  for (const std::vector<int>& comp : components) {
    if (static_cast<int>(comp.size()) > limit) {
      ++result.components_greedy;
      continue;
    }
    Context ctx = make_context(adj, current, comp);
    LocalProblem lp = build_local(problem, adj, ctx, comp, {});
    std::vector<int> local;
    bool exact = solve(lp, restrict_to(comp, current), budget, &local);
    ++(exact ? result.components_exact : result.components_greedy);
    for (size_t a = 0; a < comp.size(); ++a) current[comp[a]] = 2 * n + next_id + local[a];
    next_id += static_cast<int>(comp.size());
  }
  Partition p = finish(problem, current);
  p.components_exact = result.components_exact;
  p.components_greedy = result.components_greedy;
  return p;
}

}  // namespace kiln::fusion
