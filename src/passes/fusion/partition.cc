// Placeholder until the partitioners land: every item alone in its group.
#include "passes/fusion/partition.h"

namespace kiln::fusion {

static std::vector<int> singletons(const Problem& problem) {
  std::vector<int> g(problem.items.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<int>(i);
  return g;
}

bool is_legal(const Problem&, const std::vector<int>&, std::string*) { return true; }
int64_t saved_bytes(const Problem&, const std::vector<int>&) { return 0; }
Partition partition_greedy(const Problem& problem) { return {singletons(problem)}; }
Partition partition_optimal(const Problem& problem, const OptimalOptions&) {
  return {singletons(problem)};
}

}  // namespace kiln::fusion
