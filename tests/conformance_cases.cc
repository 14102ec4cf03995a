// The conformance table (tests/conformance.h): every op of the op table, with the dtypes,
// shapes and attributes its kernels take and the input ranges its math needs. Sections:
//   0. generated from the op table: a generic case per elementwise math op (its arity and dtype
//      domain from ops/elementwise_math.h), so a new one is covered without writing its case;
//   1. every op at every dtype it accepts (small shapes, both sides of each broadcast, the
//      warp/block boundary of long rows), where the generic case does not serve;
//   2. the CPU fast paths' geometry: odd sizes (not multiples of the vector width), sizes that
//      parallel_for splits, each binary layout, suffix and prefix reductions, checked at the
//      tolerance those kernels always held (f32 against an f64 reference rounded to f32);
//   3. training kernels: optimizer updates (also mixed precision), gelu_grad, reshape,
//      transpose, attention and packed attention (gradients on the forward's out and lse);
//   4. convolution and pooling;
//   5. fused nodes, made by the passes that make them in real steps (fusion, classifier,
//      multi-tensor) from small IR graphs.
// Tolerances are per output dtype (tolerance_of), times Case::tolerance where an op sums many
// rounded terms, or Case::taken_by_tolerance where a case was ported with its own.
#include <fmt/format.h>

#include <array>
#include <limits>
#include <string>

#include "backends/classifier_test_util.h"
#include "conformance.h"
#include "ir/text.h"
#include "passes/classifier.h"
#include "passes/fusion/fusion.h"
#include "ops/elementwise.h"
#include "passes/multi_tensor.h"

namespace kiln::testing::conformance {
namespace {

using Ints = std::vector<int64_t>;

// ---- input generators ---------------------------------------------------------------------

// Uniform values: floats in [lo, hi); integers in [ilo, ihi) (u8 from max(ilo, 0)); bools half.
Gen uniform(Shape shape, double lo = -2.0, double hi = 2.0, double ilo = -20, double ihi = 20) {
  return [=](DType t, uint64_t seed) {
    if (is_float(t)) return rand(t, shape, seed, lo, hi);
    if (t == DType::kU8) return rand(t, shape, seed, std::max(ilo, 0.0), std::min(ihi, 256.0));
    return rand(t, shape, seed, ilo, ihi);
  };
}
Gen positive(Shape shape) { return uniform(std::move(shape), 0.25, 3.0, 1, 20); }
// A fixed dtype regardless of the case's (bool conditions, indices, scalars).
Gen fixed(DType type, Shape shape, double lo, double hi) {
  return [=](DType, uint64_t seed) { return rand(type, shape, seed, lo, hi); };
}
// A ReLU6's outputs: about a fifth exactly 0 and a fifth exactly 6, so comparisons meet ties.
Gen clipped(Shape shape) {
  return [=](DType t, uint64_t seed) {
    Tensor x = rand(t, shape, seed, -2.0, 8.0);
    for (int64_t i = 0; i < x.numel(); ++i) x.set(i, std::clamp(x.get(i), 0.0, 6.0));
    return x;
  };
}
Gen values(DType type, Shape shape, std::vector<double> v) {
  return [=](DType, uint64_t) { return make(type, shape, v); };
}
// Class labels (r * 7 + 3) % vocab, every `ignore_every`-th row (from row 2) set to `ignore`.
Gen labels(DType type, Shape shape, int64_t vocab, int ignore_every, int64_t ignore) {
  return [=](DType, uint64_t) {
    std::vector<double> v;
    for (int64_t r = 0; r < numel(shape); ++r)
      v.push_back(ignore_every > 0 && r % ignore_every == 2 ? static_cast<double>(ignore)
                                                            : static_cast<double>((r * 7 + 3) % vocab));
    return make(type, shape, v);
  };
}

// A padding mask of the case's dtype, rows of Tk (the last dim): key j of row r is masked (by
// -10000 or -inf, in turn) when (j + r) % 3 == 2, key 0 never, so every row keeps keys (with a
// causal mask too).
Gen padding_mask(Shape shape) {
  return [=](DType t, uint64_t) {
    const int64_t tk = shape.back(), rows = tk > 0 ? numel(shape) / tk : 0;
    std::vector<double> v;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < tk; ++j)
        v.push_back(j > 0 && (j + r) % 3 == 2 ? ((j + r) / 3 % 2 ? -std::numeric_limits<double>::infinity() : -10000.0)
                                              : 0.0);
    return make(t, shape, v);
  };
}

// Padded sequences of the case's dtype, rows of Tk: even rows padded at the end (-10000 from
// key Tk - 7 - 13 r on, at least one key kept), odd rows at the start (-inf before key
// min(64, Tk - 1): with Tk > 64 a whole first block of 64 keys). Not for causal attention (whose
// first queries would see no key).
Gen padded_lengths(Shape shape) {
  return [=](DType t, uint64_t) {
    const int64_t tk = shape.back(), rows = tk > 0 ? numel(shape) / tk : 0;
    std::vector<double> v;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < tk; ++j) {
        if (r % 2 == 0) v.push_back(j >= std::max<int64_t>(1, tk - 7 - 13 * r) ? -10000.0 : 0.0);
        else v.push_back(j < std::min<int64_t>(64, tk - 1) ? -std::numeric_limits<double>::infinity() : 0.0);
      }
    return make(t, shape, v);
  };
}

// attention's key_bias shape for q and k: q's leading dims without the heads axis, then Tk.
Shape key_bias_shape(const Shape& q, const Shape& k, bool bthd) {
  const size_t r = q.size(), lead = bthd ? r - 3 : (r >= 3 ? r - 3 : 0);
  Shape shape(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(lead));
  shape.push_back(k[bthd ? r - 3 : r - 2]);
  return shape;
}

const std::vector<DType> kF32 = {DType::kF32};
const std::vector<DType> kFloats = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16};
const std::vector<DType> kHalfAndF32 = {DType::kF32, DType::kF16, DType::kBF16};
const std::vector<DType> kArith = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                                   DType::kI32, DType::kI64, DType::kU8};
const std::vector<DType> kAll = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                                 DType::kI32, DType::kI64, DType::kU8, DType::kBool};
const std::vector<DType> kNoBytes = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                                     DType::kI32, DType::kI64};

std::string tag(const Shape& shape) {
  return shape.empty() ? std::string("scalar") : fmt::format("{}", fmt::join(shape, "x"));
}

// The output shape `op` infers (for gradients' dy of the forward's shape).
Shape output_shape(Op op, std::vector<TensorType> inputs, Attributes attrs) {
  return infer(op, inputs, std::move(attrs)).at(0).shape;
}

// ---- 0. generated from the op table ------------------------------------------------------

// The math table gives an elementwise op its arity and dtype domain but not the inputs where it
// is defined. So a generic case draws on [-2, 2) (integers [-20, 20)) and moves the draw into
// the first narrower range on which the reference kernel stays in the op's domain (no
// non-finite output, no data error): log and sqrt get (0.25, 3), acos (0.25, 0.95), integer
// division nonzero divisors.
struct DrawRange {
  double lo, hi, ilo, ihi;
};
constexpr DrawRange kWide{-2, 2, -20, 20};
constexpr std::array<DrawRange, 3> kDomainRanges = {kWide, DrawRange{0.25, 3, 1, 20},
                                                    DrawRange{0.25, 0.95, 1, 20}};

// x drawn by uniform(shape) at kWide, moved affinely into `to` (bools stay: every op takes them).
Tensor moved_into(const Tensor& x, const DrawRange& to) {
  Tensor y = x.clone();
  const DType t = x.dtype();
  if (t == DType::kBool) return y;
  const bool integer = !is_float(t);
  const double lo = integer ? (t == DType::kU8 ? 0.0 : kWide.ilo) : kWide.lo;
  const double hi = integer ? kWide.ihi : kWide.hi;
  const double to_lo = integer ? to.ilo : to.lo, to_hi = integer ? to.ihi : to.hi;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double v = to_lo + (x.get(i) - lo) / (hi - lo) * (to_hi - to_lo);
    y.set(i, integer ? std::floor(v) : v);
  }
  return y;
}

// Whether the reference kernel of `op` gives finite outputs on `inputs` without a data error.
bool in_domain(Op op, const std::vector<Tensor>& inputs, const Attributes& attrs) {
  const Instance instance = instance_of(op, inputs, attrs);
  std::vector<Tensor> outputs;
  for (const TensorType& t : instance.output_types) outputs.emplace_back(t);
  try {
    op_def(op).reference(KernelArgs{instance.node().attrs, instance.inputs, outputs});
  } catch (const Error&) {
    return false;
  }
  for (const Tensor& out : outputs)
    if (is_float(out.dtype()))
      for (int64_t i = 0; i < out.numel(); ++i)
        if (!std::isfinite(out.get(i))) return false;
  return true;
}

// One case per op of the math table (gelu and gelu_grad in their default form): unary on
// (3, 70), binary on (4, 1, 5) and (3, 1) where the op broadcasts, else on two (3, 70); the
// dtypes its domain takes.
void add_generated_from_table(std::vector<Case>& c) {
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    if (!ops::is_math_op(op)) continue;
    const Attributes attrs = normalize_attributes(op, {});
    int arity = 0;
    math::Domain domain = math::Domain::kFloat;
    math::visit(*ops::elementwise_fn(op, attrs), [&](auto line) {
      arity = decltype(line)::arity();
      domain = decltype(line)::domain();
    });
    const std::vector<DType>& dtypes = domain == math::Domain::kFloat        ? kFloats
                                       : domain == math::Domain::kArithmetic ? kArith
                                                                             : kAll;
    std::vector<Shape> shapes = {{3, 70}};
    if (arity == 2) {
      shapes = {{4, 1, 5}, {3, 1}};
      try {
        infer_types(op, std::vector<TensorType>{{dtypes[0], shapes[0]}, {dtypes[0], shapes[1]}},
                    attrs);
      } catch (const Error&) {
        shapes = {{3, 70}, {3, 70}};  // no broadcast (gelu_grad: dy has x's type)
      }
    }
    Case generic{std::string(op_name(op)) + "_generic", op, dtypes};
    for (const Shape& shape : shapes) generic.inputs.push_back(uniform(shape));
    generic.derive = [op](std::vector<Tensor>& inputs, const Attributes& node_attrs) {
      const std::vector<Tensor> wide = inputs;
      for (const DrawRange& range : kDomainRanges) {
        for (size_t k = 0; k < wide.size(); ++k) inputs[k] = moved_into(wide[k], range);
        if (in_domain(op, inputs, node_attrs)) return;
      }
      fail("{}: no draw range of the generic case is in its domain: give it a case of its own",
           op_name(op));
    };
    c.push_back(std::move(generic));
  }
}

// ---- 1. every op at every dtype ------------------------------------------------------------

