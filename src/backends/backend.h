// Operator dialects (RAF's idea): every op may have several kernel implementations, from
// different libraries or hand-written, each registered with a dialect name, a device, a priority
// and a supports(node) predicate. Lowering picks the highest-priority implementation that
// supports the node among the dialects the user allows. The CPU reference kernel of every op is
// registered as dialect "reference" at the lowest priority, so every node always has one.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/op_def.h"
#include "tensor/tensor.h"

namespace kiln {


// A node as a kernel sees it at selection time.
struct NodeView {
  const Node& node;
  std::span<const TensorType> input_types;
  std::span<const TensorType> output_types;
};

struct KernelImpl {
  std::string dialect;  // "reference", "cpu", "openblas", later "cublaslt", "nvrtc", ...
  Device device = Device::kCpu;
  int priority = 0;     // higher wins
  std::function<bool(const NodeView&)> supports;  // empty: supports every node of the op
  KernelFn kernel;
  // The kernel reads element i of every input before writing element i of its output (or, for
  // a row kernel, a whole row before writing it), and its pointers are not __restrict__, so the
  // memory plan may put the node's output over a same-typed input that dies at the node
  // (analysis/memory_plan.h).
  bool in_place_ok = false;
  // Optional one-time work for a node before its first run (compiling a generated kernel,
  // building a library's plan for these types): the executor calls it at construction for
  // every node it bound to this kernel, with the node's types as at selection. It must be
  // thread-safe: the executor prepares nodes on several threads at once (nodes with the same
  // generated kernel too), each with the executor's CUDA device current.
  std::function<void(const NodeView&)> prepare = nullptr;
};

inline constexpr int kReferencePriority = 0;

class KernelRegistry {
 public:
  void add(Op op, KernelImpl impl);
  // The chosen implementation; `dialects` empty means all. Throws kiln::Error if none fits
  // (only possible when the user restricted dialects).
  const KernelImpl& select(const NodeView& node, Device device,
                           const std::vector<std::string>& dialects) const;
  // All implementations of `op` on `device`, highest priority first.
  std::vector<const KernelImpl*> candidates(Op op, Device device) const;
  std::vector<std::string> dialect_names() const;

 private:
  std::map<Op, std::vector<KernelImpl>> impls_;
};

// Every kernel kiln has, registered once at first use.
const KernelRegistry& kernel_registry();

// Filled by each backend (backends/cpu/cpu_backend.cc, ...).
void register_cpu_kernels(KernelRegistry& registry);
// The CUDA kernels (backends/cuda/cuda_backend.cc); does nothing in a build without CUDA.
void register_cuda_kernels(KernelRegistry& registry);

}  // namespace kiln
