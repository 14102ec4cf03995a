// Unary elementwise ops, gelu and cast: shape/dtype inference, error cases and the reference
// kernels on hand-checked values (binary ops, comparisons and where are in
// elementwise_binary_test.cc, dropout in dropout_test.cc).
#include <cmath>
#include <limits>
#include <numbers>

#include "ops/elementwise_test_util.h"

namespace kiln::testing {
namespace {

const Op kFloatOnlyUnary[] = {Op::kErf,     Op::kExp,  Op::kLog,  Op::kReciprocal, Op::kRsqrt,
                              Op::kSigmoid, Op::kSilu, Op::kSqrt, Op::kTanh, Op::kSin, Op::kCos};
const Op kIntegerUnary[] = {Op::kAbs, Op::kNeg, Op::kRelu, Op::kSquare};

// ---- unary inference ----

TEST(ElementwiseUnary, InferenceKeepsTypeForEveryFloatDtype) {
  for (DType dtype : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16}) {
    for (Op op : kFloatOnlyUnary) {
      EXPECT_EQ(infer1(op, {tt(dtype, {2, 3})}), tt(dtype, {2, 3})) << op_name(op);
      EXPECT_EQ(infer1(op, {tt(dtype, {})}), tt(dtype, {})) << op_name(op);
    }
    for (Op op : kIntegerUnary) EXPECT_EQ(infer1(op, {tt(dtype, {4})}), tt(dtype, {4}));
  }
}

TEST(ElementwiseUnary, IntegerOpsAcceptIntegerDtypes) {
  for (DType dtype : {DType::kI32, DType::kI64, DType::kU8}) {
    for (Op op : kIntegerUnary) {
      EXPECT_EQ(infer1(op, {tt(dtype, {5, 1})}), tt(dtype, {5, 1})) << op_name(op);
    }
  }
}

TEST(ElementwiseUnary, FloatOnlyOpsRejectIntegers) {
  EXPECT_TRUE(throws_with([] { infer(Op::kExp, {tt(DType::kI64, {3})}); },
                          {"exp: needs a float tensor, got i64[3]"}));
  for (Op op : kFloatOnlyUnary) {
    std::string expected = std::string(op_name(op)) + ": needs a float tensor, got i32[2,2]";
    EXPECT_TRUE(throws_with([&] { infer(op, {tt(DType::kI32, {2, 2})}); }, {expected}));
    EXPECT_TRUE(throws_with([&] { infer(op, {tt(DType::kBool, {2})}); }, {"got bool[2]"}));
  }
}

TEST(ElementwiseUnary, IntegerOpsRejectBool) {
  for (Op op : kIntegerUnary) {
    EXPECT_TRUE(throws_with([&] { infer(op, {tt(DType::kBool, {2})}); },
                            {op_name(op), "needs a float or integer tensor, got bool[2]"}));
  }
}

TEST(ElementwiseUnary, RejectsWrongInputCountAndAttributes) {
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kExp, {tt(DType::kF32, {2}), tt(DType::kF32, {2})});
      },
      {"exp", "got 2 inputs, expected 1"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kTanh, {tt(DType::kF32, {2})}, {{"alpha", 1.0}});
      },
      {"tanh", "unknown attribute 'alpha'"}));
}

// ---- unary reference kernels ----

