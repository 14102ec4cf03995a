// Binary arithmetic ops, comparisons and where: broadcasting inference, dtype errors and the
// reference kernels on hand-checked values.
#include <cmath>
#include <limits>

#include "ops/elementwise_test_util.h"

namespace kiln::testing {
namespace {

const Op kArithmetic[] = {Op::kAdd, Op::kSub, Op::kMul, Op::kDiv, Op::kMaximum, Op::kMinimum};
const Op kComparisons[] = {Op::kEq, Op::kNe, Op::kLt, Op::kLe, Op::kGt, Op::kGe};

// ---- inference ----

TEST(ElementwiseBinary, InferenceBroadcasts) {
  for (Op op : kArithmetic) {
    EXPECT_EQ(infer1(op, {tt(DType::kF32, {2, 3}), tt(DType::kF32, {3})}), tt(DType::kF32, {2, 3}));
    EXPECT_EQ(infer1(op, {tt(DType::kF32, {4, 1}), tt(DType::kF32, {1, 5})}),
              tt(DType::kF32, {4, 5}));
    EXPECT_EQ(infer1(op, {tt(DType::kBF16, {}), tt(DType::kBF16, {2})}), tt(DType::kBF16, {2}));
    EXPECT_EQ(infer1(op, {tt(DType::kI64, {2, 1, 3}), tt(DType::kI64, {4, 1})}),
              tt(DType::kI64, {2, 4, 3}));
    EXPECT_EQ(infer1(op, {tt(DType::kU8, {0, 3}), tt(DType::kU8, {1, 3})}), tt(DType::kU8, {0, 3}));
  }
  EXPECT_EQ(infer1(Op::kPow, {tt(DType::kF16, {3, 1}), tt(DType::kF16, {2})}),
            tt(DType::kF16, {3, 2}));
}

TEST(ElementwiseBinary, RejectsShapesThatDoNotBroadcast) {
  for (Op op : kArithmetic) {
    EXPECT_TRUE(throws_with(
        [&] {
          infer(op, {tt(DType::kF32, {2, 3}), tt(DType::kF32, {4})});
        },
        {std::string(op_name(op)) + ": ", "(2, 3)", "(4,)", "do not broadcast"}));
  }
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kPow, {tt(DType::kF32, {2, 5}), tt(DType::kF32, {3, 5})});
      },
      {"pow", "(2, 5)", "(3, 5)"}));
}

TEST(ElementwiseBinary, RejectsMixedDtypesSuggestingACast) {
  for (Op op : kArithmetic) {
    EXPECT_TRUE(throws_with(
        [&] {
          infer(op, {tt(DType::kF32, {2}), tt(DType::kF16, {2})});
        },
        {std::string(op_name(op)) + ": ", "f32[2]", "f16[2]", "cast"}));
  }
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kAdd, {tt(DType::kI32, {3}), tt(DType::kI64, {})});
      },
      {"add", "i32[3]", "i64[]", "cast"}));
}

TEST(ElementwiseBinary, RejectsBadDtypes) {
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kPow, {tt(DType::kI32, {2}), tt(DType::kI32, {2})});
      },
      {"pow: needs a float tensor, got i32[2]"}));
  for (Op op : kArithmetic) {
    EXPECT_TRUE(throws_with(
        [&] {
          infer(op, {tt(DType::kBool, {2}), tt(DType::kBool, {2})});
        },
        {op_name(op), "got bool[2]"}));
  }
  EXPECT_TRUE(throws_with([] { infer(Op::kAdd, {tt(DType::kF32, {2})}); },
                          {"add", "got 1 inputs, expected 2"}));
}

// ---- reference kernels ----

