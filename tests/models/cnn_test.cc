// The CNN of the model zoo (src/models/cnn.cc) and init_params_fan_in (src/models/init.cc): the
// graph's inputs, names and shapes; a forward run through the executor against a plain-C++
// computation written here (no kiln ops); the loss at initialization near ln(10); the fast
// dialects against the reference on a batch; and a float64 gradient check of the whole graph.
#include <cmath>

#include "gradcheck.h"
#include "models/models.h"
#include "runtime/executor.h"

namespace kiln {
namespace {

using Vec = std::vector<double>;

// Params then data: the order the model zoo promises.
std::vector<std::string> input_names(const Graph& g) {
  std::vector<std::string> names;
  for (const GraphInput& in : g.inputs) names.push_back(g.value(in.value).name);
  return names;
}

// Labels in [0, classes) and images in [0, 1), like normalized pixels.
std::vector<Tensor> data_inputs(const models::CnnConfig& c, uint64_t seed) {
  Tensor x = random_tensor({c.dtype, {c.batch, c.channels, c.height, c.width}}, seed, 0.0, 1.0);
  Tensor labels =
      random_tensor({DType::kI64, {c.batch}}, seed + 1, 0.0, static_cast<double>(c.classes));
  return {x, labels};
}

TEST(Cnn, GraphInputsOutputsAndShapes) {
  Graph g = models::cnn(models::CnnConfig{});
  EXPECT_EQ(g.name, "cnn");
  EXPECT_EQ(input_names(g),
            (std::vector<std::string>{"conv0.weight", "conv0.bias", "conv1.weight", "conv1.bias",
                                      "fc.weight", "fc.bias", "x", "labels"}));
  const std::vector<TensorType> expected = {{DType::kF32, {16, 1, 3, 3}},
                                            {DType::kF32, {16}},
                                            {DType::kF32, {32, 16, 3, 3}},
                                            {DType::kF32, {32}},
                                            {DType::kF32, {1568, 10}},  // 32 channels * 7 * 7
                                            {DType::kF32, {10}},
                                            {DType::kF32, {32, 1, 28, 28}},
                                            {DType::kI64, {32}}};
  for (size_t i = 0; i < g.inputs.size(); ++i)
    EXPECT_EQ(g.type(g.inputs[i].value), expected[i]) << i;
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(g.inputs[i].role, Role::kParam);
  EXPECT_EQ(g.inputs[6].role, Role::kData);
  EXPECT_EQ(g.inputs[7].role, Role::kData);
  ASSERT_EQ(g.outputs.size(), 2u);
  EXPECT_EQ(g.value(g.outputs[0]).name, "loss");
  EXPECT_EQ(g.value(g.outputs[1]).name, "logits");
  EXPECT_EQ(g.type(g.outputs[0]), (TensorType{DType::kF32, {}}));
  EXPECT_EQ(g.type(g.outputs[1]), (TensorType{DType::kF32, {32, 10}}));

  // Odd sizes round down at each pool: 15 -> 7 -> 3.
  Graph odd = models::cnn({2, 3, 15, 15, {4, 5}, 6});
  EXPECT_EQ(odd.type(odd.inputs[4].value).shape, (Shape{5 * 3 * 3, 6}));
}

TEST(Cnn, RejectsImagesTooSmallForItsStages) {
  try {
    models::cnn({2, 1, 5, 5, {4, 4, 4}, 3});  // 5 -> 2 -> 1 -> 0
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("5x5"), std::string::npos) << e.what();
  }
  EXPECT_THROW(models::cnn({2, 1, 8, 8, {}, 3}), Error);
}

TEST(Cnn, InitParamsFanIn) {
  Graph g = models::cnn(models::CnnConfig{});
  std::vector<Tensor> params = models::init_params_fan_in(g, 5);
  ASSERT_EQ(params.size(), 6u);
  // fan_in: conv0 1*3*3 = 9, conv1 16*3*3 = 144, fc 1568 (its first dim).
  const std::vector<double> bounds = {1.0 / 3.0, 0.0, 1.0 / 12.0, 0.0, 1.0 / std::sqrt(1568.0),
                                      0.0};
  for (size_t i = 0; i < params.size(); ++i) {
    SCOPED_TRACE(input_names(g)[i]);
    EXPECT_EQ(params[i].type(), g.type(g.inputs[i].value));
    double max_abs = 0.0, mean = 0.0;
    for (int64_t j = 0; j < params[i].numel(); ++j) {
      max_abs = std::max(max_abs, std::abs(params[i].get(j)));
      mean += params[i].get(j) / static_cast<double>(params[i].numel());
    }
    if (bounds[i] == 0.0) {
      EXPECT_EQ(max_abs, 0.0);  // biases
      continue;
    }
    EXPECT_LE(max_abs, bounds[i]);
    EXPECT_GT(max_abs, 0.8 * bounds[i]);  // spread over the range, not bunched near 0
    EXPECT_LT(std::abs(mean), 0.2 * bounds[i]);
  }
  // Deterministic in the seed; another seed, other values.
  std::vector<Tensor> again = models::init_params_fan_in(g, 5),
                      other = models::init_params_fan_in(g, 6);
  EXPECT_EQ(again[2].to_f64(), params[2].to_f64());
  EXPECT_NE(other[2].to_f64(), params[2].to_f64());
}

// ---- an independent forward pass in plain C++ ----

// (N, C, H, W) -> (N, O, H, W): 3x3 conv, padding 1, plus bias.
Vec conv3x3(const Vec& x, const Vec& w, const Vec& b, int64_t n, int64_t c, int64_t h, int64_t wd,
            int64_t o) {
  Vec y(n * o * h * wd);
  for (int64_t in = 0; in < n; ++in)
    for (int64_t oc = 0; oc < o; ++oc)
      for (int64_t i = 0; i < h; ++i)
        for (int64_t j = 0; j < wd; ++j) {
          double s = b[oc];
          for (int64_t ic = 0; ic < c; ++ic)
            for (int64_t di = -1; di <= 1; ++di)
              for (int64_t dj = -1; dj <= 1; ++dj) {
                if (i + di < 0 || i + di >= h || j + dj < 0 || j + dj >= wd) continue;
                s += x[((in * c + ic) * h + i + di) * wd + j + dj] *
                     w[((oc * c + ic) * 3 + di + 1) * 3 + dj + 1];
              }
          y[((in * o + oc) * h + i) * wd + j] = s;
        }
  return y;
}

// relu, then 2x2 max pool with stride 2: (planes, H, W) -> (planes, H/2, W/2).
Vec relu_pool(const Vec& x, int64_t planes, int64_t h, int64_t w) {
  Vec y(planes * (h / 2) * (w / 2));
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t i = 0; i < h / 2; ++i)
      for (int64_t j = 0; j < w / 2; ++j) {
        double m = 0.0;  // relu then max == max of 0 and the window
        for (int64_t a = 0; a < 2; ++a)
          for (int64_t c = 0; c < 2; ++c) m = std::max(m, x[(p * h + 2 * i + a) * w + 2 * j + c]);
        y[(p * (h / 2) + i) * (w / 2) + j] = m;
      }
  return y;
}

