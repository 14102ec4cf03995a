// CUDA C++ generation for fused nodes (codegen.h): the entry points. The work is in four
// places: lowering.{h,cc} (a body to micro values, the machinery every kernel shape shares),
// emitters.cc (the per-op table), kernel_text.{h,cc} (text the kernel writers share) and one
// writer per kernel shape, elementwise_kernel.cc and rows_kernel.cc.
#include "backends/cuda/nvrtc/codegen.h"

#include <algorithm>

#include "backends/cuda/nvrtc/kernel_text.h"
#include "backends/cuda/nvrtc/lowering.h"

namespace kiln::cuda {

using codegen::Lowered;
using codegen::Unsupported;

bool can_generate(const Graph& body, FusedKind kind, std::string* why) {
  try {
    (void)codegen::lower(body, kind);
    return true;
  } catch (const Unsupported& u) {
    if (why) *why = u.why;
  } catch (const Error& e) {
    if (why) *why = e.what();
  }
  return false;
}

GeneratedKernel generate_kernel(const Graph& body, FusedKind kind) {
  Lowered low;
  try {
    low = codegen::lower(body, kind);
  } catch (const Unsupported& u) {
    fail("nvrtc codegen: cannot generate the {} body @{}: {}", fused_kind_name(kind), body.name,
         u.why);
  }
  return kind == FusedKind::kRows ? codegen::generate_rows(body, low)
                                  : codegen::generate_elementwise(body, low);
}

std::vector<Op> ops_with_emitters() {
  std::vector<Op> ops;
  for (const auto& [op, emitter] : codegen::emitters()) ops.push_back(op);
  std::sort(ops.begin(), ops.end(),
            [](Op a, Op b) { return op_info(a).name < op_info(b).name; });
  return ops;
}

}  // namespace kiln::cuda
