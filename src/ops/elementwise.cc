// Elementwise ops: output element i depends only on input elements i (after broadcasting).
//   unary, no attributes: abs exp log neg reciprocal relu rsqrt sigmoid silu sqrt square tanh
//     (output type = input type; abs, neg, relu, square also take integers, the rest need floats)
//   gelu {approximate: "none" (erf form) | "tanh"}
//   gelu_grad(x, dy) {approximate}: dy * gelu'(x), dy of x's type (gelu's backward op)
//   cast {dtype}: any dtype to any dtype
//   binary add sub mul div pow maximum minimum: same dtype, numpy broadcasting (pow: floats only)
//   comparisons eq ne lt le gt ge: same dtype, numpy broadcasting, bool output
//   where(cond: bool, a, b): three-way broadcasting, output dtype of a
//   dropout(x [, offset: i64 scalar]) {p, seed}: Philox-based mask (support/philox.h)
//
// Integer semantics (the reference kernels are the oracle, so they are spelled out here):
// integer results wrap modulo 2^bits; integer div truncates toward zero and throws on a zero
// divisor; cast float->int truncates toward zero and saturates at the type's range, NaN -> 0
// (what CUDA's cvt.rzi does by default), int->int wraps, anything->bool is x != 0.
// Bool is not an arithmetic type here: arithmetic ops reject it (cast it first); comparisons,
// where and cast accept it. maximum and minimum propagate NaN, like numpy and torch.
//
// Gradient rules (OpDef::gradient) are written with the builder API and reuse the forward output
// where it is cheaper (exp, sqrt, rsqrt, tanh, sigmoid, reciprocal, div). Choices at the points
// where the derivative does not exist or is ambiguous:
//   relu, abs: 0 at x == 0 (abs: sign(x) * dy).
//   maximum, minimum: dy goes to the chosen operand; on a tie each operand gets dy / 2 (the
//     average of the one-sided derivatives, as torch and jax do).
//   pow(a, b): da = dy * b * a^(b-1); db = dy * a^b * log(a), which is NaN for a < 0 (where a^b
//     has no derivative in b) and for a == 0 (0 * -inf). The exponent gradient is not built at
//     all when b comes from a source op (pow(x, 2.0)), so such graphs never take log of x.
//   cast: the gradient is cast back to a float input's dtype; an integer or bool input gets none.
//   dropout: the same dropout of dy (same p, seed, offset: the counter-based RNG regenerates the
//     mask); the offset input gets none.
// Comparisons and gelu_grad are not differentiable (gelu_grad: no second derivatives needed).
#include <cmath>
#include <limits>
#include <numbers>

#include "ir/builder.h"
#include "ops/common.h"
#include "ops/gradient.h"
#include "support/philox.h"

namespace kiln::ops {
namespace {

// Dtype checks; messages read "<op>: needs a float tensor, got i64[3]" once infer_types
// prefixes the op name.
void check_float(const TensorType& t, std::string_view what = "tensor") {
  KILN_CHECK(is_float(t.dtype), "needs a float {}, got {}", what, to_string(t));
}
void check_arithmetic(const TensorType& t) {
  KILN_CHECK(is_float(t.dtype) || is_integer(t.dtype),
             "needs a float or integer tensor, got {} (cast bool tensors first)", to_string(t));
}
void check_same_dtype(const TensorType& a, const TensorType& b) {
  if (a.dtype == b.dtype) return;
  fail(
      "inputs have different dtypes: {} and {}; insert an explicit cast (e.g. cast the {} input "
      "to {{dtype={}}})",
      to_string(a), to_string(b), dtype_name(b.dtype), dtype_name(a.dtype));
}

// Float -> integer conversion for cast: truncate toward zero, saturate, NaN -> 0. Written
// through the typed pointer because the i64 limits are not all representable as doubles.
void set_saturated(Tensor& t, int64_t index, double value) {
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      T* data = t.data<T>();
      constexpr T kLow = std::numeric_limits<T>::min(), kHigh = std::numeric_limits<T>::max();
      if (std::isnan(value)) {
        data[index] = 0;
      } else if (value <= static_cast<double>(kLow)) {
        data[index] = kLow;
      } else if (value >= static_cast<double>(kHigh)) {
        data[index] = kHigh;
      } else {
        data[index] = static_cast<T>(std::trunc(value));
      }
    } else {
      t.set(index, value);
    }
  });
}

