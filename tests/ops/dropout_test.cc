// Philox-4x32-10 against the published known-answer vectors, the dropout mask built on it, and
// the dropout op: inference, attribute checks and the reference kernel.
#include <cmath>

#include "ops/elementwise_test_util.h"
#include "support/philox.h"

namespace kiln::testing {
namespace {

void expect_block(PhiloxBlock actual, PhiloxBlock expected) {
  for (int i = 0; i < 4; ++i) EXPECT_EQ(actual.word[i], expected.word[i]) << "word " << i;
}

// ---- Philox ----

// Random123's kat_vectors, lines "philox4x32 10 <counter x4> <key x2> <expected x4>".
TEST(DropoutPhilox, KnownAnswerVectors) {
  expect_block(philox4x32_10({{0, 0, 0, 0}}, {{0, 0}}),
               {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}});
  expect_block(philox4x32_10({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
                             {{0xffffffffu, 0xffffffffu}}),
               {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}});
  expect_block(philox4x32_10({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
                             {{0xa4093822u, 0x299f31d0u}}),
               {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});
}

TEST(DropoutPhilox, WordLayoutOfAnElement) {
  // Element i: counter (block lo, block hi, offset lo, offset hi), block = i / 4; key (seed lo,
  // seed hi); word i % 4.
  for (int j = 0; j < 4; ++j) {
    EXPECT_EQ(philox_word(0, 0, j), philox4x32_10({{0, 0, 0, 0}}, {{0, 0}}).word[j]);
  }
  uint64_t seed = 0x0000000500000007ull, offset = 0x0000000300000002ull;
  uint64_t block = 0x0000000100000009ull;
  PhiloxBlock expected = philox4x32_10({{9, 1, 2, 3}}, {{7, 5}});
  for (int j = 0; j < 4; ++j) EXPECT_EQ(philox_word(seed, offset, block * 4 + j), expected.word[j]);
  EXPECT_EQ(philox_word(0, 0, 4), philox4x32_10({{1, 0, 0, 0}}, {{0, 0}}).word[0]);
}

TEST(DropoutPhilox, UniformAndThreshold) {
  EXPECT_EQ(philox_uniform(0x000000ffu), 0.0f);  // the low 8 bits are discarded
  EXPECT_EQ(philox_uniform(0x00000100u), std::ldexp(1.0f, -24));
  EXPECT_EQ(philox_uniform(0xffffffffu), 1.0f - std::ldexp(1.0f, -24));  // stays below 1
  EXPECT_EQ(philox_uniform(0x80000000u), 0.5f);
  EXPECT_EQ(dropout_threshold(0.0), 0u);
  EXPECT_EQ(dropout_threshold(0.5), 1u << 23);
  EXPECT_EQ(dropout_threshold(std::ldexp(1.0, -24)), 1u);
  EXPECT_EQ(dropout_threshold(std::ldexp(3.0, -24) + 1e-12), 4u);  // u = 3 * 2^-24 < p: dropped
  // u < p exactly when (word >> 8) < threshold; check around the threshold of p = 0.5.
  uint32_t half = dropout_threshold(0.5);
  EXPECT_TRUE(dropout_drops(0x7fffffffu, half));   // u = 0.5 - 2^-24
  EXPECT_FALSE(dropout_drops(0x80000000u, half));  // u = 0.5
  EXPECT_FALSE(dropout_drops(0u, 0u));             // p = 0 drops nothing
}

// ---- dropout op ----

TEST(DropoutOp, Inference) {
  EXPECT_EQ(infer1(Op::kDropout, {tt(DType::kF32, {4, 5})}), tt(DType::kF32, {4, 5}));
  EXPECT_EQ(infer1(Op::kDropout, {tt(DType::kBF16, {2, 3}), tt(DType::kI64, {})}, {{"p", 0.5}}),
            tt(DType::kBF16, {2, 3}));
  EXPECT_EQ(infer1(Op::kDropout, {tt(DType::kF16, {})}), tt(DType::kF16, {}));
  EXPECT_EQ(infer1(Op::kDropout, {tt(DType::kF64, {3})}, {{"p", int64_t{0}}}),
            tt(DType::kF64, {3}));
}

TEST(DropoutOp, Errors) {
  EXPECT_TRUE(throws_with([] { infer(Op::kDropout, {tt(DType::kI32, {4})}); },
                          {"dropout: needs a float tensor, got i32[4]"}));
  for (double p : {1.0, -0.1, 1.5}) {
    EXPECT_TRUE(throws_with(
        [&] {
          infer(Op::kDropout, {tt(DType::kF32, {4})}, {{"p", p}});
        },
        {"dropout", "'p'", fmt::format("{}", p), "[0, 1)"}));
  }
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kDropout, {tt(DType::kF32, {4})}, {{"p", NAN}});
      },
      {"dropout", "'p'", "nan"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kDropout, {tt(DType::kF32, {4}), tt(DType::kI32, {})});
      },
      {"dropout: offset must be an i64 scalar of shape (), got i32[]"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kDropout, {tt(DType::kF32, {4}), tt(DType::kI64, {1})});
      },
      {"dropout", "offset", "got i64[1]"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kDropout, {tt(DType::kF32, {4}), tt(DType::kI64, {}), tt(DType::kI64, {})});
      },
      {"dropout", "got 3 inputs, expected 1 to 2"}));
  EXPECT_TRUE(throws_with(
      [] {
        infer(Op::kDropout, {tt(DType::kF32, {4})}, {{"seed", 0.5}});
      },
      {"dropout", "'seed'", "expected int"}));
}

