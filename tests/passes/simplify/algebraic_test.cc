// algebraic: every rule of the table firing (IR text in, IR text or CHECK lines out) and not
// firing where it would change a result, each negative test named for why; the fixed point;
// values unchanged bitwise on random inputs.
#include "passes/simplify/algebraic.h"
#include "passes/simplify/dead_code.h"

#include <cmath>
#include <limits>
#include <set>

#include "simplify_test_util.h"

namespace kiln {
namespace {

using testing::contains;
using testing::expect_unchanged;
using testing::lacks;
using testing::run_on_text;

// `body` placed in a graph with these inputs; returns the text after the pass.
std::string simplify(const std::string& params, const std::string& body,
                     bool expect_change = true) {
  AlgebraicSimplifier pass;
  testing::PassOnText r = run_on_text(pass, "graph @g(" + params + ") {\n" + body + "}\n");
  EXPECT_EQ(r.changed, expect_change);
  return r.text;
}

TEST(Algebraic, TableHasUniqueNames) {
  std::set<std::string> names;
  for (const RewriteRule& rule : algebraic_rules()) EXPECT_TRUE(names.insert(rule.name).second);
  EXPECT_EQ(names.size(), 19u);
}

TEST(Algebraic, MulByOne) {
  std::string t = simplify("%x: f32[4] data",
                           "  %0 = full() {dtype=f32, shape=[], value=1.0} : f32[]\n"
                           "  %1 = mul(%0, %x) : f32[4]\n"
                           "  return %1\n");
  EXPECT_EQ(t,
            "graph @g(%x: f32[4] data) {\n"
            "  %0 = full() {dtype=f32, shape=[], value=1.0} : f32[]\n"
            "  return %x\n"
            "}\n");
}

TEST(Algebraic, MulByABiggerOneBecomesBroadcast) {
  std::string t = simplify("%x: f32[4] data",
                           "  %0 = full() {dtype=f32, shape=[3, 4], value=1.0} : f32[3,4]\n"
                           "  %1 = mul(%x, %0) : f32[3,4]\n"
                           "  return %1\n");
  EXPECT_TRUE(contains(t, "%1 = broadcast_to(%x) {shape=[3, 4]} : f32[3,4]\n  return %1\n"));
  EXPECT_TRUE(lacks(t, "mul("));
}

TEST(Algebraic, MulByOneSeesThroughBroadcastAndConstants) {
  std::string t = simplify("%x: i32[2] data",
                           "  %0 = constant() {dtype=i32, shape=[1], values=[1.0]} : i32[1]\n"
                           "  %1 = broadcast_to(%0) {shape=[2]} : i32[2]\n"
                           "  %2 = mul(%x, %1) : i32[2]\n"
                           "  return %2\n");
  EXPECT_TRUE(contains(t, "return %x\n"));
}

TEST(Algebraic, NoFoldMulByNonOne) {
  AlgebraicSimplifier pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = constant() {dtype=f32, shape=[2], values=[1.0, 1.5]} : f32[2]\n"
      "  %1 = mul(%x, %0) : f32[2]\n"
      "  return %1\n"
      "}\n");
}

TEST(Algebraic, AddZeroForIntegersAndNegativeFloatZero) {
  std::string t = simplify("%i: i64[3] data, %x: f32[3] data",
                           "  %0 = full() {dtype=i64, shape=[], value=0.0} : i64[]\n"
                           "  %1 = add(%i, %0) : i64[3]\n"
                           "  %2 = full() {dtype=f32, shape=[], value=-0.0} : f32[]\n"
                           "  %3 = add(%2, %x) : f32[3]\n"
                           "  return %1, %3\n");
  EXPECT_TRUE(contains(t, "return %i, %x\n"));
}

TEST(Algebraic, NoFoldFloatAddOfPositiveZeroSinceItTurnsNegativeZeroPositive) {
  const char* text =
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = full() {dtype=f32, shape=[], value=0.0} : f32[]\n"
      "  %1 = add(%x, %0) : f32[2]\n"
      "  return %1\n"
      "}\n";
  AlgebraicSimplifier pass;
  expect_unchanged(pass, text);
  // Why: -0.0 + 0.0 is +0.0, so x + 0 is not x for x = -0.0.
  std::vector<Tensor> out =
      testing::run_step(parse(text), {testing::make(DType::kF32, {2}, {-0.0, 1.0})});
  EXPECT_FALSE(std::signbit(out[0].get(0)));
}

TEST(Algebraic, SubZero) {
  std::string t = simplify("%x: f32[3] data",
                           "  %0 = full() {dtype=f32, shape=[], value=0.0} : f32[]\n"
                           "  %1 = sub(%x, %0) : f32[3]\n"
                           "  return %1\n");
  EXPECT_TRUE(contains(t, "return %x\n"));
}

TEST(Algebraic, NoFoldFloatSubOfNegativeZeroSinceItTurnsNegativeZeroPositive) {
  // x - (-0.0) = x + 0.0: not the identity on -0.0. And 0 - x is not x at all.
  AlgebraicSimplifier pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = full() {dtype=f32, shape=[], value=-0.0} : f32[]\n"
      "  %1 = sub(%x, %0) : f32[2]\n"
      "  %2 = full() {dtype=f32, shape=[], value=0.0} : f32[]\n"
      "  %3 = sub(%2, %x) : f32[2]\n"
      "  return %1, %3\n"
      "}\n");
}

