// Neural-network ops. Float dtypes only (f32, f64, f16, bf16); inputs share one dtype unless
// stated.
//   matmul(a, b) {transpose_a, transpose_b}: (..., M, K) @ (..., K, N) -> (batch..., M, N); the
//     batch dims broadcast numpy-style, so (B, T, C) @ (C, D) works.
//   softmax, log_softmax {axis = -1}: numerically stable (the max is subtracted first).
//   layer_norm(x, gamma, beta) {epsilon = 1e-5}: over the last axis, biased variance.
//   rms_norm(x, gamma) {epsilon = 1e-6}: x / sqrt(mean(x^2) + epsilon) * gamma, last axis.
//   cross_entropy(logits (..., V), labels (...) i32/i64) {ignore_index = -100, reduction =
//     "mean" | "sum" | "none"}: logsumexp(logits) - logits[label] per row; ignored rows add 0 and
//     are not counted; "mean" over zero counted rows is 0.
//   attention(q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv) [, key_bias (..., Tk)])
//     {causal = false, scale (optional, absent = 1/sqrt(D))} -> (out, lse): out = softmax(s) v
//     with the scores s_ij = scale * q_i . k_j + key_bias_j for unmasked keys (causal masks key
//     j > query i, top-left aligned like PyTorch's is_causal); lse (..., Tq) =
//     log(sum_j exp(s_ij)) over the unmasked keys, natural log, the scale included (so
//     P_ij = exp(s_ij - lse_i)); -inf for a row with no keys (Tk = 0: its out is 0, or every
//     score -inf: its out is NaN, as softmax's over them is). lse is f32 for f32/f16/bf16 inputs (the statistic stays f32 under mixed
//     precision) and f64 for f64. It is the saved statistic the backward needs (FlashAttention,
//     cuDNN and PyTorch's SDPA return it too); it is differentiable like out.
//     key_bias (optional, q's dtype): one row of Tk per batch entry, added to the scores of
//     every head and query: a BERT-style padding mask (-10000 or -inf for padded keys, 0 for the
//     others) or any additive per-key bias. Its shape is q's leading dims without the heads
//     axis, then Tk: (B, Tk) for q (B, H, Tq, D) ("bhtd") and for q (B, Tq, H, D) ("bthd").
//     {layout = "bhtd" | "bthd"}: "bhtd" (the default) is the above, heads among the leading
//     dims; "bthd" takes q (..., Tq, H, D), k (..., Tk, H, D), v (..., Tk, H, Dv), the layout a
//     (B, T, C) projection has when reshaped to (B, T, H, D), and gives out (..., Tq, H, Dv) and
//     lse (..., Tq, H): the same attention per (leading index, head) with no transposes around
//     it (the simplifier folds them: passes/simplify/algebraic.cc).
//     Grouped-query attention: k and v may have Hkv heads where q has H, Hkv dividing H (the
//     heads axis: -2 for "bthd", -3 for "bhtd"); query head h reads key/value head
//     h / (H / Hkv), and attention_grad's dk, dv sum over the query heads of their group.
//   attention_qkv(qkv (..., T, 3, H, D) [, key_bias (..., T)]) {causal, scale} -> (out (..., T, H,
//     D), lse (..., T, H)): self-attention over a packed projection: attention{layout
//     "bthd"}(qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :] [, key_bias]). A (B, T, 3C) projection reshaped to (B, T, 3, H, D)
//     is read in place (kernels take q, k, v by strides) and its gradient written in place: no
//     split before attention, no concat after its gradient. The simplifier forms it from
//     attention over the split of a projection (passes/simplify/algebraic.cc).
//   rotary_embedding(x) {base = 10000, inverse = false, layout = "bhtd" | "bthd"}: rotary
//     position embeddings, "rotate half" (GPT-NeoX, LLaMA): x (..., T, D) ("bhtd") or
//     (..., T, H, D) ("bthd", like attention's layouts), D even, positions 0 .. T-1 along T. For
//     position t and i < D/2, with angle a = t * base^(-2i/D): y_i = x_i cos a - x_{i+D/2} sin a,
//     y_{i+D/2} = x_{i+D/2} cos a + x_i sin a. inverse rotates by -a: the inverse and the
//     transpose of the rotation, so it is the gradient (rotary_embedding{inverse = !inverse}).
//     A (B, T, H, D) projection is rotated in place of its layout: no transposes around it.
// Backward ops: first-class ops (not compositions) because kernel libraries serve them as such
// (cuDNN, FlashAttention, Liger, llm.c). None is differentiable itself (no second derivatives).
//   softmax_grad(y, dy) {axis = -1}: y * (dy - sum(dy * y, axis)), y = softmax(x).
//   log_softmax_grad(y, dy) {axis = -1}: dy - exp(y) * sum(dy, axis), y = log_softmax(x).
//   layer_norm_grad(x, gamma, dy) {epsilon = 1e-5} -> (dx, dgamma, dbeta); dgamma and dbeta
//     are summed over every leading dim: shape (C,).
//   rms_norm_grad(x, gamma, dy) {epsilon = 1e-6} -> (dx, dgamma).
//   cross_entropy_grad(logits, labels, dloss) {ignore_index, reduction} -> dlogits:
//     (softmax(logits) - one_hot(label)) times dloss / counted rows ("mean"), dloss ("sum") or
//     dloss[row] ("none": dloss has labels' shape); ignored rows get 0.
//   attention_grad(q, k, v, out, dout, lse [, key_bias]) {causal, scale, layout} -> (dq, dk, dv),
//     with out and lse attention's outputs for q, k, v (, key_bias) and these attributes.
//     (key_bias's own gradient, sum_i dS_ij over the heads and queries, is the last column of dk
//     of attention_grad over q and k with a column of ones and zeros appended: the gradient rule
//     emits it, and dead-code removes it where the bias needs none.) Defined by the FlashAttention-2
//     formulas on the GIVEN out and lse, which every kernel follows: P_ij = exp(s_ij - lse_i)
//     (0 for masked keys), D_i = dout_i . out_i, dP_ij = dout_i . v_j,
//     dS_ij = P_ij (dP_ij - D_i), dv_j = sum_i P_ij dout_i, dq_i = scale sum_j dS_ij k_j,
//     dk_j = scale sum_i dS_ij q_i. (attention's gradient rule relies on D coming from the
//     given out when the loss also depends on lse.)
//   attention_qkv_grad(qkv, out, dout, lse [, key_bias]) {causal, scale} -> dqkv (..., T, 3, H, D):
//     dq, dk, dv of attention_grad{layout "bthd"} on qkv's three parts, packed like qkv.
// Gradient rules (OpDef::gradient) of the forward ops emit these ops (matmul's emits matmuls).
// Reference kernels are plain loops in double through Tensor::get/set: the test oracle.
#include <algorithm>
#include <cmath>
#include <limits>

#include "ir/builder.h"
#include "ops/common.h"
#include "ops/fp8.h"
#include "ops/gradient.h"

namespace kiln::ops {
namespace {

constexpr double kNegativeInfinity = -std::numeric_limits<double>::infinity();

void check_float(const TensorType& t, const char* what) {
  KILN_CHECK(is_float(t.dtype), "{} is {}, expected a float dtype (f32, f64, f16, bf16)", what,
             dtype_name(t.dtype));
}

void check_same_dtype(const TensorType& t, const char* what, const TensorType& first,
                      const char* first_name) {
  KILN_CHECK(t.dtype == first.dtype, "{} is {}, expected {} like {}", what, dtype_name(t.dtype),
             dtype_name(first.dtype), first_name);
}

// Rows of a tensor reduced over the last axis: (rows, C).
struct Rows {
  int64_t rows;
  int64_t cols;
};
Rows rows_of(const Shape& shape) {
  int64_t cols = shape.back();
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
  return {rows, cols};
}

// ---- matmul ----

struct MatmulDims {
  Shape batch;          // broadcast batch shape
  Shape a_batch, b_batch;
  int64_t m, k, n;
};

MatmulDims matmul_dims(const TensorType& a, const TensorType& b, const Attributes& attrs) {
  check_float(a, "a");
  check_same_dtype(b, "b", a, "a");
  for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}}) {
    KILN_CHECK(t->rank() >= 2,
               "{} has shape {} (rank {}), expected rank >= 2; reshape a vector to (1, K) or "
               "(K, 1) first",
               name, to_string(t->shape), t->rank());
  }
  const bool ta = attrs.b("transpose_a"), tb = attrs.b("transpose_b");
  const int ra = a.rank(), rb = b.rank();
  MatmulDims d;
  d.m = ta ? a.shape[ra - 1] : a.shape[ra - 2];
  const int64_t ka = ta ? a.shape[ra - 2] : a.shape[ra - 1];
  const int64_t kb = tb ? b.shape[rb - 1] : b.shape[rb - 2];
  d.n = tb ? b.shape[rb - 2] : b.shape[rb - 1];
  if (ka != kb) {
    std::string flags;
    if (ta) flags += " transpose_a";
    if (tb) flags += " transpose_b";
    fail("inner dims differ: a is {}, b is {}{}", to_string(a.shape), to_string(b.shape),
         flags.empty() ? "" : " (with" + flags + ")");
  }
  d.k = ka;
  d.a_batch.assign(a.shape.begin(), a.shape.end() - 2);
  d.b_batch.assign(b.shape.begin(), b.shape.end() - 2);
  try {
    d.batch = broadcast_shapes(d.a_batch, d.b_batch);
  } catch (const Error&) {
    fail("batch dims do not broadcast: a is {}, b is {} (batch {} vs {})", to_string(a.shape),
         to_string(b.shape), to_string(d.a_batch), to_string(d.b_batch));
  }
  return d;
}

