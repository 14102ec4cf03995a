// The per-op emitters of the nvrtc codegen (lowering.h): what each op a fused body may hold
// computes, as micro values over its inputs. A math line of ops/elementwise_math.h needs nothing
// here (emit_line calls it); a new op is a function here and a line in the table at the end.
#include <cmath>

#include "backends/cuda/nvrtc/lowering.h"
#include "ops/elementwise.h"

namespace kiln::cuda::codegen {
namespace {

// An op that is a line of ops/elementwise_math.h: a call of the line's functor with the device
// policy (the prelude holds both). Integer operands only where nothing can wrap or divide by
// zero: comparisons, and maximum and minimum, which select an operand (u8 not at all).
std::vector<int> emit_line(Ctx& c) {
  const math::Fn fn = *ops::elementwise_fn(c.node.op, c.attrs());
  std::string name;
  math::Domain domain = math::Domain::kFloat;
  math::visit(fn, [&](auto line) {
    name = decltype(line)::name();
    domain = decltype(line)::domain();
  });
  if (domain == math::Domain::kCompare || fn == math::Fn::kMaximum || fn == math::Fn::kMinimum) {
    for (size_t k = 0; k < c.node.inputs.size(); ++k)
      c.require(c.in_type(static_cast<int>(k)).dtype != DType::kU8,
                "u8 operands are not generated");
  } else {
    c.require_float();
  }
  const std::vector<int> args = c.operands();
  std::string call = "kiln::math::" + name + "::apply<KilnMath>($0";
  for (size_t k = 1; k < args.size(); ++k) call += fmt::format(", ${}", k);
  return {c.e(c.ct(), call + ")", args)};
}

std::vector<int> emit_cast(Ctx& c) {
  const DType from = c.in_type(0).dtype, to = c.out_type().dtype;
  const std::string ct = c.ct();
  std::string text;
  if (to == DType::kBool) {
    text = "($0 != 0)";
  } else if (to == DType::kF16) {
    text = "__half2float(__float2half_rn(static_cast<float>($0)))";
  } else if (to == DType::kBF16) {
    text = "__bfloat162float(__float2bfloat16_rn(static_cast<float>($0)))";
  } else if (is_float(to) || !is_float(from)) {
    text = "static_cast<$t>($0)";  // to a float, or integer/bool to integer (wraps)
  } else {
    // Float to integer: truncate toward zero, saturate, NaN -> 0 (cvt.rzi does all three).
    const bool dbl = from == DType::kF64;
    if (to == DType::kI32) text = dbl ? "__double2int_rz($0)" : "__float2int_rz($0)";
    else if (to == DType::kI64) text = dbl ? "__double2ll_rz($0)" : "__float2ll_rz($0)";
    else text = dbl ? "static_cast<unsigned char>(min(__double2uint_rz($0), 255u))"
                    : "static_cast<unsigned char>(min(__float2uint_rz($0), 255u))";
  }
  return {c.e(ct, text, c.operands())};
}

std::vector<int> emit_full(Ctx& c) {
  return {c.e(c.ct(), lit(c.ct(), c.attrs().f("value")), {})};
}

// concat(x, full(c)) along the last axis, as a body output only: x's rows stored with the full's
// columns of c after each (the padded activation of passes/ones_column.h, whose ones column a
// weight-gradient GEMM turns into the bias gradient). The row stays in registers; the store
// goes to a row stride of N + width. Rows kernels only, and no body node may read it.
std::vector<int> emit_concat(Ctx& c) {
  c.require(c.l.rows(), "a padded row needs a \"rows\" fused node");
  c.require(c.node.inputs.size() == 2, "only concat(x, full), a padded row, is generated");
  c.require_last_axis(c.attrs().i("axis"), c.out_type().rank());
  const Node* pad = nullptr;
  for (const Node& n : c.body().nodes) {
    if (!n.outputs.empty() && n.outputs[0] == c.node.inputs[1]) pad = &n;
    for (ValueId in : n.inputs)
      c.require(in != c.node.outputs[0], "a padded row is read inside the body");
  }
  c.require(pad != nullptr && pad->op == Op::kFull, "the second operand is not a full");
  const Shape& xs = c.in_type(0).shape;
  c.require(!xs.empty() && xs.back() == c.n() && numel(xs) == c.l.r() * c.n(),
            fmt::format("x has shape {}, not the iteration space {}", to_string(xs),
                        to_string(c.l.s())));
  const int64_t width = c.in_type(1).shape.back();
  // A lane (or thread) per pad column.
  c.require(width >= 1 && width <= 32, fmt::format("a pad of {} columns (1 to 32)", width));
  const int x = c.x(0, Space::kFull);
  c.require(c.l.vals()[x].space == Space::kFull, "x is per row, not per element");
  c.l.pads()[c.node.outputs[0]] = RowPad{width, pad->attrs.f("value")};
  return {x};
}

std::vector<int> emit_reshape(Ctx& c) {
  // Flat order is unchanged; only whole-space values may be reshaped (see Lowering::load).
  c.require(numel(c.in_type(0).shape) == c.l.r() * c.n() || numel(c.in_type(0).shape) == 1,
            "only reshapes of whole-iteration-space values are generated");
  return {c.x(0, Space::kFull)};
}

// sum / mean over every axis but the last, of a value spanning the iteration space (R, N): one
// value per column, written as a group output (elementwise and rows kernels).
std::vector<int> emit_column_reduction(Ctx& c) {
  const Shape& shape = c.in_type(0).shape;
  c.require(!shape.empty() && shape.back() == c.n() && numel(shape) == c.l.r() * c.n(),
            fmt::format("a column reduction of {}, which is not the iteration space {}",
                        to_string(shape), to_string(c.l.s())));
  const int x = c.x(0, Space::kFull, &shape);
  return {c.l.column(x, c.node.op == Op::kMean ? c.l.r() : 1)};
}

// sum / mean / max over the last axis (rows kernels), or sum / mean over the leading axes.
std::vector<int> emit_row_reduction(Ctx& c) {
  c.require_float();
  const std::vector<int64_t>& axes = c.attrs().ints("axes");
  const int rank = c.in_type(0).rank();
  if (c.node.op != Op::kMax && column_axes(axes, rank)) return emit_column_reduction(c);
  c.require(axes.size() == 1 || (axes.empty() && rank == 1),
            "only reductions over the last axis are generated");
  if (!axes.empty()) c.require_last_axis(axes[0], rank);
  const int x = c.row_input(0);
  if (c.node.op == Op::kMax) return {c.max(x)};
  const int s = c.sum(x);
  if (c.node.op == Op::kSum) return {s};
  return {c.e(c.ct(), "($0 / " + lit(c.ct(), static_cast<double>(c.n())) + ")", {s})};
}

std::vector<int> emit_softmax(Ctx& c, bool log) {
  c.require_float();
  c.require_last_axis(c.attrs().i("axis"), c.in_type(0).rank());
  const std::string t = c.ct();
  const int x = c.row_input(0);
  const int m = c.max(x);
  const int ex = c.e(t, "KilnMath::exp($0 - $1)", {x, m});
  const int s = c.sum(ex);
  if (log) return {c.e(t, "($0 - $1 - KilnMath::log($2))", {x, m, s})};
  return {c.e(t, "($0 / $1)", {ex, s})};
}

std::vector<int> emit_softmax_grad(Ctx& c, bool log) {
  c.require_float();
  c.require_last_axis(c.attrs().i("axis"), c.in_type(0).rank());
  const std::string t = c.ct();
  const int y = c.row_input(0), dy = c.row_input(1);
  if (log) return {c.e(t, "($0 - KilnMath::exp($1) * $2)", {dy, y, c.sum(dy)})};
  return {c.e(t, "($0 * ($1 - $2))", {y, dy, c.sum(c.e(t, "($0 * $1)", {dy, y}))})};
}

std::vector<int> emit_layer_norm(Ctx& c) {
  c.require_float();
  const std::string t = c.ct(), n = lit(t, static_cast<double>(c.n()));
  const int x = c.row_input(0);
  const int gamma = c.x(1, Space::kFull), beta = c.x(2, Space::kFull);
  const int mean = c.e(t, "($0 / " + n + ")", {c.sum(x)});
  const int d = c.e(t, "($0 - $1)", {x, mean});
  const int var = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $0)", {d}))});
  const int rstd =
      c.e(t, "KilnMath::rsqrt($0 + " + lit(t, c.attrs().f("epsilon")) + ")", {var});
  return {c.e(t, "($0 * $1 * $2 + $3)", {d, rstd, gamma, beta})};
}

std::vector<int> emit_rms_norm(Ctx& c) {
  c.require_float();
  const std::string t = c.ct(), n = lit(t, static_cast<double>(c.n()));
  const int x = c.row_input(0);
  const int gamma = c.x(1, Space::kFull);
  const int ms = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $0)", {x}))});
  const int rstd = c.e(t, "KilnMath::rsqrt($0 + " + lit(t, c.attrs().f("epsilon")) + ")", {ms});
  return {c.e(t, "($0 * $1 * $2)", {x, rstd, gamma})};
}