TEST(DropoutOp, NormalizeAttributes) {
  Attributes filled = normalize_attributes(Op::kDropout, {});
  EXPECT_EQ(filled.f("p"), 0.1);
  EXPECT_EQ(filled.i("seed"), 0);
  EXPECT_EQ(filled.items().size(), 2u);
  Attributes converted =
      normalize_attributes(Op::kDropout, {{"p", int64_t{0}}, {"seed", int64_t{42}}});
  EXPECT_EQ(attr_kind(converted.get("p")), AttrKind::kFloat);
  EXPECT_EQ(converted.i("seed"), 42);
  EXPECT_TRUE(throws_with(
      [] {
        normalize_attributes(Op::kDropout, {{"rate", 0.5}});
      },
      {"dropout", "unknown attribute 'rate'", "p, seed"}));
}

TEST(DropoutOp, MaskFollowsThePhiloxKnownAnswer) {
  // seed 0, offset 0: elements 0..3 use the zero KAT words 6627e8d5 e169c58d bc57ac4c 9b00dbd8,
  // i.e. u = 0.399, 0.881, 0.736, 0.605: with p = 0.5 element 0 is dropped, the rest kept x2.
  Tensor x = make(DType::kF32, {4}, {1, -2, 3, 0.5});
  EXPECT_TRUE(all_close(ref1(Op::kDropout, {x}, {{"p", 0.5}}),
                        make(DType::kF32, {4}, {0, -4, 6, 1}), 0, 0));
  // With p = 0.7 the words below 0.7 * 2^32 (elements 0 and 3) are dropped.
  EXPECT_TRUE(
      all_close(ref1(Op::kDropout, {x}, {{"p", 0.7}}),
                make(DType::kF32, {4},
                     {0, static_cast<float>(-2 / (1 - 0.7)), static_cast<float>(3 / (1 - 0.7)), 0}),
                0, 0));
}

TEST(DropoutOp, DropFractionIsNearP) {
  const int64_t n = 200000;
  Tensor x = rand(DType::kF32, {n}, 7, 0.5, 1.5);  // never zero
  for (double p : {0.1, 0.3, 0.9}) {
    Tensor y = ref1(Op::kDropout, {x}, {{"p", p}, {"seed", int64_t{1234}}});
    int64_t zeros = 0;
    for (int64_t i = 0; i < n; ++i) zeros += y.get(i) == 0.0;
    double fraction = double(zeros) / n;
    double sigma = std::sqrt(p * (1 - p) / n);  // binomial standard deviation
    EXPECT_NEAR(fraction, p, 5 * sigma) << "p = " << p;
  }
}

