// Fast kernels for the ops a training step spends its time in once matmul is fast (profiled in
// bench/log/sessions-1-12.md, "CPU training step"):
//   dialect "cpu":
//     optimizer_update          f32 param/grad/state (lr and step: any float scalar, read once):
//                               one pass over the elements evaluating the optimizer's rule
//                               (ops/optimizer/rules.h), its per-step constants computed once.
//     reshape                   any dtype: a flat copy (the executor gives every value its own
//                               buffer; a view would need aliasing support there).
//     broadcast_to              any dtype: runs over the trailing dims, copied or filled (a
//                               BatchNorm's per-channel gradients, (1, C, 1, 1) to (N, C, H, W)).
//     transpose                 any dtype, any permutation. Size-1 axes are dropped and input
//                               axes that stay adjacent are merged first, so (0, 2, 1, 3) of
//                               (B, T, H, D) becomes "copy runs of D", and a last-two-axes swap
//                               becomes a batch of 2-D transposes, done in cache tiles.
//   dialect "openblas":
//     attention, attention_grad  f32. Per (batch..., head) slice: S = scale Q K^T (sgemm), the
//                               causal mask and a stable row softmax (its log-sum-exp is the
//                               lse output), O = P V (sgemm); the backward rebuilds
//                               P = exp(S - lse) from the saved lse (no row max or sum) and
//                               does dV = P^T dO, dP = dO V^T, dS = P * (dP - D) with
//                               D = rowsum(dO * O), dQ = scale dS K, dK = scale dS^T Q as
//                               sgemms. Grouped-query attention (k, v with fewer heads) reads a
//                               key/value head's rows for each query head of its group; their
//                               dk, dv are accumulated by the sgemms (beta 1 after the first).
//     attention_qkv,            f32, the same kernels with q, k, v read in place from the packed
//     attention_qkv_grad        (..., T, 3, H, D) (rows 3 H D apart) and dq, dk, dv written in
//                               place into dqkv.
//
// Threading: the "cpu" kernels split their element range with support/parallel.h. The
// attention kernels run their slices one after another on the calling thread and leave the
// threading to OpenBLAS inside each sgemm: the project links the pthread OpenBLAS, and an OpenMP
// region around (or between) its calls makes the two thread pools spin against each other.
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/fast_math.h"
#include "backends/cpu/row_ops.h"
#include "ops/optimizer/optimizers.h"
#include "support/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {
namespace {

using Ints = std::vector<int64_t>;

// Row-major multi-index of flat position `index` in `shape`.
Ints unravel(int64_t index, const Shape& shape) {
  Ints out(shape.size(), 0);
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    if (shape[d] == 0) continue;
    out[d] = index % shape[d];
    index /= shape[d];
  }
  return out;
}

KernelImpl fast(std::function<bool(const NodeView&)> supports, KernelFn kernel,
                bool in_place_ok = false) {
  return KernelImpl{"cpu", Device::kCpu, kFastPriority, std::move(supports), std::move(kernel),
                    in_place_ok};
}

// Elements per thread chunk for the optimizer updates: they stream 5-7 arrays (memory bound)
// with a few flops per element.
constexpr int64_t kGrainUpdate = 8192;

// ---- optimizer_update -----------------------------------------------------------------------

// Elements handled per block: each block is read into local arrays, updated there by the rule
// (ops/optimizer/rules.h) and only then stored, because the outputs may lie over their inputs
// (the executor writes updated params and state in place: KernelImpl::in_place_ok), so no
// pointer is __restrict__.
constexpr int64_t kUpdateBlock = 256;