TEST(ElementwiseUnary, ReferenceF64ClosedForms) {
  const double ln2 = std::numbers::ln2, ln3 = std::log(3.0), e = std::numbers::e;
  Tensor x = make(DType::kF64, {5}, {-2, -0.5, 0.25, 1, 3});
  EXPECT_TRUE(all_close(ref1(Op::kAbs, {x}), make(DType::kF64, {5}, {2, 0.5, 0.25, 1, 3}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kNeg, {x}), make(DType::kF64, {5}, {2, 0.5, -0.25, -1, -3}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kRelu, {x}), make(DType::kF64, {5}, {0, 0, 0.25, 1, 3}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kSquare, {x}), make(DType::kF64, {5}, {4, 0.25, 0.0625, 1, 9}), 0, 0));

  Tensor logs = make(DType::kF64, {4}, {0, ln2, -1, 2 * ln3});
  EXPECT_TRUE(
      all_close(ref1(Op::kExp, {logs}), make(DType::kF64, {4}, {1, 2, 1 / e, 9}), 0, 1e-15));
  Tensor positive = make(DType::kF64, {4}, {0.25, 1, e, 4});
  EXPECT_TRUE(all_close(ref1(Op::kLog, {positive}),
                        make(DType::kF64, {4}, {-2 * ln2, 0, 1, 2 * ln2}), 1e-15, 1e-15));
  Tensor squares = make(DType::kF64, {4}, {0.25, 4, 16, 9});
  EXPECT_TRUE(all_close(ref1(Op::kSqrt, {squares}), make(DType::kF64, {4}, {0.5, 2, 4, 3}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kRsqrt, {squares}),
                        make(DType::kF64, {4}, {2, 0.5, 0.25, 1.0 / 3}), 0, 1e-15));
  Tensor r = make(DType::kF64, {4}, {0.25, 2, -4, 0.0});
  EXPECT_TRUE(all_close(ref1(Op::kReciprocal, {r}),
                        make(DType::kF64, {4}, {4, 0.5, -0.25, INFINITY}), 0, 0));

  // sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4; tanh(ln 2) = (4 - 1) / (4 + 1).
  Tensor s = make(DType::kF64, {4}, {0, ln3, -ln3, ln2});
  EXPECT_TRUE(all_close(ref1(Op::kSigmoid, {s}), make(DType::kF64, {4}, {0.5, 0.75, 0.25, 2.0 / 3}),
                        0, 1e-15));
  EXPECT_TRUE(all_close(ref1(Op::kSilu, {s}),
                        make(DType::kF64, {4}, {0, 0.75 * ln3, -0.25 * ln3, 2.0 / 3 * ln2}), 0,
                        1e-15));
  EXPECT_TRUE(
      all_close(ref1(Op::kTanh, {s}), make(DType::kF64, {4}, {0, 0.8, -0.8, 0.6}), 0, 1e-15));

  // erf from the standard normal table: erf(x / sqrt 2) = 2 Phi(x) - 1, Phi(1) =
  // 0.841344746068543, Phi(2) = 0.977249868051821; erf is odd.
  const double inv_sqrt2 = 1 / std::numbers::sqrt2;
  Tensor z = make(DType::kF64, {5}, {0, inv_sqrt2, -inv_sqrt2, 2 * inv_sqrt2, 30});
  EXPECT_TRUE(all_close(ref1(Op::kErf, {z}),
                        make(DType::kF64, {5}, {0, 2 * 0.841344746068543 - 1,
                                                1 - 2 * 0.841344746068543,
                                                2 * 0.977249868051821 - 1, 1}),
                        0, 1e-14));
}

TEST(ElementwiseUnary, ReferenceSpecialValues) {
  Tensor x = make(DType::kF32, {4}, {NAN, -INFINITY, INFINITY, -0.0});
  Tensor relu = ref1(Op::kRelu, {x});
  EXPECT_TRUE(std::isnan(relu.get(0)));  // NaN propagates through relu
  EXPECT_EQ(relu.get(1), 0.0);
  EXPECT_EQ(relu.get(2), INFINITY);
  Tensor sig = ref1(Op::kSigmoid, {x});
  EXPECT_EQ(sig.get(1), 0.0);
  EXPECT_EQ(sig.get(2), 1.0);
  EXPECT_EQ(ref1(Op::kLog, {make(DType::kF32, {1}, {0})}).get(0), -INFINITY);
  EXPECT_TRUE(std::isnan(ref1(Op::kSqrt, {make(DType::kF32, {1}, {-1})}).get(0)));
  EXPECT_EQ(ref1(Op::kRsqrt, {make(DType::kF32, {1}, {0})}).get(0), INFINITY);
}

TEST(ElementwiseUnary, ReferenceF32RoundsOnStore) {
  // 1/3 in f32 is 11184811 * 2^-25.
  Tensor y = ref1(Op::kReciprocal, {make(DType::kF32, {1}, {3})});
  EXPECT_EQ(y.dtype(), DType::kF32);
  EXPECT_EQ(y.get(0), 11184811.0 / 33554432.0);
  Tensor t = ref1(Op::kTanh, {make(DType::kF32, {3}, {-1, 0.5, 2})});
  EXPECT_TRUE(all_close(
      t, make(DType::kF32, {3}, {-0.76159415595576, 0.46211715726001, 0.96402758007582}), 0, 1e-7));
}

