// Helpers shared by the op-definition tests under tests/ops/: error-message assertions and
// short tensor constructors.
#pragma once

#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>

#include "test_util.h"

namespace kiln::testing {

// Passes when `fn` throws kiln::Error whose message contains every fragment.
inline ::testing::AssertionResult throws_with(const std::function<void()>& fn,
                                              std::initializer_list<std::string_view> fragments) {
  try {
    fn();
  } catch (const Error& e) {
    std::string message = e.what();
    for (std::string_view fragment : fragments) {
      if (message.find(fragment) == std::string::npos)
        return ::testing::AssertionFailure()
               << "message \"" << message << "\" lacks \"" << fragment << "\"";
    }
    return ::testing::AssertionSuccess() << message;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-kiln exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "no kiln::Error thrown";
}

inline TensorType tt(DType dtype, Shape shape) { return TensorType{dtype, std::move(shape)}; }

// The single output of `op` run through its reference kernel.
inline Tensor ref1(Op op, const std::vector<Tensor>& inputs, Attributes attrs = {}) {
  std::vector<Tensor> out = run_reference(op, inputs, std::move(attrs));
  EXPECT_EQ(out.size(), 1u);
  return out.at(0);
}

// The single inferred output type.
inline TensorType infer1(Op op, const std::vector<TensorType>& inputs, Attributes attrs = {}) {
  std::vector<TensorType> out = infer(op, inputs, std::move(attrs));
  EXPECT_EQ(out.size(), 1u);
  return out.at(0);
}

}  // namespace kiln::testing