TEST(Algebraic, DivByOne) {
  std::string t = simplify("%x: f32[3] data, %i: i32[3] data",
                           "  %0 = full() {dtype=f32, shape=[], value=1.0} : f32[]\n"
                           "  %1 = div(%x, %0) : f32[3]\n"
                           "  %2 = full() {dtype=i32, shape=[3], value=1.0} : i32[3]\n"
                           "  %3 = div(%i, %2) : i32[3]\n"
                           "  return %1, %3\n");
  EXPECT_TRUE(contains(t, "return %x, %i\n"));
}

TEST(Algebraic, NoFoldOneDividedByX) {
  AlgebraicSimplifier pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = full() {dtype=f32, shape=[], value=1.0} : f32[]\n"
      "  %1 = div(%0, %x) : f32[2]\n"
      "  return %1\n"
      "}\n");
}

TEST(Algebraic, MulByZeroForIntegers) {
  std::string t = simplify("%i: i32[2,3] data",
                           "  %0 = full() {dtype=i32, shape=[3], value=0.0} : i32[3]\n"
                           "  %1 = mul(%0, %i) : i32[2,3]\n"
                           "  return %1\n");
  EXPECT_TRUE(contains(t, "%1 = full() {dtype=i32, shape=[2, 3], value=0.0} : i32[2,3]\n"));
  EXPECT_TRUE(lacks(t, "mul("));
}

TEST(Algebraic, NoFoldFloatMulByZeroSinceInfTimesZeroIsNan) {
  const char* text =
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = full() {dtype=f32, shape=[], value=0.0} : f32[]\n"
      "  %1 = mul(%x, %0) : f32[2]\n"
      "  return %1\n"
      "}\n";
  AlgebraicSimplifier pass;
  expect_unchanged(pass, text);
  std::vector<Tensor> out = testing::run_step(
      parse(text),
      {testing::make(DType::kF32, {2}, {std::numeric_limits<double>::infinity(), -2.0})});
  EXPECT_TRUE(std::isnan(out[0].get(0)));
  EXPECT_TRUE(std::signbit(out[0].get(1)));  // -2 * 0 = -0.0, not the zeros a rule would make
}

// After autodiff, stop_gradient has done its work: the value it passes is read directly.
TEST(Algebraic, StopGradientIsItsInput) {
  std::string t = simplify("%x: f32[2] data",
                           "  %0 = stop_gradient(%x) : f32[2]\n"
                           "  %1 = mul(%0, %x) : f32[2]\n"
                           "  return %1\n");
  EXPECT_EQ(t,
            "graph @g(%x: f32[2] data) {\n"
            "  %0 = mul(%x, %x) : f32[2]\n"
            "  return %0\n"
            "}\n");
}

