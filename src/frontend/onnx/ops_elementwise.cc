// ONNX rules for elementwise ops: math (kiln's own elementwise ops, or compositions of them where
// kiln has no single op: Softplus, Elu, Asinh, ...), comparisons, logic, casts, Where, Clip.
#include <cmath>
#include <limits>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {
namespace {

Rule unary(Op op) {
  return [op](NodeContext& c) { return std::vector<Expr>{c.b().apply1(op, {c.in(0)})}; };
}
Rule binary(Op op) {
  return [op](NodeContext& c) { return std::vector<Expr>{c.b().apply1(op, {c.in(0), c.in(1)})}; };
}
// A rule from a function of the first input.
Rule unary_fn(std::function<Expr(NodeContext&, Expr)> fn) {
  return [fn](NodeContext& c) { return std::vector<Expr>{fn(c, c.in(0))}; };
}
void require_float(NodeContext& c, const Expr& x) {
  if (!is_float(x.dtype())) c.unsupported("needs a float input, got {}", dtype_name(x.dtype()));
}
// A float-only composition.
Rule float_fn(std::function<Expr(NodeContext&, Expr)> fn) {
  return [fn](NodeContext& c) {
    Expr x = c.in(0);
    require_float(c, x);
    return std::vector<Expr>{fn(c, x)};
  };
}
// Max, Min, Sum, Mean: variadic, broadcasting.
Rule variadic(Op op, bool mean = false) {
  return [op, mean](NodeContext& c) {
    Expr acc = c.in(0);
    for (int i = 1; i < c.num_inputs(); ++i) acc = c.b().apply1(op, {acc, c.in(i)});
    if (mean) acc = acc / static_cast<double>(c.num_inputs());
    return std::vector<Expr>{acc};
  };
}
Expr zero(const Expr& like) { return scalar_like(like, 0.0); }

// floor through a truncating cast: exact where |x| < 2^52 (larger floats are integers already;
// NaN and infinities pass through).
Expr floor_of(const Expr& x) {
  Expr t = cast(cast(x, DType::kI64), x.dtype());
  Expr floored = t - cast(gt(t, x), x.dtype());
  return where(lt(abs(x), scalar_like(x, 4503599627370496.0)), floored, x);
}

}  // namespace

