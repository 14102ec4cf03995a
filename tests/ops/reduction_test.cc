// Reductions sum, mean, max and argmax: shape inference (axes, keepdims), error cases and the
// reference kernels on hand-checked values.
#include <cmath>
#include <limits>

#include "ops/elementwise_test_util.h"

namespace kiln::testing {
namespace {

using Axes = std::vector<int64_t>;
const Op kReductions[] = {Op::kSum, Op::kMean, Op::kMax};

Attributes axes(Axes a, bool keepdims = false) {
  return {{"axes", std::move(a)}, {"keepdims", keepdims}};
}

// ---- sum / mean / max inference ----

TEST(ReductionReduce, InferenceAxesAndKeepdims) {
  for (Op op : kReductions) {
    TensorType x = tt(DType::kF32, {2, 3, 4});
    EXPECT_EQ(infer1(op, {x}), tt(DType::kF32, {})) << op_name(op);
    EXPECT_EQ(infer1(op, {x}, axes({}, true)), tt(DType::kF32, {1, 1, 1}));
    EXPECT_EQ(infer1(op, {x}, axes({1})), tt(DType::kF32, {2, 4}));
    EXPECT_EQ(infer1(op, {x}, axes({1}, true)), tt(DType::kF32, {2, 1, 4}));
    EXPECT_EQ(infer1(op, {x}, axes({-1, 0})), tt(DType::kF32, {3}));
    EXPECT_EQ(infer1(op, {x}, axes({0, -1}, true)), tt(DType::kF32, {1, 3, 1}));
    EXPECT_EQ(infer1(op, {x}, axes({0, 1, 2})), tt(DType::kF32, {}));
    EXPECT_EQ(infer1(op, {tt(DType::kF16, {})}),
              tt(DType::kF16, {}));  // a scalar reduces to itself
    EXPECT_EQ(infer1(op, {tt(DType::kBF16, {5})}, axes({0}, true)), tt(DType::kBF16, {1}));
  }
}

TEST(ReductionReduce, InferenceDtypes) {
  for (DType dtype : {DType::kI32, DType::kI64, DType::kU8, DType::kF64}) {
    EXPECT_EQ(infer1(Op::kSum, {tt(dtype, {3, 2})}, axes({0})), tt(dtype, {2}));
    EXPECT_EQ(infer1(Op::kMax, {tt(dtype, {3, 2})}, axes({1})), tt(dtype, {3}));
  }
  EXPECT_TRUE(throws_with([] { infer(Op::kMean, {tt(DType::kI32, {2})}); },
                          {"mean: needs a float tensor, got i32[2]"}));
  for (Op op : kReductions) {
    EXPECT_TRUE(
        throws_with([&] { infer(op, {tt(DType::kBool, {2})}); }, {op_name(op), "got bool[2]"}));
  }
}

TEST(ReductionReduce, RejectsBadAxes) {
  for (Op op : kReductions) {
    TensorType x = tt(DType::kF32, {2, 3, 4});
    EXPECT_TRUE(
        throws_with([&] { infer(op, {x}, axes({3})); },
                    {std::string(op_name(op)) + ": ", "axis 3 is out of range for rank 3"}));
    EXPECT_TRUE(
        throws_with([&] { infer(op, {x}, axes({-4})); }, {"axis -4 is out of range for rank 3"}));
    EXPECT_TRUE(throws_with(
        [&] {
          infer(op, {x}, axes({1, -2}));
        },
        {op_name(op), "1, -2", "axis 1 twice", "f32[2,3,4]"}));
    EXPECT_TRUE(throws_with([&] { infer(op, {x}, axes({0, 0})); }, {"axis 0 twice"}));
    EXPECT_TRUE(throws_with([&] { infer(op, {tt(DType::kF32, {})}, axes({0})); },
                            {op_name(op), "axis 0", "f32[]", "no axes"}));
  }
}

TEST(ReductionReduce, RejectsBadAttributes) {
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kSum, {tt(DType::kF32, {2})}, {{"axes", int64_t{0}}});
      },
      {"sum", "'axes'", "expected ints"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kMax, {tt(DType::kF32, {2})}, {{"keepdims", int64_t{1}}});
      },
      {"max", "'keepdims'", "expected bool"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kSum, {tt(DType::kF32, {2})}, {{"axis", int64_t{0}}});
      },
      {"sum", "unknown attribute 'axis'", "axes, keepdims"}));
}