// ---- softmax / log_softmax ----

std::vector<TensorType> infer_softmax(std::span<const TensorType> in, const Attributes& attrs) {
  check_float(in[0], "input");
  KILN_CHECK(in[0].rank() >= 1, "input has shape (), expected rank >= 1");
  normalize_axis(attrs.i("axis"), in[0].rank());
  return {in[0]};
}

// Softmax (or log-softmax) along `axis`, one (outer, inner) line at a time.
void softmax_kernel(const KernelArgs& args, bool log) {
  const Tensor& x = args.inputs[0];
  Tensor& y = args.outputs[0];
  const int axis = normalize_axis(args.attrs.i("axis"), x.rank());
  int64_t outer = 1, inner = 1;
  const int64_t dim = x.shape()[axis];
  for (int d = 0; d < axis; ++d) outer *= x.shape()[d];
  for (int d = axis + 1; d < x.rank(); ++d) inner *= x.shape()[d];
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      auto at = [&](int64_t j) { return (o * dim + j) * inner + i; };
      double max = kNegativeInfinity;
      for (int64_t j = 0; j < dim; ++j) max = std::max(max, x.get(at(j)));
      double sum = 0.0;
      for (int64_t j = 0; j < dim; ++j) sum += std::exp(x.get(at(j)) - max);
      for (int64_t j = 0; j < dim; ++j) {
        double shifted = x.get(at(j)) - max;
        y.set(at(j), log ? shifted - std::log(sum) : std::exp(shifted) / sum);
      }
    }
  }
}

// ---- norms ----

void check_norm_param(const TensorType& p, const char* name, const TensorType& x) {
  check_same_dtype(p, name, x, "x");
  const Shape expected{x.shape.back()};
  KILN_CHECK(p.shape == expected, "{} has shape {}, expected {} (the last dim of x {})", name,
             to_string(p.shape), to_string(expected), to_string(x.shape));
}

void check_norm_input(const TensorType& x) {
  check_float(x, "x");
  KILN_CHECK(x.rank() >= 1, "x has shape (), expected rank >= 1 (normalized over the last axis)");
}

// ---- cross_entropy ----

enum class Reduction { kMean, kSum, kNone };

Reduction reduction_of(const Attributes& attrs) {
  const std::string& r = attrs.s("reduction");
  if (r == "mean") return Reduction::kMean;
  if (r == "sum") return Reduction::kSum;
  if (r == "none") return Reduction::kNone;
  fail("reduction is \"{}\", expected one of \"mean\", \"sum\", \"none\"", r);
}

// ---- attention ----

struct AttentionDims {
  int64_t batch;  // attention problems: the product of the leading dims (and heads, "bthd")
  int64_t tq, tk, d, dv;
  int64_t heads = 1;  // "bthd": H, the axis between T and D; "bhtd": 1
  // Query heads per key/value head (grouped-query attention; 1: one k, v head per query head).
  // Problem b reads key/value problem b / group: the kv problems are numbered like the query
  // problems with H / group heads ("bthd") or a leading heads dim H / group ("bhtd").
  int64_t group = 1;
  // Consecutive problems (the heads of one batch entry) that share a row of key_bias.
  int64_t bias_heads = 1;
  // Flat index of key 0 of the key_bias row of problem b.
  int64_t bias_row(int64_t b) const { return b / bias_heads * tk; }
  // Flat index of element 0 of row t (of a tensor with `cols` a row and `rows` rows a problem)
  // of problem b: rows of a problem are contiguous in "bhtd" and H rows apart in "bthd".
  int64_t row(int64_t b, int64_t t, int64_t rows, int64_t cols) const {
    return row_of(b, t, rows, cols, heads);
  }
  // The same for k and v (and dk, dv): row t of the key/value problem that problem b reads.
  int64_t kv_row(int64_t b, int64_t t, int64_t cols) const {
    return row_of(b / group, t, tk, cols, heads > 1 ? heads / group : 1);
  }
  // Flat index of lse's entry of row t of problem b: (..., Tq) or (..., Tq, H).
  int64_t stat(int64_t b, int64_t t) const { return row(b, t, tq, 1); }

 private:
  static int64_t row_of(int64_t b, int64_t t, int64_t rows, int64_t cols, int64_t h) {
    return ((b / h * rows + t) * h + b % h) * cols;
  }
};

bool heads_inside(const Attributes& attrs) {
  const std::string& layout = attrs.s("layout");
  if (layout == "bhtd") return false;
  if (layout == "bthd") return true;
  fail("layout is \"{}\", expected \"bhtd\" ((..., T, D), heads among the leading dims) or "
       "\"bthd\" ((..., T, H, D))", layout);
}

// The heads axis of a q, k or v of rank r: "bthd" r - 2; "bhtd" the last leading dim (r - 3),
// or -1 without leading dims.
int heads_axis(int r, bool bthd) { return bthd ? r - 2 : r - 3; }

AttentionDims attention_dims(const Shape& q, const Shape& k, const Shape& v,
                             const Attributes& attrs) {
  const size_t r = q.size();
  const int h_axis = heads_axis(static_cast<int>(r), heads_inside(attrs));
  const int64_t group = h_axis >= 0 && k[h_axis] > 0 ? q[h_axis] / k[h_axis] : 1;
  if (heads_inside(attrs)) {
    AttentionDims dims{q[r - 2], q[r - 3], k[r - 3], q[r - 1], v[r - 1], q[r - 2], group, q[r - 2]};
    for (size_t i = 0; i + 3 < r; ++i) dims.batch *= q[i];
    return dims;
  }
  AttentionDims dims{1, q[r - 2], k[r - 2], q[r - 1], v[r - 1], 1, group, r >= 3 ? q[r - 3] : 1};
  for (size_t i = 0; i + 2 < r; ++i) dims.batch *= q[i];
  return dims;
}

// key_bias's shape for q and Tk: q's leading dims without the heads axis, then Tk.
Shape key_bias_shape(const Shape& q, int64_t tk, bool bthd) {
  const size_t r = q.size(), lead = r >= 3 ? r - 3 : 0;  // "bthd": rank >= 3 (checked)
  Shape shape(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(bthd ? r - 3 : lead));
  shape.push_back(tk);
  return shape;
}

// attention's and attention_grad's key_bias (input `index` when present), checked against q.
void check_key_bias(std::span<const TensorType> in, size_t index, const Attributes& attrs) {
  if (in.size() <= index) return;
  const TensorType &q = in[0], &k = in[1], &bias = in[index];
  const bool bthd = heads_inside(attrs);
  check_same_dtype(bias, "key_bias", q, "q");
  const Shape want = key_bias_shape(q.shape, k.shape[k.rank() - (bthd ? 3 : 2)], bthd);
  KILN_CHECK(bias.shape == want,
             "key_bias has shape {}, expected {} for q {} and k {} (q's leading dims without the heads, "
             "then Tk: one row per batch entry, added to every head's and query's scores)",
             to_string(bias.shape), to_string(want), to_string(q.shape), to_string(k.shape));
}