// (x, gamma, dy) -> dx per element, and dgamma, dbeta summed over the rows (column values).
// With x_hat = (x - mean) * rstd and g = dy * gamma: dx = rstd * (g - mean(g) - x_hat *
// mean(g * x_hat)), as the op's reference kernel.
std::vector<int> emit_layer_norm_grad(Ctx& c) {
  c.require_float();
  const std::string t = c.ct(), n = lit(t, static_cast<double>(c.n()));
  const int x = c.row_input(0), dy = c.row_input(2);
  const int gamma = c.x(1, Space::kFull);
  const int mean = c.e(t, "($0 / " + n + ")", {c.sum(x)});
  const int d = c.e(t, "($0 - $1)", {x, mean});
  const int var = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $0)", {d}))});
  const int rstd = c.e(t, "KilnMath::rsqrt($0 + " + lit(t, c.attrs().f("epsilon")) + ")", {var});
  const int x_hat = c.e(t, "($0 * $1)", {d, rstd});
  const int g = c.e(t, "($0 * $1)", {dy, gamma});
  const int mean_g = c.e(t, "($0 / " + n + ")", {c.sum(g)});
  const int mean_gx = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $1)", {g, x_hat}))});
  const int dx = c.e(t, "($0 * ($1 - $2 - $3 * $4))", {rstd, g, mean_g, x_hat, mean_gx});
  return {dx, c.l.column(c.e(t, "($0 * $1)", {dy, x_hat}), 1), c.l.column(dy, 1)};
}

