// ONNX's linear quantization ops over kiln's integer dtypes (uint8, int32; kiln has no int8):
// QuantizeLinear (round half to even, then saturate), DequantizeLinear, DynamicQuantizeLinear
// (scale and zero point from the data's range, in the graph). Also the rounding helpers the rule
// files share (converter.h), built from casts since kiln has no floor op.
#include <limits>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {

Expr rounded_down(const Expr& x) {
  Expr t = cast(cast(x, DType::kI64), x.dtype());  // truncated toward zero
  return t - cast(gt(t, x), x.dtype());
}

Expr rounded_half_even(const Expr& x) {
  Expr r = rounded_down(x + 0.5);
  Expr tie = eq(r - x, scalar_like(x, 0.5));
  Expr odd = ne(r - rounded_down(r * 0.5) * 2.0, scalar_like(x, 0.0));
  return where(tie, where(odd, r - 1.0, r), r);
}

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

}  // namespace

void add_quantize_rules(RuleTable& r) {
  r["QuantizeLinear"] = quantize;
  r["DequantizeLinear"] = dequantize;
  r["DynamicQuantizeLinear"] = dynamic_quantize;
}

}  // namespace kiln::onnx