template <class Rule>
void update_kernel(const KernelArgs& args) {
  constexpr int kSlots = Rule::kSlots;
  const optim::HyperValues h = optim::hyper_values(optim::optimizer_def(Rule::kName), args.attrs);
  const auto c = Rule::template prepare<float>(h, args.inputs[2 + kSlots].get(0), args.inputs[3 + kSlots].get(0));
  const float* p = args.inputs[0].data<float>();
  const float* g = args.inputs[1].data<float>();
  const float* s[kSlots];
  float* s_out[kSlots];
  for (int j = 0; j < kSlots; ++j) {
    s[j] = args.inputs[2 + j].data<float>();
    s_out[j] = args.outputs[1 + j].data<float>();
  }
  float* p_out = args.outputs[0].data<float>();
  parallel_for(0, args.inputs[0].numel(), kGrainUpdate, [&](int64_t lo, int64_t hi) {
    float pn[kUpdateBlock], sn[kSlots][kUpdateBlock];
    for (int64_t at = lo; at < hi; at += kUpdateBlock) {
      const int64_t n = std::min(kUpdateBlock, hi - at);
      for (int64_t i = 0; i < n; ++i) {
        float slots[kSlots];
        for (int j = 0; j < kSlots; ++j) slots[j] = s[j][at + i];
        pn[i] = Rule::apply(c, p[at + i], g[at + i], slots);
        for (int j = 0; j < kSlots; ++j) sn[j][i] = slots[j];
      }
      const size_t bytes = static_cast<size_t>(n) * sizeof(float);
      std::memcpy(p_out + at, pn, bytes);
      for (int j = 0; j < kSlots; ++j) std::memcpy(s_out[j] + at, sn[j], bytes);
    }
  });
}

void optimizer_update_kernel(const KernelArgs& args) {
  const bool known = optim::visit_rule(args.attrs.s("optimizer").c_str(),
                                       [&](auto rule) { update_kernel<decltype(rule)>(args); });
  KILN_CHECK(known, "optimizer_update: no rule for optimizer '{}'", args.attrs.s("optimizer"));
}

// Param, grad, state and results f32; lr and step any float scalar (inference checked).
bool optimizer_update_supported(const NodeView& node) {
  for (size_t i = 0; i + 2 < node.input_types.size(); ++i)
    if (node.input_types[i].dtype != DType::kF32) return false;
  for (const TensorType& t : node.output_types)
    if (t.dtype != DType::kF32) return false;
  return true;
}

// ---- reshape --------------------------------------------------------------------------------

// Bytes per thread chunk for plain copies.
constexpr int64_t kGrainCopyBytes = 1 << 20;

void copy_bytes(const void* src, void* dst, int64_t bytes) {
  if (src == dst || bytes == 0) return;
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  parallel_for(0, bytes, kGrainCopyBytes, [&](int64_t lo, int64_t hi) {
    std::memcpy(d + lo, s + lo, static_cast<size_t>(hi - lo));
  });
}

void reshape_kernel(const KernelArgs& args) {
  copy_bytes(args.inputs[0].raw(), args.outputs[0].raw(),
             static_cast<int64_t>(args.outputs[0].bytes()));
}

// ---- broadcast_to ---------------------------------------------------------------------------

// The output as runs over its trailing dims, each run copied from (when the input has those
// dims whole) or filled with (when it has them as 1s) the input at the offset its outer index
// gives (stride 0 on the broadcast outer dims): (1, C, 1, 1) to (N, C, H, W) is N * C fills of
// H * W, (C,) to (B, T, C) is B * T copies of C.
template <typename T>
void broadcast_typed(const T* in, T* out, const Shape& in_shape, const Shape& out_shape) {
  const size_t rank = out_shape.size();
  Shape x(rank - in_shape.size(), 1);  // the input aligned to the output's rank
  x.insert(x.end(), in_shape.begin(), in_shape.end());
  const bool copy = x[rank - 1] == out_shape[rank - 1];
  size_t first = rank;  // the run's dims: [first, rank)
  int64_t run = 1;
  while (first > 0 && (copy ? x[first - 1] == out_shape[first - 1] : x[first - 1] == 1)) {
    --first;
    run *= out_shape[first];
  }
  std::vector<int64_t> stride(first);  // the input's, 0 on broadcast dims
  for (int64_t at = copy ? run : 1, d = static_cast<int64_t>(first) - 1; d >= 0; --d) {
    stride[d] = x[d] == 1 ? 0 : at;
    at *= x[d];
  }
  const int64_t runs = numel(out_shape) / run;
  const int64_t grain = std::max<int64_t>(1, kGrainCopyBytes / (run * static_cast<int64_t>(sizeof(T))));
  parallel_for(0, runs, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      int64_t offset = 0;
      for (int64_t rest = r, d = static_cast<int64_t>(first) - 1; d >= 0; --d) {
        offset += rest % out_shape[d] * stride[d];
        rest /= out_shape[d];
      }
      T* dst = out + r * run;
      if (copy)
        std::copy(in + offset, in + offset + run, dst);
      else
        std::fill(dst, dst + run, in[offset]);
    }
  });
}

