// recognize: finds the decomposed forms of kiln's composite ops that an exported model spells out
// op by op (an ONNX export of PyTorch code writes LayerNorm as ReduceMean, Sub, Pow, Sqrt, Div;
// GELU as Div, Erf, Add, Mul; attention as MatMul, Div, Where, Softmax, MatMul), and rewrites
// each to the one op kiln has for it, so that an imported model runs the kernels kiln's own
// models run. A third rule table, applied to a fixed point by the rule driver
// (passes/simplify/rewrite.h), then dead-code.
//
// What (each rule in recognize.cc says its forms, in any operand order):
//   matmul(a, transpose(b)), the last two axes swapped -> matmul(a, b, transpose_b)
//   x * sigmoid(x)                                   -> silu(x)
//   x * 0.5 * (1 + erf(x / sqrt 2))                  -> gelu(x)
//   x * 0.5 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) -> gelu(x, "tanh")
//   x / sqrt(mean(x^2) + eps), over the last axis     -> rms_norm(x, 1, eps)
//   (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) -> layer_norm(x, 1, 0, eps)
//   norm(x, 1, ...) * w, norm(x, g, 0) + b, w and b (C,) -> the norm with w as gamma, b as beta
//   x cos + rotate_half(x) sin, with cos and sin a rotary table for positions 0 .. T-1
//                                                    -> rotary_embedding(x, base)
//   softmax(q k^T * scale [masked]) v over the last axis, the masks none, causal and/or a
//   padding mask (one row of Tk per batch entry, broadcast over heads and queries: + M, or
//   where(pad, NEG, .)), k and v with fewer heads repeated (unsqueeze, expand, reshape)
//                                                    -> attention(q, k, v [, key_bias])
//   attention(q, repeated k, repeated v), the attention an export wrote whole over kv heads it
//   repeated first                                   -> attention(q, k, v) (grouped-query)
// Exact: a rule fires only where the one op computes what the pattern computes: the axes (the
// last, with keepdims), the constants (sqrt 2, 0.5, 1, sqrt(2/pi), 0.044715 within the rounding
// of the graph's dtype), the scale (a positive scalar), the mask (a known value: -inf, or <=
// -1e30 whose exp is 0 beside any score within 1e30 of the row's largest, above the diagonal and
// nothing else, every row keeping its diagonal; a padding mask of any values when added, a
// masking NEG when a where fills it), the rotary tables (every entry compared with
// cos and sin of t * base^(-2i/D) within the rounding of an f32 table). Anything else stays as it
// is. Rounding differs from the pattern's op by op evaluation (the one op rounds once); that is
// the point.
// Why here and not in the importer: every front end (ONNX, IR text, a builder graph written
// op by op) benefits, and the rules are tested on IR text like the other simplify rules.
// When: on the FORWARD graph, before mixed precision and autodiff (compile_step runs it first,
// passes/pipeline.h forward_pipeline), so the backward uses the composite ops' own gradient
// rules (layer_norm_grad, attention_grad, ...) rather than differentiating the decomposition.
// A rotary or attention on a heads transpose (..., H, T, D) of (..., T, H, D) values keeps that
// transpose outside the op, where the algebraic rules later fold it into the "bthd" layout as
// they do for kiln's own models.
// Expects: a verified graph. Guarantees: inputs in place; replaced nodes and what only they read
// removed; values compacted.
#pragma once

#include <map>
#include <span>

#include "passes/pass.h"
#include "passes/simplify/rewrite.h"

namespace kiln {

std::span<const RewriteRule> recognition_rules();

class RecognizeOps : public Pass {
 public:
  std::string name() const override { return "recognize"; }
  bool run(Graph& graph) override;
  // How often each rule fired in the last run.
  const std::map<std::string, int>& fired() const { return fired_; }
  // One line: the rules that fired and how often ("attention 2, gelu-erf 2, ...").
  std::vector<std::string> notes() const override;

 private:
  std::map<std::string, int> fired_;
};

}  // namespace kiln
