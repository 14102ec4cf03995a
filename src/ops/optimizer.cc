// Optimizer updates, as ops of the training graph. Each returns the new values of the tensors it
// updates; Graph::updates then writes them back over the param and state inputs, so the whole
// step (forward, backward, update) is one graph and nothing is read back to the host.
//
//   sgd_update(param, grad, buf, lr) {momentum, nesterov, weight_decay} -> (param', buf')
//     g = grad + weight_decay * param; buf' = momentum * buf + g;
//     param' = param - lr * (nesterov ? g + momentum * buf' : (momentum > 0 ? buf' : g))
//     (PyTorch's SGD with dampening 0; a zero-initialized buf gives its first-step buf = g.)
//   adamw_update(param, grad, m, v, lr, step) {beta1, beta2, epsilon, weight_decay} -> (param', m', v')
//     m' = b1 m + (1 - b1) g; v' = b2 v + (1 - b2) g^2; step is t >= 1 (this update's number);
//     param' = param - lr * (m'/(1 - b1^t) / (sqrt(v'/(1 - b2^t)) + eps) + weight_decay * param)
//     (decoupled weight decay, as PyTorch's AdamW.)
// lr and step are f32/f64 scalars (shape ()), so a schedule needs no recompilation.
#include <cmath>

#include "ops/common.h"

namespace kiln::ops {
namespace {

void check_scalar(const TensorType& t, const char* what) {
  KILN_CHECK(t.rank() == 0 && is_float(t.dtype), "{} must be a float scalar, got {}", what, to_string(t));
}

void check_like(const TensorType& param, const TensorType& t, const char* what) {
  KILN_CHECK(t.shape == param.shape, "{} has shape {}, expected the param's {}", what,
             to_string(t.shape), to_string(param.shape));
  KILN_CHECK(is_float(t.dtype), "{} must be float, got {}", what, to_string(t));
}

}  // namespace

void define_optimizer_ops(OpRegistry& registry) {
  OpDef sgd{
      {with_default("momentum", 0.0), with_default("nesterov", false), with_default("weight_decay", 0.0)},
      [](std::span<const TensorType> in, const Attributes& a) {
        KILN_CHECK(is_float(in[0].dtype), "param must be float, got {}", to_string(in[0]));
        check_like(in[0], in[1], "grad");
        check_like(in[0], in[2], "momentum buffer");
        KILN_CHECK(in[2].dtype == in[0].dtype, "momentum buffer is {}, expected the param's dtype {}",
                   to_string(in[2]), dtype_name(in[0].dtype));
        check_scalar(in[3], "lr");
        KILN_CHECK(a.f("momentum") >= 0, "momentum must be >= 0, got {}", a.f("momentum"));
        KILN_CHECK(!a.b("nesterov") || a.f("momentum") > 0, "nesterov needs momentum > 0");
        return std::vector<TensorType>{in[0], in[2]};
      },
      [](const KernelArgs& k) {
        const double momentum = k.attrs.f("momentum"), wd = k.attrs.f("weight_decay");
        const bool nesterov = k.attrs.b("nesterov");
        const Tensor &param = k.inputs[0], &grad = k.inputs[1], &buf = k.inputs[2];
        const double lr = k.inputs[3].get(0);
        for (int64_t i = 0; i < param.numel(); ++i) {
          double p = param.get(i);
          double g = grad.get(i) + wd * p;
          double b = momentum * buf.get(i) + g;
          double step = nesterov ? g + momentum * b : (momentum > 0 ? b : g);
          k.outputs[0].set(i, p - lr * step);
          k.outputs[1].set(i, b);
        }
      },
      nullptr, false};
  registry.define(Op::kSgdUpdate, std::move(sgd));

  OpDef adamw{
      {with_default("beta1", 0.9), with_default("beta2", 0.999), with_default("epsilon", 1e-8),
       with_default("weight_decay", 0.01)},
      [](std::span<const TensorType> in, const Attributes& a) {
        KILN_CHECK(is_float(in[0].dtype), "param must be float, got {}", to_string(in[0]));
        check_like(in[0], in[1], "grad");
        check_like(in[0], in[2], "first moment m");
        check_like(in[0], in[3], "second moment v");
        check_scalar(in[4], "lr");
        check_scalar(in[5], "step");
        for (const char* beta : {"beta1", "beta2"})
          KILN_CHECK(a.f(beta) >= 0 && a.f(beta) < 1, "{} must be in [0, 1), got {}", beta, a.f(beta));
        KILN_CHECK(a.f("epsilon") > 0, "epsilon must be > 0, got {}", a.f("epsilon"));
        return std::vector<TensorType>{in[0], in[2], in[3]};
      },
      [](const KernelArgs& k) {
        const double b1 = k.attrs.f("beta1"), b2 = k.attrs.f("beta2");
        const double eps = k.attrs.f("epsilon"), wd = k.attrs.f("weight_decay");
        const double lr = k.inputs[4].get(0), t = k.inputs[5].get(0);
        const double correction1 = 1.0 - std::pow(b1, t), correction2 = 1.0 - std::pow(b2, t);
        for (int64_t i = 0; i < k.inputs[0].numel(); ++i) {
          double p = k.inputs[0].get(i), g = k.inputs[1].get(i);
          double m = b1 * k.inputs[2].get(i) + (1 - b1) * g;
          double v = b2 * k.inputs[3].get(i) + (1 - b2) * g * g;
          double update = (m / correction1) / (std::sqrt(v / correction2) + eps) + wd * p;
          k.outputs[0].set(i, p - lr * update);
          k.outputs[1].set(i, m);
          k.outputs[2].set(i, v);
        }
      },
      nullptr, false};
  registry.define(Op::kAdamwUpdate, std::move(adamw));
}

}  // namespace kiln::ops