void broadcast_to_kernel(const KernelArgs& args) {
  const Tensor& x = args.inputs[0];
  Tensor& y = args.outputs[0];
  if (y.numel() == 0) return;
  if (x.numel() == y.numel()) {  // only 1s added or kept: the same bytes
    copy_bytes(x.raw(), y.raw(), static_cast<int64_t>(y.bytes()));
    return;
  }
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    broadcast_typed(x.data<T>(), y.data<T>(), x.shape(), y.shape());
  });
}

// ---- transpose ------------------------------------------------------------------------------

// A transpose reduced to its essentials: input dims `in_shape` (row-major) and `perm` (output
// axis d is input axis perm[d]), with size-1 axes dropped and input axes that stay adjacent and
// in order in the output merged into one.
struct TransposePlan {
  Shape in_shape;
  std::vector<int> perm;
};

TransposePlan simplify_transpose(const Shape& shape, const Ints& perm) {
  const int rank = static_cast<int>(shape.size());
  // Drop size-1 axes, renumbering the remaining input axes.
  std::vector<int> new_index(rank, -1);
  Shape kept_shape;
  for (int d = 0; d < rank; ++d) {
    if (shape[d] == 1) continue;
    new_index[d] = static_cast<int>(kept_shape.size());
    kept_shape.push_back(shape[d]);
  }
  std::vector<int> kept_perm;
  for (int64_t p : perm)
    if (new_index[p] >= 0) kept_perm.push_back(new_index[p]);
  // Merge runs of output axes that read consecutive input axes (p, p + 1, ...).
  const int n = static_cast<int>(kept_perm.size());
  std::vector<int> group_of_input(n, -1);  // the merged output axis each input axis joins
  std::vector<int64_t> group_size;
  std::vector<int> group_first_input;
  for (int d = 0; d < n; ++d) {
    const int p = kept_perm[d];
    if (d > 0 && kept_perm[d - 1] + 1 == p) {
      group_size.back() *= kept_shape[p];
    } else {
      group_size.push_back(kept_shape[p]);
      group_first_input.push_back(p);
    }
    group_of_input[p] = static_cast<int>(group_size.size()) - 1;
  }
  // The merged input's axes are the groups in input order.
  std::vector<int> groups_in_input_order;
  for (int p = 0; p < n; ++p) {
    const int group = group_of_input[p];
    if (group_first_input[group] == p) groups_in_input_order.push_back(group);
  }
  const int m = static_cast<int>(groups_in_input_order.size());
  std::vector<int> input_axis_of_group(m);
  TransposePlan plan;
  for (int i = 0; i < m; ++i) {
    input_axis_of_group[groups_in_input_order[i]] = i;
    plan.in_shape.push_back(group_size[groups_in_input_order[i]]);
  }
  for (int g = 0; g < m; ++g) plan.perm.push_back(input_axis_of_group[g]);
  return plan;
}

// Tile edge for 2-D transposes: a 32 x 32 tile of 4-byte elements is 4 KiB in and out.
constexpr int64_t kTile = 32;