TEST(Algebraic, NegNegReachesAFixedPoint) {
  std::string t = simplify("%x: f32[2] data",
                           "  %0 = neg(%x) : f32[2]\n"
                           "  %1 = neg(%0) : f32[2]\n"
                           "  %2 = neg(%1) : f32[2]\n"
                           "  %3 = neg(%2) : f32[2]\n"
                           "  %4 = neg(%3) : f32[2]\n"
                           "  return %4\n");
  // In one sweep: %1 -> x, so %2 becomes neg(x); %3 -> x, so %4 becomes neg(x). Three equal
  // negs of x remain, two of them dead: cse and dead-code finish the job.
  EXPECT_EQ(t,
            "graph @g(%x: f32[2] data) {\n"
            "  %0 = neg(%x) : f32[2]\n"
            "  %1 = neg(%x) : f32[2]\n"
            "  %2 = neg(%x) : f32[2]\n"
            "  return %2\n"
            "}\n");
}

TEST(Algebraic, NoFoldNegOfSomethingElse) {
  AlgebraicSimplifier pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = abs(%x) : f32[2]\n"
      "  %1 = neg(%0) : f32[2]\n"
      "  return %1\n"
      "}\n");
}

TEST(Algebraic, TransposeOfTransposeComposes) {
  // (A, B, C) -perm [1, 0, 2]-> (B, A, C) -perm [2, 0, 1]-> (C, B, A): one reversal.
  std::string t = simplify("%x: f32[2,3,4] data",
                           "  %0 = transpose(%x) {perm=[1, 0, 2]} : f32[3,2,4]\n"
                           "  %1 = transpose(%0) {perm=[2, 0, 1]} : f32[4,3,2]\n"
                           "  return %1\n");
  EXPECT_TRUE(contains(t, "%1 = transpose(%x) {perm=[2, 1, 0]} : f32[4,3,2]\n  return %1\n"));
}

TEST(Algebraic, TransposeInverseAndIdentityVanish) {
  std::string t = simplify("%x: f32[2,3] data",
                           "  %0 = transpose(%x) : f32[3,2]\n"
                           "  %1 = transpose(%0) : f32[2,3]\n"
                           "  %2 = transpose(%x) {perm=[0, 1]} : f32[2,3]\n"
                           "  return %1, %2\n");
  EXPECT_TRUE(contains(t, "return %x, %x\n"));
}

TEST(Algebraic, NoFoldTransposeOfANonTranspose) {
  AlgebraicSimplifier pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[6] data) {\n"
      "  %0 = reshape(%x) {shape=[2, 3]} : f32[2,3]\n"
      "  %1 = transpose(%0) : f32[3,2]\n"
      "  return %1\n"
      "}\n");
}

TEST(Algebraic, ReshapeChainsCollapse) {
  std::string t = simplify("%x: f32[2,6] data",
                           "  %0 = reshape(%x) {shape=[12]} : f32[12]\n"
                           "  %1 = reshape(%0) {shape=[3, -1]} : f32[3,4]\n"
                           "  %2 = reshape(%1) {shape=[2, 2, 3]} : f32[2,2,3]\n"
                           "  %3 = reshape(%x) {shape=[2, 6]} : f32[2,6]\n"
                           "  %4 = reshape(%0) {shape=[2, 6]} : f32[2,6]\n"
                           "  return %2, %3, %4\n");
  EXPECT_TRUE(contains(t, "reshape(%x) {shape=[2, 2, 3]} : f32[2,2,3]\n"));
  EXPECT_TRUE(contains(t, "return %2, %x, %x\n"));
}

TEST(Algebraic, NoFoldReshapeThatChangesTheShapeOfANonReshape) {
  AlgebraicSimplifier pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[2,3] data) {\n"
      "  %0 = transpose(%x) : f32[3,2]\n"
      "  %1 = reshape(%0) {shape=[6]} : f32[6]\n"
      "  return %1\n"
      "}\n");
}

TEST(Algebraic, BroadcastToTheSameShape) {
  std::string t = simplify("%x: f32[2,3] data",
                           "  %0 = broadcast_to(%x) {shape=[2, 3]} : f32[2,3]\n"
                           "  return %0\n");
  EXPECT_TRUE(contains(t, "return %x\n"));
}

