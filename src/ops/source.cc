// Source ops: no inputs, output given by attributes.
//   constant {dtype, shape, values}: the listed values, row-major. For integer and bool dtypes
//     `values` is a list of ints (exact for every int64: `values=[4611686018427387905]`), each
//     in the dtype's range (bool: 0 or 1); for float dtypes a list of floats, rounded to the
//     dtype.
//   full {dtype, shape, value}: every element = value (a double: for integer dtypes an integer
//     in the dtype's range; fills that a double does not hold exactly are constants).
//   iota {dtype, shape, axis}: element = its index along `axis`.
// Sources have no inputs, so there is nothing to differentiate: each says so explicitly.
#include <cmath>
#include <limits>

#include "ops/common.h"

namespace kiln::ops {
namespace {

// An integer source value must be one of its dtype's values: no silent wrap at run time.
void check_integer_fits(int64_t value, DType dtype, const char* what) {
  int64_t low = std::numeric_limits<int64_t>::min(), high = std::numeric_limits<int64_t>::max();
  if (dtype == DType::kI32) {
    low = std::numeric_limits<int32_t>::min();
    high = std::numeric_limits<int32_t>::max();
  } else if (dtype == DType::kU8) {
    low = 0;
    high = 255;
  } else if (dtype == DType::kBool) {
    low = 0;
    high = 1;
  }
  KILN_CHECK(value >= low && value <= high, "{} {} is out of range for {} ([{}, {}])", what, value,
             dtype_name(dtype), low, high);
}

}  // namespace

void define_source_ops(OpRegistry& registry) {
  registry.define(Op::kConstant, OpDef{
      {required("dtype", AttrKind::kDType), required("shape", AttrKind::kInts),
       AttrSpec{"values", AttrKind::kFloats, std::nullopt, false, /*ints_for_integer_dtype=*/true}},
      [](std::span<const TensorType>, const Attributes& a) {
        TensorType t{a.dtype("dtype"), shape_attr(a)};
        size_t n = 0;
        if (is_float(t.dtype)) {
          n = a.floats("values").size();
        } else {
          const std::vector<int64_t>& values = a.ints("values");
          n = values.size();
          for (int64_t v : values) check_integer_fits(v, t.dtype, "value");
        }
        KILN_CHECK(static_cast<int64_t>(n) == t.numel(), "{} values given for shape {} ({} elements)",
                   n, to_string(t.shape), t.numel());
        return std::vector<TensorType>{t};
      },
      [](const KernelArgs& k) {
        Tensor& out = k.outputs[0];
        if (is_float(out.dtype())) {
          const std::vector<double>& values = k.attrs.floats("values");
          for (int64_t i = 0; i < out.numel(); ++i) out.set(i, values[i]);
        } else {
          const std::vector<int64_t>& values = k.attrs.ints("values");
          for (int64_t i = 0; i < out.numel(); ++i) out.set_int(i, values[i]);
        }
      },
      /*gradient=*/nullptr, /*differentiable=*/false});

  registry.define(Op::kFull, OpDef{
      {required("dtype", AttrKind::kDType), required("shape", AttrKind::kInts),
       required("value", AttrKind::kFloat)},
      [](std::span<const TensorType>, const Attributes& a) {
        const DType dtype = a.dtype("dtype");
        const double value = a.f("value");
        if (!is_float(dtype)) {
          // Checked in double before converting: an out-of-range double -> int64 is undefined.
          KILN_CHECK(std::trunc(value) == value && value >= -std::ldexp(1.0, 63) &&
                         value < std::ldexp(1.0, 63),
                     "value {} is not an integer of {}", value, dtype_name(dtype));
          check_integer_fits(static_cast<int64_t>(value), dtype, "value");
        }
        return std::vector<TensorType>{{dtype, shape_attr(a)}};
      },
      [](const KernelArgs& k) {
        double value = k.attrs.f("value");
        for (int64_t i = 0; i < k.outputs[0].numel(); ++i) k.outputs[0].set(i, value);
      },
      /*gradient=*/nullptr, /*differentiable=*/false});

  registry.define(Op::kIota, OpDef{
      {required("dtype", AttrKind::kDType), required("shape", AttrKind::kInts),
       with_default("axis", int64_t{0})},
      [](std::span<const TensorType>, const Attributes& a) {
        TensorType t{a.dtype("dtype"), shape_attr(a)};
        KILN_CHECK(t.rank() > 0, "needs a shape of rank >= 1, got {}", to_string(t.shape));
        normalize_axis(a.i("axis"), t.rank());
        return std::vector<TensorType>{t};
      },
      [](const KernelArgs& k) {
        Tensor& out = k.outputs[0];
        int axis = normalize_axis(k.attrs.i("axis"), out.rank());
        int64_t inner = strides_of(out.shape())[axis];
        for (int64_t i = 0; i < out.numel(); ++i) out.set(i, static_cast<double>((i / inner) % out.shape()[axis]));
      },
      /*gradient=*/nullptr, /*differentiable=*/false});
}

}  // namespace kiln::ops
