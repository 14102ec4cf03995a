// Elementwise ops: each op's math is its line in ops/elementwise_math.h (the reference kernels
// evaluate it in double through ReferenceMath below, the fast kernels of every backend through
// their own primitives); this file holds the rest of their definitions: dtype checks, the
// reference loops, gradient rules. And the ops that are not math lines:
//   gelu {approximate: "none" (erf form) | "tanh"}: the line GeluErf or GeluTanh
//   gelu_grad(x, dy) {approximate}: dy * gelu'(x), dy of x's type (gelu's backward op)
//   cast {dtype}: any dtype to any dtype
//   where(cond: bool, a, b): three-way broadcasting, output dtype of a
//   dropout(x [, offset: i64 scalar]) {p, seed}: Philox-based mask (support/philox.h)
// The lines' domains: kFloat ops need float dtypes (output type = input type); kArithmetic ops
// also take integers; binary ops take one dtype, numpy broadcasting; comparisons (kCompare)
// any dtype, bool output.
//
// Integer semantics (the reference kernels are the oracle, so they are spelled out here):
// integer lines compute in int64, never through double (which does not hold every int64);
// integer results wrap modulo 2^bits; integer div truncates toward zero (like C and ONNX) and
// throws on a zero divisor, as fmod and mod do; cast float->int truncates toward zero and saturates at the type's
// range, NaN -> 0 (what CUDA's cvt.rzi does by default), int->int wraps, int->float rounds once
// to nearest, anything->bool is x != 0.
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
#include "ops/elementwise.h"
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

// The reference kernels' primitives for the lines of ops/elementwise_math.h: double precision
// through the C library, for float dtypes.
struct ReferenceMath {
  static double abs(double x) { return std::abs(x); }
  static double exp(double x) { return std::exp(x); }
  static double log(double x) { return std::log(x); }
  static double sqrt(double x) { return std::sqrt(x); }
  static double rsqrt(double x) { return 1.0 / std::sqrt(x); }
  static double tanh(double x) { return std::tanh(x); }
  static double erf(double x) { return std::erf(x); }
  static double erfc(double x) { return std::erfc(x); }
  static double sin(double x) { return std::sin(x); }
  static double cos(double x) { return std::cos(x); }
  static double pow(double a, double b) { return std::pow(a, b); }
  static double fmod(double a, double b) { return std::fmod(a, b); }
  static double acos(double x) { return std::acos(x); }
  static double asin(double x) { return std::asin(x); }
  static double atan(double x) { return std::atan(x); }
  static double rint(double x) { return std::nearbyint(x); }  // halves to even (default mode)
  static double select(bool c, double a, double b) { return c ? a : b; }
};

// The compute type of the integer lines (their T): an int64, which holds every value of every
// integer dtype and of bool. +, -, * wrap modulo 2^64, computed in uint64 because signed
// overflow is undefined in C++; Tensor::set_int then wraps the result to the output's width,
// the same bits as computing in that width. Division truncates toward zero and refuses a zero
// divisor; INT64_MIN / -1 wraps (to INT64_MIN) like the other overflows.
struct Wrapping {
  int64_t v = 0;
  constexpr Wrapping(int64_t value = 0) : v(value) {}  // implicit: the lines' T(0), T(1)

  static Wrapping from_bits(uint64_t bits) { return Wrapping(static_cast<int64_t>(bits)); }
  friend Wrapping operator+(Wrapping a, Wrapping b) {
    return from_bits(static_cast<uint64_t>(a.v) + static_cast<uint64_t>(b.v));
  }
  friend Wrapping operator-(Wrapping a, Wrapping b) {
    return from_bits(static_cast<uint64_t>(a.v) - static_cast<uint64_t>(b.v));
  }
  friend Wrapping operator*(Wrapping a, Wrapping b) {
    return from_bits(static_cast<uint64_t>(a.v) * static_cast<uint64_t>(b.v));
  }
  friend Wrapping operator-(Wrapping a) { return from_bits(uint64_t{0} - static_cast<uint64_t>(a.v)); }
  friend Wrapping operator/(Wrapping a, Wrapping b) {
    if (b.v == 0) fail("div: integer division by zero ({} / 0)", a.v);
    if (b.v == -1) return -a;  // INT64_MIN / -1 overflows: wraps
    return Wrapping(a.v / b.v);  // C++ truncates toward zero
  }
  friend bool operator==(Wrapping a, Wrapping b) { return a.v == b.v; }
  friend bool operator!=(Wrapping a, Wrapping b) { return a.v != b.v; }
  friend bool operator<(Wrapping a, Wrapping b) { return a.v < b.v; }
  friend bool operator<=(Wrapping a, Wrapping b) { return a.v <= b.v; }
  friend bool operator>(Wrapping a, Wrapping b) { return a.v > b.v; }
  friend bool operator>=(Wrapping a, Wrapping b) { return a.v >= b.v; }
};