TEST(Algebraic, NoFoldBroadcastThatGrows) {
  AlgebraicSimplifier pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[3] data) {\n"
      "  %0 = broadcast_to(%x) {shape=[2, 3]} : f32[2,3]\n"
      "  return %0\n"
      "}\n");
}

TEST(Algebraic, CastToTheSameDtypeAndExactRoundTrips) {
  std::string t = simplify("%x: f32[3] data, %h: bf16[3] data",
                           "  %0 = cast(%x) {dtype=f32} : f32[3]\n"
                           "  %1 = cast(%x) {dtype=f64} : f64[3]\n"
                           "  %2 = cast(%1) {dtype=f32} : f32[3]\n"
                           "  %3 = cast(%h) {dtype=f32} : f32[3]\n"
                           "  %4 = cast(%3) {dtype=bf16} : bf16[3]\n"
                           "  return %0, %2, %4\n");
  EXPECT_TRUE(contains(t, "return %x, %x, %h\n"));
}

TEST(Algebraic, ExactWideningCastIsSkipped) {
  // i32 -> i64 keeps every value, and i64 -> f32 rounds the same values as i32 -> f32 does.
  std::string t = simplify("%i: i32[3] data",
                           "  %0 = cast(%i) {dtype=i64} : i64[3]\n"
                           "  %1 = cast(%0) {dtype=f32} : f32[3]\n"
                           "  return %1\n");
  EXPECT_TRUE(contains(t, "%1 = cast(%i) {dtype=f32} : f32[3]\n  return %1\n"));
}

TEST(Algebraic, NoFoldWhenCastLosesPrecision) {
  // f32 -> bf16 rounds to 8 significant bits: the round trip is not x.
  const char* text =
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = cast(%x) {dtype=bf16} : bf16[2]\n"
      "  %1 = cast(%0) {dtype=f32} : f32[2]\n"
      "  return %1\n"
      "}\n";
  AlgebraicSimplifier pass;
  expect_unchanged(pass, text);
  std::vector<Tensor> out =
      testing::run_step(parse(text), {testing::make(DType::kF32, {2}, {1.001, 3.0})});
  EXPECT_NE(out[0].get(0), static_cast<double>(1.001f));
}

TEST(Algebraic, NoShortcutIntFloatIntCastsSinceSaturationDiffersFromWrapping) {
  // i32 -> f64 is exact, but f64 -> u8 saturates (300 -> 255) where i32 -> u8 wraps (300 -> 44).
  const char* text =
      "graph @g(%i: i32[1] data) {\n"
      "  %0 = cast(%i) {dtype=f64} : f64[1]\n"
      "  %1 = cast(%0) {dtype=u8} : u8[1]\n"
      "  return %1\n"
      "}\n";
  AlgebraicSimplifier pass;
  expect_unchanged(pass, text);
  std::vector<Tensor> out =
      testing::run_step(parse(text), {testing::make(DType::kI32, {1}, {300})});
  EXPECT_EQ(out[0].get(0), 255.0);
}

TEST(Algebraic, SumOfOneHotOfProvablyValidIndicesIsOnes) {
  // argmax over 5 classes gives indices in [0, 5); a clamp into [0, 4] does too.
  std::string t = simplify("%x: f32[2,3,5] data, %l: i64[2,3] data",
                           "  %0 = argmax(%x) : i64[2,3]\n"
                           "  %1 = one_hot(%0) {depth=5} : f32[2,3,5]\n"
                           "  %2 = sum(%1) {axes=[-1]} : f32[2,3]\n"
                           "  %3 = full() {dtype=i64, shape=[], value=0.0} : i64[]\n"
                           "  %4 = full() {dtype=i64, shape=[], value=4.0} : i64[]\n"
                           "  %5 = maximum(%l, %3) : i64[2,3]\n"
                           "  %6 = minimum(%5, %4) : i64[2,3]\n"
                           "  %7 = one_hot(%6) {depth=5} : f32[2,3,5]\n"
                           "  %8 = sum(%7) {axes=[2], keepdims=true} : f32[2,3,1]\n"
                           "  return %2, %8\n");
  EXPECT_TRUE(contains(t, "= full() {dtype=f32, shape=[2, 3], value=1.0} : f32[2,3]\n"));
  EXPECT_TRUE(contains(t, "= full() {dtype=f32, shape=[2, 3, 1], value=1.0} : f32[2,3,1]\n"));
  EXPECT_TRUE(lacks(t, "sum("));
}

