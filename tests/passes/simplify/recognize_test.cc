// recognize: the rules' IR text in and out is in tests/passes/kir/recognize_*.kir (one file per
// pattern, and the near misses that must stay); here every one of those graphs computes the
// same numbers after the pass as before it on random inputs (reference kernels, which compute in
// double: what differs is the rounding of the patterns' f32 intermediates), the table's names,
// and the conditions that are easier to state in code than in a file.
#include "passes/simplify/recognize.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <sstream>

#include "passes/pipeline.h"
#include "simplify_test_util.h"

namespace kiln {
namespace {

using testing::contains;
using testing::expect_unchanged;
using testing::lacks;
using testing::run_on_text;

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::filesystem::path> recognize_kir_files() {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(KILN_SOURCE_DIR) + "/tests/passes/kir"))
    if (entry.path().filename().string().starts_with("recognize_")) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

TEST(Recognize, TableHasUniqueNames) {
  std::set<std::string> names;
  for (const RewriteRule& rule : recognition_rules()) EXPECT_TRUE(names.insert(rule.name).second) << rule.name;
  EXPECT_EQ(names.size(), 13u);
}

// Every graph of the .kir tests, before and after the pass, on the same random inputs: the
// composite ops compute what their decompositions compute (up to f32 rounding).
TEST(Recognize, KirGraphsComputeTheSameAfterThePass) {
  const std::vector<std::filesystem::path> files = recognize_kir_files();
  ASSERT_GE(files.size(), 10u);
  int changed = 0;
  for (const std::filesystem::path& file : files) {
    SCOPED_TRACE(file.filename().string());
    const Graph before = parse(read_file(file));
    Graph after = before;
    RecognizeOps pass;
    changed += pass.run(after);
    verify(after);
    const std::vector<Tensor> inputs = testing::random_inputs(before, 17, 0, 3);
    const std::vector<Tensor> want = testing::run_step(before, inputs);
    const std::vector<Tensor> got = testing::run_step(after, inputs);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(testing::all_close(got[i], want[i], 2e-6, 2e-5)) << i;
  }
  EXPECT_GE(changed, 8);
}

// One random change to `g` that keeps every value's type: a float splat or a constant's element
// set to a value the rules look for (or near one), the operands of a binary op swapped or the op
// replaced by another arithmetic one, a unary op replaced, softmax's axis moved, where's branches
// or concat's parts swapped. The caller verifies the result (some changes are illegal: skipped).
void mutate(Graph& g, std::mt19937& rng) {
  static const double kValues[] = {0.0, 0.5, 1.0, 2.0, 3.0, -0.5, -1.0, 1e-5, -1e-3, 1.4142135381698608,
                                   1.5, 0.7071067690849304, 0.044714998453855515, 0.7978845834732056,
                                   -std::numeric_limits<double>::infinity(), -1e30, -1e4, 0.25, 10000.0};
  auto value = [&] { return kValues[rng() % std::size(kValues)]; };
  Node& n = g.nodes[rng() % g.nodes.size()];
  const Op arithmetic[] = {Op::kAdd, Op::kSub, Op::kMul, Op::kDiv};
  const Op unary[] = {Op::kSqrt, Op::kRsqrt, Op::kReciprocal, Op::kErf, Op::kTanh, Op::kSigmoid, Op::kExp,
                      Op::kNeg, Op::kSquare};
  switch (n.op) {
    case Op::kFull:
      if (is_float(n.attrs.dtype("dtype"))) n.attrs.set("value", value());
      break;
    case Op::kConstant: {
      if (!is_float(n.attrs.dtype("dtype"))) {  // integer and bool values are ints
        std::vector<int64_t> ints = n.attrs.ints("values");
        if (ints.empty()) break;
        int64_t& i = ints[rng() % ints.size()];
        i = n.attrs.dtype("dtype") == DType::kBool ? 1 - i : i + 1;
        n.attrs.set("values", ints);
        break;
      }
      std::vector<double> values = n.attrs.floats("values");
      if (values.empty()) break;
      double& v = values[rng() % values.size()];
      v = rng() % 2 ? value() : v * (1 + 1e-3);
      n.attrs.set("values", values);
      break;
    }
    case Op::kAdd: case Op::kSub: case Op::kMul: case Op::kDiv:
      if (rng() % 2) std::swap(n.inputs[0], n.inputs[1]);
      else n.op = arithmetic[rng() % 4];
      break;
    case Op::kSqrt: case Op::kRsqrt: case Op::kReciprocal: case Op::kErf: case Op::kTanh: case Op::kSigmoid:
    case Op::kExp: case Op::kNeg: case Op::kSquare:
      n.op = unary[rng() % std::size(unary)];
      break;
    case Op::kSoftmax:
      n.attrs.set("axis", static_cast<int64_t>(rng() % static_cast<uint64_t>(g.type(n.inputs[0]).rank())));
      break;
    case Op::kWhere:
      std::swap(n.inputs[1], n.inputs[2]);
      break;
    case Op::kConcat:
      std::reverse(n.inputs.begin(), n.inputs.end());
      break;
    default:
      break;
  }
}

// The rules' exactness, fuzzed: random legal mutants of every pattern of the .kir tests compute
// the same after the pass as before (a rule that fired where the pattern no longer holds would
// change the numbers).
TEST(Recognize, MutatedPatternsComputeTheSameAfterThePass) {
  std::mt19937 rng(11);
  int tried = 0, changed = 0;
  for (const std::filesystem::path& file : recognize_kir_files()) {
    const Graph base = parse(read_file(file));
    for (int trial = 0; trial < 80; ++trial) {
      Graph g = base;
      for (int k = 1 + static_cast<int>(rng() % 2); k > 0; --k) mutate(g, rng);
      try {
        verify(g);
      } catch (const Error&) {
        continue;
      }
      ++tried;
      Graph after = g;
      RecognizeOps pass;
      changed += pass.run(after);
      verify(after);
      const std::vector<Tensor> inputs = testing::random_inputs(g, 100 + tried, 0, 3);
      const std::vector<Tensor> want = testing::run_step(g, inputs);
      const std::vector<Tensor> got = testing::run_step(after, inputs);
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_TRUE(testing::all_close(got[i], want[i], 1e-5, 1e-4))
            << file.filename().string() << " trial " << trial << " output " << i << ":\n" << print(g) << "after:\n"
            << print(after);
    }
  }
  EXPECT_GT(tried, 500);
  EXPECT_GT(changed, 100);  // the patterns that survive a mutation still fire
}

std::string recognize(const std::string& params, const std::string& body, bool expect_change = true) {
  RecognizeOps pass;
  testing::PassOnText r = run_on_text(pass, "graph @g(" + params + ") {\n" + body + "}\n");
  EXPECT_EQ(r.changed, expect_change);
  return r.text;
}

TEST(Recognize, NormMeanWithoutKeepdimsStays) {
  // mean without keepdims gives (3,), which broadcasts along x's columns: x[i][j] times the
  // statistic of row j, not of row i.
  RecognizeOps pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[3,3] data) {\n"
      "  %x2 = mul(%x, %x) : f32[3,3]\n"
      "  %ms = mean(%x2) {axes=[1]} : f32[3]\n"
      "  %inv = rsqrt(%ms) : f32[3]\n"
      "  %y = mul(%x, %inv) : f32[3,3]\n"
      "  return %y\n"
      "}\n");
}