// (x, gamma, dy) -> dx per element and dgamma over the rows: with rstd = rsqrt(mean(x^2) + eps)
// and g = dy * gamma, dx = rstd * g - rstd^3 * x * mean(g * x), as the op's reference kernel.
std::vector<int> emit_rms_norm_grad(Ctx& c) {
  c.require_float();
  const std::string t = c.ct(), n = lit(t, static_cast<double>(c.n()));
  const int x = c.row_input(0), dy = c.row_input(2);
  const int gamma = c.x(1, Space::kFull);
  const int ms = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $0)", {x}))});
  const int rstd = c.e(t, "KilnMath::rsqrt($0 + " + lit(t, c.attrs().f("epsilon")) + ")", {ms});
  const int g = c.e(t, "($0 * $1)", {dy, gamma});
  const int mean_gx = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $1)", {g, x}))});
  const int dx = c.e(t, "($0 * $1 - $0 * $0 * $0 * $2 * $3)", {rstd, g, x, mean_gx});
  return {dx, c.l.column(c.e(t, "($0 * $1 * $2)", {dy, x, rstd}), 1)};
}

// logits (R, V) and labels (R,): max, sum of exp, and the label's logit, per row. An
// out-of-range label (the reference throws) gives NaN: a kernel cannot throw.
struct CrossEntropyRow {
  int x, label, m, s, hit, bad;
};
CrossEntropyRow cross_entropy_row(Ctx& c) {
  c.require(is_float(c.in_type(0).dtype), "logits must be float");
  const std::string t = c.ct();
  CrossEntropyRow r;
  r.x = c.row_input(0);
  r.label = c.x(1, Space::kRow);
  c.require(c.l.vals()[r.label].space == Space::kRow, "labels must be one per row");
  r.m = c.max(r.x);
  r.s = c.sum(c.e(t, "KilnMath::exp($0 - $1)", {r.x, r.m}));
  const int j = c.column();
  r.hit = c.e("bool", "($0 == static_cast<long long>($1))", {j, r.label});
  const std::string ignore = lit_int(c.attrs().i("ignore_index"));
  r.bad = c.e("bool",
              fmt::format("(static_cast<long long>($0) != {} && (static_cast<long long>($0) < 0 "
                          "|| static_cast<long long>($0) >= {}))",
                          ignore, lit_int(c.n())),
              {r.label});
  return r;
}