TEST(Algebraic, NoFoldOneHotSumWhenIndicesMayBeOutOfRange) {
  // Labels from data may be ignore_index (-100): one_hot gives a zero row there, summing to 0.
  const char* text =
      "graph @g(%l: i64[3] data) {\n"
      "  %0 = one_hot(%l) {depth=4} : f32[3,4]\n"
      "  %1 = sum(%0) {axes=[1]} : f32[3]\n"
      "  return %1\n"
      "}\n";
  AlgebraicSimplifier pass;
  expect_unchanged(pass, text);
  std::vector<Tensor> out =
      testing::run_step(parse(text), {testing::make(DType::kI64, {3}, {1, -100, 3})});
  EXPECT_EQ(out[0].get(1), 0.0);
}

TEST(Algebraic, NoFoldOneHotSumOverOtherAxes) {
  // Summing over the rows too counts the rows: not a row of ones.
  AlgebraicSimplifier pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[3,4] data) {\n"
      "  %0 = argmax(%x) : i64[3]\n"
      "  %1 = one_hot(%0) {depth=4} : f32[3,4]\n"
      "  %2 = sum(%1) : f32[]\n"
      "  return %2\n"
      "}\n");
}

// q, k, v (B=2, T=5, H=3, D=4) as a model has them after reshaping its projections to heads.
const char* kHeadsParams = "%q: f32[2,5,3,4] data, %k: f32[2,5,3,4] data, %v: f32[2,5,3,4] data";

TEST(Algebraic, AttentionOnHeadTransposesTakesLayoutBthd) {
  const std::string text =
      std::string("graph @g(") + kHeadsParams + ") {\n"
      "  %tq = transpose(%q) {perm=[0, 2, 1, 3]}\n"
      "  %tk = transpose(%k) {perm=[0, 2, 1, 3]}\n"
      "  %tv = transpose(%v) {perm=[0, 2, 1, 3]}\n"
      "  %o, %lse = attention(%tq, %tk, %tv) {causal=true}\n"
      "  %y = transpose(%o) {perm=[0, 2, 1, 3]}\n"
      "  return %y, %lse\n"
      "}\n";
  Graph g = parse(text);
  std::vector<Tensor> inputs = testing::random_inputs(g, 3, 0, 0);
  std::vector<Tensor> before = testing::run_step(g, inputs);
  AlgebraicSimplifier pass;
  ASSERT_TRUE(pass.run(g));
  EXPECT_EQ(pass.fired().at("attention-heads-inside"), 1);
  DeadCodeElimination dce;
  dce.run(g);
  const std::string after = print(g);
  EXPECT_TRUE(contains(after, "attention(%q, %k, %v) {causal=true, layout=\"bthd\"}")) << after;
  // The output's transposes cancelled; lse (B, H, T) is the bthd lse (B, T, H) transposed.
  EXPECT_TRUE(contains(after, "perm=[0, 2, 1]")) << after;
  EXPECT_TRUE(lacks(after, "perm=[0, 2, 1, 3]")) << after;
  // The same arithmetic in the same order, only indexed differently: bitwise the same.
  EXPECT_TRUE(testing::bitwise_equal(testing::run_step(g, inputs), before));
}

