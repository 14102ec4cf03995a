// The math lines mod, fmod, round, acos, asin and atan (ops/elementwise_math.h): remainders of
// every sign combination against the values C and Python define (written out by hand), integers
// exact beyond 2^53 and a zero divisor an error, round's halves to even, and each gradient rule
// against float64 central differences.
#include "gradcheck.h"
#include "test_util.h"

namespace kiln {
namespace {

using testing::expect_op_gradients;
using testing::make;
using testing::run_reference;
using Ints = std::vector<int64_t>;

Tensor i64(Shape shape, const Ints& values) {
  Tensor t(TensorType{DType::kI64, std::move(shape)});
  std::copy(values.begin(), values.end(), t.data<int64_t>());
  return t;
}
Ints i64_values(const Tensor& t) { return Ints(t.data<int64_t>(), t.data<int64_t>() + t.numel()); }

void expect_values(const Tensor& t, const std::vector<double>& expected) {
  ASSERT_EQ(t.numel(), static_cast<int64_t>(expected.size()));
  for (int64_t i = 0; i < t.numel(); ++i) EXPECT_DOUBLE_EQ(t.get(i), expected[i]) << "element " << i;
}

TEST(Remainder, SignsFollowCAndPython) {
  // a = 7, -7, 7, -7 and b = 3, 3, -3, -3: C's fmod has a's sign, Python's % has b's.
  for (DType t : {DType::kF32, DType::kF64, DType::kI32, DType::kI64}) {
    const Tensor a = make(t, {4}, {7, -7, 7, -7}), b = make(t, {4}, {3, 3, -3, -3});
    expect_values(run_reference(Op::kFmod, {a, b})[0], {1, -1, 1, -1});
    expect_values(run_reference(Op::kMod, {a, b})[0], {1, 2, -2, -1});
  }
  // Exact multiples give 0 either way; floats keep their fractions.
  expect_values(run_reference(Op::kMod, {make(DType::kF64, {3}, {6, -6, -5.5}), make(DType::kF64, {3}, {3, 3, 2})})[0],
                {0, 0, 0.5});
  expect_values(run_reference(Op::kFmod, {make(DType::kF64, {1}, {-5.5}), make(DType::kF64, {1}, {2})})[0], {-1.5});
  // Broadcasting, and u8.
  expect_values(run_reference(Op::kMod, {make(DType::kU8, {2, 2}, {200, 13, 7, 255}), make(DType::kU8, {2}, {7, 10})})[0],
                {4, 3, 0, 5});
}

TEST(Remainder, IntegersAreExactAndRefuseZero) {
  const int64_t big = (int64_t{1} << 62) + 3;  // not a double
  const int64_t half = int64_t{1} << 61;
  EXPECT_EQ(i64_values(run_reference(Op::kFmod, {i64({2}, {big, -big}), i64({2}, {half, half})})[0]), (Ints{3, -3}));
  EXPECT_EQ(i64_values(run_reference(Op::kMod, {i64({2}, {big, -big}), i64({2}, {half, half})})[0]),
            (Ints{3, half - 3}));
  // INT64_MIN % -1 is 0 (the division would overflow).
  const int64_t min = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(i64_values(run_reference(Op::kMod, {i64({1}, {min}), i64({1}, {-1})})[0]), (Ints{0}));
  EXPECT_KILN_ERROR(run_reference(Op::kMod, {i64({2}, {5, 6}), i64({2}, {2, 0})}), "remainder by zero", "6 % 0");
  EXPECT_KILN_ERROR(run_reference(Op::kFmod, {make(DType::kI32, {1}, {5}), make(DType::kI32, {1}, {0})}),
                    "remainder by zero");
}

TEST(Round, HalvesToEven) {
  for (DType t : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16})
    expect_values(run_reference(Op::kRound, {make(t, {8}, {0.5, 1.5, 2.5, -0.5, -1.5, 2.25, 2.75, -3})})[0],
                  {0, 2, 2, -0.0, -2, 2, 3, -3});
  EXPECT_KILN_ERROR(run_reference(Op::kRound, {make(DType::kI64, {1}, {3})}), "round", "float");
}

TEST(ElementwiseGrad, InverseTrigonometry) {
  expect_op_gradients(Op::kAcos, {testing::rand(DType::kF64, {3, 5}, 1, -0.9, 0.9)});
  expect_op_gradients(Op::kAsin, {testing::rand(DType::kF64, {3, 5}, 2, -0.9, 0.9)});
  expect_op_gradients(Op::kAtan, {testing::rand(DType::kF64, {3, 5}, 3, -4, 4)});
}

TEST(ElementwiseGrad, RoundIsFlat) {
  // Away from the halves the function is constant: the differences are 0, as the rule says.
  expect_op_gradients(Op::kRound, {make(DType::kF64, {5}, {0.2, -1.3, 2.8, 7.1, -0.4})});
}

TEST(ElementwiseGrad, RemaindersAwayFromTheirJumps) {
  // a / b kept 0.1 or more from every integer, where y jumps; both signs of each operand, and a
  // broadcast divisor.
  const Tensor a = make(DType::kF64, {2, 4}, {5.3, -5.3, 5.3, -5.3, 0.7, -2.9, 8.45, -1.2});
  const Tensor b = make(DType::kF64, {2, 4}, {2.0, 2.0, -2.0, -2.0, 1.5, 1.3, -2.5, 0.7});
  for (Op op : {Op::kMod, Op::kFmod}) {
    expect_op_gradients(op, {a, b});
    expect_op_gradients(op, {a, make(DType::kF64, {4}, {2.0, 1.3, -2.5, 0.7})});
  }
}

}  // namespace
}  // namespace kiln
