// Helpers for the simplify pass tests: run a pass on IR text, CHECK-style substring checks, and
// run a graph (reference dialect) to compare results before and after a pass.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "ir/text.h"
#include "ir/verifier.h"
#include "passes/pass.h"
#include "runtime/executor.h"
#include "tensor/tensor.h"
#include "test_util.h"

namespace kiln::testing {

struct PassOnText {
  std::string text;  // the canonical text after the pass
  bool changed = false;
};

inline PassOnText run_on_text(Pass& pass, std::string_view text) {
  Graph graph = parse(text);
  PassOnText result;
  result.changed = pass.run(graph);
  verify(graph);
  result.text = print(graph);
  return result;
}

// The negative tests: the pass reports no change and the text is exactly the input's.
inline void expect_unchanged(Pass& pass, std::string_view text) {
  const std::string before = print(parse(text));
  PassOnText after = run_on_text(pass, text);
  EXPECT_FALSE(after.changed);
  EXPECT_EQ(after.text, before);
}

// CHECK / CHECK-NOT lines.
inline ::testing::AssertionResult contains(const std::string& text, std::string_view fragment) {
  if (text.find(fragment) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected to find \"" << fragment << "\" in:\n" << text;
}
inline ::testing::AssertionResult lacks(const std::string& text, std::string_view fragment) {
  if (text.find(fragment) == std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "did not expect \"" << fragment << "\" in:\n" << text;
}

// Random inputs in graph-input order: floats uniform in [-1, 1), integers in [int_low, int_high).
inline std::vector<Tensor> random_inputs(const Graph& graph, uint64_t seed, int64_t int_low,
                                         int64_t int_high) {
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < graph.inputs.size(); ++i) {
    const TensorType& t = graph.type(graph.inputs[i].value);
    inputs.push_back(is_float(t.dtype)
                         ? random_tensor(t, seed + i, -1.0, 1.0)
                         : random_tensor(t, seed + i, static_cast<double>(int_low),
                                         static_cast<double>(int_high)));
  }
  return inputs;
}

// One run through the reference kernels: the outputs, then the new value of every update target
// (in Graph::updates order). The inputs are cloned first, since updates write into them.
inline std::vector<Tensor> run_step(const Graph& graph, const std::vector<Tensor>& inputs) {
  std::vector<Tensor> fresh;
  for (const Tensor& t : inputs) fresh.push_back(t.clone());
  Executor executor(graph, ExecutorOptions{Device::kCpu, {"reference"}});
  std::vector<Tensor> results = executor.run(fresh);
  for (const Update& update : graph.updates)
    results.push_back(fresh.at(graph.input_index(update.target)));
  return results;
}

inline ::testing::AssertionResult bitwise_equal(const std::vector<Tensor>& a,
                                                const std::vector<Tensor>& b) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << a.size() << " results vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].type() != b[i].type())
      return ::testing::AssertionFailure() << "result " << i << ": " << to_string(a[i].type())
                                           << " vs " << to_string(b[i].type());
    if (std::memcmp(a[i].raw(), b[i].raw(), a[i].bytes()) != 0)
      return ::testing::AssertionFailure() << "result " << i << " differs: " << summarize(a[i])
                                           << " vs " << summarize(b[i]);
  }
  return ::testing::AssertionSuccess();
}

// Every element within rtol of the largest magnitude of its tensor (a relative error measure
// that does not blow up on elements that happen to be near zero).
inline ::testing::AssertionResult relatively_close(const std::vector<Tensor>& a,
                                                   const std::vector<Tensor>& b, double rtol) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << a.size() << " results vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].type() != b[i].type())
      return ::testing::AssertionFailure() << "result " << i << ": types differ";
    double scale = 0;
    for (int64_t k = 0; k < b[i].numel(); ++k) scale = std::max(scale, std::abs(b[i].get(k)));
    const double error = max_scaled_error(a[i], b[i], rtol * std::max(scale, 1e-300), 0.0);
    if (!(error <= 1.0))
      return ::testing::AssertionFailure() << "result " << i << ": error " << error
                                           << " x (rtol " << rtol << " * max |b| " << scale << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kiln::testing