// T is the dtype's storage type.
template <typename T>
void transpose_typed(const T* __restrict__ in, T* __restrict__ out, const TransposePlan& plan) {
  const int rank = static_cast<int>(plan.perm.size());
  const Ints in_strides = strides_of(plan.in_shape);
  Shape out_shape(rank);
  for (int d = 0; d < rank; ++d) out_shape[d] = plan.in_shape[plan.perm[d]];
  const int64_t total = numel(plan.in_shape);

  if (plan.perm[rank - 1] == rank - 1) {
    // The last axis stays last: copy contiguous runs of `run` elements. Every output row (all
    // output axes but the last) is one run; its input offset follows an odometer.
    const int64_t run = plan.in_shape[rank - 1];
    const int64_t rows = total / run;
    parallel_for(0, rows, std::max<int64_t>(1, kGrainCheap / run), [&](int64_t lo, int64_t hi) {
      Ints index = unravel(lo, Shape(out_shape.begin(), out_shape.end() - 1));
      int64_t offset = 0;
      for (int d = 0; d + 1 < rank; ++d) offset += index[d] * in_strides[plan.perm[d]];
      for (int64_t r = lo; r < hi; ++r) {
        const T* src = in + offset;
        T* dst = out + r * run;
        if (run >= 64) {
          std::memcpy(dst, src, static_cast<size_t>(run) * sizeof(T));
        } else {
          for (int64_t i = 0; i < run; ++i) dst[i] = src[i];
        }
        for (int d = rank - 2; d >= 0; --d) {  // odometer over the output row index
          offset += in_strides[plan.perm[d]];
          if (++index[d] < out_shape[d]) break;
          offset -= in_strides[plan.perm[d]] * index[d];
          index[d] = 0;
        }
      }
    });
    return;
  }

  // The last axis moves: a batch of 2-D transposes between input axis a = perm[rank - 1] (the
  // output's contiguous axis) and the input's last axis (output axis j), done tile by tile.
  // The other axes form the batch, walked in output order.
  const int a = plan.perm[rank - 1];
  int j = 0;
  while (plan.perm[j] != rank - 1) ++j;
  const Ints out_strides = strides_of(out_shape);
  const int64_t rows_a = plan.in_shape[a];         // along a: stride in_strides[a] in, 1 out
  const int64_t cols_c = plan.in_shape[rank - 1];  // along the last: stride 1 in, out_strides[j]
  const int64_t in_stride_a = in_strides[a], out_stride_c = out_strides[j];
  std::vector<int> batch_axes;  // output axes other than j and the last
  for (int d = 0; d + 1 < rank; ++d)
    if (d != j) batch_axes.push_back(d);
  Shape batch_shape;
  for (int d : batch_axes) batch_shape.push_back(out_shape[d]);
  const int64_t batches = numel(batch_shape);
  const int64_t tiles_a = (rows_a + kTile - 1) / kTile;
  // Work items: (batch, tile row along a); each writes its own output elements.
  parallel_for(0, batches * tiles_a, std::max<int64_t>(1, kGrainCheap / (kTile * cols_c)),
               [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t batch = item / tiles_a, tile = item % tiles_a;
      const Ints index = unravel(batch, batch_shape);
      int64_t in_base = 0, out_base = 0;
      for (size_t k = 0; k < batch_axes.size(); ++k) {
        in_base += index[k] * in_strides[plan.perm[batch_axes[k]]];
        out_base += index[k] * out_strides[batch_axes[k]];
      }
      const int64_t a0 = tile * kTile, a1 = std::min(rows_a, a0 + kTile);
      for (int64_t c0 = 0; c0 < cols_c; c0 += kTile) {
        const int64_t c1 = std::min(cols_c, c0 + kTile);
        for (int64_t c = c0; c < c1; ++c) {
          const T* src = in + in_base + c;
          T* dst = out + out_base + c * out_stride_c;
          for (int64_t r = a0; r < a1; ++r) dst[r] = src[r * in_stride_a];
        }
      }
    }
  });
}

void transpose_kernel(const KernelArgs& args) {
  const Tensor& x = args.inputs[0];
  Tensor& y = args.outputs[0];
  if (y.numel() == 0) return;
  Ints perm = args.attrs.ints("perm");
  const int rank = x.rank();
  if (perm.empty())
    for (int d = rank - 1; d >= 0; --d) perm.push_back(d);
  for (int64_t& p : perm) p = normalize_axis(p, rank);
  const TransposePlan plan = simplify_transpose(x.shape(), perm);
  if (plan.perm.size() <= 1) {  // nothing moves: the same bytes
    copy_bytes(x.raw(), y.raw(), static_cast<int64_t>(y.bytes()));
    return;
  }
  // Through the dtype's own storage type (Half, BFloat16 and bool included): plain copies.
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    transpose_typed(x.data<T>(), y.data<T>(), plan);
  });
}

// ---- attention, attention_grad, attention_qkv, attention_qkv_grad ----------------------------
//
// One code path for both layouts and the packed ops: a problem's q, k, v, out (and their
// gradients) are matrices whose rows are `ld*` elements apart, so "bhtd" (rows adjacent), "bthd"
// (rows H heads apart) and attention_qkv's packed (..., T, 3, H, D) (rows 3 H D apart, k and v
// H D and 2 H D after q) differ only in strides and base pointers: q, k, v are read in place
// from qkv and dq, dk, dv written in place into dqkv.

