#include "backends/backend.h"

#include <algorithm>
#include <set>

#include "support/error.h"

namespace kiln {


void KernelRegistry::add(Op op, KernelImpl impl) {
  KILN_CHECK(impl.kernel != nullptr, "kernel for {} in dialect {} has no function", op_name(op),
             impl.dialect);
  auto& list = impls_[op];
  list.push_back(std::move(impl));
  std::stable_sort(list.begin(), list.end(),
                   [](const KernelImpl& a, const KernelImpl& b) { return a.priority > b.priority; });
}

std::vector<const KernelImpl*> KernelRegistry::candidates(Op op, Device device) const {
  std::vector<const KernelImpl*> out;
  auto it = impls_.find(op);
  if (it == impls_.end()) return out;
  for (const KernelImpl& impl : it->second)
    if (impl.device == device) out.push_back(&impl);
  return out;
}

const KernelImpl& KernelRegistry::select(const NodeView& view, Device device,
                                         const std::vector<std::string>& dialects) const {
  for (const KernelImpl* impl : candidates(view.node.op, device)) {
    bool allowed = dialects.empty() ||
                   std::find(dialects.begin(), dialects.end(), impl->dialect) != dialects.end();
    if (allowed && (!impl->supports || impl->supports(view))) return *impl;
  }
  std::vector<std::string> have;
  for (const KernelImpl* impl : candidates(view.node.op, device)) have.push_back(impl->dialect);
  fail("no {} kernel for {} among the allowed dialects [{}] (it has: [{}])", device_name(device),
       op_name(view.node.op), fmt::join(dialects, ", "), fmt::join(have, ", "));
}

std::vector<std::string> KernelRegistry::dialect_names() const {
  std::set<std::string> names;
  for (const auto& [op, list] : impls_)
    for (const KernelImpl& impl : list) names.insert(impl.dialect);
  return {names.begin(), names.end()};
}

const KernelRegistry& kernel_registry() {
  static const KernelRegistry instance = [] {
    KernelRegistry r;
    register_cpu_kernels(r);
    register_cuda_kernels(r);
    return r;
  }();
  return instance;
}

}  // namespace kiln
