// Source ops: no inputs, output given by attributes.
//   constant {dtype, shape, values}: the listed values, row-major.
//   full {dtype, shape, value}: every element = value.
//   iota {dtype, shape, axis}: element = its index along `axis`.
// Sources have no inputs, so there is nothing to differentiate: each says so explicitly.
#include "ops/common.h"

namespace kiln::ops {

void define_source_ops(OpRegistry& registry) {
  registry.define(Op::kConstant, OpDef{
      {required("dtype", AttrKind::kDType), required("shape", AttrKind::kInts),
       required("values", AttrKind::kFloats)},
      [](std::span<const TensorType>, const Attributes& a) {
        TensorType t{a.dtype("dtype"), shape_attr(a)};
        size_t n = a.floats("values").size();
        KILN_CHECK(static_cast<int64_t>(n) == t.numel(), "{} values given for shape {} ({} elements)",
                   n, to_string(t.shape), t.numel());
        return std::vector<TensorType>{t};
      },
      [](const KernelArgs& k) {
        const std::vector<double>& values = k.attrs.floats("values");
        for (int64_t i = 0; i < k.outputs[0].numel(); ++i) k.outputs[0].set(i, values[i]);
      },
      /*gradient=*/nullptr, /*differentiable=*/false});

  registry.define(Op::kFull, OpDef{
      {required("dtype", AttrKind::kDType), required("shape", AttrKind::kInts),
       required("value", AttrKind::kFloat)},
      [](std::span<const TensorType>, const Attributes& a) {
        return std::vector<TensorType>{{a.dtype("dtype"), shape_attr(a)}};
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