// Attention's inputs checked; returns the output type (q's shape with Dv as the last dim).
TensorType infer_attention(const TensorType& q, const TensorType& k, const TensorType& v,
                           const Attributes& attrs) {
  check_float(q, "q");
  check_same_dtype(k, "k", q, "q");
  check_same_dtype(v, "v", q, "q");
  const bool bthd = heads_inside(attrs);
  const int lead_end = bthd ? 3 : 2;  // q (lead..., Tq, [H,] D)
  KILN_CHECK(q.rank() >= lead_end,
             "q has shape {}, expected rank >= {} ({})", to_string(q.shape), lead_end,
             bthd ? "..., Tq, H, D" : "..., Tq, D");
  KILN_CHECK(k.rank() == q.rank() && v.rank() == q.rank(),
             "q, k, v have shapes {}, {}, {}, expected one rank", to_string(q.shape),
             to_string(k.shape), to_string(v.shape));
  const int r = q.rank();
  // Grouped-query attention: k and v may have fewer heads than q (a divisor of q's), each
  // shared by q's heads h with h / (Hq / Hkv) its index; the heads axis is r - 2 ("bthd") or
  // the last leading dim ("bhtd"). Every other leading dim must be equal.
  const int h_axis = heads_axis(r, bthd);
  auto without_heads = [&](const Shape& s) {
    Shape lead(s.begin(), s.end() - lead_end);
    if (!bthd && !lead.empty()) lead.pop_back();  // "bhtd": the heads are the last leading dim
    return lead;
  };
  KILN_CHECK(without_heads(k.shape) == without_heads(q.shape) &&
                 without_heads(v.shape) == without_heads(q.shape),
             "leading dims differ: q is {}, k is {}, v is {} (they must be equal, no "
             "broadcasting; only k and v may have fewer heads)",
             to_string(q.shape), to_string(k.shape), to_string(v.shape));
  if (h_axis >= 0) {
    const int64_t hq = q.shape[h_axis], hk = k.shape[h_axis];
    KILN_CHECK(v.shape[h_axis] == hk && hk >= 1 && hq % hk == 0,
               "head counts differ: q is {}, k is {}, v is {} (expected k and v with the same "
               "number of heads, one that divides q's: grouped-query attention; layout {})",
               to_string(q.shape), to_string(k.shape), to_string(v.shape),
               bthd ? "bthd: (..., T, H, D)" : "bhtd: (..., H, T, D)");
  }
  KILN_CHECK(k.shape[r - 1] == q.shape[r - 1],
             "head dims differ: q is {}, k is {} (expected the same D)", to_string(q.shape),
             to_string(k.shape));
  KILN_CHECK(v.shape[r - lead_end] == k.shape[r - lead_end],
             "key lengths differ: k is {}, v is {} (expected the same Tk)", to_string(k.shape),
             to_string(v.shape));
  Shape out = q.shape;
  out[r - 1] = v.shape[r - 1];
  return {q.dtype, out};
}

// The type of attention's lse for query q (inputs already checked): q's shape without D; f64
// for f64 inputs, f32 otherwise.
TensorType attention_lse_type(const TensorType& q) {
  return {q.dtype == DType::kF64 ? DType::kF64 : DType::kF32,
          Shape(q.shape.begin(), q.shape.end() - 1)};
}

// Scores of query i of batch b: scores[j] = scale * q_i . k_j (+ key_bias_j where `bias` is
// given), -inf for masked keys (causal, j > i; key 0 is never masked).
void attention_scores(const Tensor& q, const Tensor& k, const Tensor* bias, const AttentionDims& d,
                      int64_t b, int64_t i, bool causal, double scale, std::vector<double>& scores) {
  const int64_t qi = d.row(b, i, d.tq, d.d);
  for (int64_t j = 0; j < d.tk; ++j) {
    double s = kNegativeInfinity;
    if (!causal || j <= i) {
      s = 0.0;
      const int64_t kj = d.kv_row(b, j, d.d);
      for (int64_t c = 0; c < d.d; ++c) s += q.get(qi + c) * k.get(kj + c);
      s *= scale;
      if (bias != nullptr) s += bias->get(d.bias_row(b) + j);
    }
    scores[j] = s;
  }
}

// Softmax weights of query i of batch b over the keys: weights[j] = P[i, j]. Masked keys (a
// score of -inf) get exactly 0; when every score is -inf the weights are 0/0 (NaN), as
// softmax's. Returns the row's log-sum-exp of the scores (-inf when there are no keys, or none
// left).
double attention_weights(const Tensor& q, const Tensor& k, const Tensor* bias, const AttentionDims& d,
                         int64_t b, int64_t i, bool causal, double scale, std::vector<double>& weights) {
  attention_scores(q, k, bias, d, b, i, causal, scale, weights);
  double max = kNegativeInfinity;
  for (int64_t j = 0; j < d.tk; ++j) max = std::max(max, weights[j]);
  double sum = 0.0;
  for (int64_t j = 0; j < d.tk; ++j) {
    weights[j] = weights[j] == kNegativeInfinity ? 0.0 : std::exp(weights[j] - max);
    sum += weights[j];
  }
  for (int64_t j = 0; j < d.tk; ++j) weights[j] /= sum;
  return d.tk == 0 ? kNegativeInfinity : max + std::log(sum);
}

double attention_scale(const Attributes& attrs, int64_t head_dim) {
  if (attrs.has("scale")) return attrs.f("scale");
  return head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
}

// attention_qkv's input checked: (..., T, 3, H, D), a float dtype.
void check_packed_qkv(const TensorType& qkv) {
  check_float(qkv, "qkv");
  KILN_CHECK(qkv.rank() >= 4 && qkv.shape[qkv.rank() - 3] == 3,
             "qkv has shape {}, expected (..., T, 3, H, D): q, k, v packed along axis -3",
             to_string(qkv.shape));
}

// The "bthd" attributes that attention_qkv's (causal, scale) mean for the unpacked op.
Attributes unpacked_attrs(const Attributes& attrs) {
  Attributes out = attrs;
  out.set("layout", std::string("bthd"));
  return out;
}

// Part `which` (0 q, 1 k, 2 v) of a packed (..., T, 3, H, D) type: (..., T, H, D).
TensorType unpacked_type(const TensorType& qkv) {
  Shape shape = qkv.shape;
  shape.erase(shape.end() - 3);
  return {qkv.dtype, shape};
}

// attention_qkv's and attention_qkv_grad's key_bias (input `index` when present): as the
// unpacked "bthd" attention's, (..., T).
void check_packed_key_bias(std::span<const TensorType> in, size_t index, const Attributes& attrs) {
  if (in.size() <= index) return;
  const TensorType part = unpacked_type(in[0]);
  const std::vector<TensorType> unpacked{part, part, part, in[index]};
  check_key_bias(unpacked, 3, unpacked_attrs(attrs));
}

// Copies part `which` of `qkv` out (unpack) or into it (pack). A row of the packed tensor is
// 3 * H * D elements: q's H * D, then k's, then v's.
void unpack_qkv(const Tensor& qkv, int which, Tensor& part) {
  const int64_t hd = part.shape().back() * part.shape()[part.shape().size() - 2];
  for (int64_t i = 0; i < part.numel(); ++i)
    part.set(i, qkv.get((i / hd * 3 + which) * hd + i % hd));
}
void pack_qkv(const Tensor& part, int which, Tensor& qkv) {
  const int64_t hd = part.shape().back() * part.shape()[part.shape().size() - 2];
  for (int64_t i = 0; i < part.numel(); ++i)
    qkv.set((i / hd * 3 + which) * hd + i % hd, part.get(i));
}

// Cross-entropy's logits and labels checked; returns the shape of the per-row losses (labels').
Shape check_cross_entropy_inputs(const TensorType& logits, const TensorType& labels) {
  check_float(logits, "logits");
  KILN_CHECK(logits.rank() >= 1 && logits.shape.back() >= 1,
             "logits have shape {}, expected (..., V) with V >= 1", to_string(logits.shape));
  KILN_CHECK(labels.dtype == DType::kI32 || labels.dtype == DType::kI64,
             "labels are {}, expected i32 or i64", dtype_name(labels.dtype));
  const Shape expected(logits.shape.begin(), logits.shape.end() - 1);
  KILN_CHECK(labels.shape == expected,
             "labels have shape {}, expected {} (logits {} without the last dim)",
             to_string(labels.shape), to_string(expected), to_string(logits.shape));
  return expected;
}

// Label of row r, checked against the vocabulary unless it is ignore_index (kernel-time error).
int64_t checked_label(const char* op, const Tensor& labels, int64_t r, int64_t vocab,
                      int64_t ignore_index) {
  const int64_t label = labels.get_int(r);
  if (label != ignore_index && (label < 0 || label >= vocab))
    fail("{}: label {} (row {}) is out of range [0, {}) and is not ignore_index {}", op, label, r,
         vocab, ignore_index);
  return label;
}

// ---- backward ops ----

// A gradient input `dy` must match the forward tensor it is the gradient of.
void check_grad_input(const TensorType& dy, const char* name, const TensorType& like,
                      const char* like_name) {
  check_same_dtype(dy, name, like, like_name);
  KILN_CHECK(dy.shape == like.shape, "{} has shape {}, expected {} like {}", name,
             to_string(dy.shape), to_string(like.shape), like_name);
}

std::vector<TensorType> infer_softmax_grad(std::span<const TensorType> in,
                                           const Attributes& attrs) {
  const TensorType &y = in[0], &dy = in[1];
  check_float(y, "y");
  KILN_CHECK(y.rank() >= 1, "y has shape (), expected rank >= 1");
  check_grad_input(dy, "dy", y, "y");
  normalize_axis(attrs.i("axis"), y.rank());
  return {y};
}

