// Pass "fp8-linear": marks a FORWARD graph's linear layers as fp8 matmuls (ops/fp8.h), the
// `--amp fp8` recipe: the layer's product takes e4m3 operands with per-tensor scales, and autodiff
// then makes its two gradient products fp8 too (e5m2 for the incoming gradient).
//
// A linear layer here is matmul(x, w) (either transpose flag on w, x of any rank, not transposed
// when batched) whose w is a 2-D param, read directly or through casts (mixed precision's cast to
// bf16), with every GEMM dimension of the product and of its gradients a multiple of 16 (the FP8
// tensor cores' layout rule: x's rows, w's two dims). Kept in 16 bits:
//   * the classifier: a product whose result reaches a cross_entropy through casts and reshapes
//     (the logits feed the loss directly, and torchao's recipes leave the head in bf16 too);
//   * attention's products and every other matmul of two activations (no param operand).
// Runs after the mixed-precision pass (compile/training_graph.cc), on the graph autodiff sees.
//
// Expects: a verified graph. Guarantees: the same graph with fp8_a = fp8_b = "e4m3" set on the
// matched matmuls; nothing else changes.
#pragma once

#include "passes/pass.h"

namespace kiln {

class Fp8Linear : public Pass {
 public:
  std::string name() const override { return "fp8-linear"; }
  bool run(Graph& graph) override;
  std::vector<std::string> notes() const override;

 private:
  int marked_ = 0, skipped_ = 0;
};

}  // namespace kiln