std::vector<int> emit_cross_entropy(Ctx& c) {
  c.require(c.attrs().s("reduction") == "none",
            "reduction \"" + c.attrs().s("reduction") +
                "\" sums over rows (a column reduction); only \"none\" is generated");
  const std::string t = c.ct(), ignore = lit_int(c.attrs().i("ignore_index"));
  CrossEntropyRow r = cross_entropy_row(c);
  const int picked = c.sum(c.e(t, "($0 ? $1 : static_cast<$t>(0))", {r.hit, r.x}));
  return {c.e(t,
              "($4 ? kiln_nan() : static_cast<long long>($0) == " + ignore +
                  " ? static_cast<$t>(0) : $1 + KilnMath::log($2) - $3)",
              {r.label, r.m, r.s, picked, r.bad})};
}

std::vector<int> emit_cross_entropy_grad(Ctx& c) {
  const std::string& reduction = c.attrs().s("reduction");
  c.require(reduction == "none" || reduction == "sum",
            "reduction \"" + reduction +
                "\" divides by the count of labelled rows (a column reduction); only \"none\" "
                "and \"sum\" are generated");
  const std::string t = c.ct(), ignore = lit_int(c.attrs().i("ignore_index"));
  CrossEntropyRow r = cross_entropy_row(c);
  const int dloss = c.x(2, Space::kRow);
  const int p = c.e(t, "(KilnMath::exp($0 - $1) / $2)", {r.x, r.m, r.s});
  return {c.e(t,
              "($4 ? kiln_nan() : static_cast<long long>($0) == " + ignore +
                  " ? static_cast<$t>(0) : ($1 - ($2 ? static_cast<$t>(1) : static_cast<$t>(0)))"
                  " * $3)",
              {r.label, p, r.hit, dloss, r.bad})};
}

}  // namespace

// THE emitter table: one entry per op the nvrtc dialect generates; the op of every math line
// is emit_line.
const std::map<Op, Emitter>& emitters() {
  static const std::map<Op, Emitter> table = [] {
    std::map<Op, Emitter> t = {
        {Op::kWhere, [](Ctx& c) { return std::vector<int>{c.e(c.ct(), "($0 ? $1 : $2)", c.operands())}; }},
        {Op::kCast, emit_cast},
        {Op::kConcat, emit_concat},
        {Op::kFull, emit_full},
        {Op::kReshape, emit_reshape},
        {Op::kSum, emit_row_reduction},
        {Op::kMean, emit_row_reduction},
        {Op::kMax, emit_row_reduction},
        {Op::kSoftmax, [](Ctx& c) { return emit_softmax(c, false); }},
        {Op::kLogSoftmax, [](Ctx& c) { return emit_softmax(c, true); }},
        {Op::kSoftmaxGrad, [](Ctx& c) { return emit_softmax_grad(c, false); }},
        {Op::kLogSoftmaxGrad, [](Ctx& c) { return emit_softmax_grad(c, true); }},
        {Op::kLayerNorm, emit_layer_norm},
        {Op::kRmsNorm, emit_rms_norm},
        {Op::kLayerNormGrad, emit_layer_norm_grad},
        {Op::kRmsNormGrad, emit_rms_norm_grad},
        {Op::kCrossEntropy, emit_cross_entropy},
        {Op::kCrossEntropyGrad, emit_cross_entropy_grad},
    };
    for (int i = 0; i < kNumOps; ++i)
      if (ops::is_math_op(static_cast<Op>(i))) t[static_cast<Op>(i)] = emit_line;
    return t;
  }();
  return table;
}

}  // namespace kiln::cuda::codegen