struct AttentionShape {
  int64_t slices;  // attention problems: the product of the leading dims (and heads, "bthd")
  int64_t tq, tk, d, dv;
  int64_t heads = 1;  // "bthd" and packed: H (problem b is head b % H); "bhtd": 1
  // Elements between consecutive rows of a problem: q and k (and dq, dk), v (and dv), out (and
  // dout). "bhtd": d, d, dv; "bthd": H d, Hkv d, Hkv dv; packed: 3 H d, 3 H d, H d.
  int64_t ld_q = 0, ld_k = 0, ld_v = 0, ld_o = 0;
  // Grouped-query attention: query heads per key/value head. Problem b reads k and v of
  // key/value problem b / group (the group's problems are consecutive).
  int64_t group = 1;
  // Consecutive problems (one batch entry's heads) that share a row of attention's key_bias.
  int64_t bias_heads = 1;
  // Offset of problem b's first row in a tensor of `rows` rows a problem, `cols` elements a
  // head's row, rows `ld` apart (lse: cols 1, ld H).
  int64_t base(int64_t b, int64_t rows, int64_t cols, int64_t ld) const {
    return b / heads * rows * ld + b % heads * cols;
  }
  // The same for k and v (dk, dv): the rows of the key/value problem that problem b reads.
  int64_t kv_base(int64_t b, int64_t cols, int64_t ld) const {
    const int64_t kv = b / group, kv_heads = heads > 1 ? heads / group : 1;
    return kv / kv_heads * tk * ld + kv % kv_heads * cols;
  }
};

AttentionShape attention_shape(const Shape& q, const Shape& k, const Shape& v,
                               const Attributes& attrs) {
  const size_t r = q.size();
  if (attrs.s("layout") == "bthd") {
    const int64_t h = q[r - 2], hk = k[r - 2];
    AttentionShape s{h, q[r - 3], k[r - 3], q[r - 1], v[r - 1], h};
    s.ld_q = h * s.d;
    s.ld_k = hk * s.d;
    s.ld_v = hk * s.dv;
    s.ld_o = h * s.dv;
    s.group = hk > 0 ? h / hk : 1;
    s.bias_heads = h;
    for (size_t i = 0; i + 3 < r; ++i) s.slices *= q[i];
    return s;
  }
  AttentionShape s{1, q[r - 2], k[r - 2], q[r - 1], v[r - 1]};
  s.ld_q = s.ld_k = s.d;
  s.ld_v = s.ld_o = s.dv;
  if (r >= 3 && k[r - 3] > 0) s.group = q[r - 3] / k[r - 3];
  if (r >= 3) s.bias_heads = q[r - 3];
  for (size_t i = 0; i + 2 < r; ++i) s.slices *= q[i];
  return s;
}

// attention_qkv's problems for qkv (..., T, 3, H, D): q, k, v at column offsets 0, H D, 2 H D of
// rows 3 H D long; out (..., T, H, D) as for "bthd".
AttentionShape packed_attention_shape(const Shape& qkv) {
  const size_t r = qkv.size();
  const int64_t t = qkv[r - 4], h = qkv[r - 2], d = qkv[r - 1];
  AttentionShape s{h, t, t, d, d, h};
  s.bias_heads = h;
  s.ld_q = s.ld_k = s.ld_v = 3 * h * d;
  s.ld_o = h * d;
  for (size_t i = 0; i + 4 < r; ++i) s.slices *= qkv[i];
  return s;
}

float attention_scale(const Attributes& attrs, int64_t head_dim) {
  if (attrs.has("scale")) return static_cast<float>(attrs.f("scale"));
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

// C (m x n, row-major, rows ldc apart) = alpha * op(A) op(B) + beta * C, with op(A) m x k,
// op(B) k x n and the rows of A and B lda and ldb apart.
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
           const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
           float beta = 0.0f) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

// Adds key_bias's row `bias` to the first `live` scores of `row`; returns the row's largest score
// (-inf when the bias masked every key: the row's P is then 0/0, NaN, as softmax's).
float add_key_bias(float* row, const float* bias, int64_t live) {
  for (int64_t j = 0; j < live; ++j) row[j] += bias[j];
  return max_row_ignoring_nan(row, live);
}