void add_every_op(std::vector<Case>& c) {
  const Shape s{3, 70};
  // Unary: the generic cases (section 0) serve erf, exp, sigmoid, silu, tanh, sin, cos, log,
  // sqrt, rsqrt, reciprocal, abs, neg, relu, square and stop_gradient; these need ranges of their
  // own.
  c.push_back({"gelu", Op::kGelu, kFloats, {uniform(s, -4, 4)}});
  c.push_back({"gelu_tanh", Op::kGelu, kFloats, {uniform(s, -4, 4)}, {{"approximate", std::string("tanh")}}});
  c.push_back({"gelu_grad", Op::kGeluGrad, kFloats, {uniform(s, -4, 4), uniform(s)}});
  c.push_back({"gelu_grad_tanh", Op::kGeluGrad, kFloats, {uniform(s, -4, 4), uniform(s)},
               {{"approximate", std::string("tanh")}}});
  // Binary, broadcasting (the generic cases) and not.
  for (auto [name, op] : {std::pair{"add", Op::kAdd}, {"sub", Op::kSub}, {"mul", Op::kMul},
                          {"maximum", Op::kMaximum}, {"minimum", Op::kMinimum}}) {
    c.push_back({std::string(name) + "_same", op, kArith, {uniform({2, 33}), uniform({2, 33})}});
    // Broadcast over leading dims (collapsed to rows), either side.
    c.push_back({std::string(name) + "_rows", op, kArith, {uniform({3, 4, 70}), uniform({4, 70})}});
    c.push_back({std::string(name) + "_rows_left", op, kArith,
                 {uniform({1, 70}), uniform({5, 1, 70})}});
  }
  c.push_back({"div", Op::kDiv, kArith, {uniform({4, 1, 5}, -2, 2, -50, 50), positive({3, 1})}});
  c.push_back({"div_negative", Op::kDiv, kArith,
               {uniform({2, 9}, -2, 2, -50, 50), uniform({9}, -3, -0.25, -9, -1)}});
  c.push_back({"pow", Op::kPow, kFloats, {positive({4, 1, 5}), uniform({3, 1})}});
  // The same-shape and scalar-exponent forms the CPU fast kernel takes.
  c.push_back({"pow_same", Op::kPow, kFloats, {positive({7, 33}), uniform({7, 33}, -3, 3)}});
  c.push_back({"pow_scalar", Op::kPow, kF32, {positive({301, 517}), values(DType::kF32, {}, {2.0})}});
  // Inverse trigonometry inside (-1, 1); round across halves (16-bit floats land on them);
  // remainders of every sign combination.
  for (auto [name, op] : {std::pair{"acos", Op::kAcos}, {"asin", Op::kAsin}})
    c.push_back({name, op, kFloats, {uniform(s, -0.95, 0.95)}});
  c.push_back({"atan", Op::kAtan, kFloats, {uniform(s, -6, 6)}});
  c.push_back({"round", Op::kRound, kFloats, {uniform(s, -6, 6)}});
  for (auto [name, op] : {std::pair{"mod", Op::kMod}, {"fmod", Op::kFmod}}) {
    const std::string n = name;
    c.push_back({n + "_positive", op, kArith, {uniform({4, 1, 5}, -9, 9, -50, 50), positive({3, 1})}});
    c.push_back({n + "_negative", op, kNoBytes,
                 {uniform({2, 9}, -9, 9, -50, 50), uniform({9}, -3, -0.25, -9, -1)}});
  }
  for (auto [name, op] : {std::pair{"eq", Op::kEq}, {"ne", Op::kNe}, {"lt", Op::kLt},
                          {"le", Op::kLe}, {"gt", Op::kGt}, {"ge", Op::kGe}})
    c.push_back({name, op, kAll, {uniform({4, 1, 5}, -2, 2, -3, 3), uniform({3, 1}, -2, 2, -3, 3)}});
  c.push_back({"where", Op::kWhere, kAll,
               {fixed(DType::kBool, {3, 1, 4}, 0, 1), uniform({5, 1}), uniform({4})}});
  // Casts from every dtype to each target; floats in [-300, 300) exercise u8/i32 saturation.
  for (DType to : kAll)
    c.push_back({"cast_to_" + std::string(dtype_name(to)), Op::kCast, kAll,
                 {uniform({5, 40}, -300, 300, -300, 300)}, {{"dtype", to}}});
  c.push_back({"dropout", Op::kDropout, kFloats, {uniform({7, 61})}, {{"p", 0.3}, {"seed", 7}}});
  c.push_back({"dropout_offset", Op::kDropout, kFloats,
               {uniform({7, 61}), values(DType::kI64, {}, {5})}, {{"p", 0.5}, {"seed", 11}}});
  // Sources.
  // Integer and bool sources hold integers of their dtype (a fraction there is an error).
  const std::vector<DType> kIntegers = {DType::kI32, DType::kI64, DType::kU8};
  c.push_back({"full", Op::kFull, kFloats, {}, {{"shape", Ints{3, 5}}, {"value", 2.5}}, 1, true});
  c.push_back({"full_integer", Op::kFull, kIntegers, {}, {{"shape", Ints{3, 5}}, {"value", 7.0}}, 1, true});
  c.push_back({"full_bool", Op::kFull, {DType::kBool}, {}, {{"shape", Ints{3, 5}}, {"value", 1.0}}, 1, true});
  c.push_back({"iota", Op::kIota, kArith, {}, {{"shape", Ints{3, 4, 5}}, {"axis", 1}}, 1, true});
  c.push_back({"constant", Op::kConstant, kFloats, {},
               {{"shape", Ints{2, 3}}, {"values", std::vector<double>{1, -2, 3.5, 0, 7, 1}}}, 1,
               true});
  c.push_back({"constant_integer", Op::kConstant, kIntegers, {},
               {{"shape", Ints{2, 3}}, {"values", Ints{1, 200, 3, 0, 7, 1}}}, 1, true});
  c.push_back({"constant_bool", Op::kConstant, {DType::kBool}, {},
               {{"shape", Ints{2, 3}}, {"values", Ints{1, 0, 1, 0, 0, 1}}}, 1, true});
  // Shape ops.
  c.push_back({"reshape", Op::kReshape, kAll, {uniform({4, 6})}, {{"shape", Ints{2, -1, 3}}}});
  c.push_back({"transpose", Op::kTranspose, kAll, {uniform({2, 3, 4, 5})},
               {{"perm", Ints{2, 0, 3, 1}}}});
  c.push_back({"transpose_reverse", Op::kTranspose, kAll, {uniform({3, 17, 2})}});
  c.push_back({"broadcast_to", Op::kBroadcastTo, kAll, {uniform({3, 1})},
               {{"shape", Ints{2, 3, 4}}}});
  // The cpu kernel's runs: filled per channel (a BatchNorm's gradient), copied rows, copied
  // runs between broadcast dims, a scalar, and a batch split across threads.
  for (const auto& [from, to] : std::vector<std::pair<Shape, Ints>>{{{1, 6, 1, 1}, {4, 6, 5, 7}},
                                                                    {{7}, {2, 3, 7}},
                                                                    {{1, 4, 1, 5}, {3, 4, 2, 5}},
                                                                    {{}, {3, 5}},
                                                                    {{64, 1, 1}, {32, 64, 16, 16}}})
    c.push_back({fmt::format("broadcast_to_{}_{}", tag(from), fmt::join(to, "x")), Op::kBroadcastTo, kAll,
                 {uniform(from)}, {{"shape", to}}});
  c.push_back({"slice", Op::kSlice, kAll, {uniform({6, 7, 5})},
               {{"starts", Ints{1, -5, 0}}, {"ends", Ints{5, 7, 5}}, {"steps", Ints{2, 1, 3}}}});
  // Contiguous runs (steps 1): a last-axis range (the qkv split) and a range of rows.
  c.push_back({"slice_last_axis_run", Op::kSlice, kAll, {uniform({2, 5, 24})},
               {{"starts", Ints{0, 0, 8}}, {"ends", Ints{2, 5, 16}}}});
  c.push_back({"slice_rows", Op::kSlice, kAll, {uniform({6, 7, 5})},
               {{"starts", Ints{1, 0, 0}}, {"ends", Ints{5, 7, 5}}}});
  c.push_back({"concat", Op::kConcat, kAll,
               {uniform({2, 3, 4}), uniform({2, 1, 4}), uniform({2, 5, 4})}, {{"axis", 1}}});
  c.push_back({"split", Op::kSplit, kAll, {uniform({2, 9, 4})},
               {{"axis", -2}, {"sizes", Ints{2, 3, 4}}}});
  c.push_back({"gather", Op::kGather, kAll, {uniform({10, 6}), fixed(DType::kI64, {3, 4}, 0, 10)}});
  c.push_back({"gather_axis1_i32", Op::kGather, kAll,
               {uniform({3, 10, 2}), fixed(DType::kI32, {7}, 0, 10)}, {{"axis", 1}}});
  // Duplicate indices: several atomics land on one row. 16-bit floats add in their own
  // precision in any order (the reference adds in index order), hence the factor.
  c.push_back({"scatter_add", Op::kScatterAdd, kNoBytes,
               {uniform({10, 6}), fixed(DType::kI64, {3, 4}, 0, 10), uniform({3, 4, 6})}, {}, 4});
  c.push_back({"scatter_add_axis1_i32", Op::kScatterAdd, kNoBytes,
               {uniform({2, 5, 3}), fixed(DType::kI32, {8}, 0, 5), uniform({2, 8, 3})},
               {{"axis", 1}}, 4});
  // The elements ops: indices of each element (repeats among them), every reduction; repeated
  // positions are combined in index order on every backend, so even "none" is deterministic.
  c.push_back({"gather_elements", Op::kGatherElements, kAll,
               {uniform({5, 6}), fixed(DType::kI64, {7, 4}, 0, 5)}});
  c.push_back({"gather_elements_axis1_i32", Op::kGatherElements, kAll,
               {uniform({3, 10, 2}), fixed(DType::kI32, {2, 4, 2}, 0, 10)}, {{"axis", 1}}});
  for (const std::string reduction : {"none", "add", "mul", "max", "min"})
    c.push_back({"scatter_elements_" + reduction, Op::kScatterElements,
                 reduction == "none" ? kAll : kArith,
                 {uniform({5, 6}), fixed(DType::kI64, {7, 4}, 0, 5), uniform({7, 4})},
                 {{"reduction", reduction}}, 4});
  c.push_back({"scatter_elements_axis1_i32", Op::kScatterElements, kArith,
               {uniform({3, 10, 2}), fixed(DType::kI32, {2, 4, 2}, 0, 10), uniform({2, 4, 2})},
               {{"axis", 1}, {"reduction", std::string("add")}}, 4});
  c.push_back({"cumsum", Op::kCumsum, kArith, {uniform({4, 7, 3})}, {{"axis", 1}}, 4});
  c.push_back({"cumsum_exclusive_reverse", Op::kCumsum, kArith, {uniform({5, 33})},
               {{"axis", -1}, {"exclusive", true}, {"reverse", true}}, 4});
  // Integer and 16-bit ties exercise the lower-index rule; k = the dim is a sort.
  c.push_back({"topk", Op::kTopk, kArith, {uniform({4, 9, 3}, -2, 2, -3, 3)},
               {{"k", 4}, {"axis", 1}}});
  c.push_back({"topk_sort_smallest", Op::kTopk, kArith, {uniform({6, 40}, -2, 2, -5, 5)},
               {{"k", 40}, {"largest", false}}});
  c.push_back({"one_hot", Op::kOneHot, kAll, {fixed(DType::kI64, {3, 5}, -2, 8)},
               {{"depth", 6}}, 1, true});
  // offload and reload: exact copies (the conformance runner's tensors are all on the device
  // under test; a host side is the executor's and the trainer's, tests/passes/offload_test.cc).
  c.push_back({"offload", Op::kOffload, kAll, {uniform({3, 7, 5})}});
  c.push_back({"reload", Op::kReload, kAll, {uniform({3, 7, 5})}});
  // Reductions: small lines (a warp per output) and long ones (a block per output).
  for (auto [name, op, types] : {std::tuple{"sum", Op::kSum, kArith},
                                 {"mean", Op::kMean, kFloats}, {"max", Op::kMax, kArith}}) {
    const std::string n = name;
    c.push_back({n + "_all", op, types, {uniform({4, 5, 6})}, {}, 4});
    c.push_back({n + "_axis1", op, types, {uniform({4, 5, 6})}, {{"axes", Ints{1}}}, 4});
    c.push_back({n + "_axes02_keepdims", op, types, {uniform({4, 5, 6})},
                 {{"axes", Ints{0, -1}}, {"keepdims", true}}, 4});
    c.push_back({n + "_long_rows", op, types, {uniform({3, 3000})}, {{"axes", Ints{1}}}, 4});
    c.push_back({n + "_long_columns", op, types, {uniform({2000, 3})}, {{"axes", Ints{0}}}, 4});
    c.push_back({n + "_many_rows", op, types, {uniform({5000, 4})}, {{"axes", Ints{1}}}, 4});
  }
  // Products of values near 1 (integers 1..3, which wrap in i32 and u8 alike on every backend).
  c.push_back({"prod_axis1", Op::kProd, kArith, {uniform({4, 5, 6}, 0.5, 1.5, 1, 4)},
               {{"axes", Ints{1}}}, 4});
  c.push_back({"prod_all", Op::kProd, kArith, {uniform({3, 5}, 0.7, 1.3, 1, 3)}, {}, 4});
  c.push_back({"prod_long_rows_keepdims", Op::kProd, kArith, {uniform({3, 300}, 0.9, 1.1, 1, 2)},
               {{"axes", Ints{-1}}, {"keepdims", true}}, 4});
  // Integer ties exercise the first-index rule.
  c.push_back({"argmax", Op::kArgmax, kArith, {uniform({4, 7, 5})}, {{"axis", 1}}});
  c.push_back({"argmax_last_keepdims", Op::kArgmax, kArith, {uniform({6, 300})},
               {{"keepdims", true}}});
  // NN.
  c.push_back({"matmul", Op::kMatmul, kFloats, {uniform({3, 4, 5}), uniform({5, 6})}});
  c.push_back({"matmul_odd", Op::kMatmul, kFloats, {uniform({33, 40}), uniform({40, 17})}, {}, 2});
  c.push_back({"matmul_ta_bcast", Op::kMatmul, kFloats,
               {uniform({2, 1, 20, 18}), uniform({3, 20, 19})}, {{"transpose_a", true}}, 2});
  c.push_back({"matmul_tb", Op::kMatmul, kFloats, {uniform({2, 17, 21}), uniform({2, 9, 21})},
               {{"transpose_b", true}}, 2});
  c.push_back({"matmul_tab", Op::kMatmul, kFloats, {uniform({21, 17}), uniform({9, 21})},
               {{"transpose_a", true}, {"transpose_b", true}}, 2});
  c.push_back({"softmax", Op::kSoftmax, kFloats, {uniform({4, 37}, -4, 4)}});
  c.push_back({"softmax_axis1", Op::kSoftmax, kFloats, {uniform({3, 5, 4}, -4, 4)}, {{"axis", 1}}});
  c.push_back({"softmax_long", Op::kSoftmax, kFloats, {uniform({2, 1000}, -4, 4)}, {}, 2});
  c.push_back({"log_softmax", Op::kLogSoftmax, kFloats, {uniform({4, 37}, -4, 4)}});
  c.push_back({"log_softmax_axis0", Op::kLogSoftmax, kFloats, {uniform({6, 5}, -4, 4)},
               {{"axis", 0}}});
  c.push_back({"softmax_grad", Op::kSoftmaxGrad, kFloats, {uniform({4, 37}, 0, 1), uniform({4, 37})},
               {}, 2});
  c.push_back({"softmax_grad_axis1", Op::kSoftmaxGrad, kFloats,
               {uniform({3, 5, 4}, 0, 1), uniform({3, 5, 4})}, {{"axis", 1}}, 2});
  c.push_back({"log_softmax_grad", Op::kLogSoftmaxGrad, kFloats,
               {uniform({4, 37}, -4, 0), uniform({4, 37})}, {}, 2});
  c.push_back({"layer_norm", Op::kLayerNorm, kFloats,
               {uniform({2, 3, 50}), uniform({50}), uniform({50})}, {}, 2});
  c.push_back({"layer_norm_wide", Op::kLayerNorm, kFloats,
               {uniform({5, 700}), uniform({700}), uniform({700})}, {{"epsilon", 1e-3}}, 2});
  c.push_back({"rms_norm", Op::kRmsNorm, kFloats, {uniform({2, 3, 50}), uniform({50})}, {}, 2});
  c.push_back({"layer_norm_grad", Op::kLayerNormGrad, kFloats,
               {uniform({6, 50}), uniform({50}), uniform({6, 50})}, {}, 4});
  c.push_back({"layer_norm_grad_wide", Op::kLayerNormGrad, kFloats,
               {uniform({40, 300}), uniform({300}), uniform({40, 300})}, {}, 4});
  c.push_back({"rms_norm_grad", Op::kRmsNormGrad, kFloats,
               {uniform({6, 50}), uniform({50}), uniform({6, 50})}, {}, 4});
  const Gen labels64 = values(DType::kI64, {6}, {3, -100, 0, 10, 5, 7});
  const Gen labels32 = values(DType::kI32, {2, 3}, {3, -100, 0, 10, 5, 7});
  for (const char* reduction : {"mean", "sum", "none"}) {
    const std::string r = reduction;
    c.push_back({"cross_entropy_" + r, Op::kCrossEntropy, kFloats,
                 {uniform({6, 11}, -4, 4), labels64}, {{"reduction", r}}, 2});
    c.push_back({"cross_entropy_i32_" + r, Op::kCrossEntropy, kFloats,
                 {uniform({2, 3, 11}, -4, 4), labels32}, {{"reduction", r}}, 2});
    c.push_back({"cross_entropy_grad_" + r, Op::kCrossEntropyGrad, kFloats,
                 {uniform({6, 11}, -4, 4), labels64, uniform(r == "none" ? Shape{6} : Shape{})},
                 {{"reduction", r}}, 2});
  }
  c.push_back({"cross_entropy_all_ignored", Op::kCrossEntropy, kFloats,
               {uniform({2, 5}), values(DType::kI64, {2}, {-100, -100})}});
  c.push_back({"attention", Op::kAttention, kFloats,
               {uniform({2, 3, 5, 8}), uniform({2, 3, 7, 8}), uniform({2, 3, 7, 6})}, {}, 2});
  c.push_back({"attention_causal_scaled", Op::kAttention, kFloats,
               {uniform({2, 9, 8}), uniform({2, 9, 8}), uniform({2, 9, 8})},
               {{"causal", true}, {"scale", 0.5}}, 2});
  c.push_back({"attention_no_head_dim_out", Op::kAttention, kFloats,
               {uniform({2, 4, 8}), uniform({2, 5, 8}), uniform({2, 5, 0})}, {}, 2});
  // attention_grad is defined on the out and lse it is given (P = exp(s - lse),
  // D = dout . out), so independent random ones test it; |s| <= 8 / sqrt(8) with q, k in
  // [-1, 1], and lse in [1, 3] keeps P below e^2.
  auto lse = [](Shape shape) -> Gen {
    return [=](DType t, uint64_t seed) {
      return rand(t == DType::kF64 ? DType::kF64 : DType::kF32, shape, seed, 1.0, 3.0);
    };
  };
  c.push_back({"attention_grad", Op::kAttentionGrad, kFloats,
               {uniform({2, 3, 5, 8}, -1, 1), uniform({2, 3, 7, 8}, -1, 1), uniform({2, 3, 7, 6}),
                uniform({2, 3, 5, 6}), uniform({2, 3, 5, 6}), lse({2, 3, 5})}, {}, 4});
  c.push_back({"attention_grad_causal", Op::kAttentionGrad, kFloats,
               {uniform({2, 9, 8}, -1, 1), uniform({2, 9, 8}, -1, 1), uniform({2, 9, 8}),
                uniform({2, 9, 8}), uniform({2, 9, 8}), lse({2, 9})},
               {{"causal", true}}, 4});
  // Grouped-query attention: k and v with fewer heads (2 or 1) than q, both layouts.
  c.push_back({"attention_gqa_bthd", Op::kAttention, kFloats,
               {uniform({2, 5, 4, 8}), uniform({2, 7, 2, 8}), uniform({2, 7, 2, 6})},
               {{"causal", true}, {"layout", std::string("bthd")}}, 2});
  c.push_back({"attention_gqa_bhtd", Op::kAttention, kFloats,
               {uniform({2, 3, 5, 8}), uniform({2, 1, 7, 8}), uniform({2, 1, 7, 6})}, {}, 2});
  c.push_back({"attention_gqa_grad_bthd", Op::kAttentionGrad, kFloats,
               {uniform({2, 9, 4, 8}, -1, 1), uniform({2, 9, 2, 8}, -1, 1), uniform({2, 9, 2, 8}),
                uniform({2, 9, 4, 8}), uniform({2, 9, 4, 8}), lse({2, 9, 4})},
               {{"causal", true}, {"layout", std::string("bthd")}}, 4});
  c.push_back({"attention_gqa_grad_bhtd", Op::kAttentionGrad, kFloats,
               {uniform({2, 3, 5, 8}, -1, 1), uniform({2, 1, 7, 8}, -1, 1), uniform({2, 1, 7, 6}),
                uniform({2, 3, 5, 6}), uniform({2, 3, 5, 6}), lse({2, 3, 5})}, {}, 4});
  // A key_bias (attention's padding mask, or any additive per-key bias): one row of Tk per batch
  // entry, broadcast over the heads and queries; both layouts, grouped-query, causal too.
  c.push_back({"attention_key_bias", Op::kAttention, kFloats,
               {uniform({2, 3, 5, 8}), uniform({2, 3, 7, 8}), uniform({2, 3, 7, 6}), uniform({2, 7})}, {}, 2});
  c.push_back({"attention_key_bias_padding_gqa_bthd", Op::kAttention, kFloats,
               {uniform({2, 9, 4, 8}), uniform({2, 9, 2, 8}), uniform({2, 9, 2, 6}), padding_mask({2, 9})},
               {{"causal", true}, {"layout", std::string("bthd")}}, 2});
  c.push_back({"attention_key_bias_grad", Op::kAttentionGrad, kFloats,
               {uniform({2, 3, 5, 8}, -1, 1), uniform({2, 3, 7, 8}, -1, 1), uniform({2, 3, 7, 6}),
                uniform({2, 3, 5, 6}), uniform({2, 3, 5, 6}), lse({2, 3, 5}), uniform({2, 7}, -1, 1)},
               {}, 4});
  c.push_back({"attention_key_bias_grad_padding_gqa_bthd", Op::kAttentionGrad, kFloats,
               {uniform({2, 9, 4, 8}, -1, 1), uniform({2, 9, 2, 8}, -1, 1), uniform({2, 9, 2, 8}),
                uniform({2, 9, 4, 8}), uniform({2, 9, 4, 8}), lse({2, 9, 4}), padding_mask({2, 9})},
               {{"causal", true}, {"layout", std::string("bthd")}}, 4});
  // Rotary embeddings: both layouts, both directions; D/2 odd (scalar path) and a multiple of 8
  // (the GPU's 16-byte chunks of both halves).
  c.push_back({"rotary_embedding", Op::kRotaryEmbedding, kFloats, {uniform({2, 3, 9, 6})}});
  c.push_back({"rotary_embedding_bthd_inverse", Op::kRotaryEmbedding, kFloats,
               {uniform({2, 9, 3, 16})},
               {{"layout", std::string("bthd")}, {"inverse", true}, {"base", 500.0}}});
  c.push_back({"rotary_embedding_bthd_wide", Op::kRotaryEmbedding, kFloats,
               {uniform({2, 33, 2, 64})}, {{"layout", std::string("bthd")}}});
  // Packed self-attention, (B, T, 3, H, D): every float dtype, head dims the GPU kernels take.
  c.push_back({"attention_qkv", Op::kAttentionQkv, kFloats, {uniform({2, 9, 3, 2, 8}, -1, 1)},
               {{"causal", true}}, 2});
  c.push_back({"attention_qkv_grad", Op::kAttentionQkvGrad, kFloats,
               {uniform({2, 9, 3, 2, 8}, -1, 1), uniform({2, 9, 2, 8}), uniform({2, 9, 2, 8}),
                lse({2, 9, 2})},
               {{"causal", true}}, 4});
  c.push_back({"attention_qkv_key_bias", Op::kAttentionQkv, kFloats,
               {uniform({2, 9, 3, 2, 8}, -1, 1), padding_mask({2, 9})}, {}, 2});
  c.push_back({"attention_qkv_grad_key_bias", Op::kAttentionQkvGrad, kFloats,
               {uniform({2, 9, 3, 2, 8}, -1, 1), uniform({2, 9, 2, 8}), uniform({2, 9, 2, 8}),
                lse({2, 9, 2}), uniform({2, 9}, -1, 1)},
               {{"causal", true}}, 4});
  const Gen lr = fixed(DType::kF32, {}, 0.01, 0.1);
  const Gen step = values(DType::kF64, {}, {3});
  c.push_back({"optimizer_update_sgd", Op::kOptimizerUpdate, kFloats,
               {uniform({40}), uniform({40}), uniform({40}), lr, step}, {{"optimizer", "sgd"}}});
  c.push_back({"optimizer_update_sgd_nesterov", Op::kOptimizerUpdate, kFloats,
               {uniform({40}), uniform({40}), uniform({40}), lr, step},
               {{"optimizer", "sgd"}, {"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.01}}});
  c.push_back({"optimizer_update_adamw", Op::kOptimizerUpdate, kFloats,
               {uniform({40}), uniform({40}), uniform({40}), positive({40}), lr, step}, {{"optimizer", "adamw"}}});
  c.push_back({"optimizer_update_lion", Op::kOptimizerUpdate, kFloats,
               {uniform({40}), uniform({40}), uniform({40}), lr, step},
               {{"optimizer", "lion"}, {"weight_decay", 0.1}}});
}

// ---- 2. the CPU fast paths' geometry (f32) -------------------------------------------------

void add_fast_path_geometry(std::vector<Case>& c) {
  // Unary: tiny, odd, not a multiple of 4 or 8 lanes, and one that parallel_for splits; the
  // ranges reach each approximation's switch points and ends.
  struct Unary {
    Op op;
    const char* range;
    double low, high;
    Tolerance tol;
    Attributes attrs = {};
  };
  const std::vector<Unary> unary = {
      {Op::kErf, "0.6", -0.6, 0.6, {1e-9, 2e-6}},  // around the polynomial / erfc switch at 0.5
      {Op::kErf, "6", -6, 6, {1e-9, 2e-6}},
      {Op::kExp, "10", -10, 10, {1e-30, 2e-6}},
      {Op::kExp, "95", -95, 95, {1e-37, 2e-6}},  // underflow to 0 / overflow to inf at the ends
      {Op::kLog, "50", 0.01, 50, {1e-7, 1e-6}},
      {Op::kTanh, "0.6", -0.6, 0.6, {1e-9, 2e-6}},  // around the polynomial / exp switch at 0.5
      {Op::kTanh, "12", -12, 12, {1e-9, 2e-6}},
      {Op::kSin, "30", -30, 30, {1e-7, 1e-6}},
      {Op::kCos, "30", -30, 30, {1e-7, 1e-6}},
      {Op::kSigmoid, "30", -30, 30, {1e-12, 2e-6}},
      {Op::kRelu, "1", -1, 1, {0, 0}},
      {Op::kGelu, "6", -6, 6, {1e-9, 1e-5}, {{"approximate", std::string("none")}}},
      {Op::kGelu, "0.5", -0.5, 0.5, {1e-9, 2e-6}, {{"approximate", std::string("none")}}},
      {Op::kGelu, "tanh_6", -6, 6, {1e-9, 1e-5}, {{"approximate", std::string("tanh")}}},
      {Op::kSilu, "30", -30, 30, {1e-9, 2e-6}},
      {Op::kNeg, "1", -1, 1, {0, 0}},
      {Op::kAbs, "1", -1, 1, {0, 0}},
      {Op::kSqrt, "100", 0.01, 100, {0, 1e-6}},
      {Op::kRsqrt, "100", 0.01, 100, {0, 1e-6}},
      {Op::kReciprocal, "100", 0.01, 100, {0, 1e-6}},
      {Op::kReciprocal, "negative_100", -100, -0.01, {0, 1e-6}},
      {Op::kSquare, "3", -3, 3, {0, 1e-6}},
  };
  for (const Unary& u : unary)
    for (const Shape& shape : std::vector<Shape>{{1}, {7}, {129}, {3, 5, 33}, {301, 517}})
      c.push_back({.name = fmt::format("{}_range{}_{}", op_name(u.op), u.range, tag(shape)),
                   .op = u.op, .dtypes = kF32, .inputs = {uniform(shape, u.low, u.high)},
                   .attrs = u.attrs, .taken_by_tolerance = u.tol, .taken_by = {"cpu"}});

  // Binary: each layout the "cpu" kernel has (same, scalar either side, row either side, block
  // either side).
  const std::vector<std::pair<Shape, Shape>> layouts = {
      {{7}, {7}},                  {{3, 129}, {3, 129}},
      {{1, 3, 5}, {3, 5}},         // same up to leading 1s
      {{301, 517}, {301, 517}},    // split across threads
      {{4, 33}, {1}},              // scalar b
      {{}, {4, 33}},               // scalar a (rank 0)
      {{301, 517}, {1, 1}},        // scalar b, split across threads
      {{2, 3, 7}, {7}},            // row b: (B, T, C) op (C,)
      {{2, 3, 7}, {3, 7}},         // row b: (B, T, C) op (T, C)
      {{2, 3, 129}, {1, 1, 129}},  // row b with leading 1s
      {{129}, {5, 3, 129}},        // row a: (C,) op (B, T, C)
      {{1000, 129}, {129}},        // row b, split across threads
      {{600, 1}, {1}},             // row of one element
      {{4, 6, 5, 7}, {1, 6, 1, 1}},  // block b: per channel, (N, C, H, W) op (1, C, 1, 1)
      {{6, 1, 1}, {3, 6, 5, 7}},     // block a, of lower rank
      {{2, 3, 7}, {2, 3, 1}},        // block b: a column
      {{4, 6, 5, 7}, {4, 6, 1, 1}},  // block b over two dims
      {{32, 64, 16, 16}, {64, 1, 1}},  // block b, split across threads
  };
  for (Op op : {Op::kAdd, Op::kSub, Op::kMul, Op::kDiv, Op::kMaximum, Op::kMinimum})
    for (const auto& [a, b] : layouts) {
      const std::string name = fmt::format("{}_layout_{}_{}", op_name(op), tag(a), tag(b));
      // Divisors away from 0, of both signs (the quotient both ways round).
      const Gen gen_b = op == Op::kDiv ? uniform(b, 0.5, 2.0) : uniform(b);
      c.push_back({.name = name, .op = op, .dtypes = kF32, .inputs = {uniform(a), gen_b},
                   .taken_by_tolerance = Tolerance{1e-7, 1e-6}, .taken_by = {"cpu"}});
      if (op == Op::kDiv)
        c.push_back({.name = name + "_reversed", .op = op, .dtypes = kF32,
                     .inputs = {gen_b, uniform(a)}, .taken_by_tolerance = Tolerance{1e-7, 1e-6}, .taken_by = {"cpu"}});
    }

  // Comparisons into bool, on a ReLU6's outputs (ties with 0 and 6: its gradient's masks).
  for (Op op : {Op::kEq, Op::kNe, Op::kLt, Op::kLe, Op::kGt, Op::kGe}) {
    const std::vector<std::pair<std::string, std::vector<Gen>>> operands = {
        {"same", {clipped({4, 6, 5, 7}), clipped({4, 6, 5, 7})}},
        {"zero", {clipped({4, 6, 5, 7}), values(DType::kF32, {}, {0.0})}},
        {"six_left", {values(DType::kF32, {}, {6.0}), clipped({4, 6, 5, 7})}},
        {"channel", {clipped({4, 6, 5, 7}), clipped({1, 6, 1, 1})}},
        {"rows", {clipped({5, 3, 129}), clipped({129})}},
    };
    for (const auto& [tag_name, inputs] : operands)
      c.push_back({.name = fmt::format("{}_layout_{}", op_name(op), tag_name), .op = op, .dtypes = kF32,
                   .inputs = inputs, .taken_by_tolerance = Tolerance{0, 0}, .taken_by = {"cpu"}});
  }

  // Reductions over suffix axes (rows), prefix axes (columns: bias gradients) and both around
  // kept middle axes (BatchNorm's per-channel statistics); positive inputs keep sums away from
  // cancellation, so rtol means something; negative ones check the max of negatives.
  const std::vector<std::pair<Shape, Ints>> reductions = {
      {{7}, {}},           {{7}, {0}},           {{129}, {-1}},      {{3, 129}, {1}},
      {{3, 129}, {-1}},    {{3, 129}, {}},       {{3, 129}, {0, 1}}, {{2, 3, 7}, {1, 2}},
      {{2, 3, 7}, {-1, -2}}, {{1000, 129}, {1}},  // rows split across threads
      {{1, 1}, {}},        {{70001}, {}},       // one long row split across threads
      {{2, 70001}, {-1}},
      {{3, 129}, {0}},     {{2, 3, 7}, {0, 1}},  {{2, 3, 7}, {-3}},  {{4096, 33}, {0}},
      {{70001, 2}, {0}},
      {{4, 5, 6, 7}, {0, 2, 3}}, {{2, 3, 7}, {0, -1}}, {{3, 2, 4, 5}, {0, 3}},  // middle kept
      {{2, 1, 3}, {0, 2}},       {{8, 16, 30, 30}, {0, 2, 3}},                // one channel; many
  };
  for (Op op : {Op::kSum, Op::kMean, Op::kMax})
    for (const auto& [shape, axes] : reductions)
      for (bool keepdims : {false, true})
        for (auto [sign, lo, hi] : {std::tuple{"positive", 0.5, 1.5}, {"negative", -3.0, -1.0}})
          c.push_back({.name = fmt::format("{}_{}_axes{}{}_{}", op_name(op), tag(shape),
                                           fmt::join(axes, "_"), keepdims ? "_keepdims" : "", sign),
                       .op = op, .dtypes = kF32, .inputs = {uniform(shape, lo, hi)},
                       .attrs = {{"axes", axes}, {"keepdims", keepdims}},
                       .taken_by_tolerance = Tolerance{1e-5, 1e-5}, .taken_by = {"cpu"}});

  // Row ops: one element, odd lengths, rows split across threads, one long row.
  for (const Shape& shape : std::vector<Shape>{{1}, {7}, {4, 129}, {3, 5, 33}, {2, 70001}, {700, 65}}) {
    const Gen x = uniform(shape, -8, 8);
    c.push_back({.name = "softmax_rows_" + tag(shape), .op = Op::kSoftmax, .dtypes = kF32,
                 .inputs = {x}, .taken_by_tolerance = Tolerance{1e-9, 1e-5}, .taken_by = {"cpu"}});
    c.push_back({.name = "softmax_rows_last_axis_" + tag(shape), .op = Op::kSoftmax,
                 .dtypes = kF32, .inputs = {x},
                 .attrs = {{"axis", static_cast<int64_t>(shape.size()) - 1}},
                 .taken_by_tolerance = Tolerance{1e-9, 1e-5}, .taken_by = {"cpu"}});
    c.push_back({.name = "log_softmax_rows_" + tag(shape), .op = Op::kLogSoftmax, .dtypes = kF32,
                 .inputs = {x}, .taken_by_tolerance = Tolerance{1e-5, 1e-6}, .taken_by = {"cpu"}});
  }
  // Far from 0: the max shift matters.
  c.push_back({.name = "softmax_far_from_zero", .op = Op::kSoftmax, .dtypes = kF32,
               .inputs = {uniform({3, 17}, 80, 120)}, .taken_by_tolerance = Tolerance{1e-9, 1e-5}, .taken_by = {"cpu"}});
  c.push_back({.name = "log_softmax_far_from_zero", .op = Op::kLogSoftmax, .dtypes = kF32,
               .inputs = {uniform({3, 17}, 80, 120)}, .taken_by_tolerance = Tolerance{2e-5, 1e-6}, .taken_by = {"cpu"}});
  for (const Shape& shape : std::vector<Shape>{{1}, {5, 1}, {7}, {4, 129}, {3, 5, 33}, {2, 70001}, {700, 65}})
    for (double epsilon : {1e-5, 0.1}) {
      const Shape row{shape.back()};
      c.push_back({.name = fmt::format("layer_norm_rows_{}_eps{}", tag(shape), epsilon),
                   .op = Op::kLayerNorm, .dtypes = kF32,
                   .inputs = {uniform(shape, -3, 3), uniform(row, 0.5, 1.5), uniform(row, -1, 1)},
                   .attrs = {{"epsilon", epsilon}}, .taken_by_tolerance = Tolerance{2e-5, 1e-5}, .taken_by = {"cpu"}});
    }
  // A large mean and a small spread: the variance must be taken about the mean.
  c.push_back({.name = "layer_norm_large_mean", .op = Op::kLayerNorm, .dtypes = kF32,
               .inputs = {uniform({6, 100}, 99, 101), uniform({100}, 0.5, 1.5), uniform({100}, -1, 1)},
               .taken_by_tolerance = Tolerance{1e-4, 1e-5}, .taken_by = {"cpu"}});

  // cross_entropy: every fifth row ignored (-100), or a custom ignore_index some labels hit.
  const std::vector<std::pair<Shape, DType>> losses = {
      {{1, 1}, DType::kI64},      {{7, 11}, DType::kI64},   {{2, 3, 129}, DType::kI32},
      {{4, 50001}, DType::kI64},  {{600, 33}, DType::kI32}, {{5}, DType::kI64}};
  for (const auto& [logits, label_type] : losses) {
    const Shape rows(logits.begin(), logits.end() - 1);
    for (std::string reduction : {"mean", "sum", "none"}) {
      c.push_back({.name = fmt::format("cross_entropy_rows_{}_{}_{}", tag(logits),
                                       dtype_name(label_type), reduction),
                   .op = Op::kCrossEntropy, .dtypes = kF32,
                   .inputs = {uniform(logits, -6, 6), labels(label_type, rows, logits.back(), 5, -100)},
                   .attrs = {{"reduction", reduction}}, .taken_by_tolerance = Tolerance{1e-5, 1e-5}, .taken_by = {"cpu"}});
      c.push_back({.name = fmt::format("cross_entropy_rows_{}_{}_{}_ignore3", tag(logits),
                                       dtype_name(label_type), reduction),
                   .op = Op::kCrossEntropy, .dtypes = kF32,
                   .inputs = {uniform(logits, -6, 6), labels(label_type, rows, logits.back(), 0, 0)},
                   .attrs = {{"reduction", reduction}, {"ignore_index", int64_t{3}}},
                   .taken_by_tolerance = Tolerance{1e-5, 1e-5}, .taken_by = {"cpu"}});
    }
  }

  // matmul: every transpose, batch dims folded into M, broadcast batches, f32 and f64.
  struct Matmul {
    Shape a, b;
    bool ta = false, tb = false;
  };
  const std::vector<Matmul> matmuls = {
      {{1, 1}, {1, 1}},
      {{7, 5}, {5, 3}},
      {{129, 65}, {65, 33}},
      {{5, 7}, {5, 3}, true, false},
      {{7, 5}, {3, 5}, false, true},
      {{5, 7}, {3, 5}, true, true},
      {{2, 3, 4, 5}, {5, 6}},              // batch folded into M
      {{2, 3, 4, 5}, {6, 5}, false, true},  // folded, b transposed
      {{2, 3, 5, 4}, {5, 6}, true, false},  // a transposed: one GEMM per batch
      {{3, 5}, {2, 5, 4}},                  // a broadcast over b's batch
      {{2, 1, 4, 5}, {3, 5, 6}},            // both broadcast: (2, 3, 4, 6)
      {{2, 1, 5, 4}, {1, 3, 6, 5}, true, true},
      {{1, 7, 5}, {4, 5, 129}},
  };
  for (const Matmul& m : matmuls)
    for (auto [dtype, tol] : {std::pair{DType::kF32, Tolerance{1e-5, 1e-5}},
                              {DType::kF64, Tolerance{1e-13, 1e-12}}})
      c.push_back({.name = fmt::format("matmul_{}_{}{}{}", tag(m.a), tag(m.b), m.ta ? "_ta" : "",
                                       m.tb ? "_tb" : ""),
                   .op = Op::kMatmul, .dtypes = {dtype}, .inputs = {uniform(m.a, -1, 1), uniform(m.b, -1, 1)},
                   .attrs = {{"transpose_a", m.ta}, {"transpose_b", m.tb}}, .taken_by_tolerance = tol, .taken_by = {"openblas"}});
  // K = 0: an empty sum, all zeros (written: the output is poisoned).
  c.push_back({.name = "matmul_empty_k", .op = Op::kMatmul, .dtypes = {DType::kF32, DType::kF64},
               .inputs = {uniform({3, 0}), uniform({0, 4})}, .taken_by = {"openblas"}});
  c.push_back({"matmul_empty_k_16_bit", Op::kMatmul, {DType::kF16, DType::kBF16},
               {uniform({3, 0}), uniform({0, 4})}});
  // K = 1000 in f32: rounding grows with K (about sqrt(K) ulps of the sum of |terms|).
  c.push_back({.name = "matmul_large_k", .op = Op::kMatmul, .dtypes = kF32,
               .inputs = {uniform({16, 1000}, -1, 1), uniform({1000, 9}, -1, 1)},
               .taken_by_tolerance = Tolerance{2e-4, 1e-4}, .taken_by = {"openblas"}});
}

// ---- 3. training kernels -------------------------------------------------------------------

Attributes attention_attrs(bool causal, double scale, bool bthd) {
  Attributes attrs{{"causal", causal}};
  if (scale > 0) attrs.set("scale", scale);
  if (bthd) attrs.set("layout", std::string("bthd"));
  return attrs;
}

void add_training_kernels(std::vector<Case>& c) {
  // Tiny, odd (not a multiple of 4 or 8 lanes, nor of the 256-element update block), and one
  // that parallel_for splits.
  const std::vector<Shape> shapes = {{1}, {7}, {257}, {3, 5, 33}, {301, 517}};
  // AdamW: v >= 0, as AdamW keeps; lr and step as f32 or f64 scalars; a large lr makes the
  // update term dominate p' (a few f32 roundings of |p| <= 2: atol 1e-6).
  const std::vector<Attributes> adamw_attrs = {
      {{"optimizer", "adamw"}},  // defaults: beta1 0.9, beta2 0.999, epsilon 1e-8, weight_decay 0.01
      {{"optimizer", "adamw"}, {"beta1", 0.8}, {"beta2", 0.95}, {"epsilon", 1e-6}, {"weight_decay", 0.1}},
      {{"optimizer", "adamw"}, {"weight_decay", 0.0}},
  };
  for (const Shape& shape : shapes)
    for (size_t a = 0; a < adamw_attrs.size(); ++a)
      for (double step : {1.0, 7.0, 1000.0})
        for (auto [lr, lr_type] : {std::pair{1e-3, DType::kF32}, {0.3, DType::kF64}})
          c.push_back({.name = fmt::format("adamw_update_{}_attrs{}_step{}_lr{}", tag(shape), a,
                                           step, lr),
                       .op = Op::kOptimizerUpdate, .dtypes = kF32,
                       .inputs = {uniform(shape, -2, 2), uniform(shape, -1, 1),
                                  uniform(shape, -0.5, 0.5), uniform(shape, 1e-4, 0.5),
                                  values(lr_type, {}, {lr}), values(DType::kF32, {}, {step})},
                       .attrs = adamw_attrs[a],
                       // GPU kernels compute the bias corrections 1 - beta^t in f32 (1 - 0.999
                       // is 1.3e-5 off in f32), which a large lr carries into p'.
                       .tolerance = lr > 0.1 ? 4.0 : 1.0,
                       .taken_by_tolerance = Tolerance{lr > 0.1 ? 1e-6 : 1e-7, 1e-6}, .taken_by = {"cpu"}});
  const std::vector<Attributes> sgd_attrs = {
      {{"optimizer", "sgd"}},
      {{"optimizer", "sgd"}, {"weight_decay", 0.05}},
      {{"optimizer", "sgd"}, {"momentum", 0.9}},
      {{"optimizer", "sgd"}, {"momentum", 0.9}, {"weight_decay", 0.01}},
      {{"optimizer", "sgd"}, {"momentum", 0.8}, {"nesterov", true}, {"weight_decay", 0.02}},
      // Lion: its sign makes p' exact up to the decay's rounding.
      {{"optimizer", "lion"}},
      {{"optimizer", "lion"}, {"beta1", 0.95}, {"beta2", 0.98}, {"weight_decay", 0.1}},
  };
  for (const Shape& shape : shapes)
    for (size_t a = 0; a < sgd_attrs.size(); ++a)
      for (auto [lr, lr_type] : {std::pair{0.01, DType::kF32}, {0.5, DType::kF64}})
        c.push_back({.name = fmt::format("{}_update_{}_attrs{}_lr{}", sgd_attrs[a].s("optimizer"), tag(shape), a, lr),
                     .op = Op::kOptimizerUpdate, .dtypes = kF32,
                     .inputs = {uniform(shape, -2, 2), uniform(shape, -1, 1), uniform(shape, -1, 1),
                                values(lr_type, {}, {lr}), values(DType::kF32, {}, {4})},
                     .attrs = sgd_attrs[a],
                     .taken_by_tolerance = Tolerance{lr > 0.1 ? 1e-6 : 1e-7, 1e-6}, .taken_by = {"cpu"}});
  // Mixed precision (param, grad, state) as the GPU's update kernels take them, at the
  // loosest dtype's tolerance (the case's dtype); lr and step of other float dtypes.
  const std::vector<std::array<DType, 3>> mixed = {
      {DType::kBF16, DType::kBF16, DType::kF32}, {DType::kF32, DType::kBF16, DType::kF32},
      {DType::kF32, DType::kF16, DType::kF32}};
  for (const auto& [p, g, s] : mixed)
    for (int64_t n : {int64_t{7}, int64_t{100003}}) {
      const DType loosest = g;
      const std::string types = fmt::format("{}_{}_{}_{}", dtype_name(p), dtype_name(g), dtype_name(s), n);
      c.push_back({.name = "adamw_update_mixed_" + types, .op = Op::kOptimizerUpdate, .dtypes = {loosest},
                   .inputs = {fixed(p, {n}, -1, 1), fixed(g, {n}, -1, 1), fixed(s, {n}, -0.1, 0.1),
                              fixed(s, {n}, 1e-4, 1e-2), values(DType::kF32, {}, {1e-2}),
                              values(DType::kF64, {}, {3})},
                   .attrs = {{"optimizer", "adamw"}, {"weight_decay", 0.1}, {"beta2", 0.95}}});
      if (s == p)
        c.push_back({.name = "sgd_update_mixed_" + types, .op = Op::kOptimizerUpdate, .dtypes = {loosest},
                     .inputs = {fixed(p, {n}, -1, 1), fixed(g, {n}, -1, 1), fixed(s, {n}, -1, 1),
                                values(DType::kBF16, {}, {0.125}), values(DType::kF32, {}, {2})},
                     .attrs = {{"optimizer", "sgd"}, {"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.01}}});
    }
  // gelu_grad: rtol 1e-5 as gelu's fast kernel; atol 1e-7 for the zero of gelu' near
  // x = -0.75, where Phi(x) and x phi(x) (about 0.23 each) cancel.
  for (std::string approximate : {"none", "tanh"})
    for (const Shape& shape : shapes)
      for (double range : {6.0, 0.6, 40.0})
        c.push_back({.name = fmt::format("gelu_grad_{}_{}_range{}", approximate, tag(shape), range),
                     .op = Op::kGeluGrad, .dtypes = kF32,
                     .inputs = {uniform(shape, -range, range), uniform(shape, -1, 1)},
                     .attrs = {{"approximate", approximate}},
                     .taken_by_tolerance = Tolerance{1e-7, 1e-5}, .taken_by = {"cpu"}});
  // reshape and transpose copy: exact, every dtype.
  c.push_back({.name = "reshape_every_dtype", .op = Op::kReshape, .dtypes = kAll,
               .inputs = {uniform({3, 7, 11}, 1, 100, 1, 100)}, .attrs = {{"shape", Ints{21, -1}}},
               .taken_by_tolerance = Tolerance{0, 0}, .taken_by = {"cpu"}});
  c.push_back({.name = "reshape_split_copy", .op = Op::kReshape, .dtypes = kF32,
               .inputs = {uniform({1024, 1031})}, .attrs = {{"shape", Ints{-1}}},
               .taken_by_tolerance = Tolerance{0, 0}, .taken_by = {"cpu"}});
  const std::vector<std::pair<Shape, Ints>> transposes = {
      {{2, 5, 3, 7}, {0, 2, 1, 3}},    // (B, T, H, D) -> (B, H, T, D): runs of D
      {{4, 64, 4, 16}, {0, 2, 1, 3}},  // gpt2-tiny's head split
      {{3, 37, 41}, {0, 2, 1}},        // last two axes: batched 2-D tiles, partial tiles
      {{2, 3, 33, 65}, {0, 1, 3, 2}},
      {{301, 517}, {1, 0}},            // one big 2-D transpose, split across threads
      {{5, 6, 7}, {}},                 // default perm reverses
      {{2, 3, 4, 5}, {2, 3, 0, 1}},    // merges to a (6, 20) transpose
      {{1, 5, 1, 3}, {3, 2, 0, 1}},    // size-1 axes dropped
      {{2, 3, 4, 5, 6}, {2, 0, 4, 1, 3}},
      {{2, 3, 4, 5, 6}, {4, 3, 2, 1, 0}},
      {{2, 3, 4}, {-1, 0, 1}},         // negative axes
      {{6, 9}, {0, 1}},                // identity
      {{3, 0, 2}, {2, 1, 0}},          // empty
      {{7}, {0}},
  };
  for (const auto& [shape, perm] : transposes)
    c.push_back({.name = fmt::format("transpose_{}_perm{}", tag(shape), fmt::join(perm, "_")),
                 .op = Op::kTranspose,
                 .dtypes = {DType::kF32, DType::kF64, DType::kBF16, DType::kI32, DType::kBool},
                 .inputs = {uniform(shape, 1, 100, 1, 100)}, .attrs = {{"perm", perm}},
                 .taken_by_tolerance = Tolerance{0, 0}, .taken_by = {"cpu"}});

  // attention and attention_grad (the gradient on the forward's own out and lse): f32 sums
  // over D and Tk of products of values in [-1, 1] plus an f32 softmax: atol 1e-5, rtol 1e-4.
  struct Attention {
    Shape q, k, v;
    bool causal;
    double scale;       // <= 0: the default 1/sqrt(D)
    bool bthd = false;  // layout "bthd": q (..., Tq, H, D)
    int bias = 0;       // key_bias: 0 none, 1 random in [-2, 2), 2 a padding mask, 3 padded lengths
  };
  const std::vector<Attention> attentions = {
      {{2, 3, 7, 5}, {2, 3, 7, 5}, {2, 3, 7, 6}, false, 0},
      {{2, 3, 7, 5}, {2, 3, 7, 5}, {2, 3, 7, 6}, true, 0},
      {{2, 5, 4}, {2, 9, 4}, {2, 9, 3}, false, 0},   // Tq < Tk
      {{2, 9, 4}, {2, 5, 4}, {2, 5, 3}, false, 0},   // Tq > Tk
      {{2, 5, 4}, {2, 9, 4}, {2, 9, 3}, true, 0},    // causal, top-left: query i sees keys <= i
      {{2, 9, 4}, {2, 5, 4}, {2, 5, 3}, true, 0},    // later queries see every key
      {{13, 8}, {11, 8}, {11, 1}, false, 0.3},       // no batch dims, explicit scale
      {{1, 2, 17, 3}, {1, 2, 17, 3}, {1, 2, 17, 3}, true, 2.5},
      {{4, 4, 64, 16}, {4, 4, 64, 16}, {4, 4, 64, 16}, true, 0},  // gpt2-tiny's attention
      {{1, 1, 129, 33}, {1, 1, 129, 33}, {1, 1, 129, 35}, true, 0},
      {{1, 1, 1, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}, true, 0},
      {{2, 7, 3, 5}, {2, 7, 3, 5}, {2, 7, 3, 6}, true, 0, true},    // bthd, H = 3
      {{2, 5, 4, 4}, {2, 9, 4, 4}, {2, 9, 4, 3}, false, 0, true},   // bthd, Tq < Tk
      {{4, 64, 4, 16}, {4, 64, 4, 16}, {4, 64, 4, 16}, true, 0, true},  // gpt2-tiny, simplified
      {{9, 2, 4}, {5, 2, 4}, {5, 2, 3}, true, 0.7, true},           // bthd, no batch dims
      // Grouped-query attention (k, v heads dividing q's): bthd, bhtd, one kv head (MQA).
      {{2, 7, 4, 5}, {2, 7, 2, 5}, {2, 7, 2, 6}, true, 0, true},
      {{2, 6, 5, 4}, {2, 2, 5, 4}, {2, 2, 5, 3}, false, 0},
      {{9, 4, 4}, {5, 1, 4}, {5, 1, 3}, true, 0.7, true},
      {{4, 64, 4, 16}, {4, 64, 2, 16}, {4, 64, 2, 16}, true, 0, true},  // llama-tiny's attention
      // A key_bias: random, or a padding mask (BERT's), in each layout and with GQA.
      {{2, 3, 7, 5}, {2, 3, 7, 5}, {2, 3, 7, 6}, false, 0, false, 1},
      {{2, 3, 7, 5}, {2, 3, 9, 5}, {2, 3, 9, 6}, true, 0, false, 2},
      {{13, 8}, {11, 8}, {11, 1}, false, 0.3, false, 1},              // no batch dims: bias (Tk)
      {{2, 7, 3, 5}, {2, 7, 3, 5}, {2, 7, 3, 6}, false, 0, true, 2},   // bthd
      {{2, 3, 7, 5}, {2, 3, 9, 5}, {2, 3, 9, 6}, false, 0, false, 3},  // padded at either end
      {{2, 6, 5, 4}, {2, 2, 5, 4}, {2, 2, 5, 3}, false, 0, false, 1},  // GQA bhtd
      {{4, 64, 4, 16}, {4, 64, 2, 16}, {4, 64, 2, 16}, false, 0, true, 2},  // GQA bthd
  };
  // attention_grad's (q, k, v, out, dout, lse [, key_bias]): out and lse from the reference
  // forward.
  const auto forward_out_and_lse = [](std::vector<Tensor>& in, const Attributes& attrs) {
    std::vector<Tensor> fwd_in{in[0], in[1], in[2]};
    if (in.size() > 6) fwd_in.push_back(in[6]);
    const std::vector<Tensor> fwd = run_reference(Op::kAttention, fwd_in, attrs);
    in[3] = fwd[0];
    in[5] = fwd[1];
  };
  const auto key_bias = [](int kind, const Shape& shape) {
    return kind == 1 ? uniform(shape) : kind == 2 ? padding_mask(shape) : padded_lengths(shape);
  };
  for (size_t i = 0; i < attentions.size(); ++i) {
    const Attention& a = attentions[i];
    const Attributes attrs = attention_attrs(a.causal, a.scale, a.bthd);
    Shape out = a.q;
    out.back() = a.v.back();
    Shape lse = a.q;
    lse.pop_back();
    if (a.bthd) std::swap(lse[lse.size() - 1], lse[lse.size() - 2]);
    const std::string name = fmt::format("attention_geometry{}_{}", i, tag(a.q));
    std::vector<Gen> forward{uniform(a.q, -1, 1), uniform(a.k, -1, 1), uniform(a.v, -1, 1)};
    std::vector<Gen> backward{uniform(a.q, -1, 1), uniform(a.k, -1, 1), uniform(a.v, -1, 1),
                              uniform(out), uniform(out, -1, 1), uniform(lse)};
    if (a.bias) {
      forward.push_back(key_bias(a.bias, key_bias_shape(a.q, a.k, a.bthd)));
      backward.push_back(forward.back());
    }
    c.push_back({.name = name, .op = Op::kAttention, .dtypes = kF32, .inputs = forward,
                 .attrs = attrs, .taken_by_tolerance = Tolerance{1e-5, 1e-4}, .taken_by = {"openblas"}});
    c.push_back({.name = name + "_grad", .op = Op::kAttentionGrad, .dtypes = kF32, .inputs = backward,
                 .attrs = attrs, .taken_by_tolerance = Tolerance{1e-5, 1e-4}, .taken_by = {"openblas"},
                 .derive = forward_out_and_lse});
  }
  // Large scores: a stable softmax must not overflow (scores up to 8 * 8 * 4 = 256); lse is up
  // to about 256, so rtol 1e-4 of it bounds the f32 rounding of the scores.
  c.push_back({.name = "attention_large_scores", .op = Op::kAttention, .dtypes = kF32,
               .inputs = {uniform({2, 6, 8}, -8, 8), uniform({2, 6, 8}, -8, 8), uniform({2, 6, 8}, -1, 1)},
               .attrs = {{"causal", true}, {"scale", 4.0}}, .taken_by_tolerance = Tolerance{1e-5, 1e-4}, .taken_by = {"openblas"}});
  c.push_back({.name = "attention_large_scores_grad", .op = Op::kAttentionGrad, .dtypes = kF32,
               .inputs = {uniform({2, 6, 8}, -8, 8), uniform({2, 6, 8}, -8, 8), uniform({2, 6, 8}, -1, 1),
                          uniform({2, 6, 8}), uniform({2, 6, 8}, -1, 1), uniform({2, 6})},
               .attrs = {{"causal", true}, {"scale", 4.0}}, .taken_by_tolerance = Tolerance{1e-4, 1e-4}, .taken_by = {"openblas"},
               .derive = forward_out_and_lse});

  // The GPU kernels' geometry (tensor cores: head dims multiple of 8 up to 128; T not a
  // multiple of the 64-row tile; both layouts; Tq != Tk), every float dtype; q and k in [-2, 2]
  // so the softmax is far from uniform. 16-bit kernels round P and dS before their products.
  struct Tiled {
    Shape q, k;
    bool causal, bthd;
    int bias = 0;  // key_bias: 0 none, 1 random, 2 a padding mask, 3 padded lengths
  };
  const std::vector<Tiled> tiled = {
      {{2, 3, 77, 64}, {2, 3, 77, 64}, true, false},
      {{2, 77, 3, 32}, {2, 77, 3, 32}, true, true},
      {{1, 2, 40, 128}, {1, 2, 77, 128}, false, false},
      // Grouped-query attention on the tensor cores: 2 query heads a kv head ("bthd", as
      // llama's) and 4 ("bhtd"): dk and dv sum over the group.
      {{2, 77, 4, 64}, {2, 77, 2, 64}, true, true},
      {{1, 4, 70, 32}, {1, 1, 70, 32}, true, false},
      // A key_bias (the kernels' B path) on the tensor cores, both layouts: padded sequences
      // (blocks of keys masked whole, a row's first block among them), a padding mask with a
      // causal one, a random bias over GQA.
      {{2, 3, 77, 64}, {2, 3, 77, 64}, false, false, 3},
      {{2, 77, 3, 32}, {2, 77, 3, 32}, true, true, 2},
      {{2, 77, 4, 64}, {2, 77, 2, 64}, false, true, 1},
  };
  for (const Tiled& a : tiled) {
    const Attributes attrs = attention_attrs(a.causal, 0, a.bthd);
    Shape lse = a.q;
    lse.pop_back();
    if (a.bthd) std::swap(lse[lse.size() - 1], lse[lse.size() - 2]);
    const std::string name = fmt::format("attention_tiled_{}_{}{}", tag(a.q), tag(a.k),
                                         a.bias == 0 ? "" : a.bias == 1 ? "_bias" : "_padding" + std::to_string(a.bias));
    std::vector<Gen> forward{uniform(a.q), uniform(a.k), uniform(a.k, -1, 1)};
    std::vector<Gen> backward{uniform(a.q), uniform(a.k), uniform(a.k, -1, 1), uniform(a.q),
                              uniform(a.q, -1, 1), uniform(lse)};
    if (a.bias) {
      forward.push_back(key_bias(a.bias, key_bias_shape(a.q, a.k, a.bthd)));
      backward.push_back(forward.back());
    }
    c.push_back({.name = name, .op = Op::kAttention, .dtypes = kFloats, .inputs = forward, .attrs = attrs,
                 .tolerance = 2});
    c.push_back({.name = name + "_grad", .op = Op::kAttentionGrad, .dtypes = kFloats, .inputs = backward,
                 .attrs = attrs, .tolerance = 6, .derive = forward_out_and_lse});
  }
  c.push_back({.name = "attention_qkv_tiled", .op = Op::kAttentionQkv, .dtypes = kFloats,
               .inputs = {uniform({2, 77, 3, 3, 64})}, .attrs = {{"causal", true}},
               .tolerance = 2});

  // attention_qkv and its gradient (on the forward's out and lse): (..., T, 3, H, D).
  struct Packed {
    Shape qkv;
    bool causal;
    double scale;
    int bias = 0;  // key_bias: 0 none, 1 random, 2 a padding mask, 3 padded lengths
  };
  const std::vector<Packed> packed = {
      {{2, 7, 3, 3, 5}, false, 0},     // odd T and D, H = 3
      {{2, 7, 3, 3, 5}, true, 0},
      {{9, 3, 2, 4}, true, 0.7},       // rank 4: no batch dims
      {{13, 3, 1, 6}, false, 0},       // one head
      {{2, 3, 11, 3, 2, 3}, true, 0},  // rank 6: two batch dims
      {{2, 3, 11, 3, 2, 3}, false, 1.7},
      {{1, 1, 3, 1, 1}, true, 0},      // T = H = D = 1
      {{2, 64, 3, 4, 16}, true, 0},    // gpt2-tiny's packed projection
      {{1, 33, 3, 5, 7}, false, 0.4},
      {{2, 7, 3, 3, 5}, false, 0, 1},  // a key_bias (B, T)
      {{9, 3, 2, 4}, true, 0.7, 2},     // no batch dims: (T)
      {{2, 64, 3, 4, 16}, false, 0, 3},  // BERT-sized padded sequences
  };
  const auto packed_forward = [](std::vector<Tensor>& in, const Attributes& attrs) {
    std::vector<Tensor> fwd_in{in[0]};
    if (in.size() > 4) fwd_in.push_back(in[4]);
    const std::vector<Tensor> fwd = run_reference(Op::kAttentionQkv, fwd_in, attrs);
    in[1] = fwd[0];
    in[3] = fwd[1];
  };
  for (const Packed& p : packed) {
    const Attributes attrs = attention_attrs(p.causal, p.scale, false);
    Shape out = p.qkv;
    out.erase(out.end() - 3);  // (..., T, H, D)
    Shape lse = out;
    lse.pop_back();
    const std::string name = fmt::format("attention_qkv_{}_{}{}", tag(p.qkv), p.causal ? "causal" : "full",
                                         p.bias == 0 ? "" : "_bias");
    std::vector<Gen> forward{uniform(p.qkv, -1, 1)};
    std::vector<Gen> backward{uniform(p.qkv, -1, 1), uniform(out), uniform(out, -1, 1), uniform(lse)};
    if (p.bias) {
      Shape bias(out.begin(), out.end() - 2);  // (..., T)
      forward.push_back(key_bias(p.bias, bias));
      backward.push_back(forward.back());
    }
    c.push_back({.name = name, .op = Op::kAttentionQkv, .dtypes = kF32, .inputs = forward, .attrs = attrs,
                 .taken_by_tolerance = Tolerance{1e-5, 1e-4}, .taken_by = {"openblas"}});
    c.push_back({.name = name + "_grad", .op = Op::kAttentionQkvGrad, .dtypes = kF32, .inputs = backward,
                 .attrs = attrs, .taken_by_tolerance = Tolerance{1e-5, 1e-4},
                 .taken_by = {"openblas"}, .derive = packed_forward});
  }
}

// ---- 4. convolution and pooling ------------------------------------------------------------

void add_conv_and_pool(std::vector<Case>& c) {
  // f32 against the f64-accumulated reference: GEMM sums of up to ~800 products of O(1) values.
  const Tolerance conv_tol{2e-4, 2e-4};
  struct Conv {
    Shape x, w;
    Ints stride, padding;
    int64_t groups = 1;
  };
  const std::vector<Conv> convs = {
      {{2, 3, 7, 9}, {5, 3, 3, 3}, {1, 1}, {1, 1}},
      {{2, 3, 7, 9}, {5, 3, 3, 3}, {2, 2}, {1, 1}},     // stride 2, padding 1, odd sizes
      {{3, 2, 8, 6}, {4, 2, 3, 3}, {2, 2}, {1, 1}},     // even sizes: the last row unused
      {{2, 3, 9, 7}, {4, 3, 2, 3}, {2, 1}, {0, 1}},     // unequal per-dim attributes
      {{3, 4, 5, 5}, {6, 4, 1, 1}, {1, 1}, {0, 0}},     // 1x1 kernel: a plain GEMM
      {{1, 3, 11, 13}, {7, 3, 5, 5}, {3, 2}, {2, 2}},   // one image: the GEMM writes y directly
      {{2, 1, 4, 4}, {2, 1, 3, 3}, {1, 1}, {3, 3}},     // padding wider than the kernel's reach
      {{5, 1, 28, 28}, {16, 1, 3, 3}, {1, 1}, {1, 1}},  // the CNN's first layer
      {{2, 3, 7, 6}, {4, 3, 1, 1}, {2, 2}, {0, 0}},     // 1x1 with a stride: not x itself
      {{2, 2, 4, 5}, {3, 2, 1, 1}, {1, 1}, {1, 1}},     // 1x1 with padding: not x itself
      // Groups: one GEMM per group on offsets of the same buffers (openblas).
      {{2, 4, 7, 6}, {6, 2, 3, 3}, {1, 1}, {1, 1}, 2},
      {{3, 6, 8, 7}, {3, 2, 3, 2}, {2, 1}, {1, 0}, 3},  // one output channel per group
      {{2, 8, 5, 5}, {8, 2, 1, 1}, {1, 1}, {0, 0}, 4},  // grouped 1x1
      // Depthwise (groups = C): the cpu dialect's direct loops.
      {{2, 5, 9, 8}, {5, 1, 3, 3}, {1, 1}, {1, 1}, 5},
      {{3, 4, 9, 9}, {4, 1, 3, 3}, {2, 2}, {1, 1}, 4},    // stride 2, MobileNet's downsampling
      {{2, 3, 7, 10}, {6, 1, 3, 5}, {1, 2}, {2, 1}, 3},   // two filters per channel, unequal
      {{1, 4, 4, 4}, {8, 1, 5, 5}, {1, 1}, {3, 3}, 4},    // padding past the kernel's reach
      {{4, 32, 16, 16}, {32, 1, 3, 3}, {1, 1}, {1, 1}, 32},  // many planes: split across threads
  };
  // f32 as the openblas kernels always held it; the other float dtypes (the CUDA kernels take
  // them all) at their own tolerance.
  const std::vector<DType> other_floats = {DType::kF64, DType::kF16, DType::kBF16};
  for (const Conv& v : convs) {
    const Attributes attrs{{"stride", v.stride}, {"padding", v.padding}, {"groups", v.groups}};
    const Shape y = output_shape(Op::kConv2d, {{DType::kF32, v.x}, {DType::kF32, v.w}}, attrs);
    const std::string name =
        fmt::format("conv2d_{}_{}_s{}_p{}{}", tag(v.x), tag(v.w), fmt::join(v.stride, ""),
                    fmt::join(v.padding, ""), v.groups == 1 ? "" : fmt::format("_g{}", v.groups));
    const bool depthwise = v.groups > 1 && v.groups == v.x[1];
    Attributes input_attrs = attrs;
    input_attrs.set("input_shape", v.x);
    Attributes weight_attrs = attrs;
    weight_attrs.set("weight_shape", v.w);
    for (bool f32 : {true, false}) {
      const std::string suffix = f32 ? "" : "_dtypes";
      const std::vector<DType> dtypes = f32 ? kF32 : other_floats;
      const std::optional<Tolerance> own = f32 ? std::optional(conv_tol) : std::nullopt;
      const std::vector<std::string> taken_by =
          f32 ? std::vector<std::string>{depthwise ? "cpu" : "openblas"} : std::vector<std::string>{};
      c.push_back({.name = name + suffix, .op = Op::kConv2d, .dtypes = dtypes,
                   .inputs = {uniform(v.x, -1, 1), uniform(v.w, -1, 1)}, .attrs = attrs,
                   .taken_by_tolerance = own, .taken_by = taken_by});
      c.push_back({.name = name + "_grad_input" + suffix, .op = Op::kConv2dGradInput,
                   .dtypes = dtypes, .inputs = {uniform(y, -1, 1), uniform(v.w, -1, 1)},
                   .attrs = input_attrs, .taken_by_tolerance = own, .taken_by = taken_by});
      c.push_back({.name = name + "_grad_weight" + suffix, .op = Op::kConv2dGradWeight,
                   .dtypes = dtypes, .inputs = {uniform(v.x, -1, 1), uniform(y, -1, 1)},
                   .attrs = weight_attrs, .taken_by_tolerance = own, .taken_by = taken_by});
    }
  }
  struct Pool {
    Shape x;
    Ints kernel, stride, padding;
  };
  const std::vector<Pool> pools = {
      {{2, 3, 7, 9}, {2, 2}, {}, {0, 0}},      // default stride, odd sizes (the edge dropped)
      {{2, 3, 7, 9}, {3, 3}, {2, 2}, {1, 1}},  // overlapping windows, padding 1
      {{1, 2, 6, 7}, {2, 3}, {1, 2}, {1, 1}},  // unequal per-dim attributes
      {{3, 2, 5, 5}, {1, 1}, {1, 1}, {0, 0}},  // identity
      {{32, 16, 28, 28}, {2, 2}, {}, {0, 0}},  // a CNN batch: split across threads
  };
  for (const Pool& p : pools) {
    Attributes attrs{{"kernel", p.kernel}, {"stride", p.stride}, {"padding", p.padding}};
    const Shape y = output_shape(Op::kMaxPool2d, {{DType::kF32, p.x}}, attrs);
    const std::string name = fmt::format("{}_k{}_s{}_p{}", tag(p.x), fmt::join(p.kernel, ""),
                                         fmt::join(p.stride, ""), fmt::join(p.padding, ""));
    Attributes grad_attrs = attrs;
    grad_attrs.set("input_shape", p.x);
    for (bool f32 : {true, false}) {
      const std::string suffix = f32 ? "" : "_dtypes";
      const std::vector<DType> dtypes = f32 ? kF32 : other_floats;
      const std::optional<Tolerance> own = f32 ? std::optional(Tolerance{1e-6, 1e-6}) : std::nullopt;
      const std::vector<std::string> taken_by = f32 ? std::vector<std::string>{"cpu"}
                                                    : std::vector<std::string>{};
      c.push_back({.name = "max_pool2d_" + name + suffix, .op = Op::kMaxPool2d, .dtypes = dtypes,
                   .inputs = {uniform(p.x, -1, 1)}, .attrs = attrs, .taken_by_tolerance = own,
                   .taken_by = taken_by});
      c.push_back({.name = "max_pool2d_grad_" + name + suffix, .op = Op::kMaxPool2dGrad,
                   .dtypes = dtypes, .inputs = {uniform(p.x, -1, 1), uniform(y, -1, 1)},
                   .attrs = attrs, .taken_by_tolerance = own, .taken_by = taken_by});
      c.push_back({.name = "avg_pool2d_" + name + suffix, .op = Op::kAvgPool2d, .dtypes = dtypes,
                   .inputs = {uniform(p.x, -1, 1)}, .attrs = attrs, .taken_by_tolerance = own,
                   .taken_by = taken_by});
      c.push_back({.name = "avg_pool2d_grad_" + name + suffix, .op = Op::kAvgPool2dGrad,
                   .dtypes = dtypes, .inputs = {uniform(y, -1, 1)}, .attrs = grad_attrs,
                   .taken_by_tolerance = own, .taken_by = taken_by});
    }
  }
  // Other float dtypes: the reference's, and whatever kernel takes them.
  c.push_back({"conv2d_dtypes", Op::kConv2d, kFloats, {uniform({2, 3, 6, 5}), uniform({4, 3, 3, 3})},
               {{"padding", Ints{1, 1}}}, 4});
  c.push_back({"max_pool2d_dtypes", Op::kMaxPool2d, kFloats, {uniform({2, 3, 6, 5})},
               {{"kernel", Ints{2, 2}}}});
}

// ---- 5. fused nodes --------------------------------------------------------------------------

// IR text with "$T" standing for the case's dtype.
std::string with_dtype(std::string text, DType dtype) {
  for (size_t at = text.find("$T"); at != std::string::npos; at = text.find("$T", at))
    text.replace(at, 2, dtype_name(dtype));
  return text;
}

// The graph of `text` at a dtype after `pass`, which must change it.
template <typename PassType>
std::function<Graph(DType)> after_pass(std::string text) {
  return [text = std::move(text)](DType dtype) {
    Graph g = parse(with_dtype(text, dtype));
    PassType pass;
    KILN_CHECK(pass.run(g), "the {} pass left the graph unchanged:\n{}", pass.name(),
               with_dtype(text, dtype));
    return g;
  };
}

void add_fused(std::vector<Case>& c) {
  // Fusion groups (passes/fusion): elementwise chains, row ops, column reductions, GEMM
  // epilogues; 16-bit bodies carry the rounding of every intermediate in the reference, which
  // the kernels keep in f32: the factor.
  const auto fusion_case = [&](std::string name, std::string text, double tolerance,
                               std::function<Tensor(const std::string&, const TensorType&, uint64_t)>
                                   input = nullptr) {
    c.push_back({.name = std::move(name), .op = Op::kFused, .dtypes = kHalfAndF32,
                 .tolerance = tolerance, .graph = after_pass<FusionPass>(std::move(text)),
                 .graph_input = std::move(input)});
  };
  // tanh(gelu(x + bias) * s): a row-vector bias and a scalar broadcast into (B, T, C).
  fusion_case("fused_elementwise_chain",
              "graph @g(%x: $T[3,37,96] data, %bias: $T[96] data, %s: $T[] data) {\n"
              "  %h = add(%x, %bias)\n  %g = gelu(%h)\n  %m = mul(%g, %s)\n  %y = tanh(%m)\n"
              "  return %y\n}\n",
              4);
  // A (1, 1, C) row and a per-row (B, T, 1) column, a cast and a where.
  fusion_case("fused_elementwise_broadcasts",
              "graph @g(%x: $T[4,29,48] data, %bias: $T[1,1,48] data, %scale: $T[4,29,1] data, "
              "%keep: bool[4,29,48] data) {\n"
              "  %h = sub(%x, %bias)\n  %m = mul(%scale, %h)\n  %f = cast(%m) {dtype=f32}\n"
              "  %e = exp(%f)\n  %y = where(%keep, %e, %f)\n  return %y\n}\n",
              4);
  // h = x + residual; y = layer_norm(h): both outputs (h is also read inside).
  fusion_case("fused_rows_residual_layer_norm",
              "graph @g(%x: $T[2,53,128] data, %res: $T[2,53,128] data, %gamma: $T[128] data, "
              "%beta: $T[128] data) {\n"
              "  %h = add(%x, %res)\n  %y = layer_norm(%h, %gamma, %beta)\n  return %h, %y\n}\n",
              4);
  // softmax(x) * m + x; a hand-decomposed softmax with per-row columns, a row mean, and a where
  // on a per-row bool column (the cross-entropy gradient's mask).
  fusion_case("fused_rows_softmax_epilogue",
              "graph @g(%x: $T[6,23,70] data, %m: $T[6,23,70] data) {\n"
              "  %p = softmax(%x) {axis=-1}\n  %pm = mul(%p, %m)\n  %y = add(%pm, %x)\n"
              "  return %y\n}\n",
              4);
  fusion_case("fused_rows_decomposed_softmax",
              "graph @g(%x: $T[6,23,70] data, %keep: bool[6,23,1] data, %other: $T[] data) {\n"
              "  %row_max = max(%x) {axes=[-1], keepdims=true}\n  %d = sub(%x, %row_max)\n"
              "  %e = exp(%d)\n  %row_sum = sum(%e) {axes=[2], keepdims=true}\n"
              "  %q = div(%e, %row_sum)\n  %row_mean = mean(%q) {axes=[-1]}\n"
              "  %masked = where(%keep, %q, %other)\n"
              "  return %q, %row_mean, %masked\n}\n",
              4);
  // A bias gradient (column sum) next to the full-size gradient, and a column mean.
  fusion_case("fused_column_reductions",
              "graph @g(%dy: $T[5,41,72] data, %x: $T[5,41,72] data) {\n"
              "  %dx = gelu_grad(%x, %dy)\n  %db = sum(%dx) {axes=[0, 1]}\n"
              "  %xm = mul(%dx, %x)\n  %dm = mean(%xm) {axes=[1, 0], keepdims=true}\n"
              "  return %dx, %db, %dm\n}\n",
              8);
  // GPT-2's backward at a norm: dx per row, dgamma/dbeta summed over rows, the residual
  // gradient added and its bias gradient.
  for (const char* op : {"layer_norm_grad", "rms_norm_grad"}) {
    const bool layer = std::string(op) == "layer_norm_grad";
    fusion_case(fmt::format("fused_rows_{}_columns", op),
                fmt::format("graph @g(%x: $T[3,31,40] data, %gamma: $T[40] data, "
                            "%resid: $T[3,31,40] data, %dy: $T[3,31,40] data) {{\n"
                            "  {} = {}(%x, %gamma, %dy)\n  %sum = add(%dx, %resid)\n"
                            "  %bias_grad = sum(%sum) {{axes=[0, 1]}}\n"
                            "  return %sum, %bias_grad, {}\n}}\n",
                            layer ? "%dx, %dgamma, %dbeta" : "%dx, %dgamma", op,
                            layer ? "%dgamma, %dbeta" : "%dgamma"),
                8);
  }
  // A GEMM nucleus with a bias and GELU epilogue, and one adding a residual.
  fusion_case("fused_gemm_bias_gelu",
              "graph @g(%a: $T[37,24] data, %w: $T[24,56] data, %bias: $T[56] data) {\n"
              "  %p = matmul(%a, %w)\n  %h = add(%p, %bias)\n  %y = gelu(%h) {approximate=\"tanh\"}\n"
              "  return %y\n}\n",
              4);
  fusion_case("fused_gemm_transposed_residual",
              "graph @g(%a: $T[45,32] data, %w: $T[40,32] data, %res: $T[45,40] data) {\n"
              "  %p = matmul(%a, %w) {transpose_b=true}\n  %y = add(%p, %res)\n  return %y\n}\n",
              4);
  // Cross-entropy rows with integer labels (reduction "none": row ops) and the gradient.
  fusion_case("fused_rows_cross_entropy",
              "graph @g(%x: $T[6,7,33] data, %t: i64[6,7] data, %d: $T[6,7] data) {\n"
              "  %s = mul(%x, %x)\n  %loss = cross_entropy(%s, %t) {reduction=\"none\"}\n"
              "  %g = cross_entropy_grad(%s, %t, %d) {reduction=\"none\"}\n  %y = add(%g, %x)\n"
              "  return %loss, %y\n}\n",
              4, [](const std::string& name, const TensorType& type, uint64_t seed) {
                if (name == "t") return rand(type.dtype, type.shape, seed, 0, 33);
                return random_tensor(type, seed, -1.0, 1.0);
              });

  // The fused classifier (passes/classifier.h): logits of each float width, the gradient cast
  // back, every reduction, i32 and i64 labels, every third row ignored.
  struct Classifier {
    DType logits, grad, labels;
    int64_t vocab;
    const char* reduction;
    Shape rows;
  };
  const std::vector<Classifier> classifiers = {
      {DType::kF32, DType::kF32, DType::kI64, 7, "mean", {9}},
      {DType::kF32, DType::kF32, DType::kI32, 1001, "sum", {3, 5}},
      {DType::kBF16, DType::kBF16, DType::kI64, 256, "none", {9}},
      {DType::kF16, DType::kF16, DType::kI32, 33, "mean", {3, 5}},
      {DType::kF32, DType::kBF16, DType::kI64, 4099, "none", {3}},
  };
  for (const Classifier& k : classifiers) {
    ClassifierCase spec;
    spec.logits = k.logits;
    spec.grad = k.grad;
    spec.labels = k.labels;
    spec.vocab = k.vocab;
    spec.reduction = k.reduction;
    spec.rows = k.rows;
    c.push_back({.name = fmt::format("fused_classifier_{}_{}_{}_v{}_{}", dtype_name(k.logits),
                                     dtype_name(k.grad), dtype_name(k.labels), k.vocab, k.reduction),
                 .op = Op::kFused, .dtypes = {k.grad}, .tolerance = 2,
                 .graph = [spec](DType) { return classifier_graph(spec); },
                 .graph_input = [vocab = k.vocab](const std::string& name, const TensorType& type,
                                                  uint64_t seed) {
                   if (name == "x") return random_tensor(type, seed, -6.0, 6.0);
                   if (name == "d") return random_tensor(type, seed, 0.5, 2.0);
                   Tensor labels = random_tensor(type, seed, 0.0, static_cast<double>(vocab));
                   for (int64_t r = 1; r < labels.numel(); r += 3) labels.set(r, -100.0);
                   return labels;
                 }});
  }

  // Multi-tensor nodes (passes/multi_tensor.h): grouped AdamW and SGD updates of odd sizes, the
  // global gradient norm (f32 and bf16 terms), grouped casts of params to 16 bits. %e stands
  // for a step's activations, so grouping cannot raise the planned peak.
  const auto update_input = [](const std::string& name, const TensorType& type, uint64_t seed) {
    if (name == "lr") return make(type.dtype, {}, {0.01});
    if (name == "step") return make(type.dtype, {}, {3});
    if (name[0] == 'v') return random_tensor(type, seed, 0.01, 1.0);  // AdamW's v >= 0
    return random_tensor(type, seed, -1.0, 1.0);
  };
  c.push_back({.name = "fused_multi_tensor_adamw", .op = Op::kFused, .dtypes = kF32,
               .graph = after_pass<MultiTensorPass>(
                   "graph @g(%x: f32[4096] data, %w: f32[33,7] param, %b: f32[257] param, "
                   "%gw: f32[33,7] data, %gb: f32[257] data, %mw: f32[33,7] state, "
                   "%vw: f32[33,7] state, %mb: f32[257] state, %vb: f32[257] state, "
                   "%lr: f32[] data, %step: f32[] state) {\n"
                   "  %e = exp(%x)\n  %loss = sum(%e)\n"
                   "  %w1, %mw1, %vw1 = optimizer_update(%w, %gw, %mw, %vw, %lr, %step) {optimizer=\"adamw\", "
                   "weight_decay=0.1}\n"
                   "  %b1, %mb1, %vb1 = optimizer_update(%b, %gb, %mb, %vb, %lr, %step) {optimizer=\"adamw\", "
                   "weight_decay=0.1}\n"
                   "  update %w = %w1\n  update %mw = %mw1\n  update %vw = %vw1\n"
                   "  update %b = %b1\n  update %mb = %mb1\n  update %vb = %vb1\n"
                   "  return %loss\n}\n"),
               .graph_input = update_input});
  c.push_back({.name = "fused_multi_tensor_sgd", .op = Op::kFused, .dtypes = kF32,
               .graph = after_pass<MultiTensorPass>(
                   "graph @g(%x: f32[4096] data, %w: f32[33,7] param, %b: f32[257] param, "
                   "%gw: f32[33,7] data, %gb: f32[257] data, %bw: f32[33,7] state, "
                   "%bb: f32[257] state, %lr: f32[] data, %step: f32[] state) {\n"
                   "  %e = exp(%x)\n  %loss = sum(%e)\n"
                   "  %w1, %bw1 = optimizer_update(%w, %gw, %bw, %lr, %step) {optimizer=\"sgd\", momentum=0.9, "
                   "weight_decay=0.01}\n"
                   "  %b1, %bb1 = optimizer_update(%b, %gb, %bb, %lr, %step) {optimizer=\"sgd\", momentum=0.9, "
                   "weight_decay=0.01}\n"
                   "  update %w = %w1\n  update %bw = %bw1\n  update %b = %b1\n  update %bb = %bb1\n"
                   "  return %loss\n}\n"),
               .graph_input = update_input});
  c.push_back({.name = "fused_global_norm", .op = Op::kFused, .dtypes = kF32, .tolerance = 4,
               .graph = after_pass<MultiTensorPass>(
                   "graph @g(%ga: f32[33,7] data, %gb: f32[257] data, %gc: bf16[1001] data) {\n"
                   "  %0 = square(%ga)\n  %1 = sum(%0)\n  %2 = square(%gb)\n  %3 = sum(%2)\n"
                   "  %4 = add(%1, %3)\n  %5 = cast(%gc) {dtype=f32}\n  %6 = square(%5)\n"
                   "  %7 = sum(%6)\n  %8 = add(%4, %7)\n  %norm = sqrt(%8)\n  return %norm\n}\n")});
  c.push_back({.name = "fused_multi_tensor_cast", .op = Op::kFused, .dtypes = kF32,
               .graph = after_pass<MultiTensorPass>(
                   "graph @g(%x: f32[4096] data, %a: bf16[2,33] data, %w: f32[33,7] param, "
                   "%b: f32[257] param) {\n"
                   "  %e = exp(%x)\n  %loss = sum(%e)\n  %wb = cast(%w) {dtype=bf16}\n"
                   "  %y = matmul(%a, %wb)\n  %bh = cast(%b) {dtype=f16}\n  %z = neg(%bh)\n"
                   "  return %loss, %y, %z\n}\n")});
}

std::vector<Case> build_cases() {
  std::vector<Case> c;
  add_generated_from_table(c);
  add_every_op(c);
  add_fast_path_geometry(c);
  add_training_kernels(c);
  add_conv_and_pool(c);
  add_fused(c);
  return c;
}

}  // namespace

const std::vector<Case>& cases() {
  static const std::vector<Case> all = build_cases();
  return all;
}

}  // namespace kiln::testing::conformance