TEST(Algebraic, AttentionGradOnHeadTransposesTakesLayoutBthd) {
  const std::string text =
      std::string("graph @g(") + kHeadsParams + ", %g: f32[2,5,3,4] data) {\n"
      "  %tq = transpose(%q) {perm=[0, 2, 1, 3]}\n"
      "  %tk = transpose(%k) {perm=[0, 2, 1, 3]}\n"
      "  %tv = transpose(%v) {perm=[0, 2, 1, 3]}\n"
      "  %o, %lse = attention(%tq, %tk, %tv) {causal=true}\n"
      "  %tg = transpose(%g) {perm=[0, 2, 1, 3]}\n"
      "  %dq, %dk, %dv = attention_grad(%tq, %tk, %tv, %o, %tg, %lse) {causal=true}\n"
      "  %gq = transpose(%dq) {perm=[0, 2, 1, 3]}\n"
      "  %gk = transpose(%dk) {perm=[0, 2, 1, 3]}\n"
      "  %gv = transpose(%dv) {perm=[0, 2, 1, 3]}\n"
      "  return %gq, %gk, %gv\n"
      "}\n";
  Graph g = parse(text);
  std::vector<Tensor> inputs = testing::random_inputs(g, 5, 0, 0);
  std::vector<Tensor> before = testing::run_step(g, inputs);
  AlgebraicSimplifier pass;
  ASSERT_TRUE(pass.run(g));
  EXPECT_EQ(pass.fired().at("attention-heads-inside"), 2);
  DeadCodeElimination dce;
  dce.run(g);
  const std::string after = print(g);
  EXPECT_TRUE(contains(after, "attention_grad(%q, %k, %v, ")) << after;
  EXPECT_TRUE(lacks(after, "transpose")) << after;  // every transpose met its inverse
  EXPECT_TRUE(testing::bitwise_equal(testing::run_step(g, inputs), before));
}

TEST(Algebraic, CastOfTransposeBecomesTransposeOfCast) {
  std::string t = simplify("%x: f32[2,3] data",
                           "  %0 = transpose(%x) {perm=[1, 0]} : f32[3,2]\n"
                           "  %1 = cast(%0) {dtype=bf16} : bf16[3,2]\n"
                           "  return %1\n");
  EXPECT_TRUE(contains(t, "cast(%x) {dtype=bf16} : bf16[2,3]")) << t;
  EXPECT_TRUE(contains(t, "{perm=[1, 0]} : bf16[3,2]")) << t;
  // A transpose of a cast is left as it is (the rule only moves casts before transposes).
  simplify("%x: f32[2,3] data",
           "  %0 = cast(%x) {dtype=bf16} : bf16[2,3]\n"
           "  %1 = transpose(%0) {perm=[1, 0]} : bf16[3,2]\n"
           "  return %1\n",
           /*expect_change=*/false);
}

TEST(Algebraic, MixedPrecisionAttentionTakesLayoutBthd) {
  // As mixed precision leaves it: f32 transposes, then casts to bf16 before attention.
  const std::string text =
      std::string("graph @g(") + kHeadsParams + ") {\n"
      "  %tq = transpose(%q) {perm=[0, 2, 1, 3]}\n"
      "  %tk = transpose(%k) {perm=[0, 2, 1, 3]}\n"
      "  %tv = transpose(%v) {perm=[0, 2, 1, 3]}\n"
      "  %cq = cast(%tq) {dtype=bf16}\n"
      "  %ck = cast(%tk) {dtype=bf16}\n"
      "  %cv = cast(%tv) {dtype=bf16}\n"
      "  %o, %lse = attention(%cq, %ck, %cv) {causal=true}\n"
      "  %y = transpose(%o) {perm=[0, 2, 1, 3]}\n"
      "  return %y\n"
      "}\n";
  Graph g = parse(text);
  std::vector<Tensor> inputs = testing::random_inputs(g, 9, 0, 0);
  std::vector<Tensor> before = testing::run_step(g, inputs);
  AlgebraicSimplifier pass;
  ASSERT_TRUE(pass.run(g));
  DeadCodeElimination dce;
  dce.run(g);
  const std::string after = print(g);
  EXPECT_TRUE(contains(after, "layout=\"bthd\"")) << after;
  EXPECT_TRUE(lacks(after, "transpose")) << after;
  EXPECT_TRUE(testing::bitwise_equal(testing::run_step(g, inputs), before));
}