TEST(ElementwiseBinary, ReferenceBroadcastArithmetic) {
  Tensor a = make(DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor row = make(DType::kF32, {3}, {10, 20, 30});
  EXPECT_TRUE(all_close(ref1(Op::kAdd, {a, row}),
                        make(DType::kF32, {2, 3}, {11, 22, 33, 14, 25, 36}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kMul, {row, a}),
                        make(DType::kF32, {2, 3}, {10, 40, 90, 40, 100, 180}), 0, 0));
  // (2, 1) - (1, 3): an outer difference.
  Tensor column = make(DType::kF64, {2, 1}, {1, 2});
  Tensor across = make(DType::kF64, {1, 3}, {0.5, 1, 4});
  EXPECT_TRUE(all_close(ref1(Op::kSub, {column, across}),
                        make(DType::kF64, {2, 3}, {0.5, 0, -3, 1.5, 1, -2}), 0, 0));
  Tensor scalar = make(DType::kF64, {}, {4});
  EXPECT_TRUE(all_close(ref1(Op::kDiv, {across, scalar}),
                        make(DType::kF64, {1, 3}, {0.125, 0.25, 1}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kDiv, {scalar, make(DType::kF64, {3}, {0, -0.0, 8})}),
                        make(DType::kF64, {3}, {INFINITY, -INFINITY, 0.5}), 0, 0));
}

TEST(ElementwiseBinary, ReferencePow) {
  Tensor base = make(DType::kF64, {4}, {2, 9, 4, 0.5});
  Tensor exponent = make(DType::kF64, {4}, {3, 0.5, -1, 2});
  EXPECT_TRUE(all_close(ref1(Op::kPow, {base, exponent}),
                        make(DType::kF64, {4}, {8, 3, 0.25, 0.25}), 0, 0));
  EXPECT_TRUE(std::isnan(
      ref1(Op::kPow, {make(DType::kF32, {1}, {-8}), make(DType::kF32, {1}, {1.0 / 3})}).get(0)));
  EXPECT_TRUE(
      all_close(ref1(Op::kPow, {make(DType::kBF16, {2}, {3, 2}), make(DType::kBF16, {}, {2})}),
                make(DType::kBF16, {2}, {9, 4}), 0, 0));
}

TEST(ElementwiseBinary, ReferenceMaximumMinimumPropagateNan) {
  Tensor a = make(DType::kF32, {4}, {1, NAN, -3, 2});
  Tensor b = make(DType::kF32, {4}, {2, 0, -4, NAN});
  Tensor hi = ref1(Op::kMaximum, {a, b}), lo = ref1(Op::kMinimum, {a, b});
  EXPECT_TRUE(all_close(hi, make(DType::kF32, {4}, {2, NAN, -3, NAN}), 0, 0));
  EXPECT_TRUE(all_close(lo, make(DType::kF32, {4}, {1, NAN, -4, NAN}), 0, 0));
  EXPECT_TRUE(std::isnan(hi.get(1)) && std::isnan(hi.get(3)) && std::isnan(lo.get(1)));
  Tensor i = make(DType::kI64, {2, 2}, {-5, 7, 3, -1});
  Tensor zero = make(DType::kI64, {}, {0});
  EXPECT_TRUE(
      all_close(ref1(Op::kMaximum, {i, zero}), make(DType::kI64, {2, 2}, {0, 7, 3, 0}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kMinimum, {i, zero}), make(DType::kI64, {2, 2}, {-5, 0, 0, -1}), 0, 0));
}

TEST(ElementwiseBinary, ReferenceIntegerDivisionTruncatesTowardZero) {
  Tensor a = make(DType::kI32, {5}, {7, -7, 7, -7, 6});
  Tensor b = make(DType::kI32, {5}, {2, 2, -2, -2, 3});
  EXPECT_TRUE(all_close(ref1(Op::kDiv, {a, b}), make(DType::kI32, {5}, {3, -3, -3, 3, 2}), 0, 0));
  EXPECT_TRUE(
      all_close(ref1(Op::kDiv, {make(DType::kU8, {2}, {255, 9}), make(DType::kU8, {}, {4})}),
                make(DType::kU8, {2}, {63, 2}), 0, 0));
  // The overflowing quotient min / -1 wraps back to min.
  EXPECT_EQ(ref1(Op::kDiv, {make(DType::kI32, {1}, {-2147483648.0}), make(DType::kI32, {1}, {-1})})
                .get(0),
            -2147483648.0);
  Tensor big = ref1(
      Op::kDiv, {make(DType::kI64, {1}, {-9223372036854775808.0}), make(DType::kI64, {1}, {-1})});
  EXPECT_EQ(big.data<int64_t>()[0], std::numeric_limits<int64_t>::min());
}

TEST(ElementwiseBinary, ReferenceIntegerDivisionByZeroThrows) {
  Tensor a = make(DType::kI64, {3}, {4, 5, 6});
  Tensor b = make(DType::kI64, {3}, {1, 0, 2});
  EXPECT_THROW(run_reference(Op::kDiv, {a, b}), kiln::Error);
  EXPECT_TRUE(throws_with(
      [&] {
        run_reference(Op::kDiv, {a, b});
      },
      {"div", "division by zero", "5 / 0"}));
}

TEST(ElementwiseBinary, ReferenceIntegerOverflowWraps) {
  EXPECT_EQ(
      ref1(Op::kAdd, {make(DType::kI32, {1}, {2147483647}), make(DType::kI32, {1}, {1})}).get(0),
      -2147483648.0);
  EXPECT_EQ(ref1(Op::kSub, {make(DType::kU8, {1}, {3}), make(DType::kU8, {1}, {5})}).get(0), 254);
  EXPECT_EQ(ref1(Op::kMul, {make(DType::kU8, {1}, {16}), make(DType::kU8, {1}, {17})}).get(0),
            272 - 256);
  EXPECT_TRUE(
      all_close(ref1(Op::kAdd, {make(DType::kI64, {2}, {-3, 40}), make(DType::kI64, {2}, {5, 2})}),
                make(DType::kI64, {2}, {2, 42}), 0, 0));
}

TEST(ElementwiseBinary, ReferenceHalfRoundsOnStore) {
  // 1 + 2^-11 is halfway between 1 and the next f16 (1 + 2^-10): ties to even give 1.
  // In bf16, 1 + 2^-8 is halfway between 1 and 1 + 2^-7: also 1; 1 + 3 * 2^-9 rounds up.
  EXPECT_EQ(
      ref1(Op::kAdd, {make(DType::kF16, {1}, {1}), make(DType::kF16, {1}, {1.0 / 2048})}).get(0),
      1.0);
  EXPECT_EQ(ref1(Op::kAdd,
                 {make(DType::kBF16, {2}, {1, 1}), make(DType::kBF16, {2}, {1.0 / 256, 3.0 / 512})})
                .get(1),
            1.0 + 1.0 / 128);
  EXPECT_EQ(
      ref1(Op::kAdd, {make(DType::kBF16, {1}, {1}), make(DType::kBF16, {1}, {1.0 / 256})}).get(0),
      1.0);
  EXPECT_TRUE(all_close(
      ref1(Op::kMul, {make(DType::kBF16, {2}, {1.5, -0.25}), make(DType::kBF16, {2}, {1.5, 8})}),
      make(DType::kBF16, {2}, {2.25, -2}), 0, 0));
  // 65504 (the f16 max) + 32 rounds to infinity in f16.
  EXPECT_EQ(ref1(Op::kAdd, {make(DType::kF16, {1}, {65504}), make(DType::kF16, {1}, {32})}).get(0),
            INFINITY);
}

// ---- comparisons ----

TEST(ElementwiseCompare, InferenceGivesBool) {
  for (Op op : kComparisons) {
    EXPECT_EQ(infer1(op, {tt(DType::kF32, {2, 3}), tt(DType::kF32, {3})}),
              tt(DType::kBool, {2, 3}));
    EXPECT_EQ(infer1(op, {tt(DType::kI64, {}), tt(DType::kI64, {4, 1})}), tt(DType::kBool, {4, 1}));
    EXPECT_EQ(infer1(op, {tt(DType::kBool, {2}), tt(DType::kBool, {2})}), tt(DType::kBool, {2}));
    EXPECT_TRUE(throws_with(
        [&] {
          infer(op, {tt(DType::kF32, {2}), tt(DType::kBF16, {2})});
        },
        {std::string(op_name(op)) + ": ", "f32[2]", "bf16[2]", "cast"}));
    EXPECT_TRUE(throws_with(
        [&] {
          infer(op, {tt(DType::kF32, {2, 2}), tt(DType::kF32, {3})});
        },
        {op_name(op), "(2, 2)", "(3,)", "do not broadcast"}));
  }
}

TEST(ElementwiseCompare, ReferenceAgainstBroadcastScalar) {
  Tensor a = make(DType::kF32, {3}, {1, 2, 3});
  Tensor two = make(DType::kF32, {}, {2});
  auto check = [&](Op op, std::vector<double> expected) {
    Tensor y = ref1(op, {a, two});
    EXPECT_EQ(y.dtype(), DType::kBool);
    EXPECT_TRUE(all_close(y, make(DType::kBool, {3}, expected), 0, 0)) << op_name(op);
  };
  check(Op::kEq, {0, 1, 0});
  check(Op::kNe, {1, 0, 1});
  check(Op::kLt, {1, 0, 0});
  check(Op::kLe, {1, 1, 0});
  check(Op::kGt, {0, 0, 1});
  check(Op::kGe, {0, 1, 1});
}

TEST(ElementwiseCompare, ReferenceNanIsUnordered) {
  Tensor nan = make(DType::kF64, {1}, {NAN});
  Tensor one = make(DType::kF64, {1}, {1});
  EXPECT_EQ(ref1(Op::kEq, {nan, nan}).get(0), 0);
  EXPECT_EQ(ref1(Op::kNe, {nan, nan}).get(0), 1);
  for (Op op : {Op::kLt, Op::kLe, Op::kGt, Op::kGe})
    EXPECT_EQ(ref1(op, {nan, one}).get(0), 0) << op_name(op);
}

TEST(ElementwiseCompare, ReferenceIntegersAndBools) {
  Tensor a = make(DType::kI64, {2, 2}, {-1, 5, 5, 9});
  Tensor b = make(DType::kI64, {2, 1}, {5, 9});
  EXPECT_TRUE(all_close(ref1(Op::kEq, {a, b}), make(DType::kBool, {2, 2}, {0, 1, 0, 1}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kLt, {a, b}), make(DType::kBool, {2, 2}, {1, 0, 1, 0}), 0, 0));
  Tensor p = make(DType::kBool, {2}, {1, 0});
  Tensor q = make(DType::kBool, {2}, {1, 1});
  EXPECT_TRUE(all_close(ref1(Op::kEq, {p, q}), make(DType::kBool, {2}, {1, 0}), 0, 0));
  EXPECT_TRUE(all_close(ref1(Op::kGt, {q, p}), make(DType::kBool, {2}, {0, 1}), 0, 0));
  // bf16 compares the stored (rounded) values: 1 + 2^-9 is stored as 1.
  EXPECT_EQ(ref1(Op::kEq, {make(DType::kBF16, {1}, {1 + 1.0 / 512}), make(DType::kBF16, {1}, {1})})
                .get(0),
            1);
}

// ---- where ----

TEST(ElementwiseWhere, InferenceBroadcastsThreeWays) {
  EXPECT_EQ(
      infer1(Op::kWhere, {tt(DType::kBool, {2, 1}), tt(DType::kF32, {3}), tt(DType::kF32, {})}),
      tt(DType::kF32, {2, 3}));
  EXPECT_EQ(infer1(Op::kWhere,
                   {tt(DType::kBool, {}), tt(DType::kI64, {4, 1, 2}), tt(DType::kI64, {5, 1})}),
            tt(DType::kI64, {4, 5, 2}));
  EXPECT_EQ(
      infer1(Op::kWhere, {tt(DType::kBool, {3}), tt(DType::kBool, {3}), tt(DType::kBool, {3})}),
      tt(DType::kBool, {3}));
}

TEST(ElementwiseWhere, Errors) {
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kWhere, {tt(DType::kF32, {2}), tt(DType::kF32, {2}), tt(DType::kF32, {2})});
      },
      {"where: condition must be a bool tensor, got f32[2]"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kWhere, {tt(DType::kBool, {2}), tt(DType::kF32, {2}), tt(DType::kF16, {2})});
      },
      {"where", "f32[2]", "f16[2]", "cast"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kWhere, {tt(DType::kBool, {2}), tt(DType::kF32, {3}), tt(DType::kF32, {1})});
      },
      {"where", "(2,)", "(3,)", "do not broadcast"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kWhere,
              {tt(DType::kBool, {2, 1}), tt(DType::kF32, {1, 3}), tt(DType::kF32, {5, 1, 4})});
      },
      {"where", "(2, 3)", "(5, 1, 4)", "do not broadcast"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kWhere, {tt(DType::kBool, {2}), tt(DType::kF32, {2})});
      },
      {"where", "got 2 inputs, expected 3"}));
}