TEST(ReductionReduce, NormalizeAttributesFillsDefaults) {
  Attributes filled = normalize_attributes(Op::kMean, {});
  EXPECT_EQ(filled.ints("axes"), Axes{});
  EXPECT_FALSE(filled.b("keepdims"));
  Attributes given = normalize_attributes(Op::kSum, {{"axes", Axes{-1}}});
  EXPECT_EQ(given.ints("axes"), Axes{-1});
  EXPECT_FALSE(given.b("keepdims"));
  // An empty float list (as the text parser may produce for "[]") is accepted as empty ints.
  EXPECT_EQ(normalize_attributes(Op::kMax, {{"axes", std::vector<double>{}}}).ints("axes"), Axes{});
}

TEST(ReductionReduce, EmptyAxes) {
  // sum over a size-0 axis is 0; mean and max have no value there.
  EXPECT_EQ(infer1(Op::kSum, {tt(DType::kF32, {2, 0})}, axes({1})), tt(DType::kF32, {2}));
  EXPECT_EQ(infer1(Op::kSum, {tt(DType::kI32, {0})}), tt(DType::kI32, {}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kMax, {tt(DType::kF32, {2, 0})}, axes({1}));
      },
      {"max: cannot take max over an empty axis", "axis 1", "f32[2,0]"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kMean, {tt(DType::kF32, {0, 3})});
      },
      {"mean: cannot take mean over an empty axis", "axis 0", "f32[0,3]"}));
  // Reducing a non-empty axis of a tensor that is empty elsewhere is fine: the output is empty.
  EXPECT_EQ(infer1(Op::kMax, {tt(DType::kF32, {0, 3})}, axes({1})), tt(DType::kF32, {0}));
  EXPECT_EQ(infer1(Op::kMean, {tt(DType::kF32, {0, 3})}, axes({1}, true)), tt(DType::kF32, {0, 1}));
}

// ---- sum / mean / max reference ----