// The primitives the integer lines (kArithmetic, kCompare) use.
struct IntegerMath {
  static Wrapping abs(Wrapping x) { return x.v < 0 ? -x : x; }  // abs(INT64_MIN) wraps
  static Wrapping select(bool c, Wrapping a, Wrapping b) { return c ? a : b; }
  static Wrapping fmod(Wrapping a, Wrapping b) {  // C's remainder; mod's line builds on it
    if (b.v == 0) fail("mod/fmod: integer remainder by zero ({} % 0)", a.v);
    return b.v == -1 ? Wrapping(0) : Wrapping(a.v % b.v);  // INT64_MIN % -1 would trap
  }
};

// Stores an integer line's result: a bool (comparisons) or a Wrapping.
void store_int(Tensor& out, int64_t index, bool value) { out.set_int(index, value ? 1 : 0); }
void store_int(Tensor& out, int64_t index, Wrapping value) { out.set_int(index, value.v); }

// ---- gradient rules of the math lines --------------------------------------------------------

// gradient<op>: the rule of each differentiable line (comparisons have none), defined below;
// define_line registers it.
template <Op op>
std::vector<Expr> gradient(const GradContext& c);

// A scalar zero of `like`'s dtype: the "no gradient here" branch of a where.
Expr zero_like(const Expr& like) { return like.builder().scalar(0.0, like.dtype()); }

template <>
std::vector<Expr> gradient<Op::kAbs>(const GradContext& c) {
  const Expr &x = c.x(), &dy = c.dy();
  return {where(gt(x, zero_like(x)), dy, where(lt(x, zero_like(x)), -dy, zero_like(dy)))};
}
// d erf(x) = 2 / sqrt(pi) e^(-x^2).
template <>
std::vector<Expr> gradient<Op::kErf>(const GradContext& c) {
  return {c.dy() * (exp(-square(c.x())) * (2.0 * std::numbers::inv_sqrtpi))};
}
// d sin(x) = cos(x), d cos(x) = -sin(x).
template <>
std::vector<Expr> gradient<Op::kSin>(const GradContext& c) {
  return {c.dy() * cos(c.x())};
}
template <>
std::vector<Expr> gradient<Op::kCos>(const GradContext& c) {
  return {-(c.dy() * sin(c.x()))};
}
template <>
std::vector<Expr> gradient<Op::kExp>(const GradContext& c) {
  return {c.dy() * c.y()};
}
template <>
std::vector<Expr> gradient<Op::kLog>(const GradContext& c) {
  return {c.dy() / c.x()};
}
template <>
std::vector<Expr> gradient<Op::kNeg>(const GradContext& c) {
  return {-c.dy()};
}
// d(1/x) = -1/x^2 = -y^2.
template <>
std::vector<Expr> gradient<Op::kReciprocal>(const GradContext& c) {
  return {-(c.dy() * square(c.y()))};
}
template <>
std::vector<Expr> gradient<Op::kRelu>(const GradContext& c) {
  return {where(gt(c.x(), zero_like(c.x())), c.dy(), zero_like(c.dy()))};
}
// d x^(-1/2) = -x^(-3/2) / 2 = -y^3 / 2.
template <>
std::vector<Expr> gradient<Op::kRsqrt>(const GradContext& c) {
  return {(c.dy() * -0.5) * (square(c.y()) * c.y())};
}
template <>
std::vector<Expr> gradient<Op::kSigmoid>(const GradContext& c) {
  return {c.dy() * (c.y() * (1.0 - c.y()))};
}
// silu = x s(x): s + x s (1 - s) = s (1 + x (1 - s)).
template <>
std::vector<Expr> gradient<Op::kSilu>(const GradContext& c) {
  Expr s = sigmoid(c.x());
  return {c.dy() * (s * (1.0 + c.x() * (1.0 - s)))};
}
// d sqrt(x) = 1 / (2 sqrt(x)) = 0.5 / y.
template <>
std::vector<Expr> gradient<Op::kSqrt>(const GradContext& c) {
  return {(c.dy() * 0.5) / c.y()};
}
template <>
std::vector<Expr> gradient<Op::kSquare>(const GradContext& c) {
  return {c.dy() * (c.x() * 2.0)};
}
template <>
std::vector<Expr> gradient<Op::kTanh>(const GradContext& c) {
  return {c.dy() * (1.0 - square(c.y()))};
}

