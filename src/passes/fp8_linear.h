// Pass "fp8-linear": marks a FORWARD graph's linear layers as fp8 matmuls (ops/fp8.h), the
// `--amp fp8` recipe: the layer's product takes e4m3 operands with per-tensor scales, and autodiff
// then makes its two gradient products fp8 too (the incoming gradient in e4m3, or e5m2 if asked).
//
// A linear layer here is matmul(x, w) (either transpose flag on w, x of any rank, not transposed
// when batched) whose w is a 2-D param, read directly or through casts (mixed precision's cast to
// bf16), with every GEMM dimension of the product and of its gradients a multiple of 16 (the FP8
// tensor cores' layout rule: x's rows, w's two dims). Kept in 16 bits:
//   * the classifier: a product whose result reaches a cross_entropy through casts and reshapes
//     (the logits feed the loss directly, and torchao's recipes leave the head in bf16 too);
//   * attention's products and every other matmul of two activations (no param operand).
// And, unless every_linear is set, only where the cost model says fp8 is faster: a layer's three
// products (forward, dx, dw) at the FP8 rate plus their quantization (each operand read for its
// amax, read again and written as bytes: 5 bytes an element, and 4 launches a product) against
// the same products in bf16. The quantization grows with k (m + n) and the saving with m n k, so
// wide layers gain and narrow ones lose: llama-1b's SwiGLU products are faster in fp8, GPT-2's
// 768-wide layers slower (bench/gpu_gemm_bench fp8). torchao filters its layers by size likewise.
// Runs after the mixed-precision pass (compile/training_graph.cc), on the graph autodiff sees.
//
// Expects: a verified graph. Guarantees: the same graph with fp8_a = fp8_b = "e4m3", fp8_grad
// (options.grad) and fp8_fast_accum set on the matched matmuls; nothing else changes.
#pragma once

#include <utility>

#include "analysis/cost_model.h"
#include "ops/fp8.h"
#include "passes/pass.h"

namespace kiln {

struct Fp8LinearOptions {
  bool every_linear = false;  // mark every layer the rules allow, faster or not (tests, studies)
  Fp8Format grad = kFp8GradDefault;  // the incoming gradient's format in the backward products
  CostModel model = CostModel::defaults(Device::kCuda);
};

// A linear layer of `rows` tokens from `in` to `out` features: its three products' seconds in
// bf16 and in fp8 (quantization included), by the model's rates.
struct Fp8Estimate {
  double bf16_s = 0, fp8_s = 0;
};
Fp8Estimate fp8_estimate(const CostModel& model, int64_t rows, int64_t in, int64_t out);

// One line for a user: how many of a compiled step's matmul products (fused bodies included)
// run in fp8, so that `--amp fp8` on layers too narrow to gain says so instead of silently
// training in bf16.
std::string fp8_summary(const Graph& step);

class Fp8Linear : public Pass {
 public:
  explicit Fp8Linear(Fp8LinearOptions options = {}) : options_(std::move(options)) {}
  std::string name() const override { return "fp8-linear"; }
  bool run(Graph& graph) override;
  std::vector<std::string> notes() const override;

 private:
  Fp8LinearOptions options_;
  int marked_ = 0, skipped_ = 0, slower_ = 0;
};

}  // namespace kiln