// Calls fn(at, dim) once per line along `axis` of `shape`; at(j) is the flat index of element j.
template <typename Fn>
void for_each_line(const Shape& shape, int axis, Fn&& fn) {
  int64_t outer = 1, inner = 1;
  const int64_t dim = shape[axis];
  for (int d = 0; d < axis; ++d) outer *= shape[d];
  for (size_t d = axis + 1; d < shape.size(); ++d) inner *= shape[d];
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i)
      fn([&](int64_t j) { return (o * dim + j) * inner + i; }, dim);
}

// dx = y * (dy - sum(dy * y)) (softmax) or dy - exp(y) * sum(dy) (log_softmax), per line.
void softmax_grad_kernel(const KernelArgs& args, bool log) {
  const Tensor &y = args.inputs[0], &dy = args.inputs[1];
  Tensor& dx = args.outputs[0];
  const int axis = normalize_axis(args.attrs.i("axis"), y.rank());
  for_each_line(y.shape(), axis, [&](auto at, int64_t dim) {
    double total = 0.0;
    for (int64_t j = 0; j < dim; ++j) total += log ? dy.get(at(j)) : dy.get(at(j)) * y.get(at(j));
    for (int64_t j = 0; j < dim; ++j) {
      const double yj = y.get(at(j)), dyj = dy.get(at(j));
      dx.set(at(j), log ? dyj - std::exp(yj) * total : yj * (dyj - total));
    }
  });
}

// x (..., C), gamma (C,), dy like x: the inputs of layer_norm_grad and rms_norm_grad.
void check_norm_grad_inputs(std::span<const TensorType> in) {
  check_norm_input(in[0]);
  check_norm_param(in[1], "gamma", in[0]);
  check_grad_input(in[2], "dy", in[0], "x");
}

// ---- gradient rules ----

// fp8_a and fp8_b: both or neither, each a format ops/fp8.h knows, not both e5m2; fp8_grad only
// on an fp8 matmul, and never e5m2 against an e5m2 operand (its gradient products).
void check_matmul_fp8(const Attributes& attrs) {
  const MatmulFp8 f = matmul_fp8(attrs);
  KILN_CHECK(f.on() || !attrs.has("fp8_grad"), "fp8_grad is '{}' on a matmul without fp8_a and fp8_b",
             attrs.s("fp8_grad"));
  KILN_CHECK(f.on() || !f.fast_accum, "fp8_fast_accum on a matmul without fp8_a and fp8_b");
  KILN_CHECK(!(f.grad == Fp8Format::kE5M2 && (f.a == Fp8Format::kE5M2 || f.b == Fp8Format::kE5M2)),
             "fp8_grad e5m2 with an e5m2 operand: its gradient products would multiply two e5m2 operands");
  KILN_CHECK((f.a == Fp8Format::kNone) == (f.b == Fp8Format::kNone),
             "fp8_a is '{}' and fp8_b is '{}': an fp8 matmul sets both (e4m3 or e5m2) or neither",
             fp8_name(f.a), fp8_name(f.b));
  KILN_CHECK(!(f.a == Fp8Format::kE5M2 && f.b == Fp8Format::kE5M2),
             "fp8_a and fp8_b are both e5m2: one operand must be e4m3 (FP8 tensor cores multiply "
             "no two e5m2 operands)");
}

// The values a matmul reads from `t`: its own, or (format set) its fp8 quantization, whose
// inverse scale is multiplied into `scale` (ops/fp8.h states the arithmetic).
std::vector<double> matmul_operand(const Tensor& t, Fp8Format format, double& scale) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = t.get(static_cast<int64_t>(i));
  if (format != Fp8Format::kNone) scale *= static_cast<double>(fp8_quantize(v.data(), v.size(), format));
  return v;
}

std::vector<Expr> matmul_gradient(const GradContext& c) {
  const Expr &a = c.x(0), &b = c.x(1), &dc = c.dy();
  const bool ta = c.attrs().b("transpose_a"), tb = c.attrs().b("transpose_b");
  // C = op(A) op(B). dop(A) = dC op(B)^T and dop(B) = op(A)^T dC; a transposed operand's stored
  // gradient is the transpose of that, which the flags express without transpose nodes.
  // An fp8 product's gradient products are fp8 too: the incoming gradient in fp8_grad's format,
  // the other operand in its forward format, summed exactly (no fp8_fast_accum: ops/fp8.h).
  const MatmulFp8 fp8 = matmul_fp8(c.attrs());
  const Fp8Format fa = fp8.a, fb = fp8.b, fdc = fp8.grad;
  auto product = [&](Expr x, Expr y, bool tx, bool ty, Fp8Format fx, Fp8Format fy) {
    Attributes attrs{{"transpose_a", tx}, {"transpose_b", ty}};
    if (fp8.on()) {
      attrs.set("fp8_a", std::string(fp8_name(fx)));
      attrs.set("fp8_b", std::string(fp8_name(fy)));
    }
    return c.builder.apply1(Op::kMatmul, {x, y}, attrs);
  };
  Expr da = !ta ? product(dc, b, false, !tb, fdc, fb) : product(b, dc, tb, true, fb, fdc);
  Expr db;
  if (b.rank() == 2 && a.rank() > 2 && !ta) {
    // A weight shared over the batch (x (B, T, C) @ w (C, D)): one (B*T)-row matmul instead of
    // B matmuls whose (B, C, D) result is then summed.
    const int64_t k = a.dim(-1), n = dc.dim(-1);
    Expr a_rows = reshape(a, {-1, k}), dc_rows = reshape(dc, {-1, n});
    db = !tb ? product(a_rows, dc_rows, true, false, fa, fdc)
             : product(dc_rows, a_rows, true, false, fdc, fa);
  } else {
    db = !tb ? product(a, dc, !ta, false, fa, fdc) : product(dc, a, true, ta, fdc, fa);
  }
  // Batch dims that broadcast in the forward pass are summed back.
  return {reduce_to_shape(da, a.shape()), reduce_to_shape(db, b.shape())};
}

std::vector<Expr> softmax_gradient(const GradContext& c) {
  return {c.builder.apply1(Op::kSoftmaxGrad, {c.y(), c.dy()}, {{"axis", c.attrs().i("axis")}})};
}

std::vector<Expr> log_softmax_gradient(const GradContext& c) {
  return {
      c.builder.apply1(Op::kLogSoftmaxGrad, {c.y(), c.dy()}, {{"axis", c.attrs().i("axis")}})};
}

std::vector<Expr> layer_norm_gradient(const GradContext& c) {
  // (dx, dgamma, dbeta): one per input, in order.
  return c.builder.apply(Op::kLayerNormGrad, {c.x(0), c.x(1), c.dy()},
                         {{"epsilon", c.attrs().f("epsilon")}});
}

std::vector<Expr> rms_norm_gradient(const GradContext& c) {
  return c.builder.apply(Op::kRmsNormGrad, {c.x(0), c.x(1), c.dy()},
                         {{"epsilon", c.attrs().f("epsilon")}});
}

std::vector<Expr> cross_entropy_gradient(const GradContext& c) {
  Expr dlogits = c.builder.apply1(Op::kCrossEntropyGrad, {c.x(0), c.x(1), c.dy()}, c.attrs());
  return {dlogits, Expr()};  // labels are integers: no gradient
}

// Whether `e` is a zero fill (what autodiff passes for an output that got no gradient).
bool is_zero_fill(const Expr& e) {
  const Graph& g = e.builder().graph();
  for (size_t n = g.nodes.size(); n-- > 0;) {
    const Node& node = g.nodes[n];
    if (std::find(node.outputs.begin(), node.outputs.end(), e.id()) != node.outputs.end())
      return node.op == Op::kFull && node.attrs.f("value") == 0.0;
  }
  return false;  // a graph input
}

// The reference kernels of attention and attention_grad (attention_qkv's run them on copies).
void attention_reference(const KernelArgs& args) {
  const Tensor &q = args.inputs[0], &k = args.inputs[1], &v = args.inputs[2];
  Tensor &out = args.outputs[0], &lse = args.outputs[1];
  const AttentionDims d = attention_dims(q.shape(), k.shape(), v.shape(), args.attrs);
  const bool causal = args.attrs.b("causal");
  const double scale = attention_scale(args.attrs, d.d);
  const Tensor* bias = args.inputs.size() > 3 ? &args.inputs[3] : nullptr;
  std::vector<double> weights(static_cast<size_t>(d.tk));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t i = 0; i < d.tq; ++i) {
      lse.set(d.stat(b, i), attention_weights(q, k, bias, d, b, i, causal, scale, weights));
      // Weighted sum of the values.
      const int64_t oi = d.row(b, i, d.tq, d.dv);
      for (int64_t c = 0; c < d.dv; ++c) {
        double acc = 0.0;
        for (int64_t j = 0; j < d.tk; ++j)
          acc += weights[j] * v.get(d.kv_row(b, j, d.dv) + c);
        out.set(oi + c, acc);
      }
    }
  }
}