TEST(ElementwiseWhere, Reference) {
  Tensor cond = make(DType::kBool, {2, 1}, {1, 0});
  Tensor a = make(DType::kF32, {3}, {1, 2, 3});
  Tensor b = make(DType::kF32, {}, {-1});
  EXPECT_TRUE(all_close(ref1(Op::kWhere, {cond, a, b}),
                        make(DType::kF32, {2, 3}, {1, 2, 3, -1, -1, -1}), 0, 0));
  Tensor mask = make(DType::kBool, {4}, {0, 1, 1, 0});
  Tensor x = make(DType::kI32, {4}, {10, 20, 30, 40});
  Tensor y = make(DType::kI32, {4}, {-10, -20, -30, -40});
  EXPECT_TRUE(
      all_close(ref1(Op::kWhere, {mask, x, y}), make(DType::kI32, {4}, {-10, 20, 30, -40}), 0, 0));
  Tensor h = ref1(Op::kWhere,
                  {mask, make(DType::kBF16, {}, {0.5}), make(DType::kBF16, {4}, {1, 2, 3, 4})});
  EXPECT_TRUE(all_close(h, make(DType::kBF16, {4}, {1, 0.5, 0.5, 4}), 0, 0));
  // A NaN in the branch not taken does not leak through.
  Tensor n = ref1(Op::kWhere, {make(DType::kBool, {2}, {1, 0}), make(DType::kF64, {2}, {7, NAN}),
                               make(DType::kF64, {2}, {NAN, 8})});
  EXPECT_TRUE(all_close(n, make(DType::kF64, {2}, {7, 8}), 0, 0));
}

}  // namespace
}  // namespace kiln::testing
