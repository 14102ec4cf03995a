// The MLP and a 2-layer GPT built with the builder API, run by the executor, checked against
// an independent plain-C++ computation written here (no kiln ops involved).
#include <omp.h>

#include <cmath>
#include <cstring>

#include "models/models.h"
#include "runtime/executor.h"
#include "test_util.h"

namespace kiln {
namespace {

using Matrix = std::vector<double>;  // row-major

// y (n, m) = x (n, k) @ w (k, m) + b (m)
Matrix affine(const Matrix& x, const Matrix& w, const Matrix* b, int64_t n, int64_t k, int64_t m) {
  Matrix y(n * m, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) {
      double s = b ? (*b)[j] : 0.0;
      for (int64_t p = 0; p < k; ++p) s += x[i * k + p] * w[p * m + j];
      y[i * m + j] = s;
    }
  return y;
}

double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

Matrix layer_norm_rows(const Matrix& x, const Matrix& g, const Matrix& b, int64_t n, int64_t c) {
  Matrix y(x.size());
  for (int64_t i = 0; i < n; ++i) {
    double mean = 0, var = 0;
    for (int64_t j = 0; j < c; ++j) mean += x[i * c + j] / c;
    for (int64_t j = 0; j < c; ++j) var += (x[i * c + j] - mean) * (x[i * c + j] - mean) / c;
    for (int64_t j = 0; j < c; ++j)
      y[i * c + j] = (x[i * c + j] - mean) / std::sqrt(var + 1e-5) * g[j] + b[j];
  }
  return y;
}

// Mean over rows of logsumexp(row) - row[label].
double cross_entropy_rows(const Matrix& logits, const std::vector<int64_t>& labels, int64_t n, int64_t v) {
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    double mx = -INFINITY;
    for (int64_t j = 0; j < v; ++j) mx = std::max(mx, logits[i * v + j]);
    double s = 0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(logits[i * v + j] - mx);
    total += std::log(s) + mx - logits[i * v + labels[i]];
  }
  return total / n;
}

std::vector<Tensor> random_params(const Graph& g, uint64_t seed) {
  std::vector<Tensor> out;
  for (const GraphInput& in : g.inputs)
    if (in.role == Role::kParam) out.push_back(random_tensor(g.type(in.value), seed + out.size(), -0.5, 0.5));
  return out;
}

Matrix param(const Graph& g, const std::vector<Tensor>& params, const std::string& name) {
  size_t k = 0;
  for (const GraphInput& in : g.inputs) {
    if (in.role != Role::kParam) continue;
    if (g.value(in.value).name == name) return params[k].to_f64();
    ++k;
  }
  ADD_FAILURE() << "no param " << name;
  return {};
}

TEST(Models, MlpMatchesIndependentComputation) {
  models::MlpConfig config{5, 12, {7, 6}, 4};
  Graph g = models::mlp(config);
  std::vector<Tensor> inputs = random_params(g, 1);
  Tensor x = random_tensor({DType::kF32, {5, 12}}, 100);
  Tensor labels = testing::make(DType::kI64, {5}, {0, 3, 1, 2, 3});
  std::vector<Tensor> params = inputs;
  inputs.push_back(x);
  inputs.push_back(labels);
  std::vector<Tensor> out = Executor(g).run(inputs);

  Matrix h = x.to_f64();
  std::vector<int64_t> widths = {12, 7, 6, 4};
  for (int l = 0; l < 3; ++l) {
    Matrix w = param(g, params, fmt::format("fc{}.weight", l));
    Matrix b = param(g, params, fmt::format("fc{}.bias", l));
    h = affine(h, w, &b, 5, widths[l], widths[l + 1]);
    if (l < 2) for (double& v : h) v = gelu_tanh(v);
  }
  double loss = cross_entropy_rows(h, {0, 3, 1, 2, 3}, 5, 4);
  EXPECT_NEAR(out[0].get(0), loss, 1e-5 * std::max(1.0, std::abs(loss)));
  EXPECT_TRUE(testing::all_close(out[1], Tensor::from_f64(out[1].type(), h), 1e-5, 1e-4));
}

TEST(Models, GptMatchesIndependentComputation) {
  models::GptConfig c{2, 5, 11, 2, 2, 8, 0.0};
  const int64_t B = c.batch, T = c.seq, C = c.d_model, H = c.heads, D = C / H, V = c.vocab;
  Graph g = models::gpt(c);
  std::vector<Tensor> params = random_params(g, 7);
  Tensor idx = random_tensor({DType::kI64, {B, T}}, 200, 0, static_cast<double>(V));
  Tensor targets = random_tensor({DType::kI64, {B, T}}, 201, 0, static_cast<double>(V));
  std::vector<Tensor> inputs = params;
  inputs.push_back(idx);
  inputs.push_back(targets);
  std::vector<Tensor> out = Executor(g).run(inputs);

  auto P = [&](const std::string& n) { return param(g, params, n); };
  Matrix wte = P("wte"), wpe = P("wpe");
  const int64_t N = B * T;
  Matrix x(N * C);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < C; ++j)
        x[(b * T + t) * C + j] = wte[static_cast<int64_t>(idx.get(b * T + t)) * C + j] + wpe[t * C + j];
  for (int64_t l = 0; l < c.layers; ++l) {
    auto L = [&](const std::string& n) { return P(fmt::format("h{}.{}", l, n)); };
    Matrix h = layer_norm_rows(x, L("ln1.weight"), L("ln1.bias"), N, C);
    Matrix b_qkv = L("attn.bias");
    Matrix qkv = affine(h, L("attn.weight"), &b_qkv, N, C, 3 * C);
    Matrix y(N * C, 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hd = 0; hd < H; ++hd)
        for (int64_t i = 0; i < T; ++i) {
          std::vector<double> scores(i + 1);
          double mx = -INFINITY;
          for (int64_t j = 0; j <= i; ++j) {
            double s = 0;
            for (int64_t d = 0; d < D; ++d)
              s += qkv[(b * T + i) * 3 * C + hd * D + d] * qkv[(b * T + j) * 3 * C + C + hd * D + d];
            scores[j] = s / std::sqrt(static_cast<double>(D));
            mx = std::max(mx, scores[j]);
          }
          double z = 0;
          for (double& s : scores) z += (s = std::exp(s - mx));
          for (int64_t d = 0; d < D; ++d) {
            double acc = 0;
            for (int64_t j = 0; j <= i; ++j) acc += scores[j] / z * qkv[(b * T + j) * 3 * C + 2 * C + hd * D + d];
            y[(b * T + i) * C + hd * D + d] = acc;
          }
        }
    Matrix b_proj = L("proj.bias");
    Matrix a = affine(y, L("proj.weight"), &b_proj, N, C, C);
    for (int64_t i = 0; i < N * C; ++i) x[i] += a[i];
    h = layer_norm_rows(x, L("ln2.weight"), L("ln2.bias"), N, C);
    Matrix b_fc = L("fc.bias"), b_fc2 = L("fc2.bias");
    Matrix m = affine(h, L("fc.weight"), &b_fc, N, C, 4 * C);
    for (double& v : m) v = gelu_tanh(v);
    m = affine(m, L("fc2.weight"), &b_fc2, N, 4 * C, C);
    for (int64_t i = 0; i < N * C; ++i) x[i] += m[i];
  }
  x = layer_norm_rows(x, P("lnf.weight"), P("lnf.bias"), N, C);
  Matrix logits(N * V, 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t v = 0; v < V; ++v)
      for (int64_t j = 0; j < C; ++j) logits[i * V + v] += x[i * C + j] * wte[v * C + j];
  std::vector<int64_t> labels(N);
  for (int64_t i = 0; i < N; ++i) labels[i] = static_cast<int64_t>(targets.get(i));
  double loss = cross_entropy_rows(logits, labels, N, V);