// d acos(x) = -1 / sqrt(1 - x^2), d asin(x) = 1 / sqrt(1 - x^2), d atan(x) = 1 / (1 + x^2).
template <>
std::vector<Expr> gradient<Op::kAcos>(const GradContext& c) {
  return {-(c.dy() * rsqrt(1.0 - square(c.x())))};
}
template <>
std::vector<Expr> gradient<Op::kAsin>(const GradContext& c) {
  return {c.dy() * rsqrt(1.0 - square(c.x()))};
}
template <>
std::vector<Expr> gradient<Op::kAtan>(const GradContext& c) {
  return {c.dy() / (1.0 + square(c.x()))};
}
// round is a step function: 0 everywhere it has a derivative (as torch defines it).
template <>
std::vector<Expr> gradient<Op::kRound>(const GradContext& c) {
  return {c.builder.full(c.x().shape(), 0.0, c.x().dtype())};
}

// stop_gradient (torch's detach, jax's stop_gradient): the value passes, its gradient does not
// (an empty Expr: autodiff adds nothing to the input). The simplifier removes the node after
// autodiff, so no kernel ever runs it in a compiled step.
template <>
std::vector<Expr> gradient<Op::kStopGradient>(const GradContext&) {
  return {Expr()};
}

// Binary lines broadcast: each operand's gradient is summed back to its own shape
// (reduce_to_shape), since broadcasting read it more than once.
template <>
std::vector<Expr> gradient<Op::kAdd>(const GradContext& c) {
  return {reduce_to_shape(c.dy(), c.x(0).shape()), reduce_to_shape(c.dy(), c.x(1).shape())};
}
template <>
std::vector<Expr> gradient<Op::kSub>(const GradContext& c) {
  return {reduce_to_shape(c.dy(), c.x(0).shape()), -reduce_to_shape(c.dy(), c.x(1).shape())};
}
template <>
std::vector<Expr> gradient<Op::kMul>(const GradContext& c) {
  const Expr &a = c.x(0), &b = c.x(1);
  return {reduce_to_shape(c.dy() * b, a.shape()), reduce_to_shape(c.dy() * a, b.shape())};
}
// y = a / b: da = dy / b, db = -dy a / b^2 = -da y.
template <>
std::vector<Expr> gradient<Op::kDiv>(const GradContext& c) {
  const Expr &a = c.x(0), &b = c.x(1);
  Expr da = c.dy() / b;
  return {reduce_to_shape(da, a.shape()), reduce_to_shape(-(da * c.y()), b.shape())};
}