TEST(Recognize, RmsNormWithoutEpsilonAndPowMinusHalf) {
  std::string t = recognize("%x: f64[4,6] data",
                            "  %x2 = square(%x) : f64[4,6]\n"
                            "  %ms = mean(%x2) {axes=[-1], keepdims=true} : f64[4,1]\n"
                            "  %e = full() {dtype=f64, shape=[], value=-0.5} : f64[]\n"
                            "  %inv = pow(%ms, %e) : f64[4,1]\n"
                            "  %y = mul(%inv, %x) : f64[4,6]\n"
                            "  return %y\n");
  EXPECT_TRUE(contains(t, "%y = rms_norm(%x, %0) {epsilon=0.0} : f64[4,6]")) << t;
}

TEST(Recognize, NegativeEpsilonStays) {
  RecognizeOps pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[4,6] data) {\n"
      "  %x2 = square(%x) : f32[4,6]\n"
      "  %ms = mean(%x2) {axes=[-1], keepdims=true} : f32[4,1]\n"
      "  %eps = full() {dtype=f32, shape=[], value=-0.001} : f32[]\n"
      "  %a = add(%ms, %eps) : f32[4,1]\n"
      "  %inv = rsqrt(%a) : f32[4,1]\n"
      "  %y = mul(%inv, %x) : f32[4,6]\n"
      "  return %y\n"
      "}\n");
}

