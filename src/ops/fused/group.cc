#include "ops/fused/group.h"

#include <algorithm>
#include <vector>

#include "ir/op_def.h"
#include "support/error.h"

namespace kiln {
namespace {

std::optional<GroupBody> refuse(std::string* why, std::string reason) {
  if (why) *why = std::move(reason);
  return std::nullopt;
}

}  // namespace

GroupRole group_role(const Graph& graph, const Node& node) {
  const OpTraits& traits = op_def(node.op).traits;
  if (traits.fusion_role) return traits.fusion_role(graph, node);
  if (has_flag(node.op, kElementwise))
    return has_flag(node.op, kRandom) ? GroupRole::kOther : GroupRole::kElementwise;
  return traits.row_op ? GroupRole::kRowOp : GroupRole::kOther;
}

std::optional<GroupBody> match_group_body(FusedKind kind, const Graph& body, std::string* why) {
  KILN_CHECK(is_fusion_group(kind), "match_group_body: {} is not a fusion group kind",
             fused_kind_name(kind));
  const bool elementwise = kind == FusedKind::kElementwise;
  const bool gemm = kind == FusedKind::kGemmEpilogue;
  // Per value: the node reading it (-1: none yet, -2: two or more), and whether it is a column
  // value that no node may read.
  std::vector<int> reader(body.values.size(), -1);
  for (size_t n = 0; n < body.nodes.size(); ++n)
    for (ValueId id : body.nodes[n].inputs) {
      int& r = reader[static_cast<size_t>(id)];
      r = r == -1 || r == static_cast<int>(n) ? static_cast<int>(n) : -2;
    }
  auto node_text = [&](size_t n) {
    return fmt::format("node {} ({})", n, op_name(body.nodes[n].op));
  };
  auto read_inside = [&](ValueId id) { return reader[static_cast<size_t>(id)] != -1; };

  GroupBody out;
  std::vector<int> slices;  // ones-column's slices of a body input (gemm-epilogue)
  for (size_t n = 0; n < body.nodes.size(); ++n) {
    const Node& node = body.nodes[n];
    switch (group_role(body, node)) {
      case GroupRole::kElementwise:
        break;
      case GroupRole::kRowOp: {
        if (elementwise)
          return refuse(why, fmt::format("{} is a row op: an elementwise body holds none (its "
                                         "kind is \"rows\")", node_text(n)));
        ++out.row_ops;
        const int column_from = op_def(node.op).column_outputs_from;
        for (size_t k = column_from < 0 ? node.outputs.size() : static_cast<size_t>(column_from);
             k < node.outputs.size(); ++k)
          if (read_inside(node.outputs[k]))
            return refuse(why, fmt::format("{}'s column output {} is read inside the body (a "
                                           "column value can only leave it)", node_text(n), k));
        break;
      }
      case GroupRole::kColumnReduction:
        ++out.column_reductions;
        if (read_inside(node.outputs[0]))
          return refuse(why, fmt::format("{} is a column reduction read inside the body (a "
                                         "column value can only leave it)", node_text(n)));
        break;
      case GroupRole::kGemm:
        if (!gemm)
          return refuse(why, fmt::format("{} is a matmul: only a gemm-epilogue body holds one",
                                         node_text(n)));
        if (out.matmul >= 0)
          return refuse(why, fmt::format("{} is a second matmul (the first is node {}): a "
                                         "gemm-epilogue body holds exactly one", node_text(n),
                                         out.matmul));
        out.matmul = static_cast<int>(n);
        break;
      case GroupRole::kOther:
        // ones-column's pieces (passes/ones_column.h).
        if (!elementwise && node.op == Op::kFull) break;
        if (!elementwise && node.op == Op::kConcat && !read_inside(node.outputs[0]) &&
            normalize_axis(node.attrs.i("axis"), body.type(node.outputs[0]).rank()) ==
                body.type(node.outputs[0]).rank() - 1)
          break;
        if (gemm && node.op == Op::kSlice && body.input_index(node.inputs[0]) >= 0) {
          slices.push_back(static_cast<int>(n));
          break;
        }
        return refuse(why, fmt::format("{} cannot be part of a {} body (only elementwise ops, "
                                       "row ops, column reductions{})", node_text(n),
                                       fused_kind_name(kind),
                                       gemm ? ", one matmul and ones-column's padding"
                                            : elementwise ? "" : " and ones-column's padding"));
    }
  }
  if (kind == FusedKind::kRows && out.row_ops == 0)
    return refuse(why, "no row op (softmax, a norm, a last-axis reduction): a body without one "
                       "is \"elementwise\"");
  if (gemm) {
    if (out.matmul < 0) return refuse(why, "no matmul: a gemm-epilogue body holds exactly one");
    const Node& mm = body.nodes[static_cast<size_t>(out.matmul)];
    for (size_t k = 0; k < 2; ++k) {
      const ValueId operand = mm.inputs[k];
      if (body.input_index(operand) >= 0) continue;
      const bool sliced = k == 0 && std::any_of(slices.begin(), slices.end(), [&](int s) {
        return body.nodes[static_cast<size_t>(s)].outputs[0] == operand;
      });
      if (!sliced)
        return refuse(why, fmt::format("the matmul (node {}) reads its operand {} from inside "
                                       "the body: its operands are body inputs", out.matmul,
                                       k == 0 ? "a" : "b"));
    }
    for (int s : slices) {
      const ValueId sliced = body.nodes[static_cast<size_t>(s)].outputs[0];
      const bool output = std::find(body.outputs.begin(), body.outputs.end(), sliced) !=
                          body.outputs.end();
      if (reader[static_cast<size_t>(sliced)] != out.matmul || mm.inputs[0] != sliced ||
          mm.inputs[1] == sliced || output)
        return refuse(why, fmt::format("{} is read by more than the matmul's a (ones-column's "
                                       "slice x[..., :K] is read by the matmul alone)",
                                       node_text(static_cast<size_t>(s))));
    }
  }
  return out;
}

}  // namespace kiln
