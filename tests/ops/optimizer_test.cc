// sgd_update and adamw_update: inference, errors, and one- and two-step values worked out by hand.
#include <cmath>

#include "test_util.h"

namespace kiln {
namespace {
using testing::make;
using testing::run_reference;

TEST(OptimizerOps, SgdPlainMomentumNesterovAndWeightDecay) {
  Tensor p = make(DType::kF32, {2}, {1.0, -2.0});
  Tensor g = make(DType::kF32, {2}, {0.5, 0.25});
  Tensor buf = make(DType::kF32, {2}, {0.2, -0.4});
  Tensor lr = make(DType::kF32, {}, {0.1});
  // Plain SGD: p - lr g.
  auto out = run_reference(Op::kSgdUpdate, {p, g, buf, lr});
  EXPECT_FLOAT_EQ(out[0].get(0), 0.95f);
  EXPECT_FLOAT_EQ(out[0].get(1), -2.025f);
  // Momentum 0.9: buf' = 0.9 buf + g = (0.68, -0.11); p' = p - 0.1 buf'.
  out = run_reference(Op::kSgdUpdate, {p, g, buf, lr}, {{"momentum", 0.9}});
  EXPECT_FLOAT_EQ(out[1].get(0), 0.68f);
  EXPECT_FLOAT_EQ(out[1].get(1), -0.11f);
  EXPECT_FLOAT_EQ(out[0].get(0), 1.0f - 0.068f);
  EXPECT_FLOAT_EQ(out[0].get(1), -2.0f + 0.011f);
  // Nesterov: step = g + 0.9 buf' = (0.5 + 0.612, 0.25 - 0.099).
  out = run_reference(Op::kSgdUpdate, {p, g, buf, lr}, {{"momentum", 0.9}, {"nesterov", true}});
  EXPECT_FLOAT_EQ(out[0].get(0), 1.0f - 0.1112f);
  EXPECT_FLOAT_EQ(out[0].get(1), -2.0f - 0.0151f);
  // Weight decay 0.1 adds 0.1 p to the gradient: g = (0.6, 0.05).
  out = run_reference(Op::kSgdUpdate, {p, g, buf, lr}, {{"weight_decay", 0.1}});
  EXPECT_FLOAT_EQ(out[0].get(0), 0.94f);
  EXPECT_FLOAT_EQ(out[0].get(1), -2.005f);
}

TEST(OptimizerOps, AdamwFirstStepMovesByLrTimesSignOfGradient) {
  // At t = 1 with zero moments: mhat = g, vhat = g^2, so the step is lr * g/(|g| + eps) ~ lr sign(g),
  // plus decoupled decay lr * wd * p.
  Tensor p = make(DType::kF64, {3}, {1.0, -2.0, 0.5});
  Tensor g = make(DType::kF64, {3}, {0.3, -0.7, 2.0});
  Tensor zeros = make(DType::kF64, {3}, {0, 0, 0});
  Tensor lr = make(DType::kF64, {}, {0.01});
  Tensor t = make(DType::kF64, {}, {1});
  auto out = run_reference(Op::kAdamwUpdate, {p, g, zeros, zeros, lr, t}, {{"weight_decay", 0.1}, {"epsilon", 1e-8}});
  for (int i = 0; i < 3; ++i) {
    double gi = g.get(i), pi = p.get(i);
    EXPECT_NEAR(out[0].get(i), pi - 0.01 * (gi / (std::abs(gi) + 1e-8) + 0.1 * pi), 1e-12);
    EXPECT_NEAR(out[1].get(i), 0.1 * gi, 1e-15);
    EXPECT_NEAR(out[2].get(i), 0.001 * gi * gi, 1e-15);
  }
}

TEST(OptimizerOps, AdamwSecondStepUsesBiasCorrection) {
  Tensor p = make(DType::kF64, {1}, {0.5});
  Tensor g = make(DType::kF64, {1}, {0.2});
  Tensor m = make(DType::kF64, {1}, {0.04});  // after a first step with g = 0.4
  Tensor v = make(DType::kF64, {1}, {0.00016});
  Tensor lr = make(DType::kF64, {}, {0.1});
  Tensor t = make(DType::kF64, {}, {2});
  auto out = run_reference(Op::kAdamwUpdate, {p, g, m, v, lr, t}, {{"weight_decay", 0.0}});
  double m2 = 0.9 * 0.04 + 0.1 * 0.2;        // 0.056
  double v2 = 0.999 * 0.00016 + 0.001 * 0.04;  // 0.00019984
  double expected = 0.5 - 0.1 * (m2 / (1 - 0.81)) / (std::sqrt(v2 / (1 - 0.998001)) + 1e-8);
  EXPECT_NEAR(out[0].get(0), expected, 1e-12);
  EXPECT_NEAR(out[1].get(0), m2, 1e-15);
  EXPECT_NEAR(out[2].get(0), v2, 1e-15);
}

TEST(OptimizerOps, ShapeAndAttributeErrors) {
  TensorType p{DType::kF32, {2, 3}}, s{DType::kF32, {}};
  EXPECT_THROW(testing::infer(Op::kSgdUpdate, {p, {DType::kF32, {3, 2}}, p, s}), Error);
  EXPECT_THROW(testing::infer(Op::kSgdUpdate, {p, p, p, {DType::kF32, {1}}}), Error);
  EXPECT_THROW(testing::infer(Op::kSgdUpdate, {p, p, p, s}, {{"nesterov", true}}), Error);
  EXPECT_THROW(testing::infer(Op::kAdamwUpdate, {p, p, p, p, s, s}, {{"beta1", 1.0}}), Error);
  EXPECT_THROW(testing::infer(Op::kAdamwUpdate, {p, p, p, {DType::kF32, {2}}, s, s}), Error);
  EXPECT_THROW(testing::infer(Op::kAdamwUpdate, {{DType::kI32, {2, 3}}, p, p, p, s, s}), Error);
  auto types = testing::infer(Op::kAdamwUpdate, {p, p, p, p, s, s});
  ASSERT_EQ(types.size(), 3u);
  EXPECT_EQ(types[0], p);
}

}  // namespace
}  // namespace kiln
