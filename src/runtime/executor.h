// The executor: binds a verified graph to kernels (one dialect choice per node), then runs it
// on given inputs.
//
// Memory: by default the graph's intermediates (every node output that is not a graph output,
// update values included) live in ONE arena allocated at construction and reused by every run,
// at the offsets computed by plan_memory() (runtime/memory_plan.h); a kernel gets Tensor views
// of it. Graph outputs get their own buffers each run, so callers may keep them. With
// ExecutorOptions::plan_memory off, each value gets a fresh buffer when produced and is released
// after its last use (the simple allocator: what the plan is tested against).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "ir/graph.h"
#include "runtime/memory_plan.h"
#include "tensor/tensor.h"

namespace kiln {

struct ExecutorOptions {
  Device device = Device::kCpu;
  std::vector<std::string> dialects;  // allowed dialects; empty = all
  bool plan_memory = true;            // one planned arena; false: a buffer per value
  // Fill the arena with 0xFF bytes (NaN for floats) at construction: a kernel that reads its
  // output before writing it, or a plan that lets two live values share bytes, shows up in
  // tests instead of hiding behind zeroed memory.
  bool poison_arena = false;
};

class Executor {
 public:
  // Verifies the graph, selects a kernel for every node and plans and allocates the arena.
  // Throws kiln::Error.
  explicit Executor(Graph graph, ExecutorOptions options = {});

  // Runs the graph. `inputs` are in the order of graph.inputs and must match their types.
  // Graph updates are written into the storage of the corresponding input tensors. Not safe to
  // call concurrently on one Executor: runs share its arena.
  std::vector<Tensor> run(std::span<const Tensor> inputs) const;

  const Graph& graph() const { return graph_; }
  // The dialect chosen for each node, in node order.
  std::vector<std::string> node_dialects() const;
  // The memory plan in use; nullptr when options.plan_memory is off.
  const MemoryPlan* memory_plan() const { return options_.plan_memory ? &plan_ : nullptr; }

 private:
  Graph graph_;
  ExecutorOptions options_;
  std::vector<const KernelImpl*> kernels_;
  std::vector<int> last_use_;  // per value: index of the last node reading it (-1: none)
  MemoryPlan plan_;
  std::shared_ptr<std::byte[]> arena_;
};

}  // namespace kiln
