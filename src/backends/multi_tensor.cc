#include "backends/multi_tensor.h"

#include <algorithm>

#include "support/error.h"

namespace kiln::multi_tensor {

float combine_terms(const NormBody& norm, const std::vector<float>& terms) {
  std::vector<float> sums(norm.adds.size());
  auto value = [&](int c) { return c >= 0 ? terms[static_cast<size_t>(c)] : sums[static_cast<size_t>(-1 - c)]; };
  for (size_t a = 0; a < norm.adds.size(); ++a)
    sums[a] = value(norm.adds[a][0]) + value(norm.adds[a][1]);
  return value(norm.result);
}

std::vector<MemberRegions> member_regions(const std::vector<Member>& members,
                                          std::span<const Tensor> inputs,
                                          std::span<const Tensor> outputs) {
  std::vector<MemberRegions> out(members.size());
  for (size_t k = 0; k < members.size(); ++k) {
    for (int i : members[k].inputs)
      out[k].reads.push_back(Region{inputs[static_cast<size_t>(i)].raw(), inputs[static_cast<size_t>(i)].bytes()});
    for (int o : members[k].outputs)
      out[k].writes.push_back(Region{outputs[static_cast<size_t>(o)].raw(), outputs[static_cast<size_t>(o)].bytes()});
  }
  return out;
}

RunOrder plan_run_order(const std::vector<MemberRegions>& members) {
  const size_t n = members.size();
  // Every write, sorted by start: the memory plan never lets two live values overlap, so writes
  // are disjoint and the ones overlapping a read form one run of this order.
  struct Write {
    const std::byte* begin;
    const std::byte* end;
    int member;
  };
  std::vector<Write> writes;
  for (size_t k = 0; k < n; ++k)
    for (const Region& r : members[k].writes)
      if (r.bytes > 0) writes.push_back(Write{r.begin, r.begin + r.bytes, static_cast<int>(k)});
  std::sort(writes.begin(), writes.end(), [](const Write& a, const Write& b) { return a.begin < b.begin; });
  bool disjoint = true;
  for (size_t w = 1; w < writes.size(); ++w) disjoint = disjoint && writes[w].begin >= writes[w - 1].end;
  // Per member: the members that overwrite one of its operands (they must run after it), with
  // the operand. A result over its own operand is fine when it starts at the same byte.
  std::vector<std::vector<std::pair<int, int>>> overwritten_by(n);
  for (size_t j = 0; j < n; ++j) {
    for (size_t op = 0; op < members[j].reads.size(); ++op) {
      const Region& r = members[j].reads[op];
      if (r.bytes == 0) continue;
      const std::byte* end = r.begin + r.bytes;
      // Disjoint writes have their ends sorted like their starts: the first write ending after
      // r.begin, then every one starting before r's end. (Overlapping writes, which no plan
      // makes: all of them.)
      auto it = disjoint ? std::lower_bound(writes.begin(), writes.end(), r.begin,
                                            [](const Write& w, const std::byte* p) { return w.end <= p; })
                         : writes.begin();
      for (; it != writes.end() && (!disjoint || it->begin < end); ++it) {
        if (it->end <= r.begin || it->begin >= end) continue;
        if (it->member == static_cast<int>(j) && it->begin == r.begin && it->end == end) continue;
        overwritten_by[j].emplace_back(it->member, static_cast<int>(op));
      }
    }
  }
  RunOrder order;
  // Kahn's algorithm by levels over the edges j -> k (k overwrites an operand of j).
  std::vector<int> indegree(n, 0);
  for (size_t j = 0; j < n; ++j)
    for (auto [k, op] : overwritten_by[j])
      if (k != static_cast<int>(j)) ++indegree[static_cast<size_t>(k)];
  // Self-overlaps that are not exact (never made by the plan) are read from a copy.
  for (size_t j = 0; j < n; ++j)
    for (auto [k, op] : overwritten_by[j])
      if (k == static_cast<int>(j)) order.copies.emplace_back(k, op);
  std::vector<bool> done(n, false);
  size_t placed = 0;
  while (placed < n) {
    std::vector<int> wave;
    for (size_t k = 0; k < n; ++k)
      if (!done[k] && indegree[k] == 0) wave.push_back(static_cast<int>(k));
    if (wave.empty()) {
      // A cycle: the rest read copies of every operand an unplaced member overwrites, which
      // removes their edges; they then run as one wave.
      for (size_t j = 0; j < n; ++j) {
        if (done[j]) continue;
        for (auto [k, op] : overwritten_by[j])
          if (k != static_cast<int>(j) && !done[static_cast<size_t>(k)])
            order.copies.emplace_back(static_cast<int>(j), op);
        wave.push_back(static_cast<int>(j));
      }
    }
    for (int k : wave) done[static_cast<size_t>(k)] = true;
    for (int j : wave)
      for (auto [k, op] : overwritten_by[static_cast<size_t>(j)])
        if (k != j) --indegree[static_cast<size_t>(k)];
    placed += wave.size();
    order.waves.push_back(std::move(wave));
  }
  std::sort(order.copies.begin(), order.copies.end());
  order.copies.erase(std::unique(order.copies.begin(), order.copies.end()), order.copies.end());
  return order;
}

}  // namespace kiln::multi_tensor
