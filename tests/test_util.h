// Shared test helpers: run one op through the reference kernel or a chosen dialect, random
// inputs, closeness checks.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "ir/graph.h"
#include "ir/op_def.h"
#include "tensor/tensor.h"

namespace kiln::testing {

// Normalizes attrs, infers output types, allocates outputs and runs the op's reference kernel.
std::vector<Tensor> run_reference(Op op, const std::vector<Tensor>& inputs, Attributes attrs = {});
// Same, through the highest-priority CPU kernel of `dialect` that supports the node (throws if
// that dialect does not support it).
std::vector<Tensor> run_dialect(const std::string& dialect, Op op,
                                const std::vector<Tensor>& inputs, Attributes attrs = {});
// Output types the op infers for inputs of these types (throws kiln::Error like the verifier).
std::vector<TensorType> infer(Op op, const std::vector<TensorType>& inputs, Attributes attrs = {});

// A tensor from values (converted to dtype).
Tensor make(DType dtype, Shape shape, std::vector<double> values);
Tensor rand(DType dtype, Shape shape, uint64_t seed, double low = -1.0, double high = 1.0);

// gtest assertion: every element |a-b| <= atol + rtol*|b|.
::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, double atol,
                                     double rtol);

struct Tolerance {
  double atol, rtol;
};
// Runs `op` through the reference kernel and through `dialect` on the same inputs and expects
// every output close (a failure names the op, input types, attributes and output).
void expect_matches_reference(const std::string& dialect, Op op, const std::vector<Tensor>& inputs,
                              const Attributes& attrs, Tolerance tol);
// The dialect the CPU registry selects for `op` on inputs of these types.
std::string selected_dialect(Op op, const std::vector<TensorType>& inputs, Attributes attrs = {});

// The message of the kiln::Error that `fn` throws; records a test failure if it throws none.
std::string error_of(const std::function<void()>& fn);

}  // namespace kiln::testing

// Expects `statement` to throw kiln::Error whose message contains every listed fragment.
#define EXPECT_KILN_ERROR(statement, ...)                                              \
  do {                                                                                 \
    const std::string kiln_message_ = ::kiln::testing::error_of([&] { statement; });   \
    for (const std::string& fragment : std::vector<std::string>{__VA_ARGS__})          \
      EXPECT_NE(kiln_message_.find(fragment), std::string::npos)                       \
          << "message \"" << kiln_message_ << "\" lacks \"" << fragment << "\"";       \
  } while (0)