TEST(Cnn, ForwardMatchesIndependentComputation) {
  const models::CnnConfig c{3, 2, 9, 10, {4, 3}, 5};  // 9x10 -> 4x5 -> 2x2
  Graph g = models::cnn(c);
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < 6; ++i)
    inputs.push_back(random_tensor(g.type(g.inputs[i].value), 10 + i, -0.5, 0.5));
  for (Tensor& t : data_inputs(c, 50)) inputs.push_back(t);
  std::vector<Tensor> out = Executor(g).run(inputs);

  Vec h = inputs[6].to_f64();
  int64_t channels = 2, height = 9, width = 10;
  for (int s = 0; s < 2; ++s) {
    const int64_t o = c.conv_channels[s];
    h = conv3x3(h, inputs[2 * s].to_f64(), inputs[2 * s + 1].to_f64(), 3, channels, height, width,
                o);
    h = relu_pool(h, 3 * o, height, width);
    channels = o, height /= 2, width /= 2;
  }
  const int64_t features = channels * height * width;  // 3 * 2 * 2
  const Vec fw = inputs[4].to_f64(), fb = inputs[5].to_f64();
  double loss = 0.0;
  Vec logits(3 * 5);
  for (int64_t n = 0; n < 3; ++n) {
    for (int64_t k = 0; k < 5; ++k) {
      double s = fb[k];
      for (int64_t f = 0; f < features; ++f) s += h[n * features + f] * fw[f * 5 + k];
      logits[n * 5 + k] = s;
    }
    double z = 0.0;
    for (int64_t k = 0; k < 5; ++k) z += std::exp(logits[n * 5 + k]);
    loss += (std::log(z) - logits[n * 5 + static_cast<int64_t>(inputs[7].get(n))]) / 3.0;
  }
  EXPECT_NEAR(out[0].get(0), loss, 1e-5);
  EXPECT_TRUE(testing::all_close(out[1], Tensor::from_f64(out[1].type(), logits), 1e-5, 1e-4));
}

TEST(Cnn, LossAtInitIsNearLn10AndFastMatchesReference) {
  models::CnnConfig c;
  c.batch = 8;
  Graph g = models::cnn(c);
  std::vector<Tensor> inputs = models::init_params_fan_in(g, 1);
  for (Tensor& t : data_inputs(c, 7)) inputs.push_back(t);

  Executor fast(g);
  std::vector<std::string> dialects = fast.node_dialects();
  EXPECT_NE(std::find(dialects.begin(), dialects.end(), "openblas"), dialects.end());
  std::vector<Tensor> out = fast.run(inputs);
  const double loss = out[0].get(0);
  ASSERT_TRUE(std::isfinite(loss));
  // Small logits at init: nearly uniform predictions over 10 classes.
  EXPECT_NEAR(loss, std::log(10.0), 0.3);

  std::vector<Tensor> reference = Executor(g, {Device::kCpu, {"reference"}}).run(inputs);
  EXPECT_NEAR(loss, reference[0].get(0), 1e-5);
  EXPECT_TRUE(testing::all_close(out[1], reference[1], 1e-5, 1e-4));
}

TEST(Cnn, WholeGraphGradientsFloat64) {
  models::CnnConfig c{2, 2, 8, 7, {3, 2}, 4};  // 8x7 -> 4x3 -> 2x1
  c.dtype = DType::kF64;
  Graph g = models::cnn(c);
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < 6; ++i)
    inputs.push_back(random_tensor(g.type(g.inputs[i].value), 30 + i, -0.5, 0.5));
  for (Tensor& t : data_inputs(c, 60)) inputs.push_back(t);
  // Every param and the images.
  testing::expect_graph_gradients(g, 0, {0, 1, 2, 3, 4, 5, 6}, inputs);
}

}  // namespace
}  // namespace kiln
