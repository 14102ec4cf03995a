#include "passes/align_matmul.h"

#include <array>

#include "passes/simplify/dead_code.h"
#include "passes/simplify/rewrite.h"
#include "support/error.h"

namespace kiln {
namespace {

constexpr int64_t kAlignment = 8;  // elements: 16 bytes of bf16/f16

Replacement pad_columns(Rewriter& rw, const Node& n) {
  if (n.op != Op::kMatmul) return {};
  const TensorType out = rw.type(n.outputs[0]);
  if (!is_float(out.dtype) || out.rank() < 2) return {};
  const int64_t columns = out.shape.back();
  const int64_t padded = (columns + kAlignment - 1) / kAlignment * kAlignment;
  if (columns < kAlignMatmulMinColumns || padded == columns) return {};
  const ValueId w = n.inputs[1];
  const TensorType wt = rw.type(w);
  const int64_t axis = n.attrs.b("transpose_b") ? wt.rank() - 2 : wt.rank() - 1;
  Shape zeros = wt.shape;
  zeros[static_cast<size_t>(axis)] = padded - columns;
  const ValueId wide = rw.emit(Op::kConcat, {w, rw.full(zeros, 0.0, wt.dtype)}, {{"axis", axis}});
  const ValueId product = rw.emit(Op::kMatmul, {n.inputs[0], wide}, n.attrs);
  std::vector<int64_t> starts(out.shape.size(), 0), ends(out.shape.begin(), out.shape.end());
  return {rw.emit(Op::kSlice, {product}, {{"starts", starts}, {"ends", ends}})};
}

constexpr std::array kRules{RewriteRule{"pad-columns", pad_columns}};

}  // namespace

bool AlignMatmul::run(Graph& graph) {
  const std::map<std::string, int> fired = apply_rules(graph, kRules);
  padded_ = fired.empty() ? 0 : fired.begin()->second;
  if (padded_ == 0) return false;
  DeadCodeElimination().run(graph);
  return true;
}

std::vector<std::string> AlignMatmul::notes() const {
  if (padded_ == 0) return {"no product to pad"};
  return {fmt::format("{} product{} padded to a multiple of {} columns", padded_, padded_ == 1 ? "" : "s",
                      kAlignment)};
}

}  // namespace kiln
