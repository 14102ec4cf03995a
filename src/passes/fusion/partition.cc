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
#include <chrono>
#include <numeric>
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
};

Adjacency build_adjacency(const Problem& problem) {
  Adjacency a;
  a.n = static_cast<int>(problem.items.size());
  a.succ.resize(a.n);
  a.pred.resize(a.n);
  a.out_values.resize(a.n);
  a.in_values.resize(a.n);
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
  }
  return a;
}

// Group ids remapped to 0..groups-1 in order of first appearance; throws on a malformed vector.
std::vector<int> dense_groups(const Problem& problem, const std::vector<int>& group_of,
                              int* groups) {
  KILN_CHECK(group_of.size() == problem.items.size(),
             "fusion partition: group_of has {} entries, expected one per item ({})",
             group_of.size(), problem.items.size());
  std::vector<int> remap;
  std::vector<int> dense(group_of.size());
  int next = 0;
  for (size_t i = 0; i < group_of.size(); ++i) {
    int g = group_of[i];
    KILN_CHECK(g >= 0, "fusion partition: item {} has group id {}, expected >= 0", i, g);
    if (static_cast<size_t>(g) >= remap.size()) remap.resize(g + 1, -1);
    if (remap[g] < 0) remap[g] = next++;
    dense[i] = remap[g];
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

// Whether the edge producer -> consumer may lie inside one legal group at all: both fusable, in
// one iteration space, the producer no column reduction and the consumer no GEMM.
bool fusable_edge(const Problem& problem, int producer, int consumer) {
  const Item& p = problem.items[producer];
  const Item& c = problem.items[consumer];
  return fusable_kind(p.kind) && fusable_kind(c.kind) && p.space == c.space &&
         p.kind != ItemKind::kColumnReduction && c.kind != ItemKind::kGemm;
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
  Greedy(const Problem& problem, const Adjacency& adj) : problem_(problem), adj_(adj) {
    int n = adj.n;
    parent_.resize(n);
    std::iota(parent_.begin(), parent_.end(), 0);
    members_.resize(n);
    forbid_.resize(n);
    ord_.resize(n);
    gemm_.assign(n, -1);
    mark_.assign(n, 0);
    for (int i = 0; i < n; ++i) {
      members_[i] = {i};
      ord_[i] = i;
      ItemKind k = problem.items[i].kind;
      if (k == ItemKind::kGemm) {
        gemm_[i] = i;
        for (int p : adj.pred[i]) forbid_[i].push_back(p);
      }
      if (k == ItemKind::kColumnReduction)
        for (int c : adj.succ[i]) forbid_[i].push_back(c);
    }
  }

  void run() {
    std::vector<int> order;
    for (size_t v = 0; v < problem_.values.size(); ++v) {
      const ValueUse& use = problem_.values[v];
      if (!use.external && use.bytes > 0 && !use.consumers.empty())
        order.push_back(static_cast<int>(v));
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return problem_.values[a].bytes > problem_.values[b].bytes;
    });
    for (int v : order) {
      const ValueUse& use = problem_.values[v];
      std::vector<int> roots = {find(use.producer)};
      for (int c : use.consumers) roots.push_back(find(c));
      std::sort(roots.begin(), roots.end());
      roots.erase(std::unique(roots.begin(), roots.end()), roots.end());
      if (roots.size() > 1) try_merge(roots);
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
  int stamp_ = 0;
};

Partition finish(const Problem& problem, std::vector<int> group_of) {
  Partition p;
  int groups = 0;
  p.group_of = dense_groups(problem, group_of, &groups);
  p.saved_bytes = saved_bytes(problem, p.group_of);
  return p;
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
      if (problem.items[p].kind == ItemKind::kColumnReduction)
        return fail_with(fmt::format(
            "rule 'a column reduction has no consumer in its group': column reduction item {} "
            "produces value {} read by item {} in its group {}",
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

Partition partition_optimal(const Problem& problem, const OptimalOptions& options) {
  (void)options;
  return partition_greedy(problem);
}

}  // namespace kiln::fusion