TEST(ElementwiseUnary, ReferenceHalfAndBFloat16) {
  // e rounds to 2.71875 in both f16 (spacing 2^-9 in [2, 4)) and bf16 (spacing 2^-6);
  // sqrt(2) rounds to 1.4140625 in both (1448 * 2^-10 and 181 * 2^-7).
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    Tensor e = ref1(Op::kExp, {make(dtype, {2}, {1, 0})});
    EXPECT_EQ(e.dtype(), dtype);
    EXPECT_EQ(e.get(0), 2.71875);
    EXPECT_EQ(e.get(1), 1.0);
    EXPECT_EQ(ref1(Op::kSqrt, {make(dtype, {1}, {2})}).get(0), 1.4140625);
    EXPECT_TRUE(all_close(ref1(Op::kSquare, {make(dtype, {2}, {1.5, -3})}),
                          make(dtype, {2}, {2.25, 9}), 0, 0));
    EXPECT_TRUE(all_close(ref1(Op::kNeg, {make(dtype, {2}, {1.5, -3})}),
                          make(dtype, {2}, {-1.5, 3}), 0, 0));
  }
  // 1/3: f16 1365 * 2^-12, bf16 171 * 2^-9.
  EXPECT_EQ(ref1(Op::kReciprocal, {make(DType::kF16, {1}, {3})}).get(0), 1365.0 / 4096);
  EXPECT_EQ(ref1(Op::kReciprocal, {make(DType::kBF16, {1}, {3})}).get(0), 171.0 / 512);
}

TEST(ElementwiseUnary, ReferenceIntegers) {
  EXPECT_TRUE(all_close(ref1(Op::kAbs, {make(DType::kI32, {3}, {-3, 0, 7})}),
                        make(DType::kI32, {3}, {3, 0, 7}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kNeg, {make(DType::kI64, {2}, {5, -2})}),
                        make(DType::kI64, {2}, {-5, 2}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kRelu, {make(DType::kI32, {3}, {-4, 0, 9})}),
                        make(DType::kI32, {3}, {0, 0, 9}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kSquare, {make(DType::kI64, {2}, {-3, 3000000000})}),
                        make(DType::kI64, {2}, {9, 9e18}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kRelu, {make(DType::kU8, {2}, {0, 200})}),
                        make(DType::kU8, {2}, {0, 200}), 0, 0));
}

TEST(ElementwiseUnary, IntegerResultsWrap) {
  // u8: -5 = 256 - 5; i32: 65536^2 = 2^32 = 0 mod 2^32, -(-2^31) = 2^31 = -2^31 mod 2^32.
  EXPECT_EQ(ref1(Op::kNeg, {make(DType::kU8, {1}, {5})}).get(0), 251);
  EXPECT_EQ(ref1(Op::kSquare, {make(DType::kI32, {1}, {65536})}).get(0), 0);
  EXPECT_EQ(ref1(Op::kSquare, {make(DType::kU8, {1}, {20})}).get(0), 400 - 256);
  EXPECT_EQ(ref1(Op::kNeg, {make(DType::kI32, {1}, {-2147483648.0})}).get(0), -2147483648.0);
  EXPECT_EQ(ref1(Op::kAbs, {make(DType::kI32, {1}, {-2147483648.0})}).get(0), -2147483648.0);
}

// ---- gelu ----

TEST(ElementwiseGelu, InferenceAndAttributes) {
  EXPECT_EQ(infer1(Op::kGelu, {tt(DType::kBF16, {2, 8})}), tt(DType::kBF16, {2, 8}));
  EXPECT_EQ(infer1(Op::kGelu, {tt(DType::kF32, {3})}, {{"approximate", std::string("tanh")}}),
            tt(DType::kF32, {3}));
  Attributes filled = normalize_attributes(Op::kGelu, {});
  EXPECT_EQ(filled.s("approximate"), "none");
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kGelu, {tt(DType::kF32, {3})}, {{"approximate", std::string("erf")}});
      },
      {"gelu", "approximate", "\"erf\"", "\"none\"", "\"tanh\""}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kGelu, {tt(DType::kF32, {3})}, {{"approximate", int64_t{1}}});
      },
      {"gelu", "approximate", "expected string"}));
  EXPECT_TRUE(throws_with([] { infer(Op::kGelu, {tt(DType::kI32, {2})}); },
                          {"gelu: needs a float tensor, got i32[2]"}));
}

