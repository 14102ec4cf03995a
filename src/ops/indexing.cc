// Ops that index along one axis element by element (ONNX's GatherElements and ScatterElements,
// torch's gather and scatter), and the scan and the selection along an axis:
//   gather_elements(x, indices) {axis = 0}: out[q] = x[q's coordinates with the one along axis
//     replaced by indices[q]]. indices: x's rank, no dim larger than x's but along axis; out:
//     indices' shape, x's dtype.
//   scatter_elements(data, indices, updates) {axis = 0, reduction = "none"}: data with each
//     updates[q] combined into the position gather_elements reads for q: "none" replaces it (where
//     indices repeat a position the last in row-major order wins; ONNX leaves that undefined),
//     "add", "mul", "max", "min" (NaN propagates). updates: indices' shape and data's dtype.
//     ONNX's ScatterND is this op over data seen as rows (frontend/onnx/ops_tensor.cc).
//   cumsum(x) {axis, exclusive = false, reverse = false}: running sums along axis; exclusive
//     leaves each element out of its own sum (the first is 0), reverse sums from the end.
//   topk(x) {k, axis = -1, largest = true}: the k largest (or smallest) along axis, best first:
//     values (x's dtype) and their i64 indices. Ties go to the lower index; NaN ranks above every
//     number (first when largest, last when smallest), as in torch.topk. ONNX's TopK with k the
//     whole axis is a sort (torch.sort's export).
// Indices are i32 or i64 in [0, dim) (the ONNX importer wraps negative ones); one out of range is
// a kernel-time error naming it. Integers are exact: int64 arithmetic that wraps on the store,
// never through double; floats compute in double.
//
// Gradients: gather_elements and scatter_elements are each other's adjoints. gather_elements:
// dy added into zeros where it was read (a position read twice gets both). scatter_elements
// "none": data gets dy where no update replaced it, updates get dy where they went; "add": data
// gets dy, updates the same; "mul", "max" and "min" have no rule (an error says so). cumsum's
// gradient is dy's cumsum the other way round (same exclusive); topk's puts the values' dy back
// at the chosen positions.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "ir/builder.h"
#include "ops/checked_index.h"
#include "ops/common.h"
#include "ops/gradient.h"

namespace kiln::ops {
namespace {

using Ints = std::vector<int64_t>;

// ---- exact element access -------------------------------------------------------------------
// Tensor::get and set go through double, which holds integers exactly only below 2^53.

void copy_element(const Tensor& from, int64_t i, Tensor& to, int64_t j) {
  const size_t size = dtype_size(from.dtype());
  std::memcpy(to.raw() + j * size, from.raw() + i * size, size);
}

int64_t wrapping_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
int64_t wrapping_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

// ---- gather_elements, scatter_elements --------------------------------------------------------

enum class Reduction { kNone, kAdd, kMul, kMax, kMin };

Reduction reduction_of(const Attributes& a) {
  const std::string& r = a.s("reduction");
  if (r == "none") return Reduction::kNone;
  if (r == "add") return Reduction::kAdd;
  if (r == "mul") return Reduction::kMul;
  if (r == "max") return Reduction::kMax;
  if (r == "min") return Reduction::kMin;
  fail("attribute 'reduction' is \"{}\", expected \"none\", \"add\", \"mul\", \"max\" or \"min\"", r);
}

// Checks indices against x (gather_elements' input, scatter_elements' data); returns the axis.
int elements_axis(const TensorType& x, const TensorType& indices, const Attributes& a) {
  KILN_CHECK(x.rank() >= 1, "data is {}, expected rank >= 1", to_string(x));
  KILN_CHECK(indices.dtype == DType::kI32 || indices.dtype == DType::kI64,
             "indices are {}, expected i32 or i64", to_string(indices));
  KILN_CHECK(indices.rank() == x.rank(), "indices are {}, expected the rank of data {}",
             to_string(indices), to_string(x));
  const int axis = normalize_axis(a.i("axis"), x.rank());
  for (int d = 0; d < x.rank(); ++d)
    KILN_CHECK(d == axis || indices.shape[d] <= x.shape[d],
               "indices {} are larger than data {} along axis {} (only axis {} may be)",
               to_string(indices), to_string(x), d, axis);
  return axis;
}

// Where element q of indices points in data: q's coordinates (row-major over indices' shape)
// with the one along `axis` replaced by the index, through data's strides.
struct ElementsGeometry {
  int axis = 0;
  int64_t dim = 0;
  Shape index_shape;
  Ints data_strides;

