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
//   attention(q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv)) {causal = false, scale (optional,
//     absent = 1/sqrt(D))}: softmax(q k^T * scale + mask) v; causal masks key j > query i
//     (top-left aligned, like PyTorch's is_causal).
// Reference kernels are plain loops in double through Tensor::get/set: the test oracle.
#include <cmath>
#include <limits>

#include "ops/common.h"

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
  int64_t batch;  // product of the leading dims
  int64_t tq, tk, d, dv;
};

AttentionDims attention_dims(const Shape& q, const Shape& k, const Shape& v) {
  const size_t r = q.size();
  AttentionDims dims{1, q[r - 2], k[r - 2], q[r - 1], v[r - 1]};
  for (size_t i = 0; i + 2 < r; ++i) dims.batch *= q[i];
  return dims;
}

}  // namespace

void define_nn_ops(OpRegistry& registry) {
  registry.define(Op::kMatmul, OpDef{
      {with_default("transpose_a", false), with_default("transpose_b", false)},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        MatmulDims d = matmul_dims(in[0], in[1], attrs);
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
        // Offsets from for_each_broadcast count whole matrices of a and b.
        for_each_broadcast(d.batch, {d.a_batch, d.b_batch},
                           [&](int64_t batch, std::span<const int64_t> offsets) {
          const int64_t a0 = offsets[0] * m * kk, b0 = offsets[1] * kk * n, c0 = batch * m * n;
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) {
              double sum = 0.0;
              for (int64_t p = 0; p < kk; ++p) {
                double av = a.get(a0 + (ta ? p * m + i : i * kk + p));
                double bv = b.get(b0 + (tb ? j * kk + p : p * n + j));
                sum += av * bv;
              }
              c.set(c0 + i * n + j, sum);
            }
        });
      }});

  registry.define(Op::kSoftmax, OpDef{
      {with_default("axis", int64_t{-1})}, infer_softmax,
      [](const KernelArgs& args) { softmax_kernel(args, /*log=*/false); }});

  registry.define(Op::kLogSoftmax, OpDef{
      {with_default("axis", int64_t{-1})}, infer_softmax,
      [](const KernelArgs& args) { softmax_kernel(args, /*log=*/true); }});

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
      }});

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
      }});

  registry.define(Op::kCrossEntropy, OpDef{
      {with_default("ignore_index", int64_t{-100}), with_default("reduction", std::string("mean"))},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        const TensorType &logits = in[0], &labels = in[1];
        check_float(logits, "logits");
        KILN_CHECK(logits.rank() >= 1 && logits.shape.back() >= 1,
                   "logits have shape {}, expected (..., V) with V >= 1", to_string(logits.shape));
        KILN_CHECK(labels.dtype == DType::kI32 || labels.dtype == DType::kI64,
                   "labels are {}, expected i32 or i64", dtype_name(labels.dtype));
        const Shape expected(logits.shape.begin(), logits.shape.end() - 1);
        KILN_CHECK(labels.shape == expected,
                   "labels have shape {}, expected {} (logits {} without the last dim)",
                   to_string(labels.shape), to_string(expected), to_string(logits.shape));
        if (reduction_of(attrs) == Reduction::kNone)
          return std::vector<TensorType>{{logits.dtype, labels.shape}};
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
          const int64_t label = static_cast<int64_t>(labels.get(r));
          double loss = 0.0;
          if (label != ignore_index) {
            if (label < 0 || label >= vocab)
              fail("cross_entropy: label {} (row {}) is out of range [0, {}) and is not "
                   "ignore_index {}",
                   label, r, vocab, ignore_index);
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
      }});

  registry.define(Op::kAttention, OpDef{
      {with_default("causal", false), optional("scale", AttrKind::kFloat)},
      [](std::span<const TensorType> in, const Attributes& attrs) {
        const TensorType &q = in[0], &k = in[1], &v = in[2];
        check_float(q, "q");
        check_same_dtype(k, "k", q, "q");
        check_same_dtype(v, "v", q, "q");
        KILN_CHECK(q.rank() >= 2, "q has shape {}, expected rank >= 2 (..., Tq, D)",
                   to_string(q.shape));
        KILN_CHECK(k.rank() == q.rank() && v.rank() == q.rank(),
                   "q, k, v have shapes {}, {}, {}, expected one rank", to_string(q.shape),
                   to_string(k.shape), to_string(v.shape));
        const int r = q.rank();
        const Shape lead(q.shape.begin(), q.shape.end() - 2);
        KILN_CHECK(Shape(k.shape.begin(), k.shape.end() - 2) == lead &&
                       Shape(v.shape.begin(), v.shape.end() - 2) == lead,
                   "leading dims differ: q is {}, k is {}, v is {} (they must be equal, no "
                   "broadcasting)",
                   to_string(q.shape), to_string(k.shape), to_string(v.shape));
        KILN_CHECK(k.shape[r - 1] == q.shape[r - 1],
                   "head dims differ: q is {}, k is {} (expected the same D)", to_string(q.shape),
                   to_string(k.shape));
        KILN_CHECK(v.shape[r - 2] == k.shape[r - 2],
                   "key lengths differ: k is {}, v is {} (expected the same Tk)",
                   to_string(k.shape), to_string(v.shape));
        Shape out = q.shape;
        out[r - 1] = v.shape[r - 1];
        return std::vector<TensorType>{{q.dtype, out}};
      },
      [](const KernelArgs& args) {
        const Tensor &q = args.inputs[0], &k = args.inputs[1], &v = args.inputs[2];
        Tensor& out = args.outputs[0];
        const AttentionDims d = attention_dims(q.shape(), k.shape(), v.shape());
        const bool causal = args.attrs.b("causal");
        const double scale = args.attrs.has("scale") ? args.attrs.f("scale")
                             : d.d > 0               ? 1.0 / std::sqrt(static_cast<double>(d.d))
                                                     : 1.0;
        std::vector<double> scores(static_cast<size_t>(d.tk));
        for (int64_t b = 0; b < d.batch; ++b) {
          const int64_t q0 = b * d.tq * d.d, k0 = b * d.tk * d.d, v0 = b * d.tk * d.dv,
                        o0 = b * d.tq * d.dv;
          for (int64_t i = 0; i < d.tq; ++i) {
            // Scores for query i; masked keys get -inf (weight 0). Key 0 is never masked.
            double max = kNegativeInfinity;
            for (int64_t j = 0; j < d.tk; ++j) {
              double s = kNegativeInfinity;
              if (!causal || j <= i) {
                s = 0.0;
                for (int64_t c = 0; c < d.d; ++c)
                  s += q.get(q0 + i * d.d + c) * k.get(k0 + j * d.d + c);
                s *= scale;
              }
              scores[j] = s;
              max = std::max(max, s);
            }
            // Softmax over the keys.
            double sum = 0.0;
            for (int64_t j = 0; j < d.tk; ++j) {
              scores[j] = scores[j] == kNegativeInfinity ? 0.0 : std::exp(scores[j] - max);
              sum += scores[j];
            }
            // Weighted sum of the values.
            for (int64_t c = 0; c < d.dv; ++c) {
              double acc = 0.0;
              for (int64_t j = 0; j < d.tk; ++j) acc += scores[j] / sum * v.get(v0 + j * d.dv + c);
              out.set(o0 + i * d.dv + c, acc);
            }
          }
        }
      }});
}

}  // namespace kiln::ops