TEST(ReductionReduce, ReferenceMatrix) {
  Tensor x = make(DType::kF64, {2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_TRUE(all_close(ref1(Op::kSum, {x}), make(DType::kF64, {}, {21}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kSum, {x}, axes({0})), make(DType::kF64, {3}, {5, 7, 9}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kSum, {x}, axes({1})), make(DType::kF64, {2}, {6, 15}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kSum, {x}, axes({-1}, true)), make(DType::kF64, {2, 1}, {6, 15}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kSum, {x}, axes({}, true)), make(DType::kF64, {1, 1}, {21}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kMean, {x}), make(DType::kF64, {}, {3.5}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kMean, {x}, axes({0})), make(DType::kF64, {3}, {2.5, 3.5, 4.5}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kMean, {x}, axes({1}, true)), make(DType::kF64, {2, 1}, {2, 5}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kMax, {x}), make(DType::kF64, {}, {6}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kMax, {x}, axes({0})), make(DType::kF64, {3}, {4, 5, 6}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kMax, {make(DType::kF32, {2, 2}, {-1, -7, -3, -2})}, axes({1})),
                        make(DType::kF32, {2}, {-1, -2}), 0, 0));
}

TEST(ReductionReduce, ReferenceThreeDimsTwoAxes) {
  // x[i][j][k] = 6i + 2j + k, shape (2, 3, 2). Over axes (0, 2), for each j:
  // sum = (2j) + (2j + 1) + (6 + 2j) + (7 + 2j) = 8j + 14; max = 7 + 2j; mean = sum / 4.
  std::vector<double> values(12);
  for (int i = 0; i < 12; ++i) values[i] = i;
  Tensor x = make(DType::kF32, {2, 3, 2}, values);
  EXPECT_TRUE(
      all_close(ref1(Op::kSum, {x}, axes({0, 2})), make(DType::kF32, {3}, {14, 22, 30}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kSum, {x}, axes({2, 0}, true)),
                        make(DType::kF32, {1, 3, 1}, {14, 22, 30}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kMax, {x}, axes({0, -1})), make(DType::kF32, {3}, {7, 9, 11}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kMean, {x}, axes({0, 2})), make(DType::kF32, {3}, {3.5, 5.5, 7.5}), 0, 0));
  // Over axis 1 only: x[i][.][k] sums to 3 * (6i + k) + 6.
  EXPECT_TRUE(
      all_close(ref1(Op::kSum, {x}, axes({1})), make(DType::kF32, {2, 2}, {6, 9, 24, 27}), 0, 0));
}

TEST(ReductionReduce, ReferenceScalarAndEmpty) {
  Tensor s = make(DType::kF32, {}, {2.5});
  for (Op op : kReductions) EXPECT_TRUE(all_close(ref1(op, {s}), s, 0, 0)) << op_name(op);
  EXPECT_TRUE(all_close(ref1(Op::kSum, {Tensor(tt(DType::kF32, {2, 0}))}, axes({1})),
                        make(DType::kF32, {2}, {0, 0}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kSum, {Tensor(tt(DType::kI64, {0}))}), make(DType::kI64, {}, {0}), 0, 0));
  EXPECT_EQ(ref1(Op::kMax, {Tensor(tt(DType::kF32, {0, 3}))}, axes({1})).numel(), 0);
}

TEST(ReductionReduce, ReferenceIntegers) {
  Tensor x = make(DType::kI32, {2, 2}, {1, -2, 3, 4});
  EXPECT_TRUE(all_close(ref1(Op::kSum, {x}, axes({0})), make(DType::kI32, {2}, {4, 2}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kMax, {x}, axes({1})), make(DType::kI32, {2}, {1, 4}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kMax, {make(DType::kI64, {3}, {-5, -3, -9})}),
                        make(DType::kI64, {}, {-3}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kSum, {make(DType::kU8, {3}, {200, 50, 5})}),
                        make(DType::kU8, {}, {255}), 0, 0));
  // Sums wrap like the integer type: 2^31 - 1 + 1 -> -2^31; 200 + 100 -> 44 in u8.
  EXPECT_EQ(ref1(Op::kSum, {make(DType::kI32, {2}, {2147483647, 1})}).get(0), -2147483648.0);
  EXPECT_EQ(ref1(Op::kSum, {make(DType::kU8, {2}, {200, 100})}).get(0), 44);
}

TEST(ReductionReduce, ReferenceAccumulatesInDouble) {
  // 4096 ones in f16: an f16 accumulator would stop at 2048 (2048 + 1 rounds to 2048).
  std::vector<double> ones(4096, 1.0);
  EXPECT_EQ(ref1(Op::kSum, {make(DType::kF16, {4096}, ones)}).get(0), 4096);
  EXPECT_EQ(ref1(Op::kSum, {make(DType::kBF16, {64, 64}, ones)}).get(0), 4096);
  // mean(1, 2, 2) = 5/3 rounds once, on store: f16 1 + 683/1024, bf16 1 + 85/128.
  EXPECT_EQ(ref1(Op::kMean, {make(DType::kF16, {3}, {1, 2, 2})}).get(0), 1 + 683.0 / 1024);
  EXPECT_EQ(ref1(Op::kMean, {make(DType::kBF16, {3}, {1, 2, 2})}).get(0), 1 + 85.0 / 128);
  Tensor m = ref1(Op::kMax, {make(DType::kBF16, {2, 2}, {0.5, -1, 3, 2})}, axes({0}));
  EXPECT_EQ(m.dtype(), DType::kBF16);
  EXPECT_TRUE(all_close(m, make(DType::kBF16, {2}, {3, 2}), 0, 0));
}

TEST(ReductionReduce, ReferenceNanAndInfinity) {
  Tensor x = make(DType::kF32, {2, 3}, {1, NAN, 3, -INFINITY, -INFINITY, -INFINITY});
  Tensor m = ref1(Op::kMax, {x}, axes({1}));
  EXPECT_TRUE(std::isnan(m.get(0)));  // NaN propagates, as in numpy
  EXPECT_EQ(m.get(1), -INFINITY);
  EXPECT_TRUE(std::isnan(ref1(Op::kMax, {make(DType::kF64, {2}, {NAN, 5})}).get(0)));
  EXPECT_TRUE(std::isnan(ref1(Op::kSum, {x}, axes({1})).get(0)));
  EXPECT_EQ(ref1(Op::kMean, {x}, axes({1})).get(1), -INFINITY);
}

// ---- argmax ----

TEST(ReductionArgmax, Inference) {
  TensorType x = tt(DType::kF32, {2, 3});
  EXPECT_EQ(infer1(Op::kArgmax, {x}), tt(DType::kI64, {2}));
  EXPECT_EQ(infer1(Op::kArgmax, {x}, {{"axis", int64_t{0}}}), tt(DType::kI64, {3}));
  EXPECT_EQ(infer1(Op::kArgmax, {x}, {{"axis", int64_t{-2}}, {"keepdims", true}}),
            tt(DType::kI64, {1, 3}));
  EXPECT_EQ(infer1(Op::kArgmax, {x}, {{"keepdims", true}}), tt(DType::kI64, {2, 1}));
  EXPECT_EQ(infer1(Op::kArgmax, {tt(DType::kBF16, {7})}), tt(DType::kI64, {}));
  for (DType dtype : {DType::kI32, DType::kU8, DType::kBool, DType::kF16}) {
    EXPECT_EQ(infer1(Op::kArgmax, {tt(dtype, {4, 5, 6})}, {{"axis", int64_t{1}}}),
              tt(DType::kI64, {4, 6}));
  }
  Attributes filled = normalize_attributes(Op::kArgmax, {});
  EXPECT_EQ(filled.i("axis"), -1);
  EXPECT_FALSE(filled.b("keepdims"));
}

TEST(ReductionArgmax, Errors) {
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kArgmax, {tt(DType::kF32, {2, 3})}, {{"axis", int64_t{2}}});
      },
      {"argmax: ", "axis 2 is out of range for rank 2"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kArgmax, {tt(DType::kF32, {2, 3})}, {{"axis", int64_t{-3}}});
      },
      {"argmax", "axis -3"}));
  EXPECT_TRUE(throws_with([] { infer(Op::kArgmax, {tt(DType::kF32, {})}); },
                          {"argmax: needs a tensor of rank >= 1, got f32[]"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kArgmax, {tt(DType::kF32, {4, 0})});
      },
      {"argmax: cannot take argmax over an empty axis", "axis 1", "f32[4,0]"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kArgmax, {tt(DType::kF32, {2})}, {{"axes", Axes{0}}});
      },
      {"argmax", "unknown attribute 'axes'", "axis, keepdims"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kArgmax, {tt(DType::kF32, {2})}, {{"axis", Axes{0}}});
      },
      {"argmax", "'axis'", "expected int"}));
  // An empty axis elsewhere is fine: argmax over axis 1 of (0, 3) has no outputs.
  EXPECT_EQ(infer1(Op::kArgmax, {tt(DType::kF32, {0, 3})}), tt(DType::kI64, {0}));
}

