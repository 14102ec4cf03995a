// Internal to src/ops/: how op families hand their definitions to the one registry.
// To add an op: its line in ir/ops.def, its OpDef in the family file here, its tests.
#pragma once

#include <array>
#include <optional>

#include "ir/op_def.h"

namespace kiln::ops {

class OpRegistry {
 public:
  // Throws if `op` is defined twice. Returns the stored definition, for its traits:
  // `define(op, OpDef{...}).traits = {.row_op = true, ...}`.
  OpDef& define(Op op, OpDef def);
  const OpDef* find(Op op) const;

 private:
  std::array<std::optional<OpDef>, kNumOps> defs_;
};

// One function per family file.
void define_source_ops(OpRegistry& registry);       // ops/source.cc: constant, full, iota
void define_elementwise_ops(OpRegistry& registry);  // ops/elementwise.cc: unary, binary, cast, where, dropout
void define_reduction_ops(OpRegistry& registry);    // ops/reduction.cc: sum, mean, max, argmax
void define_shape_ops(OpRegistry& registry);        // ops/shape.cc: reshape, transpose, slice, ...
void define_indexing_ops(OpRegistry& registry);     // ops/indexing.cc: gather/scatter_elements, cumsum, topk
void define_nn_ops(OpRegistry& registry);           // ops/nn.cc: matmul, softmax, norms, losses, attention
void define_conv_ops(OpRegistry& registry);         // ops/conv.cc: conv2d, pooling and their gradients
void define_optimizer_ops(OpRegistry& registry);    // ops/optimizer.cc: optimizer_update
void define_collective_ops(OpRegistry& registry);  // ops/collective.cc: all_reduce, all_gather, reduce_scatter, ...
void define_transfer_ops(OpRegistry& registry);    // ops/transfer.cc: offload, reload
void define_fused_ops(OpRegistry& registry);        // ops/fused.cc: fused (a node with a body)

}  // namespace kiln::ops