void attention_grad_reference(const KernelArgs& args) {
  const Tensor &q = args.inputs[0], &k = args.inputs[1], &v = args.inputs[2],
               &out = args.inputs[3], &dout = args.inputs[4], &lse = args.inputs[5];
  Tensor &dq = args.outputs[0], &dk = args.outputs[1], &dv = args.outputs[2];
  const AttentionDims d = attention_dims(q.shape(), k.shape(), v.shape(), args.attrs);
  const bool causal = args.attrs.b("causal");
  const double scale = attention_scale(args.attrs, d.d);
  const Tensor* bias = args.inputs.size() > 6 ? &args.inputs[6] : nullptr;
  // Accumulated in double: dk and dv sum over the queries (of every query head of their group).
  std::vector<double> dq_sum(q.numel(), 0.0), dk_sum(k.numel(), 0.0), dv_sum(v.numel(), 0.0);
  std::vector<double> weights(static_cast<size_t>(d.tk)), dweights(static_cast<size_t>(d.tk));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t i = 0; i < d.tq; ++i) {
      const int64_t qi = d.row(b, i, d.tq, d.d), oi = d.row(b, i, d.tq, d.dv);
      // P_ij = exp(s_ij - lse_i), s_ij = scale * q_i . k_j + key_bias_j (masked: -inf, so
      // P_ij = 0).
      attention_scores(q, k, bias, d, b, i, causal, scale, weights);
      const double row_lse = lse.get(d.stat(b, i));
      for (int64_t j = 0; j < d.tk; ++j)
        weights[j] = weights[j] == kNegativeInfinity ? 0.0 : std::exp(weights[j] - row_lse);
      double weighted = 0.0;  // D_i = dout_i . out_i (= sum_j P_ij dP_ij)
      for (int64_t c = 0; c < d.dv; ++c)
        weighted += dout.get(oi + c) * out.get(oi + c);
      for (int64_t j = 0; j < d.tk; ++j) {
        double dp = 0.0;  // dP_ij = dout_i . v_j
        const int64_t vj = d.kv_row(b, j, d.dv);
        for (int64_t c = 0; c < d.dv; ++c) {
          const double g = dout.get(oi + c);
          dp += g * v.get(vj + c);
          dv_sum[vj + c] += weights[j] * g;
        }
        dweights[j] = dp;
      }
      for (int64_t j = 0; j < d.tk; ++j) {
        // Softmax backward; masked keys have P_ij = 0 and get nothing.
        const double ds = weights[j] * (dweights[j] - weighted) * scale;
        const int64_t kj = d.kv_row(b, j, d.d);
        for (int64_t c = 0; c < d.d; ++c) {
          dq_sum[qi + c] += ds * k.get(kj + c);
          dk_sum[kj + c] += ds * q.get(qi + c);
        }
      }
    }
  }
  for (int64_t i = 0; i < q.numel(); ++i) dq.set(i, dq_sum[i]);
  for (int64_t i = 0; i < k.numel(); ++i) dk.set(i, dk_sum[i]);
  for (int64_t i = 0; i < v.numel(); ++i) dv.set(i, dv_sum[i]);
}

// attention_qkv and its gradient: the "bthd" references on copies of the packed parts.
void attention_qkv_reference(const KernelArgs& args) {
  const Tensor& qkv = args.inputs[0];
  std::vector<Tensor> parts;
  for (int which = 0; which < 3; ++which) {
    parts.emplace_back(unpacked_type(qkv.type()));
    unpack_qkv(qkv, which, parts.back());
  }
  if (args.inputs.size() > 1) parts.push_back(args.inputs[1]);  // key_bias
  const Attributes attrs = unpacked_attrs(args.attrs);
  attention_reference(KernelArgs{attrs, parts, args.outputs});
}

void attention_qkv_grad_reference(const KernelArgs& args) {
  const Tensor& qkv = args.inputs[0];
  std::vector<Tensor> in, grads;
  for (int which = 0; which < 3; ++which) {
    in.emplace_back(unpacked_type(qkv.type()));
    unpack_qkv(qkv, which, in.back());
    grads.emplace_back(unpacked_type(qkv.type()));
  }
  for (size_t i = 1; i < args.inputs.size(); ++i) in.push_back(args.inputs[i]);  // out, dout, lse [, key_bias]
  const Attributes attrs = unpacked_attrs(args.attrs);
  attention_grad_reference(KernelArgs{attrs, in, grads});
  for (int which = 0; which < 3; ++which) pack_qkv(grads[which], which, args.outputs[0]);
}

// The gradient of attention's key_bias: dbias_j = sum over the heads and queries of dS_ij
// (dS_ij = P_ij (dP_ij - D_i), the scores' gradient without the scale). attention_grad computes
// dk_j = scale sum_i dS_ij q_i: over q with a column of ones appended and k with a column of
// zeros (the scores unchanged), dk's last column is scale sum_i dS_ij, summed over the query
// heads of each key/value head; the heads are summed here. A second attention_grad, on head
// dims D + 1: only where the bias needs a gradient (dead-code removes it elsewhere, the usual
// case of a mask made from the data).
Expr key_bias_grad(Builder& b, const Expr& q, const Expr& k, const Expr& v, const Expr& out,
                   const Expr& dout, const Expr& lse, const Expr& bias, const Attributes& attrs) {
  Attributes padded = attrs;
  const double scale = attention_scale(attrs, q.dim(-1));
  padded.set("scale", scale);  // not 1/sqrt(D + 1)
  auto with_column = [&](const Expr& x, double value) {
    Shape column = x.shape();
    column.back() = 1;
    return concat({x, b.full(column, value, x.dtype())}, -1);
  };
  std::vector<Expr> grads =
      b.apply(Op::kAttentionGrad, {with_column(q, 1.0), with_column(k, 0.0), v, out, dout, lse, bias}, padded);
  const Expr& dk = grads[1];  // (..., Hkv, Tk, D + 1) or (..., Tk, Hkv, D + 1)
  Expr column = split(dk, {dk.dim(-1) - 1, 1}, -1)[1];
  Shape per_head = dk.shape();
  per_head.pop_back();
  column = reshape(column, per_head);
  const int r = static_cast<int>(per_head.size());
  const int heads = heads_inside(attrs) ? r - 1 : r - 2;  // "bhtd" without heads (rank 1): none
  if (heads >= 0 && per_head.size() > bias.shape().size()) column = sum(column, {heads});
  return reshape(column, bias.shape()) * (1.0 / scale);
}

// dq, dk, dv (and dkey_bias) of attention{attrs}(q, k, v [, bias]) = (out, lse), given the
// gradients dout and dlse.
std::vector<Expr> attention_input_grads(Builder& b, const Expr& q, const Expr& k, const Expr& v,
                                        const Expr& out, const Expr& lse, const Expr& dout,
                                        const Expr& dlse_in, const Attributes& attrs,
                                        const Expr* bias = nullptr) {
  auto inputs = [&](std::vector<Expr> in) {
    if (bias != nullptr) in.push_back(*bias);
    return in;
  };
  auto with_bias_grad = [&](std::vector<Expr> grads, const Expr& v1, const Expr& out1, const Expr& dout1) {
    if (bias != nullptr) grads.push_back(key_bias_grad(b, q, k, v1, out1, dout1, lse, *bias, attrs));
    return grads;
  };
  if (is_zero_fill(dlse_in))  // the usual case: only out is used
    return with_bias_grad(b.apply(Op::kAttentionGrad, inputs({q, k, v, out, dout, lse}), attrs), v, out, dout);
  // The loss also depends on lse: d lse_i / d s_ij = P_ij adds dlse_i P_ij to dS_ij. The same
  // op serves: a ones column appended to v and dlse appended to dout add dlse_i to every dP_ij,
  // and a zero column appended to out leaves D_i = dout_i . out_i as it was (the op takes D from
  // the given out), so dS_ij = P_ij (dP_ij + dlse_i - D_i); dv drops the extra column.
  const DType dtype = v.dtype();
  Shape column = v.shape();
  column.back() = 1;
  Expr v1 = concat({v, b.full(column, 1.0, dtype)}, -1);
  column = out.shape();
  column.back() = 1;
  Expr out1 = concat({out, b.full(column, 0.0, dtype)}, -1);
  Expr dlse = reshape(dlse_in, column);
  if (dlse.dtype() != dtype) dlse = cast(dlse, dtype);
  Expr dout1 = concat({dout, dlse}, -1);
  std::vector<Expr> grads = b.apply(Op::kAttentionGrad, inputs({q, k, v1, out1, dout1, lse}), attrs);
  grads[2] = split(grads[2], {v.dim(-1), 1}, -1)[0];
  return with_bias_grad(grads, v1, out1, dout1);
}