TEST(ReductionArgmax, ReferenceFirstMaximumWins) {
  Tensor x = make(DType::kF32, {2, 3}, {1, 5, 5, 7, 2, 7});
  EXPECT_TRUE(all_close(ref1(Op::kArgmax, {x}), make(DType::kI64, {2}, {1, 0}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kArgmax, {x}, {{"axis", int64_t{0}}}),
                        make(DType::kI64, {3}, {1, 0, 1}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kArgmax, {x}, {{"keepdims", true}}),
                        make(DType::kI64, {2, 1}, {1, 0}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kArgmax, {make(DType::kF64, {4}, {-3, -1, -1, -2})}),
                        make(DType::kI64, {}, {1}), 0, 0));
  EXPECT_EQ(ref1(Op::kArgmax, {make(DType::kF32, {3}, {-INFINITY, -INFINITY, -INFINITY})}).get(0),
            0);
}

TEST(ReductionArgmax, ReferenceNanCountsAsMaximum) {
  EXPECT_EQ(ref1(Op::kArgmax, {make(DType::kF32, {4}, {1, NAN, 3, NAN})}).get(0), 1);
  EXPECT_EQ(ref1(Op::kArgmax, {make(DType::kF32, {2}, {NAN, 5})}).get(0), 0);
  EXPECT_EQ(ref1(Op::kArgmax, {make(DType::kF64, {3}, {INFINITY, 2, NAN})}).get(0), 2);
}

TEST(ReductionArgmax, ReferenceMiddleAxisAndOtherDtypes) {
  // x[i][j][k] = values below, shape (2, 3, 2), argmax over j.
  Tensor x = make(DType::kI32, {2, 3, 2},
                  {0, 9, 4, 9, 4, 1,  //
                   -5, -6, -7, -2, -5, -8});
  EXPECT_TRUE(all_close(ref1(Op::kArgmax, {x}, {{"axis", int64_t{1}}}),
                        make(DType::kI64, {2, 2}, {1, 0, 0, 1}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kArgmax, {x}, {{"axis", int64_t{-2}}, {"keepdims", true}}),
                        make(DType::kI64, {2, 1, 2}, {1, 0, 0, 1}), 0, 0));
  EXPECT_EQ(ref1(Op::kArgmax, {make(DType::kBool, {3}, {0, 1, 1})}).get(0), 1);
  EXPECT_EQ(ref1(Op::kArgmax, {make(DType::kU8, {3}, {7, 255, 254})}).get(0), 1);
  // In bf16, 1 + 2^-9 is stored as 1, so it ties with the earlier 1.
  EXPECT_EQ(ref1(Op::kArgmax, {make(DType::kBF16, {2}, {1, 1 + 1.0 / 512})}).get(0), 0);
  EXPECT_EQ(ref1(Op::kArgmax, {make(DType::kF32, {2}, {1, 1 + 1.0 / 512})}).get(0), 1);
}

}  // namespace
}  // namespace kiln::testing