// exp(row - m) over the first `live` scores, exactly 0 for a score of -inf (the bias masked it;
// exp_f32 stops at e^-87).
void exp_biased_scores(float* row, float m, int64_t live) {
  for (int64_t j = 0; j < live; ++j) row[j] = row[j] == -INFINITY ? 0.0f : exp_f32(row[j] - m);
}

// P (tq x tk) = softmax over each row of S = scale Q K^T (+ `bias`, key_bias's row of the
// problem, when not null), with the causal mask (key j > query i gets exactly 0; key 0 never
// masked). Written over the scores in place; lse[i * lse_stride] = the row's log-sum-exp of S.
// q and k rows are s.ld_q and s.ld_k elements apart.
void attention_probs(const float* q, const float* k, const float* bias, const AttentionShape& s,
                     bool causal, float scale, float* p, float* lse, int64_t lse_stride) {
  sgemm(false, true, s.tq, s.tk, s.d, scale, q, s.ld_q, k, s.ld_k, p, s.tk);
  for (int64_t i = 0; i < s.tq; ++i) {
    float* row = p + i * s.tk;
    const int64_t live = causal ? std::min(i + 1, s.tk) : s.tk;  // unmasked keys: [0, live)
    if (bias != nullptr) {
      const float max = add_key_bias(row, bias, live);
      exp_biased_scores(row, max, live);
      const double sum = sum_row(row, live);
      const float inv_sum = static_cast<float>(1.0 / sum);
      for (int64_t j = 0; j < live; ++j) row[j] *= inv_sum;
      std::fill(row + live, row + s.tk, 0.0f);
      lse[i * lse_stride] = static_cast<float>(static_cast<double>(max) + std::log(sum));
      continue;
    }
    const float max = max_row_ignoring_nan(row, live);
    for (int64_t j = 0; j < live; ++j) row[j] = exp_f32(row[j] - max);
    const double sum = sum_row(row, live);
    const float inv_sum = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < live; ++j) row[j] *= inv_sum;
    std::fill(row + live, row + s.tk, 0.0f);
    lse[i * lse_stride] = static_cast<float>(static_cast<double>(max) + std::log(sum));
  }
}

// P (tq x tk) = exp(S - lse) with S = scale Q K^T (+ `bias` when not null) and the saved
// log-sum-exp of each row; masked keys get exactly 0.
void attention_probs_from_lse(const float* q, const float* k, const float* bias, const float* lse,
                              int64_t lse_stride, const AttentionShape& s, bool causal,
                              float scale, float* p) {
  sgemm(false, true, s.tq, s.tk, s.d, scale, q, s.ld_q, k, s.ld_k, p, s.tk);
  for (int64_t i = 0; i < s.tq; ++i) {
    float* row = p + i * s.tk;
    const int64_t live = causal ? std::min(i + 1, s.tk) : s.tk;
    const float m = lse[i * lse_stride];
    if (bias != nullptr) {
      add_key_bias(row, bias, live);
      exp_biased_scores(row, m, live);
    } else {
      for (int64_t j = 0; j < live; ++j) row[j] = exp_f32(row[j] - m);
    }
    std::fill(row + live, row + s.tk, 0.0f);
  }
}

// key_bias's row for problem b (null without a bias).
const float* bias_row(const float* bias, const AttentionShape& s, int64_t b) {
  return bias == nullptr ? nullptr : bias + b / s.bias_heads * s.tk;
}

// The forward of every problem: out and lse from q, k, v (and key_bias, when not null) laid out
// as `s` says.
void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                       const float* bias, bool causal, float scale, float* out, float* lse) {
  std::vector<float> p(static_cast<size_t>(s.tq * s.tk));
  for (int64_t b = 0; b < s.slices; ++b) {
    attention_probs(q + s.base(b, s.tq, s.d, s.ld_q), k + s.kv_base(b, s.d, s.ld_k), bias_row(bias, s, b),
                    s, causal, scale, p.data(), lse + s.base(b, s.tq, 1, s.heads), s.heads);
    sgemm(false, false, s.tq, s.dv, s.tk, 1.0f, p.data(), s.tk, v + s.kv_base(b, s.dv, s.ld_v),
          s.ld_v, out + s.base(b, s.tq, s.dv, s.ld_o), s.ld_o);
  }
}