void add_elementwise_rules(RuleTable& r) {
  r["Abs"] = unary(Op::kAbs);
  r["Neg"] = unary(Op::kNeg);
  r["Exp"] = unary(Op::kExp);
  r["Log"] = unary(Op::kLog);
  r["Sqrt"] = unary(Op::kSqrt);
  r["Reciprocal"] = unary(Op::kReciprocal);
  r["Relu"] = unary(Op::kRelu);
  r["Sigmoid"] = unary(Op::kSigmoid);
  r["Tanh"] = unary(Op::kTanh);
  r["Erf"] = unary(Op::kErf);
  r["Sin"] = unary(Op::kSin);
  r["Cos"] = unary(Op::kCos);
  r["Acos"] = unary(Op::kAcos);
  r["Asin"] = unary(Op::kAsin);
  r["Atan"] = unary(Op::kAtan);
  r["Round"] = unary(Op::kRound);
  // fmod = 1: C's remainder (the dividend's sign); 0: Python's (the divisor's).
  r["Mod"] = [](NodeContext& c) {
    const Op op = c.attr_int("fmod", 0) != 0 ? Op::kFmod : Op::kMod;
    return std::vector<Expr>{c.b().apply1(op, {c.in(0), c.in(1)})};
  };
  r["Add"] = binary(Op::kAdd);
  r["Sub"] = binary(Op::kSub);
  r["Mul"] = binary(Op::kMul);
  r["Div"] = binary(Op::kDiv);
  r["Equal"] = binary(Op::kEq);
  r["Less"] = binary(Op::kLt);
  r["LessOrEqual"] = binary(Op::kLe);
  r["Greater"] = binary(Op::kGt);
  r["GreaterOrEqual"] = binary(Op::kGe);
  r["Max"] = variadic(Op::kMaximum);
  r["Min"] = variadic(Op::kMinimum);
  r["Sum"] = variadic(Op::kAdd);
  r["Mean"] = variadic(Op::kAdd, /*mean=*/true);

  // Pow's exponent may have another dtype than its base; an integer base is computed in f64.
  r["Pow"] = [](NodeContext& c) {
    Expr base = c.in(0), exponent = c.in(1);
    const DType out = base.dtype();
    const DType compute = is_float(out) ? out : DType::kF64;
    Expr y = pow(cast_to(base, compute), cast_to(exponent, compute));
    return std::vector<Expr>{cast_to(y, out)};
  };

  // Logic on bool tensors.
  r["Not"] = unary_fn([](NodeContext& c, Expr x) { return eq(x, c.b().scalar(0, DType::kBool)); });
  r["And"] = [](NodeContext& c) {
    return std::vector<Expr>{where(c.in(0), c.in(1), c.b().scalar(0, DType::kBool))};
  };
  r["Or"] = [](NodeContext& c) {
    return std::vector<Expr>{where(c.in(0), c.b().scalar(1, DType::kBool), c.in(1))};
  };
  r["Xor"] = binary(Op::kNe);
  r["Where"] = [](NodeContext& c) { return std::vector<Expr>{where(c.in(0), c.in(1), c.in(2))}; };
  r["IsNaN"] = float_fn([](NodeContext&, Expr x) { return ne(x, x); });
  r["IsInf"] = float_fn([](NodeContext& c, Expr x) {
    const bool negative = c.attr_int("detect_negative", 1) != 0, positive = c.attr_int("detect_positive", 1) != 0;
    const double inf = std::numeric_limits<double>::infinity();
    Expr pos = eq(x, scalar_like(x, inf)), neg = eq(x, scalar_like(x, -inf));
    if (positive && negative) return where(pos, pos, neg);
    if (positive) return pos;
    if (negative) return neg;
    return c.b().full(x.shape(), 0, DType::kBool);
  });

  r["Cast"] = [](NodeContext& c) {
    const DType to = dtype_of(static_cast<int>(c.attr_int("to", 1)), c.where() + " attribute 'to'");
    if (c.has_attr("saturate")) c.ignore_attr("saturate");  // float8 only
    return std::vector<Expr>{cast_to(c.in(0), to)};
  };
  r["CastLike"] = [](NodeContext& c) { return std::vector<Expr>{cast_to(c.in(0), c.in(1).dtype())}; };
  r["Identity"] = [](NodeContext& c) { return std::vector<Expr>{c.in(0)}; };

  r["Clip"] = [](NodeContext& c) {
    Expr x = c.in(0);
    if (c.opset() < 11) {
      const double lo = c.attr_float("min", -std::numeric_limits<double>::infinity());
      const double hi = c.attr_float("max", std::numeric_limits<double>::infinity());
      if (std::isfinite(lo)) x = maximum(x, scalar_like(x, lo));
      if (std::isfinite(hi)) x = minimum(x, scalar_like(x, hi));
      return std::vector<Expr>{x};
    }
    if (c.has_input(1)) x = maximum(x, c.in(1));
    if (c.has_input(2)) x = minimum(x, c.in(2));
    return std::vector<Expr>{x};
  };

  // Activations as compositions.
  r["LeakyRelu"] = float_fn([](NodeContext& c, Expr x) {
    const double alpha = c.attr_float("alpha", 0.01);
    return where(lt(x, zero(x)), x * alpha, x);
  });
  r["PRelu"] = [](NodeContext& c) {
    Expr x = c.in(0), slope = c.in(1);
    return std::vector<Expr>{where(lt(x, zero(x)), x * slope, x)};
  };
  r["Elu"] = float_fn([](NodeContext& c, Expr x) {
    const double alpha = c.attr_float("alpha", 1.0);
    return where(gt(x, zero(x)), x, (exp(x) - 1.0) * alpha);
  });
  r["Selu"] = float_fn([](NodeContext& c, Expr x) {
    const double alpha = c.attr_float("alpha", 1.67326319217681884765625);
    const double gamma = c.attr_float("gamma", 1.05070102214813232421875);
    return where(gt(x, zero(x)), x, (exp(x) - 1.0) * alpha) * gamma;
  });
  r["Celu"] = float_fn([](NodeContext& c, Expr x) {
    const double alpha = c.attr_float("alpha", 1.0);
    return relu(x) + minimum(zero(x), (exp(x / alpha) - 1.0) * alpha);
  });
  r["HardSigmoid"] = float_fn([](NodeContext& c, Expr x) {
    const double alpha = c.attr_float("alpha", 0.2), beta = c.attr_float("beta", 0.5);
    return maximum(zero(x), minimum(scalar_like(x, 1.0), x * alpha + beta));
  });
  r["HardSwish"] = float_fn([](NodeContext&, Expr x) {
    return x * maximum(zero(x), minimum(scalar_like(x, 1.0), x * (1.0 / 6.0) + 0.5));
  });
  // log(1 + e^x) = relu(x) + log(1 + e^-|x|): no overflow for large x.
  r["Softplus"] = float_fn([](NodeContext&, Expr x) { return relu(x) + log(exp(-abs(x)) + 1.0); });
  r["Softsign"] = float_fn([](NodeContext&, Expr x) { return x / (abs(x) + 1.0); });
  r["ThresholdedRelu"] = float_fn([](NodeContext& c, Expr x) {
    const double alpha = c.attr_float("alpha", 1.0);
    return where(gt(x, scalar_like(x, alpha)), x, zero(x));
  });
  r["Shrink"] = [](NodeContext& c) {
    Expr x = c.in(0);
    const double lambd = c.attr_float("lambd", 0.5), bias = c.attr_float("bias", 0.0);
    const DType compute = is_float(x.dtype()) ? x.dtype() : DType::kF64;
    Expr xf = cast_to(x, compute);
    Expr y = where(lt(xf, scalar_like(xf, -lambd)), xf + bias,
                   where(gt(xf, scalar_like(xf, lambd)), xf - bias, zero(xf)));
    return std::vector<Expr>{cast_to(y, x.dtype())};
  };
  r["Sign"] = unary_fn([](NodeContext&, Expr x) {
    return where(gt(x, zero(x)), scalar_like(x, 1.0), where(lt(x, zero(x)), scalar_like(x, -1.0), zero(x)));
  });
  r["Tan"] = float_fn([](NodeContext& c, Expr x) {
    return sin(x) / cos(x);
  });
  r["Sinh"] = float_fn([](NodeContext&, Expr x) { return (exp(x) - exp(-x)) * 0.5; });
  r["Cosh"] = float_fn([](NodeContext&, Expr x) { return (exp(x) + exp(-x)) * 0.5; });
  r["Asinh"] = float_fn([](NodeContext&, Expr x) { return log(x + sqrt(square(x) + 1.0)); });
  r["Acosh"] = float_fn([](NodeContext&, Expr x) { return log(x + sqrt(square(x) - 1.0)); });
  r["Atanh"] = float_fn([](NodeContext&, Expr x) { return log((1.0 + x) / (1.0 - x)) * 0.5; });
  r["Floor"] = float_fn([](NodeContext&, Expr x) { return floor_of(x); });
  r["Ceil"] = float_fn([](NodeContext&, Expr x) { return -floor_of(-x); });
}

}  // namespace kiln::onnx