TEST(ElementwiseGelu, ReferenceExactForm) {
  // gelu(x) = x * Phi(x); Phi(1) = 0.841344746068543, Phi(2) = 0.977249868051821 (tables).
  Tensor y = ref1(Op::kGelu, {make(DType::kF64, {5}, {0, 1, -1, 2, -2})});
  EXPECT_TRUE(all_close(y,
                        make(DType::kF64, {5},
                             {0, 0.841344746068543, -1 * (1 - 0.841344746068543),
                              2 * 0.977249868051821, -2 * (1 - 0.977249868051821)}),
                        1e-14, 1e-13));
}

TEST(ElementwiseGelu, ReferenceTanhForm) {
  const double c = std::sqrt(2 / std::numbers::pi);
  auto tanh_gelu = [c](double x) {
    return 0.5 * x * (1 + std::tanh(c * (x + 0.044715 * x * x * x)));
  };
  Tensor x = make(DType::kF64, {4}, {0, 1, -1, 3});
  Tensor y = ref1(Op::kGelu, {x}, {{"approximate", std::string("tanh")}});
  EXPECT_TRUE(all_close(y, make(DType::kF64, {4}, {0, tanh_gelu(1), tanh_gelu(-1), tanh_gelu(3)}),
                        0, 1e-15));
  // The two forms agree to about 2e-4 at x = 1 but are not the same function.
  EXPECT_NEAR(y.get(1), 0.841344746068543, 3e-4);
  EXPECT_NE(y.get(1), ref1(Op::kGelu, {x}).get(1));
}

TEST(ElementwiseGelu, ReferenceBFloat16) {
  // gelu(2) = 1.9545 rounds to 1.953125 (250 * 2^-7) in bf16.
  Tensor y = ref1(Op::kGelu, {make(DType::kBF16, {2}, {2, 0})});
  EXPECT_EQ(y.dtype(), DType::kBF16);
  EXPECT_EQ(y.get(0), 1.953125);
  EXPECT_EQ(y.get(1), 0.0);
}

// ---- cast ----

TEST(ElementwiseCast, Inference) {
  EXPECT_EQ(infer1(Op::kCast, {tt(DType::kF32, {2, 3})}, {{"dtype", DType::kI32}}),
            tt(DType::kI32, {2, 3}));
  EXPECT_EQ(infer1(Op::kCast, {tt(DType::kBool, {})}, {{"dtype", DType::kBF16}}),
            tt(DType::kBF16, {}));
  for (int from = 0; from < kNumDTypes; ++from) {
    for (int to = 0; to < kNumDTypes; ++to) {
      EXPECT_EQ(infer1(Op::kCast, {tt(DType(from), {4})}, {{"dtype", DType(to)}}),
                tt(DType(to), {4}));
    }
  }
  EXPECT_TRUE(throws_with([] { infer(Op::kCast, {tt(DType::kF32, {2})}); },
                          {"cast", "missing required attribute 'dtype'"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kCast, {tt(DType::kF32, {2})}, {{"dtype", std::string("f16")}});
      },
      {"cast", "'dtype'", "expected dtype"}));
}

TEST(ElementwiseCast, FloatToIntTruncatesTowardZero) {
  Tensor x = make(DType::kF32, {6}, {2.7, -2.7, 0.5, -0.5, 7, -7.999});
  EXPECT_TRUE(all_close(ref1(Op::kCast, {x}, {{"dtype", DType::kI32}}),
                        make(DType::kI32, {6}, {2, -2, 0, 0, 7, -7}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kCast, {x.reshaped({2, 3})}, {{"dtype", DType::kI64}}),
                        make(DType::kI64, {2, 3}, {2, -2, 0, 0, 7, -7}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kCast, {make(DType::kBF16, {2}, {100.5, 3.75})}, {{"dtype", DType::kU8}}),
                make(DType::kU8, {2}, {100, 3}), 0, 0));
}

