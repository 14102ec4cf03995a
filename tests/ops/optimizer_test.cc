// optimizer_update and the optimizer registry: hand-checked steps, several steps on random data
// against float64 references written here from PyTorch's and the papers' formulas (not from
// ops/optimizer/rules.h), inference errors, and the entries' slots and hyperparameters.
#include <cmath>
#include <functional>

#include "ops/optimizer/optimizers.h"
#include "test_util.h"

namespace kiln {
namespace {
using testing::make;
using testing::run_reference;

Attributes with_optimizer(const std::string& name, Attributes attrs = {}) {
  attrs.set("optimizer", name);
  return attrs;
}

TEST(OptimizerOps, SgdPlainMomentumNesterovAndWeightDecay) {
  Tensor p = make(DType::kF32, {2}, {1.0, -2.0});
  Tensor g = make(DType::kF32, {2}, {0.5, 0.25});
  Tensor buf = make(DType::kF32, {2}, {0.2, -0.4});
  Tensor lr = make(DType::kF32, {}, {0.1});
  Tensor t = make(DType::kF32, {}, {2});
  const Op op = Op::kOptimizerUpdate;
  // Plain SGD: p - lr g.
  auto out = run_reference(op, {p, g, buf, lr, t}, with_optimizer("sgd"));
  EXPECT_FLOAT_EQ(out[0].get(0), 0.95f);
  EXPECT_FLOAT_EQ(out[0].get(1), -2.025f);
  // Momentum 0.9: buf' = 0.9 buf + g = (0.68, -0.11); p' = p - 0.1 buf'.
  out = run_reference(op, {p, g, buf, lr, t}, with_optimizer("sgd", {{"momentum", 0.9}}));
  EXPECT_FLOAT_EQ(out[1].get(0), 0.68f);
  EXPECT_FLOAT_EQ(out[1].get(1), -0.11f);
  EXPECT_FLOAT_EQ(out[0].get(0), 1.0f - 0.068f);
  EXPECT_FLOAT_EQ(out[0].get(1), -2.0f + 0.011f);
  // Nesterov: step = g + 0.9 buf' = (0.5 + 0.612, 0.25 - 0.099).
  out = run_reference(op, {p, g, buf, lr, t}, with_optimizer("sgd", {{"momentum", 0.9}, {"nesterov", true}}));
  EXPECT_FLOAT_EQ(out[0].get(0), 1.0f - 0.1112f);
  EXPECT_FLOAT_EQ(out[0].get(1), -2.0f - 0.0151f);
  // Weight decay 0.1 adds 0.1 p to the gradient: g = (0.6, 0.05).
  out = run_reference(op, {p, g, buf, lr, t}, with_optimizer("sgd", {{"weight_decay", 0.1}}));
  EXPECT_FLOAT_EQ(out[0].get(0), 0.94f);
  EXPECT_FLOAT_EQ(out[0].get(1), -2.005f);
}

TEST(OptimizerOps, AdamwSecondStepUsesBiasCorrection) {
  Tensor p = make(DType::kF64, {1}, {0.5});
  Tensor g = make(DType::kF64, {1}, {0.2});
  Tensor m = make(DType::kF64, {1}, {0.04});  // after a first step with g = 0.4
  Tensor v = make(DType::kF64, {1}, {0.00016});
  Tensor lr = make(DType::kF64, {}, {0.1});
  Tensor t = make(DType::kF64, {}, {2});
  auto out = run_reference(Op::kOptimizerUpdate, {p, g, m, v, lr, t}, with_optimizer("adamw", {{"weight_decay", 0.0}}));
  double m2 = 0.9 * 0.04 + 0.1 * 0.2;        // 0.056
  double v2 = 0.999 * 0.00016 + 0.001 * 0.04;  // 0.00019984
  double expected = 0.5 - 0.1 * (m2 / (1 - 0.81)) / (std::sqrt(v2 / (1 - 0.998001)) + 1e-8);
  EXPECT_NEAR(out[0].get(0), expected, 1e-12);
  EXPECT_NEAR(out[1].get(0), m2, 1e-15);
  EXPECT_NEAR(out[2].get(0), v2, 1e-15);
}

// One optimizer's step on float64 vectors: param, gradient and state slots updated in place.
using ReferenceStep = std::function<void(std::vector<double>& p, const std::vector<double>& g,
                                         std::vector<std::vector<double>>& state, double lr, int t)>;

// `steps` updates of random params by random gradients (f64), each through the op's reference
// kernel and through `reference`, from zero state, as a training run would.
void expect_steps_match(const std::string& name, const Attributes& hyper, const ReferenceStep& reference,
                        int slots) {
  const int64_t n = 37;
  const Tensor start = testing::rand(DType::kF64, {n}, 11, -1.0, 1.0);
  std::vector<double> p_ref(n);
  for (int64_t i = 0; i < n; ++i) p_ref[static_cast<size_t>(i)] = start.get(i);
  std::vector<std::vector<double>> state_ref(static_cast<size_t>(slots), std::vector<double>(n, 0.0));
  Tensor p = start.clone();
  std::vector<Tensor> state;
  for (int j = 0; j < slots; ++j) state.push_back(make(DType::kF64, {n}, std::vector<double>(n, 0.0)));
  const double lr = 0.03;
  for (int t = 1; t <= 6; ++t) {
    const Tensor g = testing::rand(DType::kF64, {n}, 100 + static_cast<uint64_t>(t), -2.0, 2.0);
    std::vector<double> g_ref(n);
    for (int64_t i = 0; i < n; ++i) g_ref[static_cast<size_t>(i)] = g.get(i);
    std::vector<Tensor> inputs{p, g};
    inputs.insert(inputs.end(), state.begin(), state.end());
    inputs.push_back(make(DType::kF64, {}, {lr}));
    inputs.push_back(make(DType::kF64, {}, {static_cast<double>(t)}));
    const std::vector<Tensor> out = run_reference(Op::kOptimizerUpdate, inputs, with_optimizer(name, hyper));
    p = out[0];
    for (int j = 0; j < slots; ++j) state[static_cast<size_t>(j)] = out[1 + static_cast<size_t>(j)];
    reference(p_ref, g_ref, state_ref, lr, t);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(p.get(i), p_ref[static_cast<size_t>(i)], 1e-12) << name << " step " << t << " element " << i;
      for (int j = 0; j < slots; ++j)
        ASSERT_NEAR(state[static_cast<size_t>(j)].get(i), state_ref[static_cast<size_t>(j)][static_cast<size_t>(i)],
                    1e-12);
    }
  }
}

// torch.optim.SGD's step (dampening 0): d_p = g + wd p; buf = d_p at the first step, then
// momentum buf + d_p; nesterov: d_p + momentum buf, else buf.
TEST(OptimizerOps, SgdStepsMatchTorchsAlgorithm) {
  for (bool nesterov : {false, true}) {
    const double momentum = 0.9, wd = 0.05;
    expect_steps_match(
        "sgd", {{"momentum", momentum}, {"nesterov", nesterov}, {"weight_decay", wd}},
        [&](std::vector<double>& p, const std::vector<double>& g, std::vector<std::vector<double>>& s, double lr,
            int t) {
          for (size_t i = 0; i < p.size(); ++i) {
            const double d = g[i] + wd * p[i];
            s[0][i] = t == 1 ? d : momentum * s[0][i] + d;
            p[i] -= lr * (nesterov ? d + momentum * s[0][i] : s[0][i]);
          }
        },
        1);
  }
}

// torch.optim.AdamW's step: p *= 1 - lr wd; m, v moving averages; p -= lr mhat / (sqrt(vhat) + eps)
// (PyTorch divides sqrt(v) by sqrt(1 - b2^t) before adding eps, as here).
TEST(OptimizerOps, AdamwStepsMatchTorchsAlgorithm) {
  const double b1 = 0.85, b2 = 0.99, eps = 1e-6, wd = 0.1;
  expect_steps_match(
      "adamw", {{"beta1", b1}, {"beta2", b2}, {"epsilon", eps}, {"weight_decay", wd}},
      [&](std::vector<double>& p, const std::vector<double>& g, std::vector<std::vector<double>>& s, double lr,
          int t) {
        for (size_t i = 0; i < p.size(); ++i) {
          p[i] *= 1 - lr * wd;
          s[0][i] = b1 * s[0][i] + (1 - b1) * g[i];
          s[1][i] = b2 * s[1][i] + (1 - b2) * g[i] * g[i];
          const double denom = std::sqrt(s[1][i]) / std::sqrt(1 - std::pow(b2, t)) + eps;
          p[i] -= lr / (1 - std::pow(b1, t)) * s[0][i] / denom;
        }
      },
      2);
}

// Lion (Chen et al. 2023, Algorithm 2): c = b1 m + (1 - b1) g; p -= lr (sign(c) + wd p);
// m = b2 m + (1 - b2) g.
TEST(OptimizerOps, LionStepsMatchThePaper) {
  const double b1 = 0.9, b2 = 0.99, wd = 0.2;
  expect_steps_match(
      "lion", {{"beta1", b1}, {"beta2", b2}, {"weight_decay", wd}},
      [&](std::vector<double>& p, const std::vector<double>& g, std::vector<std::vector<double>>& s, double lr, int) {
        for (size_t i = 0; i < p.size(); ++i) {
          const double c = b1 * s[0][i] + (1 - b1) * g[i];
          const double sign = c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0;
          p[i] -= lr * (sign + wd * p[i]);
          s[0][i] = b2 * s[0][i] + (1 - b2) * g[i];
        }
      },
      1);
}

TEST(OptimizerOps, ShapeAndAttributeErrors) {
  TensorType p{DType::kF32, {2, 3}}, s{DType::kF32, {}};
  const Op op = Op::kOptimizerUpdate;
  const Attributes sgd = with_optimizer("sgd"), adamw = with_optimizer("adamw");
  EXPECT_KILN_ERROR(testing::infer(op, {p, {DType::kF32, {3, 2}}, p, s, s}, sgd), "grad has shape (3, 2)");
  EXPECT_KILN_ERROR(testing::infer(op, {p, p, p, {DType::kF32, {1}}, s}, sgd), "lr must be a float scalar");
  EXPECT_KILN_ERROR(testing::infer(op, {p, p, p, s, s}, with_optimizer("sgd", {{"nesterov", true}})),
                    "nesterov needs momentum > 0");
  EXPECT_KILN_ERROR(testing::infer(op, {p, p, p, p, s, s}, with_optimizer("adamw", {{"beta1", 1.0}})),
                    "beta1 must be in [0, 1), got 1");
  EXPECT_KILN_ERROR(testing::infer(op, {p, p, p, {DType::kF32, {2}}, s, s}, adamw),
                    "state slot v has shape (2,), expected the param's (2, 3)");
  EXPECT_KILN_ERROR(testing::infer(op, {{DType::kI32, {2, 3}}, p, p, p, s, s}, adamw), "param must be float");
  EXPECT_KILN_ERROR(testing::infer(op, {p, p, p, s, s}, adamw), "takes param, grad, 2 state slot(s), lr and step");
  EXPECT_KILN_ERROR(testing::infer(op, {p, p, p, p, s, s}, with_optimizer("adamw", {{"momentum", 0.9}})),
                    "optimizer adamw has no hyperparameter 'momentum'");
  EXPECT_KILN_ERROR(testing::infer(op, {p, p, p, s, s}, with_optimizer("adam")), "unknown optimizer 'adam'",
                    "sgd, adamw, lion, adafactor");
  EXPECT_KILN_ERROR(testing::infer(op, {p, p, p, s, s}, with_optimizer("adafactor")),
                    "adafactor is built from graph ops");
  auto types = testing::infer(op, {p, p, p, p, s, s}, adamw);
  ASSERT_EQ(types.size(), 3u);
  EXPECT_EQ(types[0], p);
}

TEST(OptimizerRegistry, EntriesHaveTorchDefaultsAndTheirSlots) {
  const optim::OptimizerDef& adamw = optim::optimizer_def("adamw");
  EXPECT_EQ(adamw.find_hyper("weight_decay")->default_value, 0.01);
  EXPECT_EQ(adamw.find_hyper("beta1")->default_value, 0.9);
  EXPECT_EQ(adamw.find_hyper("beta2")->default_value, 0.999);
  EXPECT_EQ(adamw.find_hyper("epsilon")->default_value, 1e-8);
  EXPECT_EQ(adamw.state_per_param_element(), 2);
  EXPECT_EQ(optim::optimizer_def("sgd").find_hyper("momentum")->default_value, 0.0);
  EXPECT_EQ(optim::optimizer_def("lion").slots.size(), 1u);
  EXPECT_EQ(optim::optimizer_def("adafactor").state_per_param_element(), 0);
  EXPECT_KILN_ERROR(optim::optimizer_def("adam"), "unknown optimizer 'adam' (expected sgd, adamw, lion, adafactor)");
  EXPECT_KILN_ERROR(optim::hyper_attributes(adamw, {{"betas", 0.9}}),
                    "optimizer adamw has no hyperparameter 'betas' (it has: beta1, beta2, epsilon, weight_decay)");
  // Adafactor's factored slots: rows and columns of a matrix (per leading index), the whole
  // second moment of a vector.
  const optim::OptimizerDef& adafactor = optim::optimizer_def("adafactor");
  EXPECT_EQ(optim::slot_shape(adafactor.slots[0], {2, 5, 3}), (Shape{2, 5}));
  EXPECT_EQ(optim::slot_shape(adafactor.slots[1], {2, 5, 3}), (Shape{2, 3}));
  EXPECT_FALSE(optim::slot_shape(adafactor.slots[2], {2, 5, 3}).has_value());
  EXPECT_EQ(optim::slot_shape(adafactor.slots[2], {7}), (Shape{7}));
  EXPECT_FALSE(optim::slot_shape(adafactor.slots[0], {7}).has_value());
  // The offload pass moves state that optimizer_update nodes alone read and update: the
  // elementwise optimizers' slots, the ones their entries call offloadable.
  for (const optim::OptimizerDef& def : optim::optimizers())
    for (const optim::StateSlot& slot : def.slots) EXPECT_EQ(slot.offloadable, def.elementwise) << def.name;
}

}  // namespace
}  // namespace kiln