// ---- unary ----

// A scalar zero of `like`'s dtype: the "no gradient here" branch of a where.
Expr zero_like(const Expr& like) { return like.builder().scalar(0.0, like.dtype()); }

std::vector<Expr> abs_gradient(const GradContext& c) {
  const Expr &x = c.x(), &dy = c.dy();
  return {where(gt(x, zero_like(x)), dy, where(lt(x, zero_like(x)), -dy, zero_like(dy)))};
}
std::vector<Expr> exp_gradient(const GradContext& c) { return {c.dy() * c.y()}; }
std::vector<Expr> log_gradient(const GradContext& c) { return {c.dy() / c.x()}; }
std::vector<Expr> neg_gradient(const GradContext& c) { return {-c.dy()}; }
// d(1/x) = -1/x^2 = -y^2.
std::vector<Expr> reciprocal_gradient(const GradContext& c) { return {-(c.dy() * square(c.y()))}; }
std::vector<Expr> relu_gradient(const GradContext& c) {
  return {where(gt(c.x(), zero_like(c.x())), c.dy(), zero_like(c.dy()))};
}
// d x^(-1/2) = -x^(-3/2) / 2 = -y^3 / 2.
std::vector<Expr> rsqrt_gradient(const GradContext& c) {
  return {(c.dy() * -0.5) * (square(c.y()) * c.y())};
}
std::vector<Expr> sigmoid_gradient(const GradContext& c) {
  return {c.dy() * (c.y() * (1.0 - c.y()))};
}
// silu = x s(x): s + x s (1 - s) = s (1 + x (1 - s)).
std::vector<Expr> silu_gradient(const GradContext& c) {
  Expr s = sigmoid(c.x());
  return {c.dy() * (s * (1.0 + c.x() * (1.0 - s)))};
}
// d sqrt(x) = 1 / (2 sqrt(x)) = 0.5 / y.
std::vector<Expr> sqrt_gradient(const GradContext& c) { return {(c.dy() * 0.5) / c.y()}; }
std::vector<Expr> square_gradient(const GradContext& c) { return {c.dy() * (c.x() * 2.0)}; }
std::vector<Expr> tanh_gradient(const GradContext& c) {
  return {c.dy() * (1.0 - square(c.y()))};
}
std::vector<Expr> gelu_gradient(const GradContext& c) {
  return {gelu_grad(c.x(), c.dy(), c.attrs().s("approximate"))};
}
std::vector<Expr> cast_gradient(const GradContext& c) {
  const Expr& x = c.x();
  if (!is_float(x.dtype())) return {Expr()};
  return {c.dy().dtype() == x.dtype() ? c.dy() : cast(c.dy(), x.dtype())};
}

using UnaryFn = double (*)(double);

void define_unary(OpRegistry& registry, Op op, bool takes_integers, UnaryFn fn, GradFn gradient) {
  InferFn infer = [takes_integers](std::span<const TensorType> in, const Attributes&) {
    if (takes_integers) {
      check_arithmetic(in[0]);
    } else {
      check_float(in[0]);
    }
    return std::vector<TensorType>{in[0]};
  };
  KernelFn kernel = [fn](const KernelArgs& k) {
    for (int64_t i = 0; i < k.outputs[0].numel(); ++i)
      set_wrapped(k.outputs[0], i, fn(k.inputs[0].get(i)));
  };
  registry.define(op, OpDef{{}, std::move(infer), std::move(kernel), std::move(gradient)});
}

std::vector<TensorType> infer_cast(std::span<const TensorType> in, const Attributes& a) {
  return {{a.dtype("dtype"), in[0].shape}};
}

