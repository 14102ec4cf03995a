#include "passes/simplify/recognize.h"

#include <array>
#include <cmath>
#include <limits>
#include <numeric>

#include "ops/slice.h"
#include "passes/simplify/dead_code.h"
#include "support/error.h"

namespace kiln {
namespace {

using Ints = std::vector<int64_t>;

const Node* producer_of(const Rewriter& rw, ValueId id, Op op) {
  const Node* p = rw.producer(id);
  return p != nullptr && p->op == op ? p : nullptr;
}

// The relative rounding of a constant an exporter wrote in `dtype` (a couple of its ulps): how
// close sqrt(2) stored in f32 is to sqrt(2).
double rounding_of(DType dtype) {
  switch (dtype) {
    case DType::kF64: return std::ldexp(1.0, -50);
    case DType::kF16: return std::ldexp(1.0, -9);
    case DType::kBF16: return std::ldexp(1.0, -6);
    default: return std::ldexp(1.0, -22);
  }
}

// `id` is a splat whose value is `target` within the rounding of `dtype`.
bool splat_near(const Rewriter& rw, ValueId id, double target) {
  std::optional<double> v = splat_value(rw, id);
  return v && std::abs(*v - target) <= rounding_of(rw.type(id).dtype) * std::abs(target);
}

bool splat_is(const Rewriter& rw, ValueId id, double target) {
  std::optional<double> v = splat_value(rw, id);
  return v && *v == target;
}

// ---- activations ----

// x * sigmoid(x) -> silu(x).
Replacement silu(Rewriter& rw, const Node& n) {
  if (n.op != Op::kMul) return {};
  for (int i : {0, 1}) {
    const Node* s = producer_of(rw, n.inputs[i], Op::kSigmoid);
    if (s == nullptr || s->inputs[0] != n.inputs[1 - i]) continue;
    const ValueId x = s->inputs[0];
    if (rw.type(x) != rw.type(n.outputs[0])) return {};
    return {rw.emit(Op::kSilu, {x})};
  }
  return {};
}

// The ways the mul `n` is a product of three values, (a * b) * c or a * (b * c), as (a, b, c).
std::vector<std::array<ValueId, 3>> three_factors(const Rewriter& rw, const Node& n) {
  std::vector<std::array<ValueId, 3>> out;
  for (int i : {0, 1})
    if (const Node* m = producer_of(rw, n.inputs[i], Op::kMul))
      out.push_back({m->inputs[0], m->inputs[1], n.inputs[1 - i]});
  return out;
}

// x for the argument of erf in exact GELU: x / sqrt(2) or x * (1 / sqrt(2)); -1 otherwise.
ValueId erf_argument(const Rewriter& rw, ValueId t) {
  const Node* p = rw.producer(t);
  if (p == nullptr) return -1;
  if (p->op == Op::kDiv && splat_near(rw, p->inputs[1], std::sqrt(2.0))) return p->inputs[0];
  if (p->op == Op::kMul)
    for (int i : {0, 1})
      if (splat_near(rw, p->inputs[1 - i], std::sqrt(0.5))) return p->inputs[i];
  return -1;
}

// x cubed: pow(x, 3), x * (x * x) or (x * x) * x; -1 otherwise.
ValueId cube_root_of(const Rewriter& rw, ValueId id) {
  const Node* p = rw.producer(id);
  if (p == nullptr) return -1;
  if (p->op == Op::kPow) return splat_is(rw, p->inputs[1], 3.0) ? p->inputs[0] : -1;
  if (p->op != Op::kMul) return -1;
  for (int i : {0, 1}) {
    const Node* sq = producer_of(rw, p->inputs[i], Op::kMul);
    const ValueId x = p->inputs[1 - i];
    if (sq != nullptr && sq->inputs[0] == x && sq->inputs[1] == x) return x;
  }
  return -1;
}

// x for the argument of tanh in GPT-2's GELU: sqrt(2/pi) * (x + 0.044715 * x^3); -1 otherwise.
ValueId tanh_argument(const Rewriter& rw, ValueId u) {
  const Node* scaled = producer_of(rw, u, Op::kMul);
  if (scaled == nullptr) return -1;
  for (int i : {0, 1}) {
    if (!splat_near(rw, scaled->inputs[1 - i], std::sqrt(2.0 / M_PI))) continue;
    const Node* inner = producer_of(rw, scaled->inputs[i], Op::kAdd);
    if (inner == nullptr) return -1;
    for (int j : {0, 1}) {
      const ValueId x = inner->inputs[j];
      const Node* term = producer_of(rw, inner->inputs[1 - j], Op::kMul);
      if (term == nullptr) continue;
      for (int k : {0, 1})
        if (splat_near(rw, term->inputs[1 - k], 0.044715) && cube_root_of(rw, term->inputs[k]) == x)
          return x;
    }
  }
  return -1;
}

// x * 0.5 * (1 + f(t)) in any grouping and order, f = erf or tanh: x, with `argument` finding
// x from t. -1 otherwise.
ValueId gelu_input(const Rewriter& rw, const Node& n, Op f, ValueId (*argument)(const Rewriter&, ValueId)) {
  if (n.op != Op::kMul) return -1;
  for (const std::array<ValueId, 3>& factors : three_factors(rw, n)) {
    for (int e = 0; e < 3; ++e) {
      const Node* one_plus = producer_of(rw, factors[e], Op::kAdd);
      if (one_plus == nullptr) continue;
      for (int i : {0, 1}) {
        const Node* fn = producer_of(rw, one_plus->inputs[i], f);
        if (fn == nullptr || !splat_is(rw, one_plus->inputs[1 - i], 1.0)) continue;
        const ValueId x = argument(rw, fn->inputs[0]);
        if (x < 0) continue;
        const ValueId a = factors[(e + 1) % 3], b = factors[(e + 2) % 3];
        if ((a == x && splat_is(rw, b, 0.5)) || (b == x && splat_is(rw, a, 0.5))) return x;
      }
    }
  }
  return -1;
}

Replacement gelu(Rewriter& rw, const Node& n, Op f, ValueId (*argument)(const Rewriter&, ValueId),
                 const char* approximate) {
  const ValueId x = gelu_input(rw, n, f, argument);
  if (x < 0 || rw.type(x) != rw.type(n.outputs[0])) return {};
  return {rw.emit(Op::kGelu, {x}, {{"approximate", std::string(approximate)}})};
}

Replacement gelu_erf(Rewriter& rw, const Node& n) { return gelu(rw, n, Op::kErf, erf_argument, "none"); }
Replacement gelu_tanh(Rewriter& rw, const Node& n) { return gelu(rw, n, Op::kTanh, tanh_argument, "tanh"); }

// ---- products ----

// matmul(a, transpose(b)) with the transpose swapping b's last two axes only -> matmul(a, b,
// transpose_b flipped); likewise for a. What an exported linear layer writes (x W^T): the GEMM
// reads W as stored, and its gradient comes out in W's layout, with no transposes.
Replacement matmul_transpose(Rewriter& rw, const Node& n) {
  if (n.op != Op::kMatmul) return {};
  for (int i : {0, 1}) {
    const Node* t = producer_of(rw, n.inputs[i], Op::kTranspose);
    if (t == nullptr) continue;
    const int rank = rw.type(n.inputs[i]).rank();
    if (rank < 2) continue;
    Ints swap(rank);
    std::iota(swap.begin(), swap.end(), 0);
    std::swap(swap[rank - 2], swap[rank - 1]);
    if (transpose_perm(*t, rank) != swap) continue;
    std::vector<ValueId> inputs = n.inputs;
    inputs[i] = t->inputs[0];
    Attributes attrs = n.attrs;
    const char* flag = i == 0 ? "transpose_a" : "transpose_b";
    attrs.set(flag, !n.attrs.b(flag));
    return {rw.emit(Op::kMatmul, inputs, attrs)};
  }
  return {};
}

// x (..., K) when `id` is x reshaped to rows (M, K), M the product of x's leading dims, x of
// rank 3 or more; -1 otherwise.
ValueId rows_of(const Rewriter& rw, ValueId id) {
  const Node* r = producer_of(rw, id, Op::kReshape);
  if (r == nullptr) return -1;
  const Shape& rows = rw.type(id).shape;
  const Shape& x = rw.type(r->inputs[0]).shape;
  if (rows.size() != 2 || x.size() < 3 || x.back() != rows[1] || numel(x) != numel(rows)) return -1;
  return r->inputs[0];
}

// matmul(reshape(x, (M, K)), w) -> reshape(matmul(x, w), (M, N)) for x (..., K) and a matrix w:
// a linear layer written over flattened rows (Hugging Face's Conv1D: view, addmm, view) as one
// over x itself, so the reshapes meet and cancel, and the product's epilogue (bias, activation,
// the next norm) fuses with it as for a plain linear layer.
Replacement matmul_rows(Rewriter& rw, const Node& n) {
  if (n.op != Op::kMatmul || n.attrs.b("transpose_a") || rw.type(n.inputs[1]).rank() != 2) return {};
  const ValueId x = rows_of(rw, n.inputs[0]);
  if (x < 0) return {};
  const ValueId y = rw.emit(Op::kMatmul, {x, n.inputs[1]}, n.attrs);
  return {rw.emit(Op::kReshape, {y}, {{"shape", rw.type(n.outputs[0]).shape}})};
}

// add(reshape(y, (M, N)), b) with b a bias of (N,) or a scalar -> reshape(add(y, b), (M, N)): the
// bias of a linear layer over flattened rows, moved to the rows' own shape (after matmul-rows).
Replacement bias_rows(Rewriter& rw, const Node& n) {
  if (n.op != Op::kAdd) return {};
  const TensorType out = rw.type(n.outputs[0]);
  for (int i : {0, 1}) {
    const ValueId y = rows_of(rw, n.inputs[static_cast<size_t>(i)]);
    const TensorType b = rw.type(n.inputs[static_cast<size_t>(1 - i)]);
    if (y < 0 || rw.type(n.inputs[static_cast<size_t>(i)]) != out || b.rank() > 1 ||
        (b.rank() == 1 && b.shape[0] != out.shape[1] && b.shape[0] != 1))
      continue;
    std::vector<ValueId> inputs = n.inputs;
    inputs[static_cast<size_t>(i)] = y;
    return {rw.emit(Op::kReshape, {rw.emit(Op::kAdd, inputs)}, {{"shape", out.shape}})};
  }
  return {};
}

// ---- norms ----

// A mean over the last axis only, keeping it.
bool is_row_mean(const Rewriter& rw, const Node* node) {
  if (node == nullptr || node->op != Op::kMean || !node->attrs.b("keepdims")) return false;
  const int rank = rw.type(node->inputs[0]).rank();
  const Ints& axes = node->attrs.ints("axes");
  if (axes.empty()) return rank == 1;
  return axes.size() == 1 && normalize_axis(axes[0], rank) == rank - 1;
}

// x for x^2 written as pow(x, 2), x * x or square(x); -1 otherwise.
ValueId square_root_of(const Rewriter& rw, ValueId id) {
  const Node* p = rw.producer(id);
  if (p == nullptr) return -1;
  if (p->op == Op::kSquare) return p->inputs[0];
  if (p->op == Op::kPow && splat_is(rw, p->inputs[1], 2.0)) return p->inputs[0];
  if (p->op == Op::kMul && p->inputs[0] == p->inputs[1]) return p->inputs[0];
  return -1;
}

// a for 1 / sqrt(a) written as rsqrt(a), reciprocal(sqrt(a)), 1 / sqrt(a) or pow(a, -0.5).
ValueId inverse_sqrt_of(const Rewriter& rw, ValueId id) {
  const Node* p = rw.producer(id);
  if (p == nullptr) return -1;
  if (p->op == Op::kRsqrt) return p->inputs[0];
  if (p->op == Op::kPow && splat_is(rw, p->inputs[1], -0.5)) return p->inputs[0];
  ValueId root = -1;
  if (p->op == Op::kReciprocal) root = p->inputs[0];
  if (p->op == Op::kDiv && splat_is(rw, p->inputs[0], 1.0)) root = p->inputs[1];
  const Node* sqrt = root < 0 ? nullptr : producer_of(rw, root, Op::kSqrt);
  return sqrt == nullptr ? -1 : sqrt->inputs[0];
}

// The parts of y / sqrt(a) written as y * (1 / sqrt(a)) (any form above, either order) or
// y / sqrt(a).
struct Normalized {
  ValueId y = -1, a = -1;
};
std::optional<Normalized> normalized(const Rewriter& rw, const Node& n) {
  if (n.op == Op::kDiv) {
    const Node* sqrt = producer_of(rw, n.inputs[1], Op::kSqrt);
    if (sqrt != nullptr) return Normalized{n.inputs[0], sqrt->inputs[0]};
  }
  if (n.op == Op::kMul)
    for (int i : {0, 1}) {
      const ValueId a = inverse_sqrt_of(rw, n.inputs[1 - i]);
      if (a >= 0) return Normalized{n.inputs[i], a};
    }
  return std::nullopt;
}

// The statistic and epsilon of a = stat + eps (a finite non-negative scalar, either order), or of
// a = stat (eps 0).
struct WithEpsilon {
  ValueId stat = -1;
  double epsilon = 0;
};
WithEpsilon split_epsilon(const Rewriter& rw, ValueId a) {
  if (const Node* add = producer_of(rw, a, Op::kAdd))
    for (int i : {0, 1}) {
      std::optional<double> eps = splat_value(rw, add->inputs[1 - i]);
      if (eps && std::isfinite(*eps) && *eps >= 0 && rw.type(add->inputs[i]) == rw.type(a))
        return {add->inputs[i], *eps};
    }
  return {a, 0.0};
}

// x / sqrt(mean(x^2) + eps) -> rms_norm(x, ones, eps).
Replacement rms_norm(Rewriter& rw, const Node& n) {
  std::optional<Normalized> parts = normalized(rw, n);
  if (!parts) return {};
  const ValueId x = parts->y;
  const TensorType type = rw.type(x);
  if (!is_float(type.dtype) || type.rank() < 1 || type != rw.type(n.outputs[0])) return {};
  const WithEpsilon e = split_epsilon(rw, parts->a);
  const Node* mean = rw.producer(e.stat);
  if (!is_row_mean(rw, mean) || square_root_of(rw, mean->inputs[0]) != x) return {};
  const ValueId ones = rw.full({type.shape.back()}, 1.0, type.dtype);
  return {rw.emit(Op::kRmsNorm, {x, ones}, {{"epsilon", e.epsilon}})};
}

// x - mean(x) over the last axis: (x, the mean's node); nullopt otherwise.
struct Centered {
  ValueId x = -1;
  const Node* mean = nullptr;
};
std::optional<Centered> centered(const Rewriter& rw, ValueId id) {
  const Node* sub = producer_of(rw, id, Op::kSub);
  if (sub == nullptr) return std::nullopt;
  const Node* mean = rw.producer(sub->inputs[1]);
  if (!is_row_mean(rw, mean) || mean->inputs[0] != sub->inputs[0]) return std::nullopt;
  return Centered{sub->inputs[0], mean};
}

// (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) -> layer_norm(x, ones, zeros, eps). The two
// x - mean(x) may be one value or two equal nodes (an export that writes it twice).
Replacement layer_norm(Rewriter& rw, const Node& n) {
  std::optional<Normalized> parts = normalized(rw, n);
  if (!parts) return {};
  std::optional<Centered> d = centered(rw, parts->y);
  if (!d) return {};
  const ValueId x = d->x;
  const TensorType type = rw.type(x);
  if (!is_float(type.dtype) || type != rw.type(n.outputs[0])) return {};
  const WithEpsilon e = split_epsilon(rw, parts->a);
  const Node* variance = rw.producer(e.stat);
  if (!is_row_mean(rw, variance)) return {};
  const ValueId d2 = square_root_of(rw, variance->inputs[0]);
  if (d2 < 0) return {};
  if (d2 != parts->y) {
    std::optional<Centered> again = centered(rw, d2);
    if (!again || again->x != x) return {};
  }
  const ValueId ones = rw.full({type.shape.back()}, 1.0, type.dtype);
  const ValueId zeros = rw.full({type.shape.back()}, 0.0, type.dtype);
  return {rw.emit(Op::kLayerNorm, {x, ones, zeros}, {{"epsilon", e.epsilon}})};
}

// `p` as a norm's (C,) parameter for rows of C: p itself when (C,), a reshape of a (1, ..., 1, C)
// of no higher rank than the rows, a broadcast of a single element; -1 when it is none of these
// (a p that varies along another axis).
ValueId as_row_param(Rewriter& rw, ValueId p, const TensorType& rows) {
  const TensorType t = rw.type(p);
  const int64_t c = rows.shape.back();
  if (t.dtype != rows.dtype || t.rank() > rows.rank()) return -1;
  if (t.shape == Shape{c}) return p;
  for (int i = 0; i + 1 < t.rank(); ++i)
    if (t.shape[i] != 1) return -1;
  if (t.rank() > 0 && t.shape.back() == c) return rw.emit(Op::kReshape, {p}, {{"shape", Shape{c}}});
  if (t.numel() != 1) return -1;
  const ValueId one = rw.emit(Op::kReshape, {p}, {{"shape", Shape{1}}});
  return rw.emit(Op::kBroadcastTo, {one}, {{"shape", Shape{c}}});
}

// norm(x, 1, ...) * w -> norm(x, w, ...) for layer_norm (its beta 0) and rms_norm.
Replacement norm_scale(Rewriter& rw, const Node& n) {
  if (n.op != Op::kMul) return {};
  for (int i : {0, 1}) {
    const Node* norm = rw.producer(n.inputs[i]);
    if (norm == nullptr || (norm->op != Op::kLayerNorm && norm->op != Op::kRmsNorm)) continue;
    if (!splat_is(rw, norm->inputs[1], 1.0)) continue;
    if (norm->op == Op::kLayerNorm && !splat_is(rw, norm->inputs[2], 0.0)) continue;
    const TensorType rows = rw.type(norm->inputs[0]);
    if (rw.type(n.outputs[0]) != rows) return {};
    std::vector<ValueId> inputs = norm->inputs;
    const Op op = norm->op;
    const Attributes attrs = norm->attrs;
    const ValueId gamma = as_row_param(rw, n.inputs[1 - i], rows);  // emits: `norm` is stale now
    if (gamma < 0) return {};
    inputs[1] = gamma;
    return {rw.emit(op, inputs, attrs)};
  }
  return {};
}

// layer_norm(x, g, 0) + b -> layer_norm(x, g, b).
Replacement norm_shift(Rewriter& rw, const Node& n) {
  if (n.op != Op::kAdd) return {};
  for (int i : {0, 1}) {
    const Node* norm = producer_of(rw, n.inputs[i], Op::kLayerNorm);
    if (norm == nullptr || !splat_is(rw, norm->inputs[2], 0.0)) continue;
    const TensorType rows = rw.type(norm->inputs[0]);
    if (rw.type(n.outputs[0]) != rows) return {};
    std::vector<ValueId> inputs = norm->inputs;
    const Attributes attrs = norm->attrs;
    const ValueId beta = as_row_param(rw, n.inputs[1 - i], rows);
    if (beta < 0) return {};
    inputs[2] = beta;
    return {rw.emit(Op::kLayerNorm, inputs, attrs)};
  }
  return {};
}

// ---- rotary embeddings ----

// `id` as a step-1 range [begin, end) of x's last axis, every other axis whole: x; -1 otherwise.
ValueId last_axis_range(const Rewriter& rw, ValueId id, int64_t begin, int64_t end) {
  const Node* p = rw.producer(id);
  if (p == nullptr) return -1;
  if (p->op == Op::kSplit) {
    const ValueId x = p->inputs[0];
    const int rank = rw.type(x).rank();
    if (normalize_axis(p->attrs.i("axis"), rank) != rank - 1) return -1;
    int64_t at = 0;
    for (size_t i = 0; i < p->outputs.size(); ++i) {
      const int64_t size = rw.type(p->outputs[i]).shape.back();
      if (p->outputs[i] == id) return at == begin && at + size == end ? x : -1;
      at += size;
    }
    return -1;
  }
  if (p->op != Op::kSlice) return -1;
  const ValueId x = p->inputs[0];
  const Shape& in = rw.type(x).shape;
  ops::SliceBounds b = ops::slice_bounds(in, p->attrs);
  const size_t last = in.size() - 1;
  for (size_t a = 0; a < in.size(); ++a) {
    if (b.steps[a] != 1) return -1;
    const int64_t want_begin = a == last ? begin : 0, want_end = a == last ? end : in[a];
    if (b.starts[a] != want_begin || b.ends[a] != want_end) return -1;
  }
  return x;
}

// x for rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2]) on the last axis; -1 otherwise.
ValueId rotate_half_of(const Rewriter& rw, ValueId id) {
  const Node* cat = producer_of(rw, id, Op::kConcat);
  if (cat == nullptr || cat->inputs.size() != 2) return -1;
  const TensorType& type = rw.type(id);
  if (normalize_axis(cat->attrs.i("axis"), type.rank()) != type.rank() - 1) return -1;
  const Node* neg = producer_of(rw, cat->inputs[0], Op::kNeg);
  if (neg == nullptr) return -1;
  const int64_t d = type.shape.back(), half = d / 2;
  if (d % 2 != 0) return -1;
  const ValueId x = last_axis_range(rw, neg->inputs[0], half, d);
  if (x < 0 || last_axis_range(rw, cat->inputs[1], 0, half) != x) return -1;
  return x;
}

// The (T, D) table a known value broadcasts as over x (..., T, D): its values when every dim
// before the last two is 1 and the last two are T and D; nullopt otherwise.
std::optional<std::vector<double>> position_table(const Rewriter& rw, ValueId id, const Shape& x) {
  const Shape& s = rw.type(id).shape;
  const size_t r = x.size();
  if (s.size() < 2 || s.size() > r || s[s.size() - 2] != x[r - 2] || s.back() != x[r - 1]) return std::nullopt;
  for (size_t i = 0; i + 2 < s.size(); ++i)
    if (s[i] != 1) return std::nullopt;
  std::optional<Tensor> t = known_value(rw, id);
  if (!t) return std::nullopt;
  return t->to_f64();
}

// cos and sin are rotary tables for positions 0 .. T-1 of x (..., T, D) with one base: that base
// (10000 where the tables do not depend on it), nullopt otherwise. Every entry is compared with
// cos and sin of t * base^(-2i/D), both halves of D, within what computing the angle in f32 can
// be off by.
std::optional<double> rotary_base(const Rewriter& rw, ValueId cos_id, ValueId sin_id, const Shape& x) {
  std::optional<std::vector<double>> c = position_table(rw, cos_id, x), s = position_table(rw, sin_id, x);
  if (!c || !s) return std::nullopt;
  const int64_t t_count = x[x.size() - 2], d = x.back(), half = d / 2;
  auto at = [&](int64_t t, int64_t i) { return static_cast<size_t>(t * d + i); };
  std::vector<double> candidates;
  if (t_count >= 2 && half >= 2) {
    // Position 1, pair 1: angle base^(-2/D).
    const double angle = std::atan2((*s)[at(1, 1)], (*c)[at(1, 1)]);
    if (!(angle > 0 && angle < 1)) return std::nullopt;
    const double base = std::pow(angle, -static_cast<double>(d) / 2.0);
    if (std::abs(std::round(base) - base) <= 1e-3 * base) candidates.push_back(std::round(base));
    candidates.push_back(base);
  } else {
    candidates.push_back(10000.0);
  }
  const double eps = std::ldexp(1.0, -20);
  for (double base : candidates) {
    bool ok = true;
    for (int64_t t = 0; t < t_count && ok; ++t)
      for (int64_t i = 0; i < half && ok; ++i) {
        const double angle = static_cast<double>(t) *
                             std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
        const double tol = eps * (1.0 + angle), want_c = std::cos(angle), want_s = std::sin(angle);
        for (int64_t j : {i, i + half})
          ok = ok && std::abs((*c)[at(t, j)] - want_c) <= tol && std::abs((*s)[at(t, j)] - want_s) <= tol;
      }
    if (ok) return base;
  }
  return std::nullopt;
}

// x when `id` is heads_swap_perm applied to x (rank >= 3); -1 otherwise.
ValueId heads_swapped_from(const Rewriter& rw, ValueId id) {
  const int rank = rw.type(id).rank();
  const Node* t = producer_of(rw, id, Op::kTranspose);
  if (rank < 3 || t == nullptr || transpose_perm(*t, rank) != heads_swap_perm(rank)) return -1;
  return t->inputs[0];
}

// x * cos + rotate_half(x) * sin -> rotary_embedding(x, base); on a heads transpose of y
// (..., T, H, D), transpose(rotary_embedding{bthd}(y)).
Replacement rotary_embedding(Rewriter& rw, const Node& n) {
  if (n.op != Op::kAdd) return {};
  const TensorType out = rw.type(n.outputs[0]);
  if (!is_float(out.dtype) || out.rank() < 2 || out.shape.back() % 2 != 0) return {};
  for (int i : {0, 1}) {
    const Node* a = producer_of(rw, n.inputs[i], Op::kMul);
    const Node* b = producer_of(rw, n.inputs[1 - i], Op::kMul);
    if (a == nullptr || b == nullptr) continue;
    for (int ai : {0, 1})
      for (int bi : {0, 1}) {
        const ValueId x = a->inputs[ai], cos = a->inputs[1 - ai], rotated = b->inputs[bi], sin = b->inputs[1 - bi];
        if (rw.type(x) != out || rotate_half_of(rw, rotated) != x) continue;
        std::optional<double> base = rotary_base(rw, cos, sin, out.shape);
        if (!base) continue;
        const ValueId y = heads_swapped_from(rw, x);
        if (y < 0) return {rw.emit(Op::kRotaryEmbedding, {x}, {{"base", *base}})};
        const ValueId rotated_y =
            rw.emit(Op::kRotaryEmbedding, {y}, {{"base", *base}, {"layout", std::string("bthd")}});
        return {rw.emit(Op::kTranspose, {rotated_y}, {{"perm", heads_swap_perm(out.rank())}})};
      }
  }
  return {};
}

// ---- attention ----

// The scores' mask, when it is one kiln's attention has: none (false) or causal (true).
struct Mask {
  ValueId scores = -1;  // what the mask applies to
  bool causal = false;
};

// A known value broadcast over the scores (..., Tq, Tk) as a (Tq, Tk) matrix (every leading dim
// 1), tested by `masked(i, j, value)`; true when `masked` holds exactly above the diagonal.
template <class Masked>
bool is_causal(const Rewriter& rw, ValueId id, const Shape& scores, Masked masked) {
  const Shape& s = rw.type(id).shape;
  const size_t r = scores.size();
  if (s.size() < 2 || s.size() > r || s[s.size() - 2] != scores[r - 2] || s.back() != scores[r - 1]) return false;
  for (size_t i = 0; i + 2 < s.size(); ++i)
    if (s[i] != 1) return false;
  std::optional<Tensor> t = known_value(rw, id);
  if (!t) return false;
  const std::vector<double> values = t->to_f64();
  const int64_t tq = scores[r - 2], tk = scores[r - 1];
  for (int64_t i = 0; i < tq; ++i)
    for (int64_t j = 0; j < tk; ++j)
      if (masked(values[static_cast<size_t>(i * tk + j)]) != (j > i)) return false;
  return true;
}

// A value that masks a score: -inf, or so negative (<= -1e30) that its exp beside any score within
// 1e30 of the row's largest is 0.
bool is_masking(double v) { return v <= -1e30; }

// `s` as a causal mask applied to scores: where(causal, NEG, scores), where(not causal, scores,
// NEG) or scores + M with M 0 on and below the diagonal and NEG above it.
std::optional<Mask> causal_mask(const Rewriter& rw, ValueId s) {
  const Node* p = rw.producer(s);
  if (p == nullptr) return std::nullopt;
  const Shape& shape = rw.type(s).shape;
  if (p->op == Op::kWhere) {
    for (int branch : {1, 2}) {
      std::optional<double> fill = splat_value(rw, p->inputs[branch]);
      const ValueId scores = p->inputs[3 - branch];
      if (!fill || !is_masking(*fill) || rw.type(scores) != rw.type(s)) continue;
      const bool masked_when = branch == 1;  // the condition's value that selects the fill
      if (is_causal(rw, p->inputs[0], shape, [&](double c) { return (c != 0) == masked_when; }))
        return Mask{scores, true};
    }
  }
  if (p->op == Op::kAdd)
    for (int i : {0, 1}) {
      const ValueId scores = p->inputs[i];
      if (rw.type(scores) != rw.type(s)) continue;
      bool other_values_zero = true;
      const bool causal = is_causal(rw, p->inputs[1 - i], shape, [&](double m) {
        if (!is_masking(m) && m != 0) other_values_zero = false;
        return is_masking(m);
      });
      if (causal && other_values_zero) return Mask{scores, true};
    }
  return std::nullopt;
}

// `m`'s dims before the heads axis when `m` (a mask operand of scores of shape `scores`
// (..., H, Tq, Tk), broadcast numpy-style) is one row of Tk per batch entry: 1 on the heads and
// query axes, each dim before them 1 or the scores' (BERT's mask[:, None, None, :]).
std::optional<Shape> key_row_dims(const Shape& m, const Shape& scores) {
  const size_t r = scores.size();
  if (r < 2 || m.size() > r) return std::nullopt;
  Shape full(r - m.size(), 1);
  full.insert(full.end(), m.begin(), m.end());
  if (full[r - 1] != scores[r - 1] || full[r - 2] != 1 || (r >= 3 && full[r - 3] != 1)) return std::nullopt;
  const size_t lead = r >= 3 ? r - 3 : 0;
  for (size_t a = 0; a < lead; ++a)
    if (full[a] != 1 && full[a] != scores[a]) return std::nullopt;
  return Shape(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(lead));
}

// `m` (key_row_dims holds) as attention's key_bias shape (..., Tk): the scores' dims before the
// heads, then Tk (a reshape, and a broadcast where `m` has 1 for a batch dim).
ValueId as_key_row(Rewriter& rw, ValueId m, const Shape& scores) {
  const size_t r = scores.size(), lead = r >= 3 ? r - 3 : 0;
  Shape own = *key_row_dims(rw.type(m).shape, scores);
  own.push_back(scores[r - 1]);
  Shape want(scores.begin(), scores.begin() + static_cast<std::ptrdiff_t>(lead));
  want.push_back(scores[r - 1]);
  ValueId row = rw.type(m).shape == own ? m : rw.emit(Op::kReshape, {m}, {{"shape", own}});
  return own == want ? row : rw.emit(Op::kBroadcastTo, {row}, {{"shape", want}});
}

// A padding mask on scores: the scores and attention's key_bias for it.
struct KeyPadding {
  ValueId scores = -1;
  ValueId bias = -1;  // (..., Tk), the scores' dtype
};

// `s` as a key-padding mask applied to scores: scores + M with M one row per batch entry
// (key_row_dims: BERT's (1 - mask[:, None, None, :]) * -10000, or any additive per-key bias),
// whose key_bias is M itself; or where(pad, NEG, scores) / where(keep, scores, NEG) with such a
// condition and NEG masking (masked_fill(mask == 0, -inf), finfo.min), whose key_bias is
// where(pad, NEG, 0): s + NEG is NEG (exactly for -inf; for NEG <= -1e30 and a score within
// 1e30 of 0, by rounding).
std::optional<KeyPadding> key_padding(Rewriter& rw, ValueId s) {
  const Node* p = rw.producer(s);
  if (p == nullptr) return std::nullopt;
  const Shape shape = rw.type(s).shape;
  const DType dtype = rw.type(s).dtype;
  if (p->op == Op::kAdd) {
    const std::array<ValueId, 2> in{p->inputs[0], p->inputs[1]};
    for (int i : {0, 1}) {
      const ValueId scores = in[i], m = in[1 - i];
      if (rw.type(scores) != rw.type(s) || rw.type(m).dtype != dtype || !key_row_dims(rw.type(m).shape, shape))
        continue;
      return KeyPadding{scores, as_key_row(rw, m, shape)};
    }
  }
  if (p->op == Op::kWhere) {
    const std::array<ValueId, 3> in{p->inputs[0], p->inputs[1], p->inputs[2]};
    for (int branch : {1, 2}) {
      std::optional<double> fill = splat_value(rw, in[branch]);
      const ValueId scores = in[3 - branch];
      if (!fill || !is_masking(*fill) || rw.type(scores) != rw.type(s) || !key_row_dims(rw.type(in[0]).shape, shape))
        continue;
      const ValueId condition = as_key_row(rw, in[0], shape);
      const ValueId neg = rw.full({}, *fill, dtype), zero = rw.full({}, 0.0, dtype);
      const ValueId bias = branch == 1 ? rw.emit(Op::kWhere, {condition, neg, zero})
                                       : rw.emit(Op::kWhere, {condition, zero, neg});
      return KeyPadding{scores, bias};
    }
  }
  return std::nullopt;
}

// `s` as raw * c or raw / c with c a positive finite scalar: (raw, the scale).
std::optional<std::pair<ValueId, double>> scaled(const Rewriter& rw, ValueId s) {
  const Node* p = rw.producer(s);
  if (p == nullptr) return std::nullopt;
  auto scalar = [&](ValueId c) -> std::optional<double> {
    std::optional<double> v = splat_value(rw, c);
    if (!v || !(*v > 0) || !std::isfinite(*v) || rw.type(c).numel() != 1) return std::nullopt;
    return v;
  };
  if (p->op == Op::kDiv && rw.type(p->inputs[0]) == rw.type(s))
    if (std::optional<double> c = scalar(p->inputs[1])) return std::pair{p->inputs[0], 1.0 / *c};
  if (p->op == Op::kMul)
    for (int i : {0, 1})
      if (rw.type(p->inputs[i]) == rw.type(s))
        if (std::optional<double> c = scalar(p->inputs[1 - i])) return std::pair{p->inputs[i], *c};
  return std::nullopt;
}

// k for k^T: transpose_b, or a transpose whose last two axes are swapped (the rest of its
// permutation kept as a transpose of its own, which the algebraic rules fold or cancel).
ValueId untransposed(Rewriter& rw, ValueId kt) {
  const Node* t = producer_of(rw, kt, Op::kTranspose);
  if (t == nullptr) return -1;
  const int rank = rw.type(kt).rank();
  Ints perm = transpose_perm(*t, rank);
  std::swap(perm[rank - 2], perm[rank - 1]);
  const ValueId y = t->inputs[0];
  Ints identity(rank);
  std::iota(identity.begin(), identity.end(), 0);
  if (perm == identity) return y;
  return rw.emit(Op::kTranspose, {y}, {{"perm", perm}});
}

// k (..., Hkv, T, D) when `id` (..., H, T, D) repeats each of its heads H / Hkv times in a row
// (an export's repeat_kv: unsqueeze at -3, expand, reshape); `id` itself otherwise.
ValueId unrepeated_heads(Rewriter& rw, ValueId id) {
  const Shape out = rw.type(id).shape;
  const int r = static_cast<int>(out.size());
  const Node* merge = producer_of(rw, id, Op::kReshape);
  if (r < 3 || merge == nullptr) return id;
  const Node* expand = producer_of(rw, merge->inputs[0], Op::kBroadcastTo);
  if (expand == nullptr) return id;
  const Shape expanded = rw.type(merge->inputs[0]).shape;  // (..., Hkv, n, T, D)
  const ValueId source = expand->inputs[0];
  Shape unsqueezed = rw.type(source).shape;  // (..., Hkv, 1, T, D)
  if (expanded.size() != out.size() + 1 || unsqueezed.size() != expanded.size()) return id;
  const int64_t hkv = expanded[r - 3], n = expanded[r - 2];
  if (hkv * n != out[r - 3] || !std::equal(out.begin(), out.begin() + r - 3, expanded.begin()) ||
      expanded[r - 1] != out[r - 2] || expanded[r] != out[r - 1])
    return id;
  Shape one = expanded;
  one[r - 2] = 1;
  if (unsqueezed != one) return id;
  Shape k_shape = out;
  k_shape[r - 3] = hkv;
  if (const Node* unsqueeze = producer_of(rw, source, Op::kReshape))
    if (rw.type(unsqueeze->inputs[0]).shape == k_shape) return unsqueeze->inputs[0];
  return rw.emit(Op::kReshape, {source}, {{"shape", k_shape}});
}

// softmax(mask(q k^T * scale)) v -> attention(q, k, v [, key_bias]) {causal, scale}: see the
// header.
Replacement attention(Rewriter& rw, const Node& n) {
  if (n.op != Op::kMatmul || n.attrs.b("transpose_a") || n.attrs.b("transpose_b")) return {};
  const Node* softmax = producer_of(rw, n.inputs[0], Op::kSoftmax);
  if (softmax == nullptr) return {};
  const TensorType probs = rw.type(n.inputs[0]);
  if (!is_float(probs.dtype) || probs.rank() < 2 ||
      normalize_axis(softmax->attrs.i("axis"), probs.rank()) != probs.rank() - 1)
    return {};
  // Peel the scale and the masks (causal, padding), in any order, down to the raw product. A
  // padding bias inside the scale ((q k^T + M) * c) is scaled too.
  ValueId s = softmax->inputs[0];
  std::optional<double> scale;
  bool causal = false, bias_scaled = false;
  ValueId bias = -1;
  for (int step = 0; step < 3; ++step) {
    if (!scale)
      if (std::optional<std::pair<ValueId, double>> sc = scaled(rw, s)) {
        s = sc->first;
        scale = sc->second;
        continue;
      }
    if (!causal)
      if (std::optional<Mask> m = causal_mask(rw, s)) {
        s = m->scores;
        causal = m->causal;
        continue;
      }
    if (bias < 0)
      if (std::optional<KeyPadding> m = key_padding(rw, s)) {
        s = m->scores;
        bias = m->bias;
        bias_scaled = scale.has_value();
        continue;
      }
    break;
  }
  const Node* product = producer_of(rw, s, Op::kMatmul);
  if (product == nullptr || product->attrs.b("transpose_a")) return {};
  const ValueId q = product->inputs[0], kt = product->inputs[1], v_in = n.inputs[1];
  const bool transpose_b = product->attrs.b("transpose_b");
  const TensorType qt = rw.type(q);
  if (qt.dtype != probs.dtype || qt.rank() != probs.rank() || rw.type(kt).rank() != qt.rank() ||
      rw.type(v_in).rank() != qt.rank())
    return {};
  ValueId k = transpose_b ? kt : untransposed(rw, kt);
  if (k < 0) return {};
  k = unrepeated_heads(rw, k);
  const ValueId v = unrepeated_heads(rw, v_in);
  // Leading dims: equal, but for the heads axis (-3) of k and v, which may be fewer (GQA) or 1
  // (a broadcast: multi-query attention).
  const Shape qs = qt.shape, ks = rw.type(k).shape, vs = rw.type(v).shape;
  const int r = qt.rank();
  if (ks[r - 1] != qs[r - 1] || vs[r - 2] != ks[r - 2]) return {};
  for (int a = 0; a < r - 2; ++a) {
    if (ks[a] != vs[a]) return {};
    if (ks[a] == qs[a]) continue;
    if (a != r - 3 || ks[a] == 0 || qs[a] % ks[a] != 0) return {};
  }
  Attributes attrs{{"causal", causal}};
  const double default_scale = 1.0 / std::sqrt(static_cast<double>(qs[r - 1]));
  const double s_value = scale.value_or(1.0);
  if (std::abs(s_value - default_scale) > rounding_of(qt.dtype) * default_scale) attrs.set("scale", s_value);
  std::vector<ValueId> inputs{q, k, v};
  if (bias >= 0) {
    // The bias's rows must be q's batch entries (k's may broadcast over them).
    if (rw.type(bias).shape.size() != static_cast<size_t>(r >= 3 ? r - 2 : 1) ||
        !std::equal(qs.begin(), qs.end() - std::min(r, 3), rw.type(bias).shape.begin()))
      return {};
    inputs.push_back(bias_scaled ? rw.emit(Op::kMul, {bias, rw.full({}, s_value, qt.dtype)}) : bias);
  }
  std::vector<ValueId> out = rw.emit_node(Op::kAttention, inputs, attrs);
  if (rw.type(out[0]) != rw.type(n.outputs[0])) return {};
  return {out[0]};
}

std::string layout_of(const Node& n) { return n.attrs.has("layout") ? n.attrs.s("layout") : "bhtd"; }

// attention (bhtd) over k and v whose heads the graph repeated (an export's repeat_kv before an
// attention it wrote whole, as torch's scaled_dot_product_attention) -> attention over the
// unrepeated k and v: grouped-query attention reads each kv head for its group of q heads.
Replacement attention_heads(Rewriter& rw, const Node& n) {
  if (n.op != Op::kAttention || layout_of(n) != "bhtd") return {};
  const ValueId k = unrepeated_heads(rw, n.inputs[1]), v = unrepeated_heads(rw, n.inputs[2]);
  if (k == n.inputs[1] || v == n.inputs[2]) return {};  // both, or the heads would disagree
  std::vector<ValueId> inputs = n.inputs;
  inputs[1] = k;
  inputs[2] = v;
  return rw.emit_node(Op::kAttention, inputs, n.attrs);
}

// THE table, tried in this order on each node.
const std::array kRules = {
    // matmul(a, transpose(b)) -> matmul(a, b) with transpose_b flipped (and for a): the
    // transpose of the last two axes read by the GEMM in place.
    RewriteRule{"matmul-transpose", matmul_transpose},
    // matmul(reshape(x) to rows, w) -> reshape(matmul(x, w)); add(that, bias) likewise: a
    // linear layer over flattened rows as one over x, its epilogue then fused as usual.
    RewriteRule{"matmul-rows", matmul_rows},
    RewriteRule{"bias-rows", bias_rows},
    // x * sigmoid(x) -> silu(x).
    RewriteRule{"silu", silu},
    // x * 0.5 * (1 + erf(x / sqrt 2)) -> gelu(x) (exact form).
    RewriteRule{"gelu-erf", gelu_erf},
    // x * 0.5 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) -> gelu(x, "tanh").
    RewriteRule{"gelu-tanh", gelu_tanh},
    // (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) -> layer_norm(x, 1, 0, eps). Before
    // rms-norm, which would take x - mean(x) for its x (the same numbers, one more kernel).
    RewriteRule{"layer-norm", layer_norm},
    // x / sqrt(mean(x^2, last axis) + eps) -> rms_norm(x, 1, eps).
    RewriteRule{"rms-norm", rms_norm},
    // norm(x, 1) * w -> norm(x, w): a (C,) weight becomes the norm's gamma.
    RewriteRule{"norm-scale", norm_scale},
    // layer_norm(x, g, 0) + b -> layer_norm(x, g, b).
    RewriteRule{"norm-shift", norm_shift},
    // x cos + rotate_half(x) sin, cos and sin tables of positions 0 .. T-1 -> rotary_embedding.
    RewriteRule{"rotary-embedding", rotary_embedding},
    // softmax(q k^T scale, no mask or causal) v -> attention(q, k, v), k and v with their own
    // (fewer) heads where the graph repeated them.
    RewriteRule{"attention", attention},
    // attention over repeated kv heads -> attention over the kv heads themselves (GQA).
    RewriteRule{"attention-heads", attention_heads},
};

}  // namespace

std::span<const RewriteRule> recognition_rules() { return kRules; }

bool RecognizeOps::run(Graph& graph) {
  fired_ = apply_rules(graph, kRules);
  if (fired_.empty()) return false;
  DeadCodeElimination().run(graph);  // the decomposed forms the rules replaced
  return true;
}

std::vector<std::string> RecognizeOps::notes() const {
  if (fired_.empty()) return {"no composite op found"};
  std::string line;
  for (const auto& [name, count] : fired_) line += fmt::format("{}{} {}", line.empty() ? "" : ", ", name, count);
  return {line};
}

}  // namespace kiln