std::vector<Expr> attention_gradient(const GradContext& c) {
  // Same attributes (causal, and scale when given); out and lse come from the forward node.
  return attention_input_grads(c.builder, c.x(0), c.x(1), c.x(2), c.y(0), c.y(1), c.dy(0),
                               c.dy(1), c.attrs(), c.inputs.size() > 3 ? &c.x(3) : nullptr);
}

std::vector<Expr> attention_qkv_gradient(const GradContext& c) {
  const Expr &qkv = c.x(0), &out = c.y(0), &lse = c.y(1);
  const Expr* bias = c.inputs.size() > 1 ? &c.x(1) : nullptr;
  const Shape part = unpacked_type(qkv.type()).shape;
  auto unpacked = [&] {
    std::vector<Expr> parts = split(qkv, {1, 1, 1}, -3);
    for (Expr& p : parts) p = reshape(p, part);
    return parts;
  };
  if (is_zero_fill(c.dy(1))) {
    std::vector<Expr> inputs{qkv, out, c.dy(0), lse};
    if (bias != nullptr) inputs.push_back(*bias);
    std::vector<Expr> grads = c.builder.apply(Op::kAttentionQkvGrad, inputs, c.attrs());
    if (bias != nullptr) {
      std::vector<Expr> parts = unpacked();
      grads.push_back(key_bias_grad(c.builder, parts[0], parts[1], parts[2], out, c.dy(0), lse, *bias,
                                    unpacked_attrs(c.attrs())));
    }
    return grads;
  }
  // The loss depends on lse too: attention's rule on the unpacked parts, packed again.
  Shape slot = qkv.shape();
  slot[slot.size() - 3] = 1;
  std::vector<Expr> parts = unpacked();
  std::vector<Expr> grads = attention_input_grads(c.builder, parts[0], parts[1], parts[2], out,
                                                   lse, c.dy(0), c.dy(1),
                                                   unpacked_attrs(c.attrs()), bias);
  for (size_t i = 0; i < 3; ++i) grads[i] = reshape(grads[i], slot);
  std::vector<Expr> result{concat({grads[0], grads[1], grads[2]}, -3)};
  if (bias != nullptr) result.push_back(grads[3]);
  return result;
}

// ---- rotary_embedding ----

// x's rows of D elements: row r is at position (r / heads) % T.
struct RotaryDims {
  int64_t rows, t, heads, d;
};

RotaryDims rotary_dims(const Shape& x, const Attributes& attrs) {
  const bool bthd = heads_inside(attrs);
  const size_t r = x.size();
  RotaryDims dims{1, x[bthd ? r - 3 : r - 2], bthd ? x[r - 2] : 1, x[r - 1]};
  for (size_t i = 0; i + 1 < r; ++i) dims.rows *= x[i];
  return dims;
}

std::vector<TensorType> infer_rotary(std::span<const TensorType> in, const Attributes& attrs) {
  const TensorType& x = in[0];
  check_float(x, "x");
  const bool bthd = heads_inside(attrs);
  KILN_CHECK(x.rank() >= (bthd ? 3 : 2), "x has shape {}, expected {}", to_string(x.shape),
             bthd ? "(..., T, H, D) (layout bthd)" : "(..., T, D) (layout bhtd)");
  KILN_CHECK(x.shape.back() % 2 == 0, "x has shape {}, expected an even last dim D (its halves "
             "rotate together)", to_string(x.shape));
  KILN_CHECK(attrs.f("base") > 0, "base is {}, expected > 0", attrs.f("base"));
  return {x};
}

void rotary_reference(const KernelArgs& args) {
  const Tensor& x = args.inputs[0];
  Tensor& y = args.outputs[0];
  const RotaryDims dims = rotary_dims(x.shape(), args.attrs);
  const double base = args.attrs.f("base"), sign = args.attrs.b("inverse") ? -1.0 : 1.0;
  const int64_t half = dims.d / 2;
  for (int64_t r = 0; r < dims.rows; ++r) {
    const double position = static_cast<double>(r / dims.heads % dims.t);
    const int64_t at = r * dims.d;
    for (int64_t i = 0; i < half; ++i) {
      const double angle = sign * position *
                           std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(dims.d));
      const double c = std::cos(angle), s = std::sin(angle);
      const double x1 = x.get(at + i), x2 = x.get(at + i + half);
      y.set(at + i, x1 * c - x2 * s);
      y.set(at + i + half, x2 * c + x1 * s);
    }
  }
}

std::vector<Expr> rotary_gradient(const GradContext& c) {
  Attributes attrs = c.attrs();
  attrs.set("inverse", !attrs.b("inverse"));
  return {c.builder.apply1(Op::kRotaryEmbedding, {c.dy()}, attrs)};
}


// ---- traits: fusion roles and FLOPs (ir/op_def.h, OpTraits) ----

double numel_of(const Graph& g, ValueId id) { return static_cast<double>(g.type(id).numel()); }

// softmax, log_softmax and their gradients: a row op over the last axis only.
GroupRole role_along_axis(const Graph& graph, const Node& node) {
  const int rank = graph.type(node.inputs[0]).rank();
  if (rank == 0) return GroupRole::kOther;
  return normalize_axis(node.attrs.i("axis"), rank) == rank - 1 ? GroupRole::kRowOp
                                                                : GroupRole::kOther;
}

// cross_entropy and its gradient: a row op when each row keeps its own loss.
GroupRole role_per_row_loss(const Graph&, const Node& node) {
  return node.attrs.s("reduction") == "none" ? GroupRole::kRowOp : GroupRole::kOther;
}

// A GEMM nucleus: B 2-D, A 2-D or rows (..., K) untransposed (a linear layer on a sequence).
GroupRole matmul_role(const Graph& graph, const Node& node) {
  const int a_rank = graph.type(node.inputs[0]).rank();
  if (graph.type(node.inputs[1]).rank() != 2 || a_rank < 2) return GroupRole::kOther;
  if (a_rank > 2 && node.attrs.b("transpose_a")) return GroupRole::kOther;
  return GroupRole::kGemm;
}

// 2MNK.
double matmul_flops(const Graph& g, const Node& node) {
  double out_numel = 0;
  for (ValueId o : node.outputs) out_numel += numel_of(g, o);
  const Shape& a = g.type(node.inputs[0]).shape;
  const size_t r = a.size();
  const double k = static_cast<double>(node.attrs.b("transpose_a") ? a[r - 2] : a[r - 1]);
  return 2.0 * out_numel * k;
}

// 2 * B*H*Tq * Tk * (D + Dv) forward (QK^T and PV); the gradient about 2.5 times that.
double attention_flops(const Graph& g, const Node& node) {
  const Shape& q = g.type(node.inputs[0]).shape;
  const Shape& v = g.type(node.inputs[2]).shape;
  const size_t r = q.size();
  const bool bthd = node.attrs.s("layout") == "bthd";
  const double keys = static_cast<double>(g.type(node.inputs[1]).shape[r - (bthd ? 3 : 2)]);
  const double rows = numel_of(g, node.inputs[0]) / static_cast<double>(q[r - 1]);  // B*H*T
  const double forward = 2.0 * rows * keys * static_cast<double>(q[r - 1] + v[r - 1]);
  return node.op == Op::kAttention ? forward : 2.5 * forward;
}

double attention_qkv_flops(const Graph& g, const Node& node) {
  const Shape& qkv = g.type(node.inputs[0]).shape;  // (..., T, 3, H, D)
  const size_t r = qkv.size();
  const double d = static_cast<double>(qkv[r - 1]);
  const double rows = numel_of(g, node.inputs[0]) / (3.0 * d);  // B*T*H
  const double forward = 2.0 * rows * static_cast<double>(qkv[r - 4]) * 2.0 * d;
  return node.op == Op::kAttentionQkv ? forward : 2.5 * forward;
}

}  // namespace