void cast_reference(const KernelArgs& k) {
  const Tensor& x = k.inputs[0];
  Tensor& out = k.outputs[0];
  for (int64_t i = 0; i < out.numel(); ++i) {
    double v = x.get(i);
    if (out.dtype() == DType::kBool || is_float(out.dtype())) {
      out.set(i, v);  // bool: v != 0; floats: round to nearest even
    } else if (is_float(x.dtype())) {
      set_saturated(out, i, v);
    } else {
      set_wrapped(out, i, v);
    }
  }
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// gelu and gelu_grad share the attribute and its check.
void check_gelu(const TensorType& x, const Attributes& a) {
  check_float(x);
  const std::string& approximate = a.s("approximate");
  KILN_CHECK(approximate == "none" || approximate == "tanh",
             "attribute 'approximate' is \"{}\", expected \"none\" or \"tanh\"", approximate);
}

// GPT-2's tanh form: gelu(x) ~ 0.5 x (1 + tanh(k (x + c x^3))).
constexpr double kGeluTanhCubic = 0.044715;
double gelu_tanh_inner_scale() { return std::sqrt(2.0 / std::numbers::pi); }

double gelu(double x, bool tanh_form) {
  if (tanh_form) {
    double u = gelu_tanh_inner_scale() * (x + kGeluTanhCubic * x * x * x);
    return 0.5 * x * (1.0 + std::tanh(u));
  }
  return 0.5 * x * (1.0 + std::erf(x / std::numbers::sqrt2));
}

// d gelu / dx. Exact form: Phi(x) + x phi(x). Tanh form, with u = k (x + c x^3) and t = tanh(u):
// 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2).
double gelu_derivative(double x, bool tanh_form) {
  if (tanh_form) {
    const double k = gelu_tanh_inner_scale();
    double t = std::tanh(k * (x + kGeluTanhCubic * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * kGeluTanhCubic * x * x);
  }
  double cdf = 0.5 * (1.0 + std::erf(x / std::numbers::sqrt2));
  double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * std::numbers::pi);
  return cdf + x * pdf;
}

void define_unary_ops(OpRegistry& registry) {
  define_unary(registry, Op::kAbs, true, [](double x) { return std::abs(x); }, abs_gradient);
  define_unary(registry, Op::kExp, false, [](double x) { return std::exp(x); }, exp_gradient);
  define_unary(registry, Op::kLog, false, [](double x) { return std::log(x); }, log_gradient);
  define_unary(registry, Op::kNeg, true, [](double x) { return -x; }, neg_gradient);
  define_unary(registry, Op::kReciprocal, false, [](double x) { return 1.0 / x; },
               reciprocal_gradient);
  // x < 0 rather than max(x, 0) so that NaN propagates.
  define_unary(registry, Op::kRelu, true, [](double x) { return x < 0 ? 0.0 : x; }, relu_gradient);
  define_unary(registry, Op::kRsqrt, false, [](double x) { return 1.0 / std::sqrt(x); },
               rsqrt_gradient);
  define_unary(registry, Op::kSigmoid, false, sigmoid, sigmoid_gradient);
  define_unary(registry, Op::kSilu, false, [](double x) { return x * sigmoid(x); }, silu_gradient);
  define_unary(registry, Op::kSqrt, false, [](double x) { return std::sqrt(x); }, sqrt_gradient);
  define_unary(registry, Op::kSquare, true, [](double x) { return x * x; }, square_gradient);
  define_unary(registry, Op::kTanh, false, [](double x) { return std::tanh(x); }, tanh_gradient);

  registry.define(
      Op::kGelu,
      OpDef{{with_default("approximate", std::string("none"))},
            [](std::span<const TensorType> in, const Attributes& a) {
              check_gelu(in[0], a);
              return std::vector<TensorType>{in[0]};
            },
            [](const KernelArgs& k) {
              bool tanh_form = k.attrs.s("approximate") == "tanh";
              for (int64_t i = 0; i < k.outputs[0].numel(); ++i)
                k.outputs[0].set(i, gelu(k.inputs[0].get(i), tanh_form));
            },
            gelu_gradient});

  registry.define(
      Op::kGeluGrad,
      OpDef{{with_default("approximate", std::string("none"))},
            [](std::span<const TensorType> in, const Attributes& a) {
              check_gelu(in[0], a);
              KILN_CHECK(in[1] == in[0], "dy must have x's type {}, got {}", to_string(in[0]),
                         to_string(in[1]));
              return std::vector<TensorType>{in[0]};
            },
            [](const KernelArgs& k) {
              bool tanh_form = k.attrs.s("approximate") == "tanh";
              const Tensor &x = k.inputs[0], &dy = k.inputs[1];
              for (int64_t i = 0; i < k.outputs[0].numel(); ++i)
                k.outputs[0].set(i, dy.get(i) * gelu_derivative(x.get(i), tanh_form));
            },
            /*gradient=*/nullptr, /*differentiable=*/false});

  registry.define(Op::kCast, OpDef{{required("dtype", AttrKind::kDType)}, infer_cast,
                                   cast_reference, cast_gradient});
}

// ---- binary ----

// Gradient rules of the broadcasting binary ops: each operand's gradient is summed back to its
// own shape (reduce_to_shape), since broadcasting read it more than once.
std::vector<Expr> add_gradient(const GradContext& c) {
  return {reduce_to_shape(c.dy(), c.x(0).shape()), reduce_to_shape(c.dy(), c.x(1).shape())};
}
std::vector<Expr> sub_gradient(const GradContext& c) {
  return {reduce_to_shape(c.dy(), c.x(0).shape()), -reduce_to_shape(c.dy(), c.x(1).shape())};
}
std::vector<Expr> mul_gradient(const GradContext& c) {
  const Expr &a = c.x(0), &b = c.x(1);
  return {reduce_to_shape(c.dy() * b, a.shape()), reduce_to_shape(c.dy() * a, b.shape())};
}
// y = a / b: da = dy / b, db = -dy a / b^2 = -da y.
std::vector<Expr> div_gradient(const GradContext& c) {
  const Expr &a = c.x(0), &b = c.x(1);
  Expr da = c.dy() / b;
  return {reduce_to_shape(da, a.shape()), reduce_to_shape(-(da * c.y()), b.shape())};
}

// True when `id` is computed by a source op (full, constant, iota), which never depends on a
// parameter, so no gradient for it is worth building.
bool is_source_output(const Graph& graph, ValueId id) {
  for (const Node& node : graph.nodes)
    for (ValueId out : node.outputs)
      if (out == id) return has_flag(node.op, kSource);
  return false;
}

// y = a^b: da = dy b a^(b-1); db = dy y log(a) (NaN for a <= 0: see the header comment).
std::vector<Expr> pow_gradient(const GradContext& c) {
  const Expr &a = c.x(0), &b = c.x(1);
  Expr da = reduce_to_shape(c.dy() * (b * pow(a, b - 1.0)), a.shape());
  if (is_source_output(c.builder.graph(), c.node.inputs[1])) return {da, Expr()};
  return {da, reduce_to_shape(c.dy() * (c.y() * log(a)), b.shape())};
}

// maximum (chosen = gt) and minimum (chosen = lt): dy to the chosen operand, half to each on a tie.
std::vector<Expr> select_gradient(const GradContext& c, Expr (*chosen)(Expr, Expr)) {
  const Expr &a = c.x(0), &b = c.x(1), &dy = c.dy();
  Expr tie = where(eq(a, b), dy * 0.5, zero_like(dy));
  return {reduce_to_shape(where(chosen(a, b), dy, tie), a.shape()),
          reduce_to_shape(where(chosen(b, a), dy, tie), b.shape())};
}
std::vector<Expr> maximum_gradient(const GradContext& c) { return select_gradient(c, gt); }
std::vector<Expr> minimum_gradient(const GradContext& c) { return select_gradient(c, lt); }

std::vector<Expr> where_gradient(const GradContext& c) {
  const Expr &condition = c.x(0), &dy = c.dy();
  return {Expr(), reduce_to_shape(where(condition, dy, zero_like(dy)), c.x(1).shape()),
          reduce_to_shape(where(condition, zero_like(dy), dy), c.x(2).shape())};
}

enum class Operands { kFloat, kArithmetic, kAny };

// Checks two inputs of a binary op and returns their broadcast shape.
Shape binary_shape(std::span<const TensorType> in, Operands operands) {
  check_same_dtype(in[0], in[1]);
  if (operands == Operands::kFloat) check_float(in[0]);
  if (operands == Operands::kArithmetic) check_arithmetic(in[0]);
  return broadcast_shapes(in[0].shape, in[1].shape);
}

// Runs fn over the broadcast inputs; `fn(a, b)` returns the output element as a double.
template <typename Fn>
void binary_loop(const KernelArgs& k, Fn&& fn) {
  const Tensor &a = k.inputs[0], &b = k.inputs[1];
  Tensor& out = k.outputs[0];
  for_each_broadcast(out.shape(), {a.shape(), b.shape()},
                     [&](int64_t i, std::span<const int64_t> at) {
                       set_wrapped(out, i, fn(a.get(at[0]), b.get(at[1])));
                     });
}

// Integer division truncating toward zero, in int64 so it is exact; the one overflowing case
// (min / -1) wraps like the other integer results.
double integer_divide(double a, double b) {
  auto x = static_cast<int64_t>(a), y = static_cast<int64_t>(b);
  if (y == 0) fail("div: integer division by zero ({} / 0)", x);
  if (y == -1) return -a;  // avoids INT64_MIN / -1; set_wrapped wraps the i32 case
  return static_cast<double>(x / y);
}

using BinaryFn = double (*)(double, double);

// `integer_fn`, when given, replaces `fn` for integer inputs (div, whose integer form differs).
void define_binary(OpRegistry& registry, Op op, Operands operands, GradFn gradient,
                   BinaryFn fn, BinaryFn integer_fn = nullptr) {
  InferFn infer = [operands](std::span<const TensorType> in, const Attributes&) {
    return std::vector<TensorType>{{in[0].dtype, binary_shape(in, operands)}};
  };
  KernelFn kernel = [fn, integer_fn](const KernelArgs& k) {
    bool integer = integer_fn != nullptr && is_integer(k.outputs[0].dtype());
    binary_loop(k, integer ? integer_fn : fn);
  };
  registry.define(op, OpDef{{}, std::move(infer), std::move(kernel), std::move(gradient)});
}

// Comparisons have bool outputs: nothing to differentiate.
void define_comparison(OpRegistry& registry, Op op, bool (*fn)(double, double)) {
  InferFn infer = [](std::span<const TensorType> in, const Attributes&) {
    return std::vector<TensorType>{{DType::kBool, binary_shape(in, Operands::kAny)}};
  };
  KernelFn kernel = [fn](const KernelArgs& k) {
    binary_loop(k, [fn](double a, double b) { return fn(a, b) ? 1.0 : 0.0; });
  };
  registry.define(op, OpDef{{}, std::move(infer), std::move(kernel), /*gradient=*/nullptr,
                            /*differentiable=*/false});
}

void define_binary_ops(OpRegistry& registry) {
  define_binary(registry, Op::kAdd, Operands::kArithmetic, add_gradient,
                [](double a, double b) { return a + b; });
  define_binary(registry, Op::kSub, Operands::kArithmetic, sub_gradient,
                [](double a, double b) { return a - b; });
  define_binary(registry, Op::kMul, Operands::kArithmetic, mul_gradient,
                [](double a, double b) { return a * b; });
  define_binary(registry, Op::kPow, Operands::kFloat, pow_gradient,
                [](double a, double b) { return std::pow(a, b); });
  define_binary(registry, Op::kMaximum, Operands::kArithmetic, maximum_gradient,
                [](double a, double b) {
                  return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b);
                });
  define_binary(registry, Op::kMinimum, Operands::kArithmetic, minimum_gradient,
                [](double a, double b) {
                  return std::isnan(a) || std::isnan(b) ? NAN : std::min(a, b);
                });
  define_binary(registry, Op::kDiv, Operands::kArithmetic, div_gradient,
                [](double a, double b) { return a / b; }, integer_divide);

  define_comparison(registry, Op::kEq, [](double a, double b) { return a == b; });
  define_comparison(registry, Op::kNe, [](double a, double b) { return a != b; });
  define_comparison(registry, Op::kLt, [](double a, double b) { return a < b; });
  define_comparison(registry, Op::kLe, [](double a, double b) { return a <= b; });
  define_comparison(registry, Op::kGt, [](double a, double b) { return a > b; });
  define_comparison(registry, Op::kGe, [](double a, double b) { return a >= b; });

  registry.define(
      Op::kWhere,
      OpDef{{},
            [](std::span<const TensorType> in, const Attributes&) {
              KILN_CHECK(in[0].dtype == DType::kBool, "condition must be a bool tensor, got {}",
                         to_string(in[0]));
              check_same_dtype(in[1], in[2]);
              Shape shape =
                  broadcast_shapes(broadcast_shapes(in[0].shape, in[1].shape), in[2].shape);
              return std::vector<TensorType>{{in[1].dtype, shape}};
            },
            [](const KernelArgs& k) {
              const Tensor &cond = k.inputs[0], &a = k.inputs[1], &b = k.inputs[2];
              Tensor& out = k.outputs[0];
              for_each_broadcast(out.shape(), {cond.shape(), a.shape(), b.shape()},
                                 [&](int64_t i, std::span<const int64_t> at) {
                                   out.set(i, cond.get(at[0]) != 0 ? a.get(at[1]) : b.get(at[2]));
                                 });
            },
            where_gradient});
}