TEST(Recognize, LayerNormWithADifferentMeanInTheVarianceStays) {
  // The variance is of x - mean(z), not of x - mean(x): not a layer norm (rms-norm still sees
  // y / sqrt(mean(y^2)) nowhere either).
  RecognizeOps pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[4,6] data, %z: f32[4,6] data) {\n"
      "  %m = mean(%x) {axes=[-1], keepdims=true} : f32[4,1]\n"
      "  %d = sub(%x, %m) : f32[4,6]\n"
      "  %mz = mean(%z) {axes=[-1], keepdims=true} : f32[4,1]\n"
      "  %dz = sub(%x, %mz) : f32[4,6]\n"
      "  %d2 = square(%dz) : f32[4,6]\n"
      "  %v = mean(%d2) {axes=[-1], keepdims=true} : f32[4,1]\n"
      "  %r = sqrt(%v) : f32[4,1]\n"
      "  %y = div(%d, %r) : f32[4,6]\n"
      "  return %y\n"
      "}\n");
}

TEST(Recognize, NormScaleTakesABroadcastWeightAndAScalar) {
  std::string t = recognize("%x: f32[2,3,8] data, %w: f32[1,1,8] param, %s: f32[] param",
                            "  %x2 = square(%x) : f32[2,3,8]\n"
                            "  %ms = mean(%x2) {axes=[-1], keepdims=true} : f32[2,3,1]\n"
                            "  %inv = rsqrt(%ms) : f32[2,3,1]\n"
                            "  %y = mul(%x, %inv) : f32[2,3,8]\n"
                            "  %o = mul(%y, %w) : f32[2,3,8]\n"
                            "  %p = mul(%y, %s) : f32[2,3,8]\n"
                            "  return %o, %p\n");
  EXPECT_TRUE(contains(t, "reshape(%w) {shape=[8]} : f32[8]")) << t;
  EXPECT_TRUE(contains(t, "broadcast_to(")) << t;
  EXPECT_TRUE(lacks(t, "mul(")) << t;
}

TEST(Recognize, AttentionOverAnotherAxisStays) {
  // softmax over the queries (axis 2), not the keys.
  RecognizeOps pass;
  expect_unchanged(pass,
      "graph @g(%q: f32[1,2,3,4] data, %k: f32[1,2,3,4] data, %v: f32[1,2,3,4] data) {\n"
      "  %s = matmul(%q, %k) {transpose_b=true} : f32[1,2,3,3]\n"
      "  %p = softmax(%s) {axis=2} : f32[1,2,3,3]\n"
      "  %o = matmul(%p, %v) : f32[1,2,3,4]\n"
      "  return %o\n"
      "}\n");
}

TEST(Recognize, AttentionWithANegativeScaleStays) {
  RecognizeOps pass;
  expect_unchanged(pass,
      "graph @g(%q: f32[1,2,3,4] data, %k: f32[1,2,3,4] data, %v: f32[1,2,3,4] data) {\n"
      "  %s = matmul(%q, %k) {transpose_b=true} : f32[1,2,3,3]\n"
      "  %c = full() {dtype=f32, shape=[], value=-2.0} : f32[]\n"
      "  %t = div(%s, %c) : f32[1,2,3,3]\n"
      "  %p = softmax(%t) {axis=-1} : f32[1,2,3,3]\n"
      "  %o = matmul(%p, %v) : f32[1,2,3,4]\n"
      "  return %o\n"
      "}\n");
}

TEST(Recognize, AttentionMaskBelowTheDiagonalOrWithAFiniteFillStays) {
  // Masked below the diagonal (anti-causal), then a causal mask filled with -1e4 (whose exp is
  // not 0 next to scores 1e4 apart): neither is kiln's causal attention.
  for (const char* values : {"[0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]", "[0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]"}) {
    const bool anti = std::string(values).starts_with("[0.0, 0.0");
    RecognizeOps pass;
    expect_unchanged(pass, std::string(
        "graph @g(%q: f32[1,2,3,4] data, %k: f32[1,2,3,4] data, %v: f32[1,2,3,4] data) {\n"
        "  %s = matmul(%q, %k) {transpose_b=true} : f32[1,2,3,3]\n"
        "  %m = constant() {dtype=bool, shape=[3, 3], values=") + values + "} : bool[3,3]\n" +
        (anti ? "  %fill = full() {dtype=f32, shape=[], value=-inf} : f32[]\n"
              : "  %fill = full() {dtype=f32, shape=[], value=-10000.0} : f32[]\n") +
        "  %t = where(%m, %fill, %s) : f32[1,2,3,3]\n"
        "  %p = softmax(%t) {axis=-1} : f32[1,2,3,3]\n"
        "  %o = matmul(%p, %v) : f32[1,2,3,4]\n"
        "  return %o\n"
        "}\n");
  }
}

