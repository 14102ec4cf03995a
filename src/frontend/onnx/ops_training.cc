// The optimizers of ONNX's ai.onnx.preview.training domain (Adagrad, Momentum, Adam): pure
// functions from (learning rate R, step count T, tensors, their gradients, their optimizer
// state) to the updated tensors and state, written out as elementwise kiln ops with the formulas
// the operators define. (kiln's own training step has its optimizer as graph ops of its own;
// these let a model that carries its update run as the file says.) T may come from the data.
#include "frontend/onnx/converter.h"

namespace kiln::onnx {
namespace {

constexpr const char* kTrainingDomain = "ai.onnx.preview.training:";

// The inputs after R and T come in `groups` runs of n tensors each (X..., G..., state...).
int64_t tensors_per_run(NodeContext& c, int groups) {
  const int rest = c.num_inputs() - 2;
  if (rest < groups || rest % groups != 0) c.fail("{} inputs after R and T, expected {} runs of the same length", rest, groups);
  return rest / groups;
}

// R and T as scalars of x's dtype.
std::pair<Expr, Expr> rate_and_step(NodeContext& c, const Expr& like) {
  Expr r = c.in(0), t = c.in(1);
  if (r.type().numel() != 1 || t.type().numel() != 1) c.fail("R and T must be scalars, got {} and {}", to_string(r.type()), to_string(t.type()));
  return {cast_to(reshape(r, {}), like.dtype()), cast_to(reshape(t, {}), like.dtype())};
}

std::vector<Expr> adagrad(NodeContext& c) {
  const int64_t n = tensors_per_run(c, 3);
  const double decay = c.attr_float("decay_factor", 0.0), epsilon = c.attr_float("epsilon", 1e-6),
               norm = c.attr_float("norm_coefficient", 0.0);
  std::vector<Expr> xs, hs;
  for (int64_t i = 0; i < n; ++i) {
    Expr x = c.in(static_cast<int>(2 + i)), g = c.in(static_cast<int>(2 + n + i)), h = c.in(static_cast<int>(2 + 2 * n + i));
    auto [r, t] = rate_and_step(c, x);
    Expr rate = r / (t * decay + 1.0);
    Expr gr = x * norm + g;
    Expr h_new = h + gr * gr;
    xs.push_back(x - rate * gr / (sqrt(h_new) + epsilon));
    hs.push_back(h_new);
  }
  xs.insert(xs.end(), hs.begin(), hs.end());
  return xs;
}

std::vector<Expr> momentum(NodeContext& c) {
  const int64_t n = tensors_per_run(c, 3);
  const double alpha = c.attr_float("alpha", 0.0), beta = c.attr_float("beta", 0.0), norm = c.attr_float("norm_coefficient", 0.0);
  const std::string mode = c.attr_string("mode", "standard");
  if (mode != "standard" && mode != "nesterov") c.fail("mode '{}' (expected standard or nesterov)", mode);
  std::vector<Expr> xs, vs;
  for (int64_t i = 0; i < n; ++i) {
    Expr x = c.in(static_cast<int>(2 + i)), g = c.in(static_cast<int>(2 + n + i)), v = c.in(static_cast<int>(2 + 2 * n + i));
    auto [r, t] = rate_and_step(c, x);
    Expr gr = x * norm + g;
    // The gradient's coefficient is 1 at the first step (T = 0).
    Expr b = where(gt(t, scalar_like(t, 0.0)), scalar_like(t, beta), scalar_like(t, 1.0));
    Expr v_new = v * alpha + b * gr;
    xs.push_back(mode == "standard" ? x - r * v_new : x - r * (gr + v_new * alpha));
    vs.push_back(v_new);
  }
  xs.insert(xs.end(), vs.begin(), vs.end());
  return xs;
}

std::vector<Expr> adam(NodeContext& c) {
  const int64_t n = tensors_per_run(c, 4);
  const double alpha = c.attr_float("alpha", 0.9), beta = c.attr_float("beta", 0.999), epsilon = c.attr_float("epsilon", 1e-6),
               norm = c.attr_float("norm_coefficient", 0.0), norm_post = c.attr_float("norm_coefficient_post", 0.0);
  std::vector<Expr> xs, vs, hs;
  for (int64_t i = 0; i < n; ++i) {
    Expr x = c.in(static_cast<int>(2 + i)), g = c.in(static_cast<int>(2 + n + i)), v = c.in(static_cast<int>(2 + 2 * n + i)),
         h = c.in(static_cast<int>(2 + 3 * n + i));
    auto [r, t] = rate_and_step(c, x);
    Expr gr = x * norm + g;
    Expr v_new = v * alpha + gr * (1 - alpha);
    Expr h_new = h * beta + gr * gr * (1 - beta);
    // Bias correction from the first step on (T > 0): r sqrt(1 - beta^T) / (1 - alpha^T).
    Expr corrected = r * sqrt(1.0 - pow(scalar_like(t, beta), t)) / (1.0 - pow(scalar_like(t, alpha), t));
    Expr rate = where(gt(t, scalar_like(t, 0.0)), corrected, r);
    Expr x_new = x - rate * (v_new / (sqrt(h_new) + epsilon));
    xs.push_back(norm_post == 0.0 ? x_new : x_new * (1 - norm_post));
    vs.push_back(v_new);
    hs.push_back(h_new);
  }
  xs.insert(xs.end(), vs.begin(), vs.end());
  xs.insert(xs.end(), hs.begin(), hs.end());
  return xs;
}

}  // namespace

void add_training_rules(RuleTable& r) {
  r[std::string(kTrainingDomain) + "Adagrad"] = adagrad;
  r[std::string(kTrainingDomain) + "Momentum"] = momentum;
  r[std::string(kTrainingDomain) + "Adam"] = adam;
}

}  // namespace kiln::onnx
