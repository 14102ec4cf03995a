// Integer reference kernels are exact for every int64: random values far above 2^53 (where a
// double no longer holds every integer) through the arithmetic, comparison, selection, cast,
// reduction and data-movement ops. The oracle is plain int64 arithmetic written here (wrapping
// through uint64, division truncating toward zero), never a double.
#include <limits>
#include <random>

#include "test_util.h"

namespace kiln::testing {
namespace {

// Random int64 values spread over the whole range, most above 2^53 in magnitude; neighbours
// (v, v + 1) are both there, so a kernel that rounds through double merges them.
Tensor random_i64(Shape shape, uint64_t seed) {
  Tensor t(TensorType{DType::kI64, std::move(shape)});
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) {
    int64_t v = static_cast<int64_t>(rng());
    if (i % 3 == 1) v = t.get_int(i - 1) + 1;                       // a neighbour
    if (i % 7 == 3) v = static_cast<int64_t>(rng() % 2001) - 1000;  // small ones too
    t.set_int(i, v);
  }
  return t;
}

int64_t wrap_add(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b)); }
int64_t wrap_sub(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b)); }
int64_t wrap_mul(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b)); }

void expect_exact(const Tensor& got, const std::vector<int64_t>& want, const std::string& what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size())) << what;
  for (int64_t i = 0; i < got.numel(); ++i)
    ASSERT_EQ(got.get_int(i), want[i]) << what << " at element " << i;
}

TEST(IntegerExact, TensorAccessorsKeepEveryInt64) {
  const std::vector<int64_t> values{(int64_t{1} << 62) + 1, INT64_MIN, INT64_MAX, (int64_t{1} << 53) + 1, -7};
  Tensor t = Tensor::from_i64({DType::kI64, {5}}, values);
  EXPECT_EQ(t.to_i64(), values);
  Tensor copy(t.type());
  for (int64_t i = 0; i < 5; ++i) copy.copy_element(i, t, 4 - i);
  EXPECT_EQ(copy.get_int(0), -7);
  EXPECT_EQ(copy.get_int(4), (int64_t{1} << 62) + 1);
  // Narrow dtypes wrap; bool is != 0; float dtypes refuse get_int.
  Tensor narrow(TensorType{DType::kI32, {2}});
  narrow.set_int(0, (int64_t{1} << 32) + 5);
  narrow.set_int(1, -1);
  EXPECT_EQ(narrow.to_i64(), (std::vector<int64_t>{5, -1}));
  Tensor flag(TensorType{DType::kBool, {1}});
  flag.set_int(0, int64_t{1} << 40);
  EXPECT_EQ(flag.get_int(0), 1);
  EXPECT_KILN_ERROR(Tensor(TensorType{DType::kF32, {1}}).get_int(0), "read as integers");
}

TEST(IntegerExact, ArithmeticInInt64WrapsAndDividesTowardZero) {
  Tensor a = random_i64({6, 7}, 1), b = random_i64({7}, 2);  // b broadcasts along rows
  for (int64_t i = 0; i < b.numel(); ++i)
    if (b.get_int(i) == 0) b.set_int(i, 3);  // division by zero is its own test
  std::vector<int64_t> add, sub, mul, div, maximum, minimum;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const int64_t x = a.get_int(i), y = b.get_int(i % 7);
    add.push_back(wrap_add(x, y));
    sub.push_back(wrap_sub(x, y));
    mul.push_back(wrap_mul(x, y));
    div.push_back(y == -1 ? wrap_sub(0, x) : x / y);
    maximum.push_back(std::max(x, y));
    minimum.push_back(std::min(x, y));
  }
  expect_exact(run_reference(Op::kAdd, {a, b})[0], add, "add");
  expect_exact(run_reference(Op::kSub, {a, b})[0], sub, "sub");
  expect_exact(run_reference(Op::kMul, {a, b})[0], mul, "mul");
  expect_exact(run_reference(Op::kDiv, {a, b})[0], div, "div");
  expect_exact(run_reference(Op::kMaximum, {a, b})[0], maximum, "maximum");
  expect_exact(run_reference(Op::kMinimum, {a, b})[0], minimum, "minimum");

  std::vector<int64_t> neg, abs, square, relu;
  for (int64_t x : a.to_i64()) {
    neg.push_back(wrap_sub(0, x));
    abs.push_back(x < 0 ? wrap_sub(0, x) : x);
    square.push_back(wrap_mul(x, x));
    relu.push_back(x < 0 ? 0 : x);
  }
  expect_exact(run_reference(Op::kNeg, {a})[0], neg, "neg");
  expect_exact(run_reference(Op::kAbs, {a})[0], abs, "abs");
  expect_exact(run_reference(Op::kSquare, {a})[0], square, "square");
  expect_exact(run_reference(Op::kRelu, {a})[0], relu, "relu");
}

