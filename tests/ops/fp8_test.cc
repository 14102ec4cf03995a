// FP8 matmuls (ops/fp8.h) on the CPU: the rounding against the formats' 256 codes decoded from
// their bit layouts, the reference matmul against a quantization written here from the
// definition, the BLAS kernel against the reference, the attributes' errors, the gradient's
// formats, the fp8-linear pass's choice of layers, and training under --amp fp8.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <vector>

#include "compile/training_graph.h"
#include "models/models.h"
#include "ops/fp8.h"
#include "passes/fp8_linear.h"
#include "passes/mixed_precision.h"
#include "test_util.h"
#include "train/job.h"

namespace kiln {
namespace {

// Every finite value of a format, decoded from its bits: sign, exponent (bias 7 / 15), mantissa
// (3 / 2 bits), subnormals at exponent 0. e4m3 (the "fn" variant) has no infinities and one NaN
// code per sign (all ones); e5m2 is IEEE-like (exponent 31: infinities and NaNs). Sorted, with
// each value's code, so ties can be broken towards the even code.
struct Code {
  double value;
  int bits;
};
std::vector<Code> finite_codes(Fp8Format f) {
  const bool e4m3 = f == Fp8Format::kE4M3;
  const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, emax = e4m3 ? 15 : 31;
  std::vector<Code> codes;
  for (int bits = 0; bits < 256; ++bits) {
    const int sign = bits >> 7, exponent = (bits >> mbits) & ((1 << (7 - mbits)) - 1);
    const int mantissa = bits & ((1 << mbits) - 1);
    if (e4m3 && exponent == emax && mantissa == (1 << mbits) - 1) continue;  // NaN
    if (!e4m3 && exponent == emax) continue;                                 // inf, NaN
    const double m = exponent == 0 ? mantissa / double(1 << mbits) : 1.0 + mantissa / double(1 << mbits);
    const double v = std::ldexp(m, (exponent == 0 ? 1 : exponent) - bias);
    codes.push_back({sign ? -v : v, bits});
  }
  std::sort(codes.begin(), codes.end(), [](const Code& a, const Code& b) { return a.value < b.value; });
  return codes;
}

// Round to nearest by search, ties to the even code, saturating: the oracle.
double nearest(const std::vector<Code>& codes, double x) {
  if (x >= codes.back().value) return codes.back().value;
  if (x <= codes.front().value) return codes.front().value;
  auto hi = std::lower_bound(codes.begin(), codes.end(), x, [](const Code& c, double v) { return c.value < v; });
  if (hi->value == x) return x;
  auto lo = hi - 1;
  const double dl = x - lo->value, dh = hi->value - x;
  if (dl != dh) return dl < dh ? lo->value : hi->value;
  // Ties: the even mantissa (+0 and -0 are both even: either is 0).
  return (lo->bits & 1) == 0 ? lo->value : hi->value;
}

TEST(Fp8Round, MatchesTheFormatsCodesEverywhereAndAtEveryTie) {
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    const std::vector<Code> codes = finite_codes(f);
    EXPECT_EQ(codes.back().value, fp8_max(f));
    std::mt19937_64 rng(17);
    std::uniform_real_distribution<double> mantissa(-2.0, 2.0);
    std::uniform_int_distribution<int> exponent(-22, 18);
    for (int i = 0; i < 20000; ++i) {
      const double x = std::ldexp(mantissa(rng), exponent(rng));
      ASSERT_EQ(fp8_round(x, f), nearest(codes, x)) << fp8_name(f) << " x " << x;
    }
    // Every midpoint between neighbours (ties, including among subnormals and at zero).
    for (size_t i = 0; i + 1 < codes.size(); ++i) {
      const double mid = 0.5 * (codes[i].value + codes[i + 1].value);
      ASSERT_EQ(fp8_round(mid, f), nearest(codes, mid)) << fp8_name(f) << " tie " << mid;
    }
    EXPECT_EQ(fp8_round(1e30, f), fp8_max(f));
    EXPECT_EQ(fp8_round(-std::numeric_limits<double>::infinity(), f), -fp8_max(f));
    EXPECT_TRUE(std::isnan(fp8_round(NAN, f)));
  }
}

TEST(Fp8Scale, MapsAmaxOntoTheLargestValueInF32) {
  EXPECT_EQ(fp8_scale(0.0f, 448.0f), 1.0f);
  EXPECT_EQ(fp8_scale(3.0f, 448.0f), 448.0f / 3.0f);
  EXPECT_EQ(fp8_scale(1e-44f, 448.0f), std::numeric_limits<float>::max());
  EXPECT_TRUE(std::isnan(fp8_scale(NAN, 448.0f)));
}

Attributes fp8_attrs(bool ta, bool tb, const std::string& fa, const std::string& fb) {
  return {{"transpose_a", ta}, {"transpose_b", tb}, {"fp8_a", fa}, {"fp8_b", fb}};
}

// The product of quantized copies, written from ops/fp8.h's definition with the oracle above.
std::vector<double> quantized_product(const Tensor& a, const Tensor& b, bool ta, bool tb,
                                      Fp8Format fa, Fp8Format fb) {
  auto quantize = [](const Tensor& t, Fp8Format f, double& inverse) {
    const std::vector<Code> codes = finite_codes(f);
    float amax = 0;
    for (int64_t i = 0; i < t.numel(); ++i) amax = std::max(amax, static_cast<float>(std::abs(t.get(i))));
    const float s = fp8_max(f) / amax;
    inverse = 1.0f / s;
    std::vector<double> q(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) q[i] = nearest(codes, static_cast<float>(t.get(i)) * s);
    return q;
  };
  double ia = 0, ib = 0;
  const std::vector<double> qa = quantize(a, fa, ia), qb = quantize(b, fb, ib);
  const int64_t m = ta ? a.shape()[1] : a.shape()[0], k = ta ? a.shape()[0] : a.shape()[1];
  const int64_t n = tb ? b.shape()[0] : b.shape()[1];
  std::vector<double> c(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (int64_t p = 0; p < k; ++p) sum += qa[ta ? p * m + i : i * k + p] * qb[tb ? j * k + p : p * n + j];
      c[i * n + j] = sum * ia * ib;
    }
  return c;
}

TEST(MatmulFp8, ReferenceAndBlasQuantizeEachOperandByItsOwnScale) {
  const int64_t m = 24, k = 48, n = 16;
  for (auto [fa, fb] : {std::pair{"e4m3", "e4m3"}, std::pair{"e5m2", "e4m3"}, std::pair{"e4m3", "e5m2"}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        // Operands of different magnitudes: each gets its own scale.
        Tensor a = testing::rand(DType::kF32, ta ? Shape{k, m} : Shape{m, k}, 3, -40.0, 40.0);
        Tensor b = testing::rand(DType::kF32, tb ? Shape{n, k} : Shape{k, n}, 4, -0.01, 0.01);
        const Attributes attrs = fp8_attrs(ta, tb, fa, fb);
        const std::vector<double> want =
            quantized_product(a, b, ta, tb, fp8_format(fa), fp8_format(fb));
        const Tensor got = testing::run_reference(Op::kMatmul, {a, b}, attrs)[0];
        const Tensor exact = testing::run_reference(Op::kMatmul, {a, b}, fp8_attrs(ta, tb, "", ""))[0];
        double err = 0, quantization = 0, norm = 0;
        for (int64_t i = 0; i < got.numel(); ++i) {
          err = std::max(err, std::abs(got.get(i) - want[i]) / (std::abs(want[i]) + 1e-6));
          quantization += std::pow(got.get(i) - exact.get(i), 2);
          norm += std::pow(exact.get(i), 2);
        }
        EXPECT_LT(err, 1e-6) << fa << " x " << fb << " ta " << ta << " tb " << tb;
        // Rounded to 2-3 mantissa bits: a visible but small error against the exact product.
        const double relative = std::sqrt(quantization / norm);
        EXPECT_GT(relative, 1e-3) << fa << " x " << fb;
        EXPECT_LT(relative, fa == std::string("e4m3") && fb == std::string("e4m3") ? 0.05 : 0.1);
        testing::expect_matches_reference("openblas", Op::kMatmul, {a, b}, attrs, {1e-6, 1e-4});
      }
}

TEST(MatmulFp8, BadFormatsAreOneClearError) {
  Tensor a = testing::rand(DType::kF32, {16, 16}, 1), b = testing::rand(DType::kF32, {16, 16}, 2);
  EXPECT_KILN_ERROR(testing::infer(Op::kMatmul, {a.type(), b.type()}, fp8_attrs(false, false, "e4m3", "")),
                    "fp8_a is 'e4m3' and fp8_b is ''", "both");
  EXPECT_KILN_ERROR(testing::infer(Op::kMatmul, {a.type(), b.type()}, fp8_attrs(false, false, "e5m2", "e5m2")),
                    "both e5m2");
  EXPECT_KILN_ERROR(testing::infer(Op::kMatmul, {a.type(), b.type()}, fp8_attrs(false, false, "e3m4", "e4m3")),
                    "'e3m4'", "e4m3 or e5m2");
  // fp8_grad: only on an fp8 matmul, a known format, never e5m2 against an e5m2 operand.
  Attributes grad_alone = fp8_attrs(false, false, "", "");
  grad_alone.set("fp8_grad", std::string("e4m3"));
  EXPECT_KILN_ERROR(testing::infer(Op::kMatmul, {a.type(), b.type()}, grad_alone), "fp8_grad is 'e4m3'",
                    "without fp8_a");
  Attributes two_e5m2 = fp8_attrs(false, false, "e5m2", "e4m3");
  two_e5m2.set("fp8_grad", std::string("e5m2"));
  EXPECT_KILN_ERROR(testing::infer(Op::kMatmul, {a.type(), b.type()}, two_e5m2), "two e5m2");
  Attributes fast_alone = fp8_attrs(false, false, "", "");
  fast_alone.set("fp8_fast_accum", true);
  EXPECT_KILN_ERROR(testing::infer(Op::kMatmul, {a.type(), b.type()}, fast_alone), "fp8_fast_accum",
                    "without fp8_a");
  Attributes unknown = fp8_attrs(false, false, "e4m3", "e4m3");
  unknown.set("fp8_grad", std::string("f8"));
  EXPECT_KILN_ERROR(testing::infer(Op::kMatmul, {a.type(), b.type()}, unknown), "'f8'");
}

// llama-tiny's forward under bf16, then the fp8-linear pass.
Graph fp8_forward() {
  Graph g = models::by_name("llama-tiny", 2, 32);
  MixedPrecisionPass().run(g);
  Fp8LinearOptions every;
  every.every_linear = true;
  Fp8Linear(every).run(g);
  return g;
}

bool reads_param(const Graph& g, ValueId id) {
  for (;;) {
    for (const GraphInput& in : g.inputs)
      if (in.value == id) return in.role == Role::kParam;
    const Node* producer = nullptr;
    for (const Node& n : g.nodes)
      if (n.outputs[0] == id) producer = &n;
    if (producer == nullptr || producer->op != Op::kCast) return false;
    id = producer->inputs[0];
  }
}

// Whether `id` flows into the cross_entropy through casts and reshapes (the logits).
bool reaches_loss(const Graph& g, ValueId id) {
  for (const Node& r : g.nodes) {
    if (std::find(r.inputs.begin(), r.inputs.end(), id) == r.inputs.end()) continue;
    if (r.op == Op::kCrossEntropy) return true;
    if ((r.op == Op::kCast || r.op == Op::kReshape) && reaches_loss(g, r.outputs[0])) return true;
  }
  return false;
}

TEST(Fp8Linear, MarksTheBlocksLinearLayersNotTheHeadNorAttention) {
  const Graph g = fp8_forward();
  const models::LlamaConfig c = models::llama_config("llama-tiny");
  int marked = 0, head = 0;
  for (const Node& n : g.nodes) {
    if (n.op != Op::kMatmul) continue;
    const MatmulFp8 f = matmul_fp8(n.attrs);
    if (reaches_loss(g, n.outputs[0])) {
      ++head;
      EXPECT_FALSE(f.on()) << "the classifier stays in bf16";
      continue;
    }
    EXPECT_TRUE(reads_param(g, n.inputs[1]));
    EXPECT_EQ(f.a, Fp8Format::kE4M3);
    EXPECT_EQ(f.b, Fp8Format::kE4M3);
    ++marked;
  }
  EXPECT_EQ(head, 1);
  // Per block: q, k, v (or qkv), o, w1, w3 (or w13), w2: at least 4 products, at most 7.
  EXPECT_GE(marked, 4 * c.layers);
  EXPECT_LE(marked, 7 * c.layers);
}

// The backward's products are fp8 too: per forward product two (dx and dW), each with the
// incoming gradient in --fp8-grad's format and the other operand e4m3; only the forward's may use
// fast accumulation.
TEST(Fp8Linear, GradientProductsAreFp8WithTheGradientInTheAskedFormatSummedExactly) {
  for (const char* grad : {"e4m3", "e5m2"}) {
    SCOPED_TRACE(grad);
    OptimizerConfig config;
    config.amp = "fp8";
    config.fp8_every_linear = true;
    config.fp8_grad = grad;
    const Graph g = build_training_graph(models::by_name("llama-tiny", 2, 32), config).graph;
    int forward = 0, backward = 0, e5m2 = 0;
    for (const Node& n : g.nodes) {
      if (n.op != Op::kMatmul || !matmul_fp8(n.attrs).on()) continue;
      const MatmulFp8 f = matmul_fp8(n.attrs);
      if (n.attrs.has("fp8_grad")) {  // the pass marks the forward products, autodiff makes the rest
        ++forward;
        EXPECT_EQ(n.attrs.s("fp8_grad"), grad);
        EXPECT_TRUE(f.fast_accum) << "the forward's products may sum fast, as torchao's";
        EXPECT_EQ(f.a, Fp8Format::kE4M3);
        EXPECT_EQ(f.b, Fp8Format::kE4M3);
        continue;
      }
      ++backward;
      EXPECT_FALSE(f.fast_accum) << "the backward's long sums stay exact";
      const int e5m2_operands = (f.a == Fp8Format::kE5M2) + (f.b == Fp8Format::kE5M2);
      EXPECT_EQ(e5m2_operands, std::string(grad) == "e5m2" ? 1 : 0);
      e5m2 += e5m2_operands;
    }
    ASSERT_GT(forward, 0);
    EXPECT_EQ(backward, 2 * forward);
    EXPECT_EQ(e5m2, std::string(grad) == "e5m2" ? backward : 0);
  }
  OptimizerConfig bad;
  bad.amp = "fp8";
  bad.fp8_grad = "e3m4";
  EXPECT_KILN_ERROR(build_training_graph(models::by_name("llama-tiny", 2, 32), bad), "'e3m4'", "e4m3 or e5m2");
}

// The cost model's choice: wide layers gain from fp8, narrow ones lose (their quantization, which
// grows with k (m + n), outweighs a saving that grows with m n k). On a model's graph: llama-1b
// keeps some products in bf16 and takes fp8 for others; llama-tiny takes none.
TEST(Fp8Linear, TheCostModelTakesFp8WhereItIsFaster) {
  const CostModel h100 = CostModel::defaults(Device::kCuda);
  const Fp8Estimate wide = fp8_estimate(h100, 8192, 2048, 8192), narrow = fp8_estimate(h100, 32768, 768, 768);
  EXPECT_LT(wide.fp8_s, wide.bf16_s);
  EXPECT_GT(narrow.fp8_s, narrow.bf16_s);
  auto marked = [](const std::string& model, int64_t batch, int64_t seq) {
    Graph g = models::by_name(model, batch, seq);
    MixedPrecisionPass().run(g);
    Fp8Linear().run(g);
    std::pair<int, int> fp8_and_not{0, 0};
    for (const Node& n : g.nodes)
      if (n.op == Op::kMatmul) (matmul_fp8(n.attrs).on() ? fp8_and_not.first : fp8_and_not.second)++;
    return fp8_and_not;
  };
  const auto [big_fp8, big_bf16] = marked("llama-1b", 4, 2048);
  EXPECT_GT(big_fp8, 0);
  EXPECT_GT(big_bf16, 0);
  EXPECT_EQ(marked("llama-tiny", 2, 32).first, 0);
}

// The run's log, and its final loss.
std::pair<std::string, double> train_llama_tiny(const std::string& amp, bool every_linear) {
  train::JobOptions o;
  o.model = "llama-tiny";
  o.data = "";  // the default text
  o.batch = 2;
  o.seq = 32;
  o.steps = 30;
  o.eval_every = 0;
  o.eval_batches = 1;
  o.optimizer.lr = 3e-3;
  o.optimizer.amp = amp;
  o.optimizer.fp8_every_linear = every_linear;
  const std::string log = (std::filesystem::temp_directory_path() / "kiln_fp8_train_log.txt").string();
  o.out = std::fopen(log.c_str(), "w");
  const train::JobResult r = train::run_training_job(o);
  std::fclose(o.out);
  std::ifstream in(log);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(log);
  return {text, r.final_loss};
}

TEST(Fp8Training, TinyLlamaLearnsAsInBf16AndTheLogSaysWhatRanInFp8) {
  const auto [bf16_log, bf16] = train_llama_tiny("bf16", false);
  // llama-tiny's layers are too small to gain: every one is forced.
  const auto [fp8_log, fp8] = train_llama_tiny("fp8", true);
  EXPECT_LT(fp8, 5.2);  // ln(256) = 5.55 at the start
  EXPECT_NEAR(fp8, bf16, 0.03 * bf16);
  EXPECT_NE(fp8, bf16);  // the fp8 products ran: the losses differ in their low bits
  EXPECT_EQ(bf16_log.find("fp8:"), std::string::npos) << bf16_log;
  // Each forward product the pass marks has two gradient products.
  int marked = 0;
  for (const Node& n : fp8_forward().nodes) marked += n.op == Op::kMatmul && matmul_fp8(n.attrs).on();
  EXPECT_NE(fp8_log.find(fmt::format("fp8: {} of the ", 3 * marked)), std::string::npos) << fp8_log;
  // Left to the cost model, none is fp8, and the log says so rather than training bf16 silently.
  const auto [gated_log, gated] = train_llama_tiny("fp8", false);
  EXPECT_NE(gated_log.find("fp8: none of the"), std::string::npos) << gated_log;
  EXPECT_EQ(gated, bf16);
}

}  // namespace
}  // namespace kiln
