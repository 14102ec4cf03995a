#include "ir/op.h"

#include <algorithm>
#include <array>

namespace kiln {
namespace {
constexpr std::array<OpInfo, kNumOps> kOpInfos = {{
#define KILN_OP(name, text, min_in, max_in, flags) {Op::k##name, text, min_in, max_in, flags},
#include "ir/ops.def"
#undef KILN_OP
}};

// The table is kept sorted so parse_op can binary-search and a newcomer can find an op.
constexpr bool table_sorted() {
  for (int i = 1; i < kNumOps; ++i)
    if (!(kOpInfos[i - 1].name < kOpInfos[i].name)) return false;
  return true;
}
static_assert(table_sorted(), "ir/ops.def must be sorted by text name");
// Bump when adding an op, together with its definition in src/ops/ and its tests.
static_assert(kNumOps == 93, "op count changed: add the op's definition and tests too");
}  // namespace

const OpInfo& op_info(Op op) { return kOpInfos[static_cast<int>(op)]; }

std::optional<Op> parse_op(std::string_view name) {
  auto it = std::lower_bound(kOpInfos.begin(), kOpInfos.end(), name,
                             [](const OpInfo& info, std::string_view n) { return info.name < n; });
  if (it == kOpInfos.end() || it->name != name) return std::nullopt;
  return it->op;
}

}  // namespace kiln