  EXPECT_NEAR(out[0].get(0), loss, 1e-4 * std::max(1.0, std::abs(loss)));
  EXPECT_TRUE(testing::all_close(out[1], Tensor::from_f64(out[1].type(), logits), 1e-4, 1e-4));
}

TEST(Models, BuilderRejectsBadShapesAtTheLineThatBuiltThem) {
  Builder b("bad");
  Expr x = b.data("x", {4, 3});
  Expr w = b.param("w", {5, 2});
  try {
    matmul(x, w);
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("matmul"), std::string::npos) << m;
    EXPECT_NE(m.find("(4, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find("(5, 2)"), std::string::npos) << m;
  }
  EXPECT_EQ(b.graph().nodes.size(), 0u);  // the failed node left nothing behind
  EXPECT_THROW(b.param("x", {1}), Error);  // duplicate name
  EXPECT_THROW(b.finish({}), Error);       // no outputs
}

TEST(Models, InitParamsFollowsGpt2Initialization) {
  models::GptConfig c = models::gpt_config("gpt2-tiny");
  Graph g = models::gpt(c);
  std::vector<Tensor> params = models::init_params(g, 3, c.layers);
  size_t k = 0;
  for (const GraphInput& in : g.inputs) {
    if (in.role != Role::kParam) continue;
    const std::string& name = g.value(in.value).name;
    std::vector<double> v = params[k++].to_f64();
    double mean = 0, sq = 0;
    for (double e : v) mean += e / v.size();
    for (double e : v) sq += (e - mean) * (e - mean) / v.size();
    double stdev = std::sqrt(sq);
    if (name.find("ln") != std::string::npos && name.find(".weight") != std::string::npos) {
      EXPECT_EQ(mean, 1.0) << name;
    } else if (g.type(in.value).rank() == 1) {
      EXPECT_EQ(mean, 0.0) << name;
    } else if (name.find("proj.weight") != std::string::npos || name.find("fc2.weight") != std::string::npos) {
      EXPECT_NEAR(stdev, 0.02 / std::sqrt(2.0 * c.layers), 0.002) << name;
    } else {
      EXPECT_NEAR(stdev, 0.02, 0.002) << name;
    }
    if (g.type(in.value).rank() == 2) {
      // Normal, not just the right spread: about 68.3% within one standard deviation, 95.4% within
      // two (a uniform of the same spread would give 57.7% and 100%).
      EXPECT_NEAR(mean, 0.0, 0.1 * stdev) << name;
      double one = 0, two = 0;
      for (double e : v) {
        one += std::abs(e - mean) < stdev;
        two += std::abs(e - mean) < 2 * stdev;
      }
      // Three standard errors of a fraction of v.size() draws.
      auto tol = [&](double p) { return 3 * std::sqrt(p * (1 - p) / static_cast<double>(v.size())); };
      EXPECT_NEAR(one / v.size(), 0.6827, tol(0.6827)) << name;
      EXPECT_NEAR(two / v.size(), 0.9545, tol(0.9545)) << name;
    }
  }
}

TEST(Models, InitParamsDependOnTheSeedAloneNotTheThreads) {
  models::GptConfig c = models::gpt_config("gpt2-tiny");
  Graph g = models::gpt(c);
  const std::vector<Tensor> a = models::init_params(g, 3, c.layers), other = models::init_params(g, 4, c.layers);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<Tensor> one_thread = models::init_params(g, 3, c.layers);
  omp_set_num_threads(threads);
  ASSERT_EQ(a.size(), one_thread.size());
  size_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(std::memcmp(a[i].raw(), one_thread[i].raw(), a[i].bytes()), 0) << i;
    differ += a[i].rank() == 2 && std::memcmp(a[i].raw(), other[i].raw(), a[i].bytes()) != 0;
  }
  EXPECT_GT(differ, 0u);
  // Distinct tensors draw distinct values (each its own seed).
  EXPECT_NE(std::memcmp(a[0].raw(), a[1].raw(), std::min(a[0].bytes(), a[1].bytes())), 0);
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// A zero3 rank draws only its shards: laid end to end (padding dropped) they are init_params'
// values bit for bit, for group sizes that pad and that do not.
TEST(Models, InitParamShardsAreTheRanksSlicesOfInitParams) {
  models::GptConfig c = models::gpt_config("gpt2-tiny");
  c.batch = 2;
  c.seq = 16;
  const Graph g = models::gpt(c);
  const std::vector<Tensor> whole = models::init_params(g, 11, c.layers);
  for (int world : {1, 2, 3, 4}) {
    std::vector<std::vector<Tensor>> ranks;
    for (int r = 0; r < world; ++r) ranks.push_back(models::init_param_shards(g, 11, c.layers, world, r));
    for (size_t p = 0; p < whole.size(); ++p) {
      const int64_t n = whole[p].numel(), k = ranks[0][p].numel();
      ASSERT_EQ(k, (n + world - 1) / world);
      for (int64_t i = 0; i < k * world; ++i) {
        const double got = ranks[static_cast<size_t>(i / k)][p].get(i % k);
        ASSERT_EQ(got, i < n ? whole[p].get(i) : 0.0) << "param " << p << " element " << i << " world " << world;
      }
    }
  }
}

}  // namespace
}  // namespace kiln