// The backward of every problem: dq (rows ld_q apart), dk (ld_k) and dv (ld_v) from q, k, v,
// out, dout and lse. Every element of a problem's dq, dk, dv rows is written (the sgemms
// overwrite; the other query heads of a key/value group add to the first one's dk and dv).
void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const float* out, const float* dout, const float* lse, const float* bias,
                        bool causal, float scale, float* dq, float* dk, float* dv) {
  std::vector<float> p(static_cast<size_t>(s.tq * s.tk)), dp(p.size());
  for (int64_t b = 0; b < s.slices; ++b) {
    const int64_t q0 = s.base(b, s.tq, s.d, s.ld_q), k0 = s.kv_base(b, s.d, s.ld_k);
    const int64_t v0 = s.kv_base(b, s.dv, s.ld_v), o0 = s.base(b, s.tq, s.dv, s.ld_o);
    const float kv_beta = b % s.group == 0 ? 0.0f : 1.0f;
    const float* qb = q + q0;
    const float* kb = k + k0;
    const float* vb = v + v0;
    const float* ob = out + o0;
    const float* dob = dout + o0;
    attention_probs_from_lse(qb, kb, bias_row(bias, s, b), lse + s.base(b, s.tq, 1, s.heads), s.heads, s,
                             causal, scale, p.data());
    sgemm(true, false, s.tk, s.dv, s.tq, 1.0f, p.data(), s.tk, dob, s.ld_o, dv + v0, s.ld_v,
          kv_beta);  // P^T dO
    sgemm(false, true, s.tq, s.tk, s.dv, 1.0f, dob, s.ld_o, vb, s.ld_v, dp.data(),
          s.tk);  // dO V^T
    // Softmax backward, row by row, into dp: dS = P (dP - D), D_i = dO_i . O_i (which equals
    // sum_j P_ij dP_ij). Masked keys have P = 0.
    for (int64_t i = 0; i < s.tq; ++i) {
      const float* pr = p.data() + i * s.tk;
      const float* orow = ob + i * s.ld_o;
      const float* dorow = dob + i * s.ld_o;
      float* dr = dp.data() + i * s.tk;
      const float weighted =
          static_cast<float>(blocked_sum(s.dv, [&](int64_t c) { return dorow[c] * orow[c]; }));
      for (int64_t j = 0; j < s.tk; ++j) dr[j] = pr[j] * (dr[j] - weighted);
    }
    sgemm(false, false, s.tq, s.d, s.tk, scale, dp.data(), s.tk, kb, s.ld_k, dq + q0,
          s.ld_q);  // dS K
    sgemm(true, false, s.tk, s.d, s.tq, scale, dp.data(), s.tk, qb, s.ld_q, dk + k0, s.ld_k,
          kv_beta);  // dS^T Q
  }
}

void attention_kernel(const KernelArgs& args) {
  const AttentionShape s = attention_shape(args.inputs[0].shape(), args.inputs[1].shape(),
                                           args.inputs[2].shape(), args.attrs);
  const float* bias = args.inputs.size() > 3 ? args.inputs[3].data<float>() : nullptr;
  attention_forward(s, args.inputs[0].data<float>(), args.inputs[1].data<float>(),
                    args.inputs[2].data<float>(), bias, args.attrs.b("causal"),
                    attention_scale(args.attrs, s.d), args.outputs[0].data<float>(),
                    args.outputs[1].data<float>());
}

void attention_grad_kernel(const KernelArgs& args) {
  const AttentionShape s = attention_shape(args.inputs[0].shape(), args.inputs[1].shape(),
                                           args.inputs[2].shape(), args.attrs);
  const float* bias = args.inputs.size() > 6 ? args.inputs[6].data<float>() : nullptr;
  attention_backward(s, args.inputs[0].data<float>(), args.inputs[1].data<float>(),
                     args.inputs[2].data<float>(), args.inputs[3].data<float>(),
                     args.inputs[4].data<float>(), args.inputs[5].data<float>(), bias,
                     args.attrs.b("causal"), attention_scale(args.attrs, s.d),
                     args.outputs[0].data<float>(), args.outputs[1].data<float>(),
                     args.outputs[2].data<float>());
}