TEST(Algebraic, NoBthdAttentionUnlessAllOfQkvAreHeadTransposes) {
  // v not transposed (a reshape to heads-first is not the same element order); or all three
  // transposed over other axes (the batch axes swapped).
  const char* cases[] = {
      "  %tq = transpose(%q) {perm=[0, 2, 1, 3]}\n"
      "  %tk = transpose(%k) {perm=[0, 2, 1, 3]}\n"
      "  %tv = reshape(%v) {shape=[2, 3, 5, 4]}\n",
      "  %tq = transpose(%q) {perm=[1, 0, 2, 3]}\n"
      "  %tk = transpose(%k) {perm=[1, 0, 2, 3]}\n"
      "  %tv = transpose(%v) {perm=[1, 0, 2, 3]}\n",
  };
  for (const char* lines : cases) {
    Graph g = parse(std::string("graph @g(") + kHeadsParams + ") {\n" + lines +
                    "  %o, %lse = attention(%tq, %tk, %tv)\n  return %o\n}\n");
    AlgebraicSimplifier pass;
    pass.run(g);
    EXPECT_FALSE(pass.fired().count("attention-heads-inside")) << lines;
    EXPECT_TRUE(lacks(print(g), "bthd")) << lines;
  }
}

// A (B=2, T=5, 3C=36) projection split into q, k, v and reshaped to heads (H=3, D=4), as GPT-2
// builds it; attention and its gradient on them, and the gradient's parts concatenated back the
// way autodiff writes a split's gradient.
std::string packed_attention_text(const std::string& split_line, const std::string& order) {
  return "graph @g(%x: f32[2,5,36] data, %g: f32[2,5,3,4] data) {\n" + split_line +
         "  %r0 = reshape(%s0) {shape=[2, 5, 3, 4]}\n"
         "  %r1 = reshape(%s1) {shape=[2, 5, 3, 4]}\n"
         "  %r2 = reshape(%s2) {shape=[2, 5, 3, 4]}\n"
         "  %o, %lse = attention(" + order + ") {causal=true, layout=\"bthd\"}\n"
         "  %dq, %dk, %dv = attention_grad(" + order + ", %o, %g, %lse) {causal=true, "
         "layout=\"bthd\"}\n"
         "  %fq = reshape(%dq) {shape=[2, 5, 12]}\n"
         "  %fk = reshape(%dk) {shape=[2, 5, 12]}\n"
         "  %fv = reshape(%dv) {shape=[2, 5, 12]}\n"
         "  %dx = concat(%fq, %fk, %fv) {axis=2}\n"
         "  return %o, %lse, %dx\n"
         "}\n";
}

TEST(Algebraic, AttentionOnSplitProjectionReadsItPacked) {
  Graph g = parse(packed_attention_text(
      "  %s0, %s1, %s2 = split(%x) {axis=-1, sizes=[12, 12, 12]}\n", "%r0, %r1, %r2"));
  std::vector<Tensor> inputs = testing::random_inputs(g, 11, 0, 0);
  std::vector<Tensor> before = testing::run_step(g, inputs);
  AlgebraicSimplifier pass;
  ASSERT_TRUE(pass.run(g));
  EXPECT_EQ(pass.fired().at("attention-packed-qkv"), 2);
  EXPECT_EQ(pass.fired().at("concat-split"), 1);
  DeadCodeElimination dce;
  dce.run(g);
  const std::string after = print(g);
  EXPECT_TRUE(contains(after, "reshape(%x) {shape=[2, 5, 3, 3, 4]}")) << after;
  EXPECT_TRUE(contains(after, "attention_qkv(")) << after;
  EXPECT_TRUE(contains(after, "attention_qkv_grad(")) << after;
  // dx is dqkv itself, reshaped back to the projection's shape: no split, no concat left.
  EXPECT_TRUE(lacks(after, "split")) << after;
  EXPECT_TRUE(lacks(after, "concat")) << after;
  EXPECT_TRUE(lacks(after, "layout")) << after;
  // The same arithmetic on the same elements: bitwise the same.
  EXPECT_TRUE(testing::bitwise_equal(testing::run_step(g, inputs), before));
}

