#include "passes/simplify/algebraic.h"

#include <array>
#include <cmath>
#include <numeric>

#include "support/error.h"

namespace kiln {
namespace {

using Ints = std::vector<int64_t>;

// `x` standing for `node`'s output: itself when the types agree; broadcast_to the output's
// shape when x is smaller (x * 1 where the 1 is the bigger operand). Same dtype always: binary
// ops take one dtype.
Replacement keep(Rewriter& rw, const Node& node, ValueId x) {
  const TensorType& out = rw.type(node.outputs[0]);
  if (rw.type(x) == out) return {x};
  if (rw.type(x).dtype != out.dtype) return {};
  return {rw.emit(Op::kBroadcastTo, {x}, {{"shape", out.shape}})};
}

bool splat_is(const Rewriter& rw, ValueId id, double wanted) {
  std::optional<double> v = splat_value(rw, id);
  return v && *v == wanted;
}

// A zero splat whose sign is `negative` (integers: any zero).
bool is_zero(const Rewriter& rw, ValueId id, bool negative) {
  std::optional<double> v = splat_value(rw, id);
  if (!v || *v != 0.0) return false;
  return !is_float(rw.type(id).dtype) || std::signbit(*v) == negative;
}

bool is_identity(const Ints& perm) {
  for (size_t i = 0; i < perm.size(); ++i)
    if (perm[i] != static_cast<int64_t>(i)) return false;
  return true;
}

const Node* producer_of(Rewriter& rw, ValueId id, Op op) {
  const Node* p = rw.producer(id);
  return p != nullptr && p->op == op ? p : nullptr;
}

// ---- the rules ----

Replacement mul_by_one(Rewriter& rw, const Node& n) {
  if (n.op != Op::kMul) return {};
  for (int i : {0, 1})
    if (splat_is(rw, n.inputs[1 - i], 1.0)) return keep(rw, n, n.inputs[i]);
  return {};
}

Replacement add_zero(Rewriter& rw, const Node& n) {
  if (n.op != Op::kAdd) return {};
  for (int i : {0, 1})
    if (is_zero(rw, n.inputs[1 - i], /*negative=*/true)) return keep(rw, n, n.inputs[i]);
  return {};
}

Replacement sub_zero(Rewriter& rw, const Node& n) {
  if (n.op != Op::kSub || !is_zero(rw, n.inputs[1], /*negative=*/false)) return {};
  return keep(rw, n, n.inputs[0]);
}

Replacement div_by_one(Rewriter& rw, const Node& n) {
  if (n.op != Op::kDiv || !splat_is(rw, n.inputs[1], 1.0)) return {};
  return keep(rw, n, n.inputs[0]);
}

Replacement mul_by_zero(Rewriter& rw, const Node& n) {
  const TensorType& out = rw.type(n.outputs[0]);
  if (n.op != Op::kMul || !is_integer(out.dtype)) return {};
  if (!is_zero(rw, n.inputs[0], false) && !is_zero(rw, n.inputs[1], false)) return {};
  return {rw.full(out.shape, 0.0, out.dtype)};
}

Replacement neg_neg(Rewriter& rw, const Node& n) {
  if (n.op != Op::kNeg) return {};
  const Node* inner = producer_of(rw, n.inputs[0], Op::kNeg);
  if (inner == nullptr) return {};
  return {inner->inputs[0]};
}

Replacement stop_gradient(Rewriter&, const Node& n) {
  if (n.op != Op::kStopGradient) return {};
  return {n.inputs[0]};
}

Replacement transpose_identity(Rewriter& rw, const Node& n) {
  if (n.op != Op::kTranspose || !is_identity(transpose_perm(n, rw.type(n.inputs[0]).rank()))) return {};
  return {n.inputs[0]};
}

Replacement transpose_transpose(Rewriter& rw, const Node& n) {
  if (n.op != Op::kTranspose) return {};
  const Node* inner = producer_of(rw, n.inputs[0], Op::kTranspose);
  if (inner == nullptr) return {};
  const ValueId x = inner->inputs[0];
  const int rank = rw.type(x).rank();
  const Ints outer_perm = transpose_perm(n, rank), inner_perm = transpose_perm(*inner, rank);
  // Output axis i is the inner output's axis outer_perm[i], which is x's axis
  // inner_perm[outer_perm[i]].
  Ints combined(rank);
  for (int i = 0; i < rank; ++i) combined[i] = inner_perm[outer_perm[i]];
  if (is_identity(combined)) return {x};
  return {rw.emit(Op::kTranspose, {x}, {{"perm", combined}})};
}

Replacement reshape_same_shape(Rewriter& rw, const Node& n) {
  if (n.op != Op::kReshape || rw.type(n.inputs[0]) != rw.type(n.outputs[0])) return {};
  return {n.inputs[0]};
}

Replacement reshape_reshape(Rewriter& rw, const Node& n) {
  if (n.op != Op::kReshape) return {};
  const Node* inner = producer_of(rw, n.inputs[0], Op::kReshape);
  if (inner == nullptr) return {};
  const ValueId x = inner->inputs[0];
  const Shape& shape = rw.type(n.outputs[0]).shape;  // resolved: no -1 left
  if (rw.type(x).shape == shape) return {x};
  return {rw.emit(Op::kReshape, {x}, {{"shape", shape}})};
}

Replacement broadcast_same_shape(Rewriter& rw, const Node& n) {
  if (n.op != Op::kBroadcastTo || rw.type(n.inputs[0]) != rw.type(n.outputs[0])) return {};
  return {n.inputs[0]};
}

Replacement cast_same_dtype(Rewriter& rw, const Node& n) {
  if (n.op != Op::kCast || rw.type(n.inputs[0]) != rw.type(n.outputs[0])) return {};
  return {n.inputs[0]};
}

// True when every value of dtype `from` is exactly representable in `to`.
bool cast_is_exact(DType from, DType to) {
  if (from == to || from == DType::kBool) return true;
  switch (from) {
    case DType::kF16:
    case DType::kBF16: return to == DType::kF32 || to == DType::kF64;
    case DType::kF32: return to == DType::kF64;
    case DType::kU8: return to != DType::kBool;  // 0..255 fits every other dtype, bf16 included
    case DType::kI32: return to == DType::kI64 || to == DType::kF64;
    default: return false;
  }
}

// The class a cast's source belongs to decides how it converts (floats saturate into integers,
// integers wrap): two sources of one class with equal values convert alike.
bool same_cast_class(DType a, DType b) {
  return a == DType::kBool || (is_float(a) && is_float(b)) || (is_integer(a) && is_integer(b));
}

Replacement cast_cast_exact(Rewriter& rw, const Node& n) {
  if (n.op != Op::kCast) return {};
  const Node* inner = producer_of(rw, n.inputs[0], Op::kCast);
  if (inner == nullptr) return {};
  const ValueId x = inner->inputs[0];
  const DType a = rw.type(x).dtype, b = rw.type(n.inputs[0]).dtype,
              c = rw.type(n.outputs[0]).dtype;
  if (!cast_is_exact(a, b)) return {};
  if (c == a) return {x};
  if (!same_cast_class(a, b)) return {};
  return {rw.emit(Op::kCast, {x}, {{"dtype", c}})};
}

Replacement sum_one_hot_classes(Rewriter& rw, const Node& n) {
  if (n.op != Op::kSum) return {};
  const Node* one_hot = producer_of(rw, n.inputs[0], Op::kOneHot);
  if (one_hot == nullptr) return {};
  const int rank = rw.type(n.inputs[0]).rank();
  const Ints& axes = n.attrs.ints("axes");
  const bool only_class_axis = axes.empty() ? rank == 1
                                            : axes.size() == 1 &&
                                                  normalize_axis(axes[0], rank) == rank - 1;
  if (!only_class_axis) return {};
  const int64_t depth = one_hot->attrs.i("depth");
  std::optional<IntRange> range = integer_range(rw, one_hot->inputs[0]);
  if (!range || range->low < 0 || range->high > static_cast<double>(depth - 1)) return {};
  const TensorType& out = rw.type(n.outputs[0]);
  return {rw.full(out.shape, 1.0, out.dtype)};
}

// cast(transpose(x)) -> transpose(cast(x)): an elementwise op commutes with a permutation.
// Mixed precision puts its casts right before the ops that run in 16 bits; this moves the
// transposes next to those ops (where attention-heads-inside and transpose-transpose meet them).
Replacement cast_transpose(Rewriter& rw, const Node& n) {
  if (n.op != Op::kCast) return {};
  const Node* t = producer_of(rw, n.inputs[0], Op::kTranspose);
  if (t == nullptr) return {};
  const Attributes perm = t->attrs;
  const ValueId cast = rw.emit(Op::kCast, {t->inputs[0]}, n.attrs);
  return {rw.emit(Op::kTranspose, {cast}, perm)};
}

// x when `id` is heads_swap_perm(id's rank) applied to x, else -1.
ValueId unswapped(Rewriter& rw, ValueId id) {
  const int rank = rw.type(id).rank();
  if (rank < 3) return -1;
  const Node* t = producer_of(rw, id, Op::kTranspose);
  if (t == nullptr || transpose_perm(*t, rank) != heads_swap_perm(rank)) return -1;
  return t->inputs[0];
}

ValueId swap_last_two(Rewriter& rw, ValueId x) {
  const int rank = rw.type(x).rank();
  Ints perm(rank);
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[rank - 2], perm[rank - 1]);
  return rw.emit(Op::kTranspose, {x}, {{"perm", perm}});
}

// attention{bhtd}(T(q), T(k), T(v)) with T = heads_swap -> T(attention{bthd}(q, k, v)), and
// attention_grad{bhtd}(T(q), T(k), T(v), out, dout, lse) -> T each of attention_grad{bthd}(q, k,
// v, T(out), T(dout), lse^T). The transposes emitted meet the ones around (a model's reshape to
// heads, its reshape back, autodiff's mirror images) and cancel by transpose-transpose. A
// key_bias (B, Tk) is the same in both layouts: it goes along as it is.
Replacement attention_heads_inside(Rewriter& rw, const Node& n) {
  if ((n.op != Op::kAttention && n.op != Op::kAttentionGrad) || n.attrs.s("layout") != "bhtd")
    return {};
  ValueId qkv[3];
  for (int i = 0; i < 3; ++i)
    if ((qkv[i] = unswapped(rw, n.inputs[i])) < 0) return {};
  Attributes attrs = n.attrs;
  attrs.set("layout", std::string("bthd"));
  const int rank = rw.type(n.inputs[0]).rank();
  auto swap = [&](ValueId x) { return rw.emit(Op::kTranspose, {x}, {{"perm", heads_swap_perm(rank)}}); };
  if (n.op == Op::kAttention) {
    std::vector<ValueId> inputs{qkv[0], qkv[1], qkv[2]};
    if (n.inputs.size() > 3) inputs.push_back(n.inputs[3]);  // key_bias
    std::vector<ValueId> out = rw.emit_node(Op::kAttention, inputs, attrs);
    return {swap(out[0]), swap_last_two(rw, out[1])};
  }
  std::vector<ValueId> inputs{qkv[0], qkv[1], qkv[2], swap(n.inputs[3]), swap(n.inputs[4]),
                              swap_last_two(rw, n.inputs[5])};
  if (n.inputs.size() > 6) inputs.push_back(n.inputs[6]);  // key_bias
  std::vector<ValueId> grads = rw.emit_node(Op::kAttentionGrad, inputs, attrs);
  return {swap(grads[0]), swap(grads[1]), swap(grads[2])};
}

// concat(split(x)) -> x: every output of one split, in order, concatenated along the split's
// axis (so the sizes add up to x's dim).
Replacement concat_split(Rewriter& rw, const Node& n) {
  if (n.op != Op::kConcat) return {};
  const Node* split = producer_of(rw, n.inputs[0], Op::kSplit);
  if (split == nullptr || split->outputs.size() != n.inputs.size()) return {};
  for (size_t i = 0; i < n.inputs.size(); ++i)
    if (n.inputs[i] != split->outputs[i]) return {};
  const ValueId x = split->inputs[0];
  const int rank = rw.type(x).rank();
  if (normalize_axis(n.attrs.i("axis"), rank) != normalize_axis(split->attrs.i("axis"), rank) ||
      rw.type(x) != rw.type(n.outputs[0]))
    return {};
  return {x};
}

// The projection x (..., T, 3 H D) whose split along its last axis into three equal parts,
// each reshaped to (..., T, H, D), gives q, k, v (in that order); -1 when they are not that.
ValueId packed_projection(Rewriter& rw, const ValueId* qkv) {
  ValueId split_of = -1, x = -1;
  for (int i = 0; i < 3; ++i) {
    const Node* r = producer_of(rw, qkv[i], Op::kReshape);
    if (r == nullptr) return -1;
    const Node* split = producer_of(rw, r->inputs[0], Op::kSplit);
    if (split == nullptr || split->outputs.size() != 3 || split->outputs[i] != r->inputs[0])
      return -1;
    if (i > 0 && split->outputs[0] != split_of) return -1;
    split_of = split->outputs[0];
    x = split->inputs[0];
    const int rank = rw.type(x).rank();
    if (rank < 1 || normalize_axis(split->attrs.i("axis"), rank) != rank - 1) return -1;
  }
  const Shape& q = rw.type(qkv[0]).shape;  // (..., T, H, D)
  if (rw.type(qkv[1]).shape != q || rw.type(qkv[2]).shape != q) return -1;
  Shape packed(q.begin(), q.end() - 2);
  packed.push_back(3 * q[q.size() - 2] * q.back());
  return rw.type(x).shape == packed ? x : -1;
}

// attention{bthd}(q, k, v [, key_bias]) with q, k, v the three parts of a split projection x ->
// attention_qkv(x as (..., T, 3, H, D) [, key_bias]); attention_grad likewise ->
// attention_qkv_grad, whose dqkv is split again into dq, dk, dv (a concat of those, as autodiff
// writes the split's gradient, then folds by concat-split: dqkv is written in place).
Replacement attention_packed_qkv(Rewriter& rw, const Node& n) {
  if ((n.op != Op::kAttention && n.op != Op::kAttentionGrad) || n.attrs.s("layout") != "bthd")
    return {};
  const ValueId x = packed_projection(rw, n.inputs.data());
  if (x < 0) return {};
  const Shape q = rw.type(n.inputs[0]).shape;
  const Shape flat = rw.type(x).shape;
  Shape packed(q.begin(), q.end() - 2);
  packed.insert(packed.end(), {3, q[q.size() - 2], q.back()});
  Attributes attrs = n.attrs;
  attrs.erase("layout");
  const ValueId qkv = rw.emit(Op::kReshape, {x}, {{"shape", packed}});
  if (n.op == Op::kAttention) {
    std::vector<ValueId> inputs{qkv};
    if (n.inputs.size() > 3) inputs.push_back(n.inputs[3]);  // key_bias
    return rw.emit_node(Op::kAttentionQkv, inputs, attrs);
  }
  std::vector<ValueId> inputs{qkv, n.inputs[3], n.inputs[4], n.inputs[5]};
  if (n.inputs.size() > 6) inputs.push_back(n.inputs[6]);  // key_bias
  const ValueId dqkv = rw.emit(Op::kAttentionQkvGrad, inputs, attrs);
  const ValueId dflat = rw.emit(Op::kReshape, {dqkv}, {{"shape", flat}});
  const int64_t c = flat.back() / 3;
  const std::vector<ValueId> parts =
      rw.emit_node(Op::kSplit, {dflat},
                   {{"axis", static_cast<int64_t>(flat.size()) - 1}, {"sizes", Ints{c, c, c}}});
  Replacement grads;
  for (ValueId p : parts) grads.push_back(rw.emit(Op::kReshape, {p}, {{"shape", q}}));
  return grads;
}

// THE table. Every rule is exact (see algebraic.h); its condition says why.
const std::array kRules = {
    // x * 1 -> x, either side; broadcast_to(x) when the 1 widens x. Exact for every dtype.
    RewriteRule{"mul-by-one", mul_by_one},
    // x + 0 -> x: integers; floats only for a -0.0 splat (-0.0 + +0.0 is +0.0, so adding +0.0
    // is not the identity on -0.0 and is intentionally left alone).
    RewriteRule{"add-zero", add_zero},
    // x - 0 -> x: integers; floats only for +0.0 (x - +0.0 = x + -0.0, the exact identity).
    RewriteRule{"sub-zero", sub_zero},
    // x / 1 -> x: floats and integers (truncating division by 1 is exact).
    RewriteRule{"div-by-one", div_by_one},
    // x * 0 -> zeros: integers only. Intentionally absent for floats: inf * 0 and NaN * 0 are
    // NaN, and -x * 0 is -0.0.
    RewriteRule{"mul-by-zero", mul_by_zero},
    // neg(neg(x)) -> x: exact (integers wrap both ways).
    RewriteRule{"neg-neg", neg_neg},
    // stop_gradient(x) -> x: its only effect, on autodiff, is over (this pass runs after it).
    RewriteRule{"stop-gradient", stop_gradient},
    // transpose with the identity permutation -> x.
    RewriteRule{"transpose-identity", transpose_identity},
    // transpose(transpose(x)) -> one transpose with the composed permutation (x if identity).
    RewriteRule{"transpose-transpose", transpose_transpose},
    // reshape to the input's own shape -> x.
    RewriteRule{"reshape-same-shape", reshape_same_shape},
    // reshape(reshape(x)) -> one reshape (x when the shapes agree): row-major order is kept.
    RewriteRule{"reshape-reshape", reshape_reshape},
    // broadcast_to the input's own shape -> x.
    RewriteRule{"broadcast-same-shape", broadcast_same_shape},
    // cast to the input's own dtype -> x.
    RewriteRule{"cast-same-dtype", cast_same_dtype},
    // cast(cast(x, B), C) where A -> B keeps every value exactly (f32 -> f64, bf16 -> f32,
    // i32 -> i64, ...): x when C == A; else cast(x, C) when A and B convert alike (both float or
    // both integer). Not for rounding casts: f32 -> bf16 -> f32 changes x.
    RewriteRule{"cast-cast-exact", cast_cast_exact},
    // sum(one_hot(i, V), class axis) -> ones, only when i is provably in [0, V) (from iota,
    // argmax, constants, a where/clamp of those): one_hot gives an all-zero row for an
    // out-of-range index (e.g. ignore_index), whose sum is 0.
    RewriteRule{"sum-one-hot-classes", sum_one_hot_classes},
    // cast(transpose(x)) -> transpose(cast(x)): exact (elementwise; a permutation of elements).
    RewriteRule{"cast-transpose", cast_transpose},
    // attention (and its gradient) on heads-first transposes of (..., T, H, D) tensors -> the
    // same attention with layout "bthd" on the tensors themselves: a permutation of which
    // element meets which, so exact; the transposes around then cancel.
    RewriteRule{"attention-heads-inside", attention_heads_inside},
    // attention (and its gradient) on the three equal parts of a split projection, reshaped to
    // (..., T, H, D) -> attention_qkv on the projection itself (its gradient: dqkv, split back
    // into dq, dk, dv): the same arithmetic on the same elements, so exact.
    RewriteRule{"attention-packed-qkv", attention_packed_qkv},
    // concat(split(x)) -> x: all of a split's outputs in order, along its axis.
    RewriteRule{"concat-split", concat_split},
};

}  // namespace

std::span<const RewriteRule> algebraic_rules() { return kRules; }

bool AlgebraicSimplifier::run(Graph& graph) {
  fired_ = apply_rules(graph, kRules);
  return !fired_.empty();
}

}  // namespace kiln
