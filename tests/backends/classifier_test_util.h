// Shared by the fused-classifier kernel tests (tests/backends/cpu_classifier_test.cc and
// tests/cuda/classifier_test.cc): a graph holding one fused "classifier" node made by the pass
// itself from IR text, and random inputs for it (never zeros).
#pragma once

#include <fmt/core.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ir/text.h"
#include "passes/classifier.h"
#include "tensor/tensor.h"

namespace kiln::testing {

struct ClassifierCase {
  DType logits = DType::kF32;  // the node's logits input (f32, bf16, f16)
  DType grad = DType::kF32;    // the gradient output; differs from logits only as f32 -> 16 bit
  DType labels = DType::kI64;
  Shape rows = {6};
  int64_t vocab = 10;
  std::string reduction = "mean";
  int64_t ignore_index = -100;

  std::string describe() const {
    return fmt::format("logits {}, grad {}, labels {}, rows ({}), V {}, {}, ignore {}",
                       dtype_name(logits), dtype_name(grad), dtype_name(labels),
                       fmt::join(rows, ", "), vocab, reduction, ignore_index);
  }
};

// A graph of one fused classifier node for `c`: cast/loss/grad/cast in IR text, outlined by
// ClassifierPass. Inputs: logits, labels, dloss.
inline Graph classifier_graph(const ClassifierCase& c) {
  auto type = [](DType d, const Shape& s) {
    return fmt::format("{}[{}]", dtype_name(d), fmt::join(s, ","));
  };
  Shape logits_shape = c.rows;
  logits_shape.push_back(c.vocab);
  const Shape dloss_shape = c.reduction == "none" ? c.rows : Shape{};
  const std::string attrs =
      fmt::format("{{ignore_index={}, reduction=\"{}\"}}", c.ignore_index, c.reduction);
  std::string text = fmt::format("graph @g(%x: {} data, %t: {} data, %d: {} data) {{\n",
                                 type(c.logits, logits_shape), type(c.labels, c.rows),
                                 type(DType::kF32, dloss_shape));
  std::string l = "%x";
  if (c.logits != DType::kF32) {
    text += "  %l = cast(%x) {dtype=f32}\n";
    l = "%l";
  }
  text += fmt::format("  %loss = cross_entropy({}, %t) {}\n", l, attrs);
  text += fmt::format("  %g = cross_entropy_grad({}, %t, %d) {}\n", l, attrs);
  std::string g = "%g";
  if (c.grad != DType::kF32) {
    text += fmt::format("  %gc = cast(%g) {{dtype={}}}\n", dtype_name(c.grad));
    g = "%gc";
  }
  text += fmt::format("  return %loss, {}\n}}\n", g);
  Graph graph = parse(text);
  EXPECT_TRUE(ClassifierPass().run(graph)) << text;
  EXPECT_EQ(graph.nodes.size(), 1u) << text;
  return graph;
}

// Logits uniform in [-6, 6) (a spread that makes softmax far from uniform), labels uniform in
// [0, V) with every third row set to ignore_index (when it is outside [0, V)), dloss in
// [0.5, 2) (per row for "none").
inline std::vector<Tensor> classifier_inputs(const Graph& graph, const ClassifierCase& c,
                                             uint64_t seed) {
  std::vector<Tensor> in;
  in.push_back(random_tensor(graph.type(graph.inputs[0].value), seed, -6.0, 6.0));
  Tensor labels = random_tensor(graph.type(graph.inputs[1].value), seed + 1, 0.0,
                                static_cast<double>(c.vocab));
  if (c.ignore_index < 0 || c.ignore_index >= c.vocab)
    for (int64_t r = 1; r < labels.numel(); r += 3) labels.set(r, static_cast<double>(c.ignore_index));
  in.push_back(labels);
  in.push_back(random_tensor(graph.type(graph.inputs[2].value), seed + 2, 0.5, 2.0));
  return in;
}

}  // namespace kiln::testing