  ElementsGeometry(const Shape& data, const Shape& indices, int axis_)
      : axis(axis_), dim(data[axis_]), index_shape(indices), data_strides(strides_of(data)) {}

  int64_t target(int64_t q, int64_t index) const {
    int64_t offset = 0;
    for (int d = static_cast<int>(index_shape.size()) - 1; d >= 0; --d) {
      const int64_t coordinate = q % index_shape[d];
      q /= index_shape[d];
      offset += (d == axis ? index : coordinate) * data_strides[d];
    }
    return offset;
  }
};

void gather_elements_reference(const KernelArgs& k) {
  const Tensor &x = k.inputs[0], &indices = k.inputs[1];
  Tensor& out = k.outputs[0];
  const int axis = normalize_axis(k.attrs.i("axis"), x.rank());
  const ElementsGeometry g(x.shape(), indices.shape(), axis);
  for (int64_t q = 0; q < indices.numel(); ++q)
    copy_element(x, g.target(q, checked_index("gather_elements", indices, q, g.dim, axis)), out, q);
}

double combine(Reduction r, double a, double b) {
  switch (r) {
    case Reduction::kNone: return b;
    case Reduction::kAdd: return a + b;
    case Reduction::kMul: return a * b;
    case Reduction::kMax: return a > b || std::isnan(a) ? a : b;  // maximum's NaN rule
    case Reduction::kMin: return a < b || std::isnan(a) ? a : b;
  }
  return b;
}
int64_t combine(Reduction r, int64_t a, int64_t b) {
  switch (r) {
    case Reduction::kNone: return b;
    case Reduction::kAdd: return wrapping_add(a, b);
    case Reduction::kMul: return wrapping_mul(a, b);
    case Reduction::kMax: return std::max(a, b);
    case Reduction::kMin: return std::min(a, b);
  }
  return b;
}

void scatter_elements_reference(const KernelArgs& k) {
  const Tensor &data = k.inputs[0], &indices = k.inputs[1], &updates = k.inputs[2];
  Tensor& out = k.outputs[0];
  const int axis = normalize_axis(k.attrs.i("axis"), data.rank());
  const Reduction reduction = reduction_of(k.attrs);
  for (int64_t i = 0; i < out.numel(); ++i) copy_element(data, i, out, i);
  const ElementsGeometry g(data.shape(), indices.shape(), axis);
  const bool integer = is_integer(out.dtype());
  for (int64_t q = 0; q < indices.numel(); ++q) {
    const int64_t at = g.target(q, checked_index("scatter_elements", indices, q, g.dim, axis));
    if (reduction == Reduction::kNone) {
      copy_element(updates, q, out, at);
    } else if (integer) {
      out.set_int(at, combine(reduction, out.get_int(at), updates.get_int(q)));
    } else {
      out.set(at, combine(reduction, out.get(at), updates.get(q)));
    }
  }
}

Expr zeros_like(Builder& b, const Expr& like) { return b.full(like.shape(), 0.0, like.dtype()); }

Expr gather_elements_of(const Expr& x, const Expr& indices, int64_t axis) {
  return x.builder().apply1(Op::kGatherElements, {x, indices}, {{"axis", axis}});
}
Expr scatter_elements_of(const Expr& data, const Expr& indices, const Expr& updates, int64_t axis,
                         const std::string& reduction) {
  return data.builder().apply1(Op::kScatterElements, {data, indices, updates},
                               {{"axis", axis}, {"reduction", reduction}});
}

std::vector<Expr> gather_elements_gradient(const GradContext& c) {
  const int64_t axis = c.attrs().i("axis");
  return {scatter_elements_of(zeros_like(c.builder, c.x(0)), c.x(1), c.dy(), axis, "add"), Expr()};
}

std::vector<Expr> scatter_elements_gradient(const GradContext& c) {
  const int64_t axis = c.attrs().i("axis");
  const Reduction reduction = reduction_of(c.attrs());
  KILN_CHECK(reduction == Reduction::kNone || reduction == Reduction::kAdd,
             "scatter_elements: reduction \"{}\" has no gradient rule (only \"none\" and \"add\")",
             c.attrs().s("reduction"));
  const Expr &indices = c.x(1), &updates = c.x(2), &dy = c.dy();
  Expr d_updates = gather_elements_of(dy, indices, axis);
  if (reduction == Reduction::kAdd) return {dy, Expr(), d_updates};
  // The replaced positions took no part of data: zero them in dy.
  return {scatter_elements_of(dy, indices, zeros_like(c.builder, updates), axis, "none"), Expr(),
          d_updates};
}

// ---- cumsum ---------------------------------------------------------------------------------

// A shape seen as (outer, dim, inner) around `axis`.
struct AxisView {
  int64_t outer = 1, dim = 1, inner = 1;
  AxisView(const Shape& shape, int axis) {
    for (int d = 0; d < axis; ++d) outer *= shape[d];
    dim = shape[axis];
    for (size_t d = axis + 1; d < shape.size(); ++d) inner *= shape[d];
  }
  int64_t at(int64_t o, int64_t a, int64_t i) const { return (o * dim + a) * inner + i; }
};

void check_arithmetic(const TensorType& x) {
  KILN_CHECK(is_float(x.dtype) || is_integer(x.dtype),
             "needs a float or integer tensor, got {} (cast bool tensors first)", to_string(x));
}

void cumsum_reference(const KernelArgs& k) {
  const Tensor& x = k.inputs[0];
  Tensor& y = k.outputs[0];
  const AxisView v(x.shape(), normalize_axis(k.attrs.i("axis"), x.rank()));
  const bool exclusive = k.attrs.b("exclusive"), reverse = k.attrs.b("reverse");
  const bool integer = is_integer(x.dtype());
  for (int64_t o = 0; o < v.outer; ++o)
    for (int64_t i = 0; i < v.inner; ++i) {
      double sum = 0.0;
      int64_t int_sum = 0;
      for (int64_t step = 0; step < v.dim; ++step) {
        const int64_t at = v.at(o, reverse ? v.dim - 1 - step : step, i);
        if (integer) {
          const int64_t before = int_sum;
          int_sum = wrapping_add(int_sum, x.get_int(at));
          y.set_int(at, exclusive ? before : int_sum);
        } else {
          const double before = sum;
          sum += x.get(at);
          y.set(at, exclusive ? before : sum);
        }
      }
    }
}

std::vector<Expr> cumsum_gradient(const GradContext& c) {
  // y_j = sum over i up to j of x_i, so dx_i = the sum over j from i on of dy_j: the same scan
  // run the other way (an element left out of its own sum leaves its own dy out too).
  Attributes attrs = c.attrs();
  attrs.set("reverse", !c.attrs().b("reverse"));
  return {c.builder.apply1(Op::kCumsum, {c.dy()}, attrs)};
}

// ---- topk -----------------------------------------------------------------------------------

// The order topk ranks elements in, as a strict "comes before": by value (NaN above every
// number), then the lower index.
template <class V>
bool ranks_before(V a, int64_t ia, V b, int64_t ib, bool largest) {
  bool a_nan = false, b_nan = false;
  if constexpr (std::is_floating_point_v<V>) a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return largest ? a_nan : b_nan;
  if (!a_nan && a != b) return largest ? a > b : a < b;
  return ia < ib;
}

void topk_reference(const KernelArgs& k) {
  const Tensor& x = k.inputs[0];
  Tensor &values = k.outputs[0], &indices = k.outputs[1];
  const int axis = normalize_axis(k.attrs.i("axis"), x.rank());
  const AxisView in(x.shape(), axis), out(values.shape(), axis);
  const bool largest = k.attrs.b("largest");
  const bool integer = is_integer(x.dtype());
  std::vector<int64_t> order(in.dim);
  for (int64_t o = 0; o < in.outer; ++o)
    for (int64_t i = 0; i < in.inner; ++i) {
      std::iota(order.begin(), order.end(), int64_t{0});
      const auto before = [&](int64_t a, int64_t b) {
        const int64_t pa = in.at(o, a, i), pb = in.at(o, b, i);
        return integer ? ranks_before(x.get_int(pa), a, x.get_int(pb), b, largest)
                       : ranks_before(x.get(pa), a, x.get(pb), b, largest);
      };
      std::partial_sort(order.begin(), order.begin() + out.dim, order.end(), before);
      for (int64_t j = 0; j < out.dim; ++j) {
        copy_element(x, in.at(o, order[j], i), values, out.at(o, j, i));
        indices.data<int64_t>()[out.at(o, j, i)] = order[j];
      }
    }
}

std::vector<Expr> topk_gradient(const GradContext& c) {
  // Each value came from one position (distinct along the line): its dy goes back there.
  const Expr& x = c.x();
  return {scatter_elements_of(zeros_like(c.builder, x), c.y(1), c.dy(0), c.attrs().i("axis"),
                              "add")};
}

}  // namespace

void define_indexing_ops(OpRegistry& registry) {
  registry.define(
      Op::kGatherElements,
      OpDef{{with_default("axis", int64_t{0})},
            [](std::span<const TensorType> in, const Attributes& a) {
              elements_axis(in[0], in[1], a);
              return std::vector<TensorType>{{in[0].dtype, in[1].shape}};
            },
            gather_elements_reference, gather_elements_gradient});

  registry.define(
      Op::kScatterElements,
      OpDef{{with_default("axis", int64_t{0}), with_default("reduction", std::string("none"))},
            [](std::span<const TensorType> in, const Attributes& a) {
              const TensorType &data = in[0], &indices = in[1], &updates = in[2];
              elements_axis(data, indices, a);
              if (reduction_of(a) != Reduction::kNone) check_arithmetic(data);
              KILN_CHECK(updates.dtype == data.dtype && updates.shape == indices.shape,
                         "updates are {}, expected {} with indices' shape {}", to_string(updates),
                         dtype_name(data.dtype), to_string(indices.shape));
              return std::vector<TensorType>{data};
            },
            scatter_elements_reference, scatter_elements_gradient});

  registry.define(
      Op::kCumsum,
      OpDef{{required("axis", AttrKind::kInt), with_default("exclusive", false),
             with_default("reverse", false)},
            [](std::span<const TensorType> in, const Attributes& a) {
              check_arithmetic(in[0]);
              KILN_CHECK(in[0].rank() >= 1, "x is {}, expected rank >= 1", to_string(in[0]));
              normalize_axis(a.i("axis"), in[0].rank());
              return std::vector<TensorType>{in[0]};
            },
            cumsum_reference, cumsum_gradient});

  registry.define(
      Op::kTopk,
      OpDef{{required("k", AttrKind::kInt), with_default("axis", int64_t{-1}),
             with_default("largest", true)},
            [](std::span<const TensorType> in, const Attributes& a) {
              const TensorType& x = in[0];
              check_arithmetic(x);
              KILN_CHECK(x.rank() >= 1, "x is {}, expected rank >= 1", to_string(x));
              const int axis = normalize_axis(a.i("axis"), x.rank());
              const int64_t k = a.i("k");
              KILN_CHECK(k >= 0 && k <= x.shape[axis],
                         "k is {}, expected 0..{} (dim {} of x {})", k, x.shape[axis], axis,
                         to_string(x));
              Shape shape = x.shape;
              shape[axis] = k;
              return std::vector<TensorType>{{x.dtype, shape}, {DType::kI64, shape}};
            },
            topk_reference, topk_gradient});
}

}  // namespace kiln::ops