TEST(Recognize, AttentionWithoutMaskOrScaleAndMultiQueryBroadcast) {
  // No scale (1, not 1/sqrt(D)); k and v of one head broadcast by the products (multi-query).
  std::string t = recognize("%q: f32[2,4,3,8] data, %k: f32[2,1,5,8] data, %v: f32[2,1,5,6] data",
                            "  %s = matmul(%q, %k) {transpose_b=true} : f32[2,4,3,5]\n"
                            "  %p = softmax(%s) {axis=-1} : f32[2,4,3,5]\n"
                            "  %o = matmul(%p, %v) : f32[2,4,3,6]\n"
                            "  return %o\n");
  EXPECT_TRUE(contains(t, "attention(%q, %k, %v) {scale=1.0} : f32[2,4,3,6], f32[2,4,3]")) << t;
}

TEST(Recognize, BertPaddingMaskChain) {
  // BERT's mask as the TorchScript exporter writes it, (1 - mask[:, None, None, :]) * -10000 from
  // an f32 (B, T) input, added after the scale: its key_bias is the chain's value, reshaped, and
  // the step computes what the pattern does. (Not a .kir file: the fuzzing there would turn the
  // chain into large offsets that differ by little, where f32 rounds the pattern's scores and
  // attention's apart.)
  const std::string text =
      "graph @g(%q: f32[2,2,3,4] data, %k: f32[2,2,3,4] data, %v: f32[2,2,3,4] data, %mask: f32[2,3] data) {\n"
      "  %s = matmul(%q, %k) {transpose_b=true} : f32[2,2,3,3]\n"
      "  %c = full() {dtype=f32, shape=[], value=2.0} : f32[]\n"
      "  %scaled = div(%s, %c) : f32[2,2,3,3]\n"
      "  %m4 = reshape(%mask) {shape=[2, 1, 1, 3]} : f32[2,1,1,3]\n"
      "  %one = full() {dtype=f32, shape=[], value=1.0} : f32[]\n"
      "  %pad = sub(%one, %m4) : f32[2,1,1,3]\n"
      "  %big = full() {dtype=f32, shape=[], value=-10000.0} : f32[]\n"
      "  %bias = mul(%pad, %big) : f32[2,1,1,3]\n"
      "  %masked = add(%scaled, %bias) : f32[2,2,3,3]\n"
      "  %p = softmax(%masked) {axis=-1} : f32[2,2,3,3]\n"
      "  %o = matmul(%p, %v) : f32[2,2,3,4]\n"
      "  return %o\n"
      "}\n";
  const Graph before = parse(text);
  Graph after = before;
  RecognizeOps pass;
  ASSERT_TRUE(pass.run(after));
  const std::string t = print(after);
  EXPECT_TRUE(contains(t, "%0 = reshape(%bias) {shape=[2, 3]} : f32[2,3]")) << t;
  EXPECT_TRUE(contains(t, "attention(%q, %k, %v, %0) : f32[2,2,3,4], f32[2,2,3]")) << t;
  EXPECT_FALSE(contains(t, "softmax")) << t;
  // Masks of 0 and 1, as a tokenizer's attention_mask: padded keys get -10000.
  std::vector<Tensor> inputs = testing::random_inputs(before, 3, 0, 3);
  inputs[3] = testing::make(DType::kF32, {2, 3}, {1, 1, 0, 1, 0, 0});
  const std::vector<Tensor> want = testing::run_step(before, inputs), got = testing::run_step(after, inputs);
  EXPECT_TRUE(testing::all_close(got[0], want[0], 1e-6, 1e-5));
}

TEST(Recognize, IsTheForwardPipelineAndCanBeDisabled) {
  EXPECT_EQ(forward_pipeline().names(), std::vector<std::string>{"recognize"});
  const std::vector<std::string> main = default_pipeline().names();
  EXPECT_EQ(std::find(main.begin(), main.end(), "recognize"), main.end());
  // --disable-pass recognize: the forward pipeline skips it; the main one accepts the name.
  PassOptions options;
  options.disabled = {"recognize", "fusion"};
  Graph g = parse("graph @g(%x: f32[4] data) {\n  %s = sigmoid(%x) : f32[4]\n  %y = mul(%x, %s) : f32[4]\n"
                  "  return %y\n}\n");
  std::vector<PassRecord> records = forward_pipeline(options).run(g);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_FALSE(records[0].ran);
  EXPECT_TRUE(contains(print(g), "sigmoid"));
  EXPECT_NO_THROW(default_pipeline(options).run(g));
  options.disabled = {"no-such-pass"};
  EXPECT_THROW(default_pipeline(options).run(g), Error);
}

}  // namespace
}  // namespace kiln