TEST(Algebraic, NoPackedAttentionUnlessQkvAreTheSplitsPartsInOrder) {
  // k and v swapped.
  {
    Graph g = parse(packed_attention_text(
        "  %s0, %s1, %s2 = split(%x) {axis=2, sizes=[12, 12, 12]}\n", "%r0, %r2, %r1"));
    AlgebraicSimplifier pass;
    pass.run(g);
    EXPECT_FALSE(pass.fired().count("attention-packed-qkv"));
    EXPECT_TRUE(lacks(print(g), "attention_qkv"));
  }
  // q, k, v from three different splits of the same projection.
  Graph g = parse(
      "graph @g(%x: f32[2,5,36] data) {\n"
      "  %a0, %a1, %a2 = split(%x) {axis=2, sizes=[12, 12, 12]}\n"
      "  %b0, %b1, %b2 = split(%x) {axis=2, sizes=[12, 12, 12]}\n"
      "  %q = reshape(%a0) {shape=[2, 5, 3, 4]}\n"
      "  %k = reshape(%b1) {shape=[2, 5, 3, 4]}\n"
      "  %v = reshape(%a2) {shape=[2, 5, 3, 4]}\n"
      "  %o, %lse = attention(%q, %k, %v) {layout=\"bthd\"}\n"
      "  return %o\n}\n");
  AlgebraicSimplifier pass;
  pass.run(g);
  EXPECT_FALSE(pass.fired().count("attention-packed-qkv"));
}

TEST(Algebraic, ConcatOfASplitsPartsInOrderIsTheInput) {
  std::string t = simplify("%x: f32[4,6] data",
                           "  %a, %b = split(%x) {axis=1, sizes=[2, 4]}\n"
                           "  %y = concat(%a, %b) {axis=-1}\n"
                           "  return %y\n");
  EXPECT_TRUE(contains(t, "return %x")) << t;
  // Out of order, or along another axis: a different tensor.
  for (const char* body : {"  %a, %b = split(%x) {axis=1, sizes=[2, 4]}\n"
                           "  %y = concat(%b, %a) {axis=1}\n  return %y\n",
                           "  %a, %b = split(%x) {axis=1, sizes=[3, 3]}\n"
                           "  %y = concat(%a, %b) {axis=0}\n  return %y\n"})
    simplify("%x: f32[4,6] data", body, /*expect_change=*/false);
}

TEST(Algebraic, RewrittenGraphComputesBitwiseTheSame) {
  Graph g = parse(
      "graph @g(%x: f32[2,3] data, %i: i32[2,3] data) {\n"
      "  %0 = full() {dtype=f32, shape=[], value=1.0} : f32[]\n"
      "  %1 = transpose(%x) : f32[3,2]\n"
      "  %2 = neg(%1) : f32[3,2]\n"
      "  %3 = neg(%2) : f32[3,2]\n"
      "  %4 = transpose(%3) : f32[2,3]\n"
      "  %5 = mul(%4, %0) : f32[2,3]\n"
      "  %6 = cast(%5) {dtype=f64} : f64[2,3]\n"
      "  %7 = cast(%6) {dtype=f32} : f32[2,3]\n"
      "  %8 = reshape(%7) {shape=[6]} : f32[6]\n"
      "  %9 = reshape(%8) {shape=[3, 2]} : f32[3,2]\n"
      "  %10 = cast(%i) {dtype=i64} : i64[2,3]\n"
      "  %11 = full() {dtype=i64, shape=[], value=0.0} : i64[]\n"
      "  %12 = mul(%10, %11) : i64[2,3]\n"
      "  %13 = add(%12, %10) : i64[2,3]\n"
      "  return %9, %13\n"
      "}\n");
  std::vector<Tensor> inputs = testing::random_inputs(g, 11, -50, 50);
  std::vector<Tensor> before = testing::run_step(g, inputs);
  AlgebraicSimplifier pass;
  ASSERT_TRUE(pass.run(g));
  EXPECT_GE(pass.fired().at("neg-neg"), 1);
  EXPECT_EQ(pass.fired().at("mul-by-zero"), 1);
  EXPECT_TRUE(testing::bitwise_equal(testing::run_step(g, inputs), before));
}

}  // namespace
}  // namespace kiln