// ---- dropout ----

// y = mask * x / (1 - p), so dx = mask * dy / (1 - p): the same dropout applied to dy.
std::vector<Expr> dropout_gradient(const GradContext& c) {
  const Attributes& a = c.attrs();
  Expr offset = c.inputs.size() > 1 ? c.x(1) : Expr();
  std::vector<Expr> grads{dropout(c.dy(), a.f("p"), a.i("seed"), offset)};
  if (c.inputs.size() > 1) grads.push_back(Expr());  // the offset is an integer
  return grads;
}

void define_dropout(OpRegistry& registry) {
  registry.define(
      Op::kDropout,
      OpDef{{with_default("p", 0.1), with_default("seed", int64_t{0})},
            [](std::span<const TensorType> in, const Attributes& a) {
              check_float(in[0]);
              double p = a.f("p");
              KILN_CHECK(p >= 0.0 && p < 1.0,
                         "attribute 'p' is {}, expected a probability in [0, 1)", p);
              if (in.size() > 1) {
                KILN_CHECK(in[1].dtype == DType::kI64 && in[1].rank() == 0,
                           "offset must be an i64 scalar of shape (), got {}", to_string(in[1]));
              }
              return std::vector<TensorType>{in[0]};
            },
            [](const KernelArgs& k) {
              double p = k.attrs.f("p");
              auto seed = static_cast<uint64_t>(k.attrs.i("seed"));
              uint64_t offset =
                  k.inputs.size() > 1 ? static_cast<uint64_t>(k.inputs[1].data<int64_t>()[0]) : 0;
              uint32_t threshold = dropout_threshold(p);
              const Tensor& x = k.inputs[0];
              Tensor& out = k.outputs[0];
              for (int64_t i = 0; i < out.numel(); ++i) {
                bool dropped =
                    dropout_drops(philox_word(seed, offset, static_cast<uint64_t>(i)), threshold);
                out.set(i, dropped ? 0.0 : x.get(i) / (1.0 - p));
              }
            },
            dropout_gradient});
}

}  // namespace

void define_elementwise_ops(OpRegistry& registry) {
  define_unary_ops(registry);
  define_binary_ops(registry);
  define_dropout(registry);
}

}  // namespace kiln::ops
