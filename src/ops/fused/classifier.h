// The body contract of kind "classifier" (the classifier pass makes it, passes/classifier.h):
// a language model's loss and its gradient, which a hand-written kernel computes in one pass
// over the logits. The body holds exactly these ops, in this order (the only form the kernels
// take):
//     [%L = cast(%X) {dtype=f32}]                     when the node's logits X are bf16/f16
//     %loss = cross_entropy(%L, %labels) {ignore_index, reduction}
//     %g = cross_entropy_grad(%L, %labels, %dloss) {ignore_index, reduction}
//     [%gc = cast(%g) {dtype=bf16|f16}]               a 16-bit gradient
//     return %loss, %g (or %gc)
// with body inputs (X, labels, dloss), L of dtype f32, and both loss ops of equal attributes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ir/graph.h"

namespace kiln {

// What a classifier node computes, read from its body. Node inputs: logits (rows..., V) of
// `logits`, labels (rows...) of `labels`, dloss (f32: the loss's shape). Node outputs: the loss
// (f32: scalar, or per row for "none") and dlogits (logits' shape, of `grad`).
struct ClassifierBody {
  DType logits = DType::kF32;  // f32, bf16 or f16
  DType labels = DType::kI64;  // i32 or i64
  DType grad = DType::kF32;    // f32, bf16 or f16
  int64_t ignore_index = -100;
  std::string reduction = "mean";  // "mean", "sum" or "none"
  int64_t rows = 0;                // product of the labels' dims
  int64_t vocab = 0;               // the logits' last dim
};
// The body's description, or nullopt (with the first reason in `why`) when `body` is not of
// the form above.
std::optional<ClassifierBody> match_classifier_body(const Graph& body, std::string* why = nullptr);

}  // namespace kiln