void define_nn_ops(OpRegistry& registry) {
  registry.define(Op::kMatmul, OpDef{
      {with_default("transpose_a", false), with_default("transpose_b", false),
       optional("fp8_a", AttrKind::kString), optional("fp8_b", AttrKind::kString),
       optional("fp8_grad", AttrKind::kString), optional("fp8_fast_accum", AttrKind::kBool)},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        MatmulDims d = matmul_dims(in[0], in[1], attrs);
        check_matmul_fp8(attrs);
        Shape out = d.batch;
        out.push_back(d.m);
        out.push_back(d.n);
        return std::vector<TensorType>{{in[0].dtype, out}};
      },
      [](const KernelArgs& args) {
        const Tensor &a = args.inputs[0], &b = args.inputs[1];
        Tensor& c = args.outputs[0];
        const bool ta = args.attrs.b("transpose_a"), tb = args.attrs.b("transpose_b");
        MatmulDims d = matmul_dims(a.type(), b.type(), args.attrs);
        const int64_t m = d.m, n = d.n, kk = d.k;
        const MatmulFp8 fp8 = matmul_fp8(args.attrs);
        double scale = 1.0;  // the product of the operands' inverse scales (ops/fp8.h)
        const std::vector<double> av = matmul_operand(a, fp8.a, scale);
        const std::vector<double> bv = matmul_operand(b, fp8.b, scale);
        // Offsets from for_each_broadcast count whole matrices of a and b.
        for_each_broadcast(d.batch, {d.a_batch, d.b_batch},
                           [&](int64_t batch, std::span<const int64_t> offsets) {
          const int64_t a0 = offsets[0] * m * kk, b0 = offsets[1] * kk * n, c0 = batch * m * n;
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) {
              double sum = 0.0;
              for (int64_t p = 0; p < kk; ++p)
                sum += av[a0 + (ta ? p * m + i : i * kk + p)] * bv[b0 + (tb ? j * kk + p : p * n + j)];
              c.set(c0 + i * n + j, sum * scale);
            }
        });
      },
      matmul_gradient})
      .traits = {.precision = Precision::kLow, .fusion_role = matmul_role,
                 .recompute = Recompute::kHeavy, .flops = matmul_flops};

  registry.define(Op::kSoftmax, OpDef{
      {with_default("axis", int64_t{-1})}, infer_softmax,
      [](const KernelArgs& args) { softmax_kernel(args, /*log=*/false); }, softmax_gradient})
      .traits = {.row_op = true, .precision = Precision::kF32, .fusion_role = role_along_axis};

  registry.define(Op::kLogSoftmax, OpDef{
      {with_default("axis", int64_t{-1})}, infer_softmax,
      [](const KernelArgs& args) { softmax_kernel(args, /*log=*/true); },
      log_softmax_gradient})
      .traits = {.row_op = true, .precision = Precision::kF32, .fusion_role = role_along_axis};

  registry.define(Op::kLayerNorm, OpDef{
      {with_default("epsilon", 1e-5)},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        check_norm_input(in[0]);
        check_norm_param(in[1], "gamma", in[0]);
        check_norm_param(in[2], "beta", in[0]);
        return std::vector<TensorType>{in[0]};
      },
      [](const KernelArgs& args) {
        const Tensor &x = args.inputs[0], &gamma = args.inputs[1], &beta = args.inputs[2];
        Tensor& y = args.outputs[0];
        const double epsilon = args.attrs.f("epsilon");
        auto [rows, cols] = rows_of(x.shape());
        for (int64_t r = 0; r < rows; ++r) {
          double mean = 0.0;
          for (int64_t c = 0; c < cols; ++c) mean += x.get(r * cols + c);
          mean /= static_cast<double>(cols);
          double variance = 0.0;  // biased: divided by C, as PyTorch's layer_norm does
          for (int64_t c = 0; c < cols; ++c) {
            double centered = x.get(r * cols + c) - mean;
            variance += centered * centered;
          }
          variance /= static_cast<double>(cols);
          const double inv_std = 1.0 / std::sqrt(variance + epsilon);
          for (int64_t c = 0; c < cols; ++c)
            y.set(r * cols + c, (x.get(r * cols + c) - mean) * inv_std * gamma.get(c) + beta.get(c));
        }
      },
      layer_norm_gradient})
      .traits = {.row_op = true, .precision = Precision::kF32, .composite = true};

  registry.define(Op::kRmsNorm, OpDef{
      {with_default("epsilon", 1e-6)},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        check_norm_input(in[0]);
        check_norm_param(in[1], "gamma", in[0]);
        return std::vector<TensorType>{in[0]};
      },
      [](const KernelArgs& args) {
        const Tensor &x = args.inputs[0], &gamma = args.inputs[1];
        Tensor& y = args.outputs[0];
        const double epsilon = args.attrs.f("epsilon");
        auto [rows, cols] = rows_of(x.shape());
        for (int64_t r = 0; r < rows; ++r) {
          double mean_square = 0.0;
          for (int64_t c = 0; c < cols; ++c) mean_square += x.get(r * cols + c) * x.get(r * cols + c);
          mean_square /= static_cast<double>(cols);
          const double inv_rms = 1.0 / std::sqrt(mean_square + epsilon);
          for (int64_t c = 0; c < cols; ++c)
            y.set(r * cols + c, x.get(r * cols + c) * inv_rms * gamma.get(c));
        }
      },
      rms_norm_gradient})
      .traits = {.row_op = true, .precision = Precision::kF32, .composite = true};

  registry.define(Op::kCrossEntropy, OpDef{
      {with_default("ignore_index", int64_t{-100}), with_default("reduction", std::string("mean"))},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        const TensorType &logits = in[0], &labels = in[1];
        Shape rows = check_cross_entropy_inputs(logits, labels);
        if (reduction_of(attrs) == Reduction::kNone)
          return std::vector<TensorType>{{logits.dtype, rows}};
        return std::vector<TensorType>{{logits.dtype, Shape{}}};
      },
      [](const KernelArgs& args) {
        const Tensor &logits = args.inputs[0], &labels = args.inputs[1];
        Tensor& out = args.outputs[0];
        const int64_t ignore_index = args.attrs.i("ignore_index");
        const Reduction reduction = reduction_of(args.attrs);
        auto [rows, vocab] = rows_of(logits.shape());
        double total = 0.0;
        int64_t counted = 0;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t label = checked_label("cross_entropy", labels, r, vocab, ignore_index);
          double loss = 0.0;
          if (label != ignore_index) {
            double max = kNegativeInfinity;
            for (int64_t c = 0; c < vocab; ++c) max = std::max(max, logits.get(r * vocab + c));
            double sum = 0.0;
            for (int64_t c = 0; c < vocab; ++c) sum += std::exp(logits.get(r * vocab + c) - max);
            loss = max + std::log(sum) - logits.get(r * vocab + label);
            total += loss;
            ++counted;
          }
          if (reduction == Reduction::kNone) out.set(r, loss);
        }
        // No counted tokens: no loss (0, not 0/0).
        if (reduction == Reduction::kSum) out.set(0, total);
        if (reduction == Reduction::kMean)
          out.set(0, counted == 0 ? 0.0 : total / static_cast<double>(counted));
      },
      cross_entropy_gradient})
      .traits = {.row_op = true, .precision = Precision::kF32,
                 .fusion_role = role_per_row_loss};

  registry.define(Op::kAttention, OpDef{
      {with_default("causal", false), optional("scale", AttrKind::kFloat),
       with_default("layout", std::string("bhtd"))},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        const TensorType out = infer_attention(in[0], in[1], in[2], attrs);
        check_key_bias(in, 3, attrs);
        return std::vector<TensorType>{out, attention_lse_type(in[0])};
      },
      attention_reference,
      attention_gradient})
      .traits = {.precision = Precision::kLow, .recompute = Recompute::kHeavy,
                 .flops = attention_flops, .composite = true};

  registry.define(Op::kAttentionQkv, OpDef{
      {with_default("causal", false), optional("scale", AttrKind::kFloat)},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        check_packed_qkv(in[0]);
        const TensorType part = unpacked_type(in[0]);
        check_packed_key_bias(in, 1, attrs);
        return std::vector<TensorType>{part, attention_lse_type(part)};
      },
      attention_qkv_reference, attention_qkv_gradient})
      .traits = {.precision = Precision::kLow, .recompute = Recompute::kHeavy,
                 .flops = attention_qkv_flops, .composite = true};

  registry.define(Op::kRotaryEmbedding, OpDef{
      {with_default("base", 10000.0), with_default("inverse", false),
       with_default("layout", std::string("bhtd"))},
      infer_rotary, rotary_reference, rotary_gradient})
      .traits = {.composite = true};

  // ---- backward ops (not differentiable themselves) ----

  registry.define(Op::kSoftmaxGrad, OpDef{
      {with_default("axis", int64_t{-1})}, infer_softmax_grad,
      [](const KernelArgs& args) { softmax_grad_kernel(args, /*log=*/false); }, nullptr, false})
      .traits = {.row_op = true, .fusion_role = role_along_axis};

  registry.define(Op::kLogSoftmaxGrad, OpDef{
      {with_default("axis", int64_t{-1})}, infer_softmax_grad,
      [](const KernelArgs& args) { softmax_grad_kernel(args, /*log=*/true); }, nullptr, false})
      .traits = {.row_op = true, .fusion_role = role_along_axis};

  registry.define(Op::kLayerNormGrad, OpDef{
      {with_default("epsilon", 1e-5)},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        check_norm_grad_inputs(in);
        return std::vector<TensorType>{in[0], in[1], in[1]};  // dx, dgamma, dbeta
      },
      [](const KernelArgs& args) {
        const Tensor &x = args.inputs[0], &gamma = args.inputs[1], &dy = args.inputs[2];
        Tensor &dx = args.outputs[0], &dgamma = args.outputs[1], &dbeta = args.outputs[2];
        const double epsilon = args.attrs.f("epsilon");
        auto [rows, cols] = rows_of(x.shape());
        const double n = static_cast<double>(cols);
        std::vector<double> dgamma_sum(cols, 0.0), dbeta_sum(cols, 0.0), x_hat(cols);
        for (int64_t r = 0; r < rows; ++r) {
          auto at = [&](int64_t c) { return r * cols + c; };
          double mean = 0.0;
          for (int64_t c = 0; c < cols; ++c) mean += x.get(at(c));
          mean /= n;
          double variance = 0.0;
          for (int64_t c = 0; c < cols; ++c) {
            const double centered = x.get(at(c)) - mean;
            variance += centered * centered;
          }
          variance /= n;
          const double inv_std = 1.0 / std::sqrt(variance + epsilon);
          // With x_hat = (x - mean) * inv_std and g = dy * gamma (the gradient w.r.t. x_hat):
          // dx = inv_std * (g - mean(g) - x_hat * mean(g * x_hat)).
          double mean_g = 0.0, mean_g_x_hat = 0.0;
          for (int64_t c = 0; c < cols; ++c) {
            x_hat[c] = (x.get(at(c)) - mean) * inv_std;
            const double g = dy.get(at(c)) * gamma.get(c);
            mean_g += g;
            mean_g_x_hat += g * x_hat[c];
            dgamma_sum[c] += dy.get(at(c)) * x_hat[c];
            dbeta_sum[c] += dy.get(at(c));
          }
          mean_g /= n;
          mean_g_x_hat /= n;
          for (int64_t c = 0; c < cols; ++c) {
            const double g = dy.get(at(c)) * gamma.get(c);
            dx.set(at(c), inv_std * (g - mean_g - x_hat[c] * mean_g_x_hat));
          }
        }
        for (int64_t c = 0; c < cols; ++c) {
          dgamma.set(c, dgamma_sum[c]);
          dbeta.set(c, dbeta_sum[c]);
        }
      },
      nullptr, false, nullptr, /*column_outputs_from=*/1})
      .traits = {.row_op = true, .composite = true};

  registry.define(Op::kRmsNormGrad, OpDef{
      {with_default("epsilon", 1e-6)},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        check_norm_grad_inputs(in);
        return std::vector<TensorType>{in[0], in[1]};  // dx, dgamma
      },
      [](const KernelArgs& args) {
        const Tensor &x = args.inputs[0], &gamma = args.inputs[1], &dy = args.inputs[2];
        Tensor &dx = args.outputs[0], &dgamma = args.outputs[1];
        const double epsilon = args.attrs.f("epsilon");
        auto [rows, cols] = rows_of(x.shape());
        const double n = static_cast<double>(cols);
        std::vector<double> dgamma_sum(cols, 0.0);
        for (int64_t r = 0; r < rows; ++r) {
          auto at = [&](int64_t c) { return r * cols + c; };
          double mean_square = 0.0;
          for (int64_t c = 0; c < cols; ++c) mean_square += x.get(at(c)) * x.get(at(c));
          mean_square /= n;
          const double inv_rms = 1.0 / std::sqrt(mean_square + epsilon);
          // y = x * inv_rms * gamma and d inv_rms / d x_c = -inv_rms^3 * x_c / C, so with
          // g = dy * gamma: dx = inv_rms * g - inv_rms^3 * x * sum(g * x) / C.
          double sum_g_x = 0.0;
          for (int64_t c = 0; c < cols; ++c) {
            sum_g_x += dy.get(at(c)) * gamma.get(c) * x.get(at(c));
            dgamma_sum[c] += dy.get(at(c)) * x.get(at(c)) * inv_rms;
          }
          const double correction = inv_rms * inv_rms * inv_rms * sum_g_x / n;
          for (int64_t c = 0; c < cols; ++c)
            dx.set(at(c), inv_rms * dy.get(at(c)) * gamma.get(c) - correction * x.get(at(c)));
        }
        for (int64_t c = 0; c < cols; ++c) dgamma.set(c, dgamma_sum[c]);
      },
      nullptr, false, nullptr, /*column_outputs_from=*/1})
      .traits = {.row_op = true, .composite = true};

  registry.define(Op::kCrossEntropyGrad, OpDef{
      {with_default("ignore_index", int64_t{-100}), with_default("reduction", std::string("mean"))},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        const TensorType &logits = in[0], &labels = in[1], &dloss = in[2];
        Shape rows = check_cross_entropy_inputs(logits, labels);
        check_same_dtype(dloss, "dloss", logits, "logits");
        const Reduction reduction = reduction_of(attrs);
        // dloss is the gradient of cross_entropy's output: per row for "none", else a scalar.
        const Shape expected = reduction == Reduction::kNone ? rows : Shape{};
        KILN_CHECK(dloss.shape == expected,
                   "dloss has shape {}, expected {} (the loss's shape for reduction \"{}\")",
                   to_string(dloss.shape), to_string(expected), attrs.s("reduction"));
        return std::vector<TensorType>{logits};
      },
      [](const KernelArgs& args) {
        const Tensor &logits = args.inputs[0], &labels = args.inputs[1], &dloss = args.inputs[2];
        Tensor& dlogits = args.outputs[0];
        const int64_t ignore_index = args.attrs.i("ignore_index");
        const Reduction reduction = reduction_of(args.attrs);
        auto [rows, vocab] = rows_of(logits.shape());
        int64_t counted = 0;
        for (int64_t r = 0; r < rows; ++r)
          if (checked_label("cross_entropy_grad", labels, r, vocab, ignore_index) != ignore_index)
            ++counted;
        for (int64_t r = 0; r < rows; ++r) {
          auto at = [&](int64_t c) { return r * vocab + c; };
          const int64_t label = labels.get_int(r);
          if (label == ignore_index) {  // contributes nothing to the loss
            for (int64_t c = 0; c < vocab; ++c) dlogits.set(at(c), 0.0);
            continue;
          }
          // counted > 0 here: this row is counted.
          const double row_scale = reduction == Reduction::kNone ? dloss.get(r)
                                   : reduction == Reduction::kSum
                                       ? dloss.get(0)
                                       : dloss.get(0) / static_cast<double>(counted);
          double max = kNegativeInfinity;
          for (int64_t c = 0; c < vocab; ++c) max = std::max(max, logits.get(at(c)));
          double sum = 0.0;
          for (int64_t c = 0; c < vocab; ++c) sum += std::exp(logits.get(at(c)) - max);
          for (int64_t c = 0; c < vocab; ++c) {
            const double p = std::exp(logits.get(at(c)) - max) / sum;
            dlogits.set(at(c), (p - (c == label ? 1.0 : 0.0)) * row_scale);
          }
        }
      },
      nullptr, false})
      .traits = {.row_op = true, .fusion_role = role_per_row_loss};

  registry.define(Op::kAttentionGrad, OpDef{
      {with_default("causal", false), optional("scale", AttrKind::kFloat),
       with_default("layout", std::string("bhtd"))},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        const TensorType out = infer_attention(in[0], in[1], in[2], attrs);
        check_grad_input(in[3], "out", out, "attention's output");
        check_grad_input(in[4], "dout", out, "attention's output");
        const TensorType lse = attention_lse_type(in[0]);
        KILN_CHECK(in[5] == lse, "lse is {}, expected {} like attention's lse for q {}",
                   to_string(in[5]), to_string(lse), to_string(in[0]));
        check_key_bias(in, 6, attrs);
        return std::vector<TensorType>{in[0], in[1], in[2]};  // dq, dk, dv
      },
      attention_grad_reference,
      nullptr, false})
      .traits = {.recompute = Recompute::kHeavy, .flops = attention_flops, .composite = true};

  registry.define(Op::kAttentionQkvGrad, OpDef{
      {with_default("causal", false), optional("scale", AttrKind::kFloat)},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        check_packed_qkv(in[0]);
        const TensorType out = unpacked_type(in[0]);
        check_grad_input(in[1], "out", out, "attention_qkv's output");
        check_grad_input(in[2], "dout", out, "attention_qkv's output");
        const TensorType lse = attention_lse_type(out);
        KILN_CHECK(in[3] == lse, "lse is {}, expected {} like attention_qkv's lse for qkv {}",
                   to_string(in[3]), to_string(lse), to_string(in[0]));
        check_packed_key_bias(in, 4, attrs);
        return std::vector<TensorType>{in[0]};  // dqkv
      },
      attention_qkv_grad_reference, nullptr, false})
      .traits = {.recompute = Recompute::kHeavy, .flops = attention_qkv_flops,
                 .composite = true};
}

}  // namespace kiln::ops