TEST(ElementwiseCast, FloatToIntSaturatesAndMapsNanToZero) {
  Tensor y = ref1(Op::kCast, {make(DType::kF64, {4}, {1e10, -1e10, NAN, INFINITY})},
                  {{"dtype", DType::kI32}});
  EXPECT_EQ(y.data<int32_t>()[0], std::numeric_limits<int32_t>::max());
  EXPECT_EQ(y.data<int32_t>()[1], std::numeric_limits<int32_t>::min());
  EXPECT_EQ(y.data<int32_t>()[2], 0);
  EXPECT_EQ(y.data<int32_t>()[3], std::numeric_limits<int32_t>::max());
  Tensor big = ref1(Op::kCast, {make(DType::kF64, {2}, {1e19, -1e19})}, {{"dtype", DType::kI64}});
  EXPECT_EQ(big.data<int64_t>()[0], std::numeric_limits<int64_t>::max());
  EXPECT_EQ(big.data<int64_t>()[1], std::numeric_limits<int64_t>::min());
  Tensor bytes = ref1(Op::kCast, {make(DType::kF32, {2}, {-1.5, 300.7})}, {{"dtype", DType::kU8}});
  EXPECT_EQ(bytes.data<uint8_t>()[0], 0);
  EXPECT_EQ(bytes.data<uint8_t>()[1], 255);
}

TEST(ElementwiseCast, IntToIntWraps) {
  EXPECT_TRUE(
      all_close(ref1(Op::kCast, {make(DType::kI32, {3}, {300, -1, 7})}, {{"dtype", DType::kU8}}),
                make(DType::kU8, {3}, {44, 255, 7}), 0, 0));
  // 2^32 + 5 -> 5; 2^31 -> -2^31.
  EXPECT_TRUE(all_close(ref1(Op::kCast, {make(DType::kI64, {2}, {4294967301.0, 2147483648.0})},
                             {{"dtype", DType::kI32}}),
                        make(DType::kI32, {2}, {5, -2147483648.0}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kCast, {make(DType::kU8, {1}, {255})}, {{"dtype", DType::kI64}}),
                        make(DType::kI64, {1}, {255}), 0, 0));
}

TEST(ElementwiseCast, ToAndFromBool) {
  Tensor y =
      ref1(Op::kCast, {make(DType::kF32, {5}, {0, -0.0, 0.5, NAN, -3})}, {{"dtype", DType::kBool}});
  EXPECT_EQ(y.dtype(), DType::kBool);
  const bool* b = y.data<bool>();
  EXPECT_FALSE(b[0]);
  EXPECT_FALSE(b[1]);
  EXPECT_TRUE(b[2]);
  EXPECT_TRUE(b[3]);  // NaN != 0
  EXPECT_TRUE(b[4]);
  EXPECT_TRUE(
      all_close(ref1(Op::kCast, {make(DType::kI32, {2}, {0, 3})}, {{"dtype", DType::kBool}}),
                make(DType::kBool, {2}, {0, 1}), 0, 0));
  Tensor flags = make(DType::kBool, {3}, {1, 0, 1});
  EXPECT_TRUE(all_close(ref1(Op::kCast, {flags}, {{"dtype", DType::kF16}}),
                        make(DType::kF16, {3}, {1, 0, 1}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kCast, {flags}, {{"dtype", DType::kI64}}),
                        make(DType::kI64, {3}, {1, 0, 1}), 0, 0));
}

TEST(ElementwiseCast, BetweenFloatsRoundsToNearest) {
  // 1/3: f16 1365 * 2^-12, bf16 171 * 2^-9; f16 -> f32 is exact.
  Tensor third = make(DType::kF64, {1}, {1.0 / 3});
  EXPECT_EQ(ref1(Op::kCast, {third}, {{"dtype", DType::kF16}}).get(0), 1365.0 / 4096);
  EXPECT_EQ(ref1(Op::kCast, {third}, {{"dtype", DType::kBF16}}).get(0), 171.0 / 512);
  Tensor half = ref1(Op::kCast, {third}, {{"dtype", DType::kF16}});
  EXPECT_EQ(ref1(Op::kCast, {half}, {{"dtype", DType::kF32}}).get(0), 1365.0 / 4096);
  // 70000 overflows f16 (max 65504) to infinity.
  EXPECT_EQ(ref1(Op::kCast, {make(DType::kF32, {1}, {70000})}, {{"dtype", DType::kF16}}).get(0),
            INFINITY);
  EXPECT_TRUE(
      all_close(ref1(Op::kCast, {make(DType::kI32, {2}, {-7, 16777217})}, {{"dtype", DType::kF32}}),
                make(DType::kF32, {2}, {-7, 16777216}), 0, 0));
}

}  // namespace
}  // namespace kiln::testing
