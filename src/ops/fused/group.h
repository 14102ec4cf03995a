// The body contract of the fusion pass's kinds: "elementwise", "rows" and "gemm-epilogue"
// (passes/fusion/fusion.h makes them; passes/ones_column.h pads and slices them), and the role
// each node plays in such a body, which the fusion pass's node classification is built on.
//
// Roles (group_role: the op's OpTraits::fusion_role, ir/op_def.h), by op and attributes (fusion
// adds its dtype and broadcast rules on top):
//   kElementwise      an elementwise op of the op table, except dropout (its counter-based mask
//                     is indexed by the element's global position: left to its own kernel)
//   kRowOp            along the last axis, rows independent: softmax, log_softmax and their
//                     gradients over the last axis; layer_norm, rms_norm and their gradients
//                     (dx per row; dgamma/dbeta are column values: OpDef::column_outputs_from);
//                     sum, mean, max over exactly the last axis; cross_entropy and
//                     cross_entropy_grad with reduction "none"
//   kColumnReduction  sum, mean over every axis but the last (rank >= 2): a bias gradient
//   kGemm             matmul of a 2-D B by a 2-D A, or by rows (..., K) of A untransposed (a
//                     linear layer on a sequence)
//   kOther            everything else
//
// Contract (what the partitioner guarantees, passes/fusion/partition.h, and what the kernels
// rely on):
//   every kind  every node is kElementwise, kRowOp, kColumnReduction or kGemm, or one of
//               ones-column's pieces below; a column value (a column reduction's result, a row
//               op's column outputs) is read by no node of the body: it is complete only after
//               the last tile, so it can only leave the body.
//   elementwise no row op, no matmul (fusion: a group with neither).
//   rows        at least one row op, no matmul.
//   gemm-epilogue exactly one matmul (the nucleus), whose operands are body inputs (or A a
//               slice of one): it reads nothing computed inside the body. Any number of row ops.
//   ones-column (rows and gemm-epilogue): `full` (the ones), a `concat` along the last axis
//               that no node of the body reads (the padded output X'), and in gemm-epilogue a
//               `slice` of a body input read by the matmul alone (x[..., :K] of X').
// Not checked here: the one iteration space of the group's items (the kernels find it, and
// refuse what they cannot tile) and the dtypes (fusion's rule: f32/bf16/f16).
#pragma once

#include <optional>
#include <string>

#include "ir/graph.h"
#include "ir/op_def.h"
#include "ops/fused/kind.h"

namespace kiln {

GroupRole group_role(const Graph& graph, const Node& node);

// What a fusion group's body holds, for the kernels and passes that read it.
struct GroupBody {
  int matmul = -1;   // gemm-epilogue: the index of its one matmul node; -1 otherwise
  int row_ops = 0;   // nodes of role kRowOp
  int column_reductions = 0;
};
// The body's description when it meets `kind`'s contract above (kind one of elementwise, rows,
// gemm-epilogue); otherwise nullopt, with the first reason in `why`.
std::optional<GroupBody> match_group_body(FusedKind kind, const Graph& body,
                                          std::string* why = nullptr);

}  // namespace kiln
