// ONNX's linear quantization ops over kiln's integer dtypes (uint8, int32; kiln has no int8):
// QuantizeLinear (round half to even, then saturate), DequantizeLinear, DynamicQuantizeLinear
// (scale and zero point from the data's range, in the graph), MatMulInteger and QLinearMatMul
// (an exact f64 GEMM of the zero-point-shifted integers, then the requantization). Also the rounding helpers the rule
// files share (converter.h), built from casts since kiln has no floor op.
#include <limits>
#include <optional>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {

Expr rounded_down(const Expr& x) {
  Expr t = cast(cast(x, DType::kI64), x.dtype());  // truncated toward zero
  return t - cast(gt(t, x), x.dtype());
}

// kiln's `round` (halves to even, as ONNX's QuantizeLinear rounds).
Expr rounded_half_even(const Expr& x) { return x.builder().apply1(Op::kRound, {x}); }

namespace {

// The range an integer dtype saturates to.
std::pair<double, double> saturation(NodeContext& c, DType dtype) {
  switch (dtype) {
    case DType::kU8: return {0, 255};
    case DType::kI32: return {std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
    default: c.unsupported("quantizing to {} (kiln quantizes to uint8 and int32)", dtype_name(dtype));
  }
}

// A per-axis scale or zero point (C,) shaped to broadcast along `axis` of a rank-`rank` tensor;
// a scalar stays as it is.
Expr along_axis(NodeContext& c, const Expr& v, int rank, int64_t axis) {
  if (v.rank() == 0) return v;
  if (v.rank() != 1) c.unsupported("blocked quantization (a scale of {})", to_string(v.type()));
  if (axis < -rank || axis >= rank) c.fail("axis {} is out of range for rank {}", axis, rank);
  if (axis < 0) axis += rank;
  Shape s(rank, 1);
  s[axis] = v.dim(0);
  return reshape(v, s);
}

std::vector<Expr> quantize(NodeContext& c) {
  Expr x = c.in(0);
  if (!is_float(x.dtype())) c.unsupported("quantizes floats, got {}", dtype_name(x.dtype()));
  const int64_t axis = c.attr_int("axis", 1);
  if (c.opset() >= 19) c.ignore_attr("saturate");  // only float8 outputs read it
  Expr scale = cast_to(along_axis(c, c.in(1), x.rank(), axis), x.dtype());
  const DType out = c.has_input(2) ? c.in(2).dtype() : DType::kU8;
  const auto [low, high] = saturation(c, out);
  Expr q = rounded_half_even(x / scale);
  if (c.has_input(2)) q = q + cast(along_axis(c, c.in(2), x.rank(), axis), x.dtype());
  q = minimum(maximum(q, scalar_like(q, low)), scalar_like(q, high));
  return {cast(q, out)};
}

std::vector<Expr> dequantize(NodeContext& c) {
  Expr x = c.in(0), scale = c.in(1);
  if (!is_float(scale.dtype())) c.fail("scale must be float, got {}", dtype_name(scale.dtype()));
  const int64_t axis = c.attr_int("axis", 1);
  // int32 values (and zero points) are exact in f64; the product is rounded to the scale's dtype.
  const DType wide = x.dtype() == DType::kI32 ? DType::kF64 : scale.dtype();
  Expr v = cast(x, wide);
  if (c.has_input(2)) v = v - cast(along_axis(c, c.in(2), x.rank(), axis), wide);
  return {cast_to(v * cast_to(along_axis(c, scale, x.rank(), axis), wide), scale.dtype())};
}

// y_scale = (max(0, max x) - min(0, min x)) / 255, y_zero_point = saturate(round(-min / scale)),
// y = saturate(round(x / scale) + y_zero_point), as uint8.
std::vector<Expr> dynamic_quantize(NodeContext& c) {
  Expr x = c.in(0);
  if (x.dtype() != DType::kF32) c.unsupported("quantizes float, got {}", dtype_name(x.dtype()));
  Expr zero = scalar_like(x, 0.0);
  Expr low = minimum(-max(-x), zero), high = maximum(max(x), zero);
  Expr scale = (high - low) / 255.0;
  auto saturate = [&](const Expr& v) { return minimum(maximum(v, scalar_like(v, 0.0)), scalar_like(v, 255.0)); };
  Expr zero_point = saturate(rounded_half_even(-low / scale));
  Expr y = saturate(rounded_half_even(x / scale) + zero_point);
  return {cast(y, DType::kU8), scale, cast(zero_point, DType::kU8)};
}

// (A - a_zero_point) @ (B - b_zero_point) of uint8 (or int32) matrices, exact: the products'
// sums are integers below 2^53, so f64 holds them and the matmul is a GEMM. A's zero point is
// one value or one per row of A (M), B's one value or one per column (N).
Expr integer_product(NodeContext& c, int a_at, int a_zero_at, int b_at, int b_zero_at) {
  Expr a = c.in(a_at), b = c.in(b_at);
  if (a.rank() < 2 || b.rank() < 2) c.unsupported("vector operands (kiln multiplies matrices here)");
  if (is_float(a.dtype()) || is_float(b.dtype())) c.fail("needs integer operands, got {} and {}", dtype_name(a.dtype()), dtype_name(b.dtype()));
  Expr fa = cast(a, DType::kF64), fb = cast(b, DType::kF64);
  auto zero_point = [&](int at, const Expr& of, bool per_row) -> std::optional<Expr> {
    if (!c.has_input(at)) return std::nullopt;
    Expr z = cast(c.in(at), DType::kF64);
    if (z.type().numel() == 1) return reshape(z, {});
    if (z.rank() != 1) c.unsupported("a zero point of {}", to_string(c.in(at).type()));
    if (per_row) {
      if (z.dim(0) != of.dim(-2)) c.fail("a_zero_point {} for {} rows", to_string(z.type()), of.dim(-2));
      return reshape(z, {z.dim(0), 1});
    }
    if (z.dim(0) != of.dim(-1)) c.fail("b_zero_point {} for {} columns", to_string(z.type()), of.dim(-1));
    return z;
  };
  if (auto z = zero_point(a_zero_at, a, true)) fa = fa - *z;
  if (auto z = zero_point(b_zero_at, b, false)) fb = fb - *z;
  return matmul(fa, fb);
}

std::vector<Expr> matmul_integer(NodeContext& c) {
  return {cast(integer_product(c, 0, 2, 1, 3), DType::kI32)};
}

// The integer product requantized: saturate(round(product * a_scale * b_scale / y_scale) +
// y_zero_point), the multiplier in f32 as the runtimes compute it.
std::vector<Expr> qlinear_matmul(NodeContext& c) {
  Expr product = cast(integer_product(c, 0, 2, 3, 5), DType::kF32);
  auto scale = [&](int at) {
    Expr s = cast_to(c.in(at), DType::kF32);
    if (s.type().numel() != 1) c.unsupported("per-axis scales in QLinearMatMul");
    return reshape(s, {});
  };
  const DType out = c.in(7).dtype();
  const auto [low, high] = saturation(c, out);
  Expr q = rounded_half_even(product * (scale(1) * scale(4) / scale(6)));
  q = q + cast(reshape(c.in(7), {}), DType::kF32);
  return {cast(minimum(maximum(q, scalar_like(q, low)), scalar_like(q, high)), out)};
}

}  // namespace

void add_quantize_rules(RuleTable& r) {
  r["MatMulInteger"] = matmul_integer;
  r["QLinearMatMul"] = qlinear_matmul;
  r["QuantizeLinear"] = quantize;
  r["DequantizeLinear"] = dequantize;
  r["DynamicQuantizeLinear"] = dynamic_quantize;
}

}  // namespace kiln::onnx