TEST(DropoutOp, KeptValuesAreExactlyScaled) {
  for (double p : {0.3, 0.5, 0.05}) {
    Tensor x = rand(DType::kF32, {3, 1000}, 11, -2.0, 2.0);
    Tensor y = ref1(Op::kDropout, {x}, {{"p", p}, {"seed", int64_t{99}}});
    int64_t kept = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      ASSERT_NE(x.get(i), 0.0);
      if (y.get(i) == 0.0) continue;
      ++kept;
      EXPECT_EQ(y.get(i), static_cast<double>(static_cast<float>(x.get(i) / (1 - p)))) << i;
    }
    EXPECT_GT(kept, 0);
  }
  Tensor x64 = rand(DType::kF64, {500}, 3, 1.0, 2.0);
  Tensor y64 = ref1(Op::kDropout, {x64}, {{"p", 0.25}});
  for (int64_t i = 0; i < x64.numel(); ++i) {
    if (y64.get(i) != 0.0) {
      EXPECT_EQ(y64.get(i), x64.get(i) / 0.75);
    }
  }
}

TEST(DropoutOp, ZeroPIsTheIdentity) {
  Tensor x = rand(DType::kF64, {64}, 5);
  EXPECT_TRUE(all_close(ref1(Op::kDropout, {x}, {{"p", 0.0}, {"seed", int64_t{3}}}), x, 0, 0));
}

// Positions where y is zero (x is never zero in these tests).
std::vector<bool> mask_of(const Tensor& y) {
  std::vector<bool> dropped(y.numel());
  for (int64_t i = 0; i < y.numel(); ++i) dropped[i] = y.get(i) == 0.0;
  return dropped;
}

int64_t differences(const std::vector<bool>& a, const std::vector<bool>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

TEST(DropoutOp, DeterministicInSeedAndOffset) {
  Tensor x = rand(DType::kF32, {16, 64}, 21, 0.5, 1.0);
  Attributes attrs{{"p", 0.5}, {"seed", int64_t{77}}};
  auto offset = [](int64_t v) { return make(DType::kI64, {}, {static_cast<double>(v)}); };
  Tensor a = ref1(Op::kDropout, {x, offset(5)}, attrs);
  Tensor b = ref1(Op::kDropout, {x, offset(5)}, attrs);
  EXPECT_TRUE(all_close(a, b, 0, 0));
  // No offset input means offset 0.
  EXPECT_TRUE(
      all_close(ref1(Op::kDropout, {x}, attrs), ref1(Op::kDropout, {x, offset(0)}, attrs), 0, 0));
  // Another offset or another seed gives another mask: about half the positions differ.
  int64_t n = x.numel();
  int64_t by_offset = differences(mask_of(a), mask_of(ref1(Op::kDropout, {x, offset(6)}, attrs)));
  int64_t by_seed = differences(
      mask_of(a), mask_of(ref1(Op::kDropout, {x, offset(5)}, {{"p", 0.5}, {"seed", int64_t{78}}})));
  EXPECT_GT(by_offset, n / 4);
  EXPECT_GT(by_seed, n / 4);
  // A negative seed or offset is used as its 64-bit pattern, not rejected.
  Tensor neg = ref1(Op::kDropout, {x, offset(-1)}, {{"p", 0.5}, {"seed", int64_t{-1}}});
  EXPECT_EQ(neg.get(0) == 0.0, philox_uniform(philox_word(~0ull, ~0ull, 0)) < 0.5f);
}

TEST(DropoutOp, MaskIsTheSameForEveryDtype) {
  Tensor x32 = rand(DType::kF32, {300}, 8, 1.0, 2.0);
  Attributes attrs{{"p", 0.4}, {"seed", int64_t{5}}};
  std::vector<bool> reference_mask = mask_of(ref1(Op::kDropout, {x32}, attrs));
  for (DType dtype : {DType::kF64, DType::kF16, DType::kBF16}) {
    Tensor x = ref1(Op::kCast, {x32}, {{"dtype", dtype}});
    Tensor y = ref1(Op::kDropout, {x}, attrs);
    EXPECT_EQ(y.dtype(), dtype);
    EXPECT_EQ(differences(mask_of(y), reference_mask), 0) << dtype_name(dtype);
  }
  // bf16 ones with p = 0.5 are kept as exactly 2.
  Tensor ones = make(DType::kBF16, {8}, {1, 1, 1, 1, 1, 1, 1, 1});
  Tensor y = ref1(Op::kDropout, {ones}, {{"p", 0.5}});
  for (int64_t i = 0; i < 8; ++i) EXPECT_TRUE(y.get(i) == 0.0 || y.get(i) == 2.0) << y.get(i);
  EXPECT_EQ(y.get(0), 0.0);  // the KAT word 6627e8d5 is below 0.5
  EXPECT_EQ(y.get(1), 2.0);
}

}  // namespace
}  // namespace kiln::testing