// attention_qkv: q, k, v read in place from the packed qkv.
void attention_qkv_kernel(const KernelArgs& args) {
  const AttentionShape s = packed_attention_shape(args.inputs[0].shape());
  const float* qkv = args.inputs[0].data<float>();
  const int64_t hd = s.heads * s.d;
  const float* bias = args.inputs.size() > 1 ? args.inputs[1].data<float>() : nullptr;
  attention_forward(s, qkv, qkv + hd, qkv + 2 * hd, bias, args.attrs.b("causal"),
                    attention_scale(args.attrs, s.d), args.outputs[0].data<float>(),
                    args.outputs[1].data<float>());
}

// attention_qkv_grad: dq, dk, dv written in place into their slots of dqkv (together they cover
// every element of it).
void attention_qkv_grad_kernel(const KernelArgs& args) {
  const AttentionShape s = packed_attention_shape(args.inputs[0].shape());
  const float* qkv = args.inputs[0].data<float>();
  float* dqkv = args.outputs[0].data<float>();
  const int64_t hd = s.heads * s.d;
  attention_backward(s, qkv, qkv + hd, qkv + 2 * hd, args.inputs[1].data<float>(),
                     args.inputs[2].data<float>(), args.inputs[3].data<float>(),
                     args.inputs.size() > 4 ? args.inputs[4].data<float>() : nullptr,
                     args.attrs.b("causal"), attention_scale(args.attrs, s.d), dqkv, dqkv + hd,
                     dqkv + 2 * hd);
}

// Every length at least 1 (an empty sum or softmax is left to the reference), and every BLAS
// dimension (leading dimensions included) and the scores buffer within BLAS's int.
bool attention_shape_supported(const AttentionShape& s) {
  for (int64_t n : {s.tq, s.tk, s.d, s.dv, s.heads, s.ld_q, s.ld_k, s.ld_v, s.ld_o, s.group})
    if (n < 1 || n > INT_MAX) return false;
  return s.tq * s.tk <= INT_MAX;
}

bool attention_supported(const NodeView& node) {
  if (!all_dtype(node, DType::kF32) || node.input_types.size() < 3) return false;
  const TensorType& q = node.input_types[0];
  const bool bthd = node.node.attrs.s("layout") == "bthd";
  if (q.rank() < (bthd ? 3 : 2)) return false;
  return attention_shape_supported(attention_shape(q.shape, node.input_types[1].shape,
                                                   node.input_types[2].shape, node.node.attrs));
}

// attention_qkv and attention_qkv_grad: f32 throughout, qkv (..., T, 3, H, D) non-empty.
bool attention_qkv_supported(const NodeView& node) {
  if (!all_dtype(node, DType::kF32) || node.input_types.empty()) return false;
  const TensorType& qkv = node.input_types[0];
  if (qkv.rank() < 4 || qkv.shape[qkv.rank() - 3] != 3) return false;
  return attention_shape_supported(packed_attention_shape(qkv.shape));
}

KernelImpl openblas(std::function<bool(const NodeView&)> supports, KernelFn kernel) {
  return KernelImpl{"openblas", Device::kCpu, kOpenBlasPriority, std::move(supports),
                    std::move(kernel)};
}

}  // namespace

void register_train_kernels(KernelRegistry& registry) {
  registry.add(Op::kOptimizerUpdate, fast(optimizer_update_supported, optimizer_update_kernel, /*in_place_ok=*/true));
  registry.add(Op::kReshape, fast({}, reshape_kernel));
  registry.add(Op::kTranspose, fast({}, transpose_kernel));
  registry.add(Op::kBroadcastTo, fast({}, broadcast_to_kernel));
  registry.add(Op::kAttention, openblas(attention_supported, attention_kernel));
  registry.add(Op::kAttentionGrad, openblas(attention_supported, attention_grad_kernel));
  registry.add(Op::kAttentionQkv, openblas(attention_qkv_supported, attention_qkv_kernel));
  registry.add(Op::kAttentionQkvGrad,
               openblas(attention_qkv_supported, attention_qkv_grad_kernel));
}

}  // namespace kiln::cpu