// fmod and mod: y = a - q b with q the integer quotient (trunc(a / b), floor(a / b)), constant
// between its jumps: da = dy, db = -dy q, q recovered as (a - y) / b rounded to the integer.
std::vector<Expr> remainder_gradient(const GradContext& c) {
  const Expr &a = c.x(0), &b = c.x(1);
  Expr quotient = c.builder.apply1(Op::kRound, {(a - c.y()) / b});
  return {reduce_to_shape(c.dy(), a.shape()), reduce_to_shape(-(c.dy() * quotient), b.shape())};
}
template <>
std::vector<Expr> gradient<Op::kFmod>(const GradContext& c) {
  return remainder_gradient(c);
}
template <>
std::vector<Expr> gradient<Op::kMod>(const GradContext& c) {
  return remainder_gradient(c);
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
template <>
std::vector<Expr> gradient<Op::kPow>(const GradContext& c) {
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
template <>
std::vector<Expr> gradient<Op::kMaximum>(const GradContext& c) {
  return select_gradient(c, gt);
}
template <>
std::vector<Expr> gradient<Op::kMinimum>(const GradContext& c) {
  return select_gradient(c, lt);
}

// ---- the math lines --------------------------------------------------------------------------

// Checks two inputs of a binary line and returns their broadcast shape.
Shape binary_shape(std::span<const TensorType> in, math::Domain domain) {
  check_same_dtype(in[0], in[1]);
  if (domain == math::Domain::kFloat) check_float(in[0]);
  if (domain == math::Domain::kArithmetic) check_arithmetic(in[0]);
  return broadcast_shapes(in[0].shape, in[1].shape);
}

// The reference kernel of line F. Float inputs: F in double (bool results as 0 and 1), stored
// rounded to the output dtype. Integer and bool inputs (the lines that take them): F in int64
// (Wrapping), stored exactly.
template <class F>
KernelFn line_reference() {
  return [](const KernelArgs& k) {
    const Tensor& a = k.inputs[0];
    Tensor& out = k.outputs[0];
    const bool integers = !is_float(a.dtype());
    if constexpr (F::arity() == 1) {
      if constexpr (F::domain() != math::Domain::kFloat) {
        if (integers) {
          for (int64_t i = 0; i < out.numel(); ++i)
            store_int(out, i, F::template apply<IntegerMath>(Wrapping(a.get_int(i))));
          return;
        }
      }
      for (int64_t i = 0; i < out.numel(); ++i)
        out.set(i, F::template apply<ReferenceMath>(a.get(i)));
    } else {
      const Tensor& b = k.inputs[1];
      if constexpr (F::domain() != math::Domain::kFloat) {
        if (integers) {
          for_each_broadcast(out.shape(), {a.shape(), b.shape()},
                             [&](int64_t i, std::span<const int64_t> at) {
                               store_int(out, i, F::template apply<IntegerMath>(
                                                     Wrapping(a.get_int(at[0])),
                                                     Wrapping(b.get_int(at[1]))));
                             });
          return;
        }
      }
      for_each_broadcast(out.shape(), {a.shape(), b.shape()},
                         [&](int64_t i, std::span<const int64_t> at) {
                           out.set(i, F::template apply<ReferenceMath>(a.get(at[0]), b.get(at[1])));
                         });
    }
  };
}

// Defines the op of line F: inference from its arity and domain, its reference kernel, and its
// gradient rule (comparisons, with bool outputs, have none).
template <class F, Op op>
void define_line(OpRegistry& registry) {
  InferFn infer = [](std::span<const TensorType> in, const Attributes&) {
    if constexpr (F::arity() == 1) {
      if (F::domain() == math::Domain::kFloat) {
        check_float(in[0]);
      } else {
        check_arithmetic(in[0]);
      }
      return std::vector<TensorType>{in[0]};
    } else {
      const DType dtype = F::domain() == math::Domain::kCompare ? DType::kBool : in[0].dtype;
      return std::vector<TensorType>{{dtype, binary_shape(in, F::domain())}};
    }
  };
  OpDef def{{}, std::move(infer), line_reference<F>()};
  if constexpr (F::domain() == math::Domain::kCompare) {
    def.differentiable = false;
  } else {
    def.gradient = gradient<op>;
  }
  // SwiGLU's activation, which exports write as x * sigmoid(x): a composite kept whole.
  def.traits.composite = op == Op::kSilu;
  registry.define(op, std::move(def));
}

// ---- gelu, gelu_grad, cast, where ------------------------------------------------------------

std::vector<Expr> gelu_gradient(const GradContext& c) {
  return {gelu_grad(c.x(), c.dy(), c.attrs().s("approximate"))};
}
std::vector<Expr> cast_gradient(const GradContext& c) {
  const Expr& x = c.x();
  if (!is_float(x.dtype())) return {Expr()};
  return {c.dy().dtype() == x.dtype() ? c.dy() : cast(c.dy(), x.dtype())};
}
std::vector<Expr> where_gradient(const GradContext& c) {
  const Expr &condition = c.x(0), &dy = c.dy();
  return {Expr(), reduce_to_shape(where(condition, dy, zero_like(dy)), c.x(1).shape()),
          reduce_to_shape(where(condition, zero_like(dy), dy), c.x(2).shape())};
}

std::vector<TensorType> infer_cast(std::span<const TensorType> in, const Attributes& a) {
  return {{a.dtype("dtype"), in[0].shape}};
}

void cast_reference(const KernelArgs& k) {
  const Tensor& x = k.inputs[0];
  Tensor& out = k.outputs[0];
  for (int64_t i = 0; i < out.numel(); ++i) {
    if (!is_float(x.dtype())) {
      out.set_int(i, x.get_int(i));  // exact: wraps to integers, != 0 to bool, rounds to floats
      continue;
    }
    double v = x.get(i);
    if (out.dtype() == DType::kBool || is_float(out.dtype())) {
      out.set(i, v);  // bool: v != 0; floats: round to nearest even
    } else {
      set_saturated(out, i, v);
    }
  }
}

// gelu and gelu_grad share the attribute and its check.
void check_gelu(const TensorType& x, const Attributes& a) {
  check_float(x);
  const std::string& approximate = a.s("approximate");
  KILN_CHECK(approximate == "none" || approximate == "tanh",
             "attribute 'approximate' is \"{}\", expected \"none\" or \"tanh\"", approximate);
}

// The reference kernel of an op whose line its attributes pick (elementwise_fn).
KernelFn form_reference(Op op) {
  return [op](const KernelArgs& k) {
    math::visit(*elementwise_fn(op, k.attrs), [&](auto line) {
      line_reference<decltype(line)>()(k);
    });
  };
}

void define_other_ops(OpRegistry& registry) {
  registry.define(
      Op::kGelu,
      OpDef{{with_default("approximate", std::string("none"))},
            [](std::span<const TensorType> in, const Attributes& a) {
              check_gelu(in[0], a);
              return std::vector<TensorType>{in[0]};
            },
            form_reference(Op::kGelu), gelu_gradient})
      .traits = {.composite = true};

  registry.define(
      Op::kGeluGrad,
      OpDef{{with_default("approximate", std::string("none"))},
            [](std::span<const TensorType> in, const Attributes& a) {
              check_gelu(in[0], a);
              KILN_CHECK(in[1] == in[0], "dy must have x's type {}, got {}", to_string(in[0]),
                         to_string(in[1]));
              return std::vector<TensorType>{in[0]};
            },
            form_reference(Op::kGeluGrad), /*gradient=*/nullptr, /*differentiable=*/false})
      .traits = {.composite = true};

  registry.define(Op::kCast, OpDef{{required("dtype", AttrKind::kDType)}, infer_cast,
                                   cast_reference, cast_gradient});

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
                                   if (cond.get_int(at[0]) != 0) out.copy_element(i, a, at[1]);
                                   else out.copy_element(i, b, at[2]);
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

std::optional<math::Fn> elementwise_fn(Op op, const Attributes& attrs) {
  switch (op) {
#define KILN_OP_LINE(Name, arity, domain, expression) \
  case Op::k##Name:                                   \
    return math::Fn::k##Name;
    KILN_ELEMENTWISE_OPS(KILN_OP_LINE)
#undef KILN_OP_LINE
    case Op::kGelu:
      return attrs.s("approximate") == "tanh" ? math::Fn::kGeluTanh : math::Fn::kGeluErf;
    case Op::kGeluGrad:
      return attrs.s("approximate") == "tanh" ? math::Fn::kGeluGradTanh : math::Fn::kGeluGradErf;
    default:
      return std::nullopt;
  }
}

bool is_math_op(Op op) {
  return op == Op::kGelu || op == Op::kGeluGrad || elementwise_fn(op, {}).has_value();
}

void define_elementwise_ops(OpRegistry& registry) {
#define KILN_DEFINE_LINE(Name, arity, domain, expression) \
  define_line<math::Name, Op::k##Name>(registry);
  KILN_ELEMENTWISE_OPS(KILN_DEFINE_LINE)
#undef KILN_DEFINE_LINE
  define_other_ops(registry);
  define_dropout(registry);
}

}  // namespace kiln::ops