TEST(IntegerExact, ComparisonsTellNeighboursApart) {
  // 2^62 + 1 and 2^62 are one double: a comparison through double calls them equal.
  const int64_t big = int64_t{1} << 62;
  Tensor a = Tensor::from_i64({DType::kI64, {3}}, std::vector<int64_t>{big + 1, big, -big - 1});
  Tensor b = Tensor::from_i64({DType::kI64, {3}}, std::vector<int64_t>{big, big + 1, -big});
  expect_exact(run_reference(Op::kEq, {a, b})[0], {0, 0, 0}, "eq");
  expect_exact(run_reference(Op::kNe, {a, b})[0], {1, 1, 1}, "ne");
  expect_exact(run_reference(Op::kGt, {a, b})[0], {1, 0, 0}, "gt");
  expect_exact(run_reference(Op::kLe, {a, b})[0], {0, 1, 1}, "le");
  Tensor random_a = random_i64({40}, 3), random_b = random_i64({40}, 4);
  std::vector<int64_t> lt;
  for (int64_t i = 0; i < 40; ++i) lt.push_back(random_a.get_int(i) < random_b.get_int(i));
  expect_exact(run_reference(Op::kLt, {random_a, random_b})[0], lt, "lt");
}

TEST(IntegerExact, WhereCastAndReductionsKeepTheValues) {
  Tensor a = random_i64({5, 8}, 5), b = random_i64({5, 8}, 6);
  Tensor condition = random_tensor({DType::kBool, {5, 8}}, 7);
  std::vector<int64_t> chosen;
  for (int64_t i = 0; i < 40; ++i) chosen.push_back(condition.get_int(i) ? a.get_int(i) : b.get_int(i));
  expect_exact(run_reference(Op::kWhere, {condition, a, b})[0], chosen, "where");

  // i64 -> i32 wraps; i64 -> f64 rounds once (to nearest, as a C++ conversion does).
  std::vector<int64_t> narrowed;
  for (int64_t x : a.to_i64()) narrowed.push_back(static_cast<int32_t>(x));
  expect_exact(run_reference(Op::kCast, {a}, {{"dtype", DType::kI32}})[0], narrowed, "cast to i32");
  Tensor wide = run_reference(Op::kCast, {a}, {{"dtype", DType::kF64}})[0];
  for (int64_t i = 0; i < 40; ++i) EXPECT_EQ(wide.data<double>()[i], static_cast<double>(a.get_int(i)));
  Tensor back = run_reference(Op::kCast, {run_reference(Op::kCast, {a}, {{"dtype", DType::kI32}})[0]},
                              {{"dtype", DType::kI64}})[0];
  expect_exact(back, narrowed, "cast i32 back to i64");

  std::vector<int64_t> sums(5, 0), maxima(5, INT64_MIN), argmax(5, 0);
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t c = 0; c < 8; ++c) {
      const int64_t x = a.get_int(r * 8 + c);
      sums[r] = wrap_add(sums[r], x);
      if (x > maxima[r]) {
        maxima[r] = x;
        argmax[r] = c;
      }
    }
  expect_exact(run_reference(Op::kSum, {a}, {{"axes", std::vector<int64_t>{1}}})[0], sums, "sum");
  expect_exact(run_reference(Op::kMax, {a}, {{"axes", std::vector<int64_t>{1}}})[0], maxima, "max");
  expect_exact(run_reference(Op::kArgmax, {a}, {{"axis", int64_t{1}}})[0], argmax, "argmax");
}

TEST(IntegerExact, DataMovementCopiesEveryBit) {
  Tensor a = random_i64({3, 4}, 8);
  std::vector<int64_t> transposed, sliced, concatenated, gathered;
  for (int64_t c = 0; c < 4; ++c)
    for (int64_t r = 0; r < 3; ++r) transposed.push_back(a.get_int(r * 4 + c));
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t c = 1; c < 4; c += 2) sliced.push_back(a.get_int(r * 4 + c));
  for (int64_t i = 0; i < 12; ++i) concatenated.push_back(a.get_int(i));
  for (int64_t i = 0; i < 12; ++i) concatenated.push_back(a.get_int(i));
  Tensor index = Tensor::from_i64({DType::kI64, {3}}, std::vector<int64_t>{2, 0, 2});
  for (int64_t row : {2, 0, 2})
    for (int64_t c = 0; c < 4; ++c) gathered.push_back(a.get_int(row * 4 + c));
  expect_exact(run_reference(Op::kTranspose, {a})[0], transposed, "transpose");
  expect_exact(run_reference(Op::kSlice, {a},
                             {{"starts", std::vector<int64_t>{0, 1}},
                              {"ends", std::vector<int64_t>{3, 4}},
                              {"steps", std::vector<int64_t>{1, 2}}})[0],
               sliced, "slice");
  expect_exact(run_reference(Op::kConcat, {a, a})[0], concatenated, "concat");
  expect_exact(run_reference(Op::kGather, {a, index})[0], gathered, "gather");
  expect_exact(run_reference(Op::kReshape, {a}, {{"shape", std::vector<int64_t>{12}}})[0], a.to_i64(), "reshape");
  expect_exact(run_reference(Op::kBroadcastTo, {a}, {{"shape", std::vector<int64_t>{2, 3, 4}}})[0],
               concatenated, "broadcast_to");
}

TEST(IntegerExact, ConstantsHoldInt64Values) {
  const std::vector<int64_t> values{(int64_t{1} << 62) + 1, INT64_MIN, INT64_MAX};
  Tensor t = run_reference(Op::kConstant, {},
                           {{"dtype", DType::kI64}, {"shape", std::vector<int64_t>{3}}, {"values", values}})[0];
  expect_exact(t, values, "constant");
}

}  // namespace
}  // namespace kiln::testing
