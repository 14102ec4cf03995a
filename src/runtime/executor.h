// The executor: binds a verified graph to kernels (one dialect choice per node), then runs it
// on given inputs. Memory is a simple reference-counted allocator for now: each value is
// allocated when produced and released after its last use. (The static arena plan comes with
// the memory-planning pass.)
#pragma once

#include <string>
#include <vector>

#include "backends/backend.h"
#include "ir/graph.h"
#include "tensor/tensor.h"

namespace kiln {

struct ExecutorOptions {
  Device device = Device::kCpu;
  std::vector<std::string> dialects;  // allowed dialects; empty = all
};

class Executor {
 public:
  // Verifies the graph and selects a kernel for every node. Throws kiln::Error.
  explicit Executor(Graph graph, ExecutorOptions options = {});

  // Runs the graph. `inputs` are in the order of graph.inputs and must match their types.
  // Graph updates are written into the storage of the corresponding input tensors.
  std::vector<Tensor> run(std::span<const Tensor> inputs) const;

  const Graph& graph() const { return graph_; }
  // The dialect chosen for each node, in node order.
  std::vector<std::string> node_dialects() const;

 private:
  Graph graph_;
  ExecutorOptions options_;
  std::vector<const KernelImpl*> kernels_;
  std::vector<int> last_use_;  // per value: index of the last node reading it (-1: none)
};

}  // namespace kiln
