// Dialect "cpu", row-wise nn ops in f32 over the last axis: softmax, log_softmax, layer_norm and
// cross_entropy. Each works on (rows, C) with one row at a time in cache: a max pass, an exp
// pass, a scale pass, all vectorized (fast_math.h, row_ops.h); rows are split across threads.
// Row statistics (sums, means, variances, losses) are accumulated in f64 across blocks, so they
// stay close to the f64 reference for long rows.
// softmax/log_softmax over another axis are refused by supports() (the reference serves them).
#include <cmath>
#include <string>
#include <vector>

#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/fast_math.h"
#include "backends/cpu/row_ops.h"
#include "support/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {
namespace {

struct Rows {
  int64_t rows = 1, cols = 1;
};
Rows rows_of(const Shape& shape) {
  Rows r{1, shape.back()};
  for (size_t d = 0; d + 1 < shape.size(); ++d) r.rows *= shape[d];
  return r;
}

// Rows per thread chunk so that a chunk holds about `grain` elements.
int64_t row_grain(int64_t cols, int64_t grain) { return std::max<int64_t>(1, grain / std::max<int64_t>(cols, 1)); }

// ---- softmax, log_softmax ----

void exp_shifted(const float* __restrict__ x, float shift, float* __restrict__ y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_f32(x[i] - shift);
}

void softmax_row(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  const float max = max_row_ignoring_nan(x, n);
  exp_shifted(x, max, y, n);
  const float inv_sum = static_cast<float>(1.0 / sum_row(y, n));
  for (int64_t i = 0; i < n; ++i) y[i] *= inv_sum;
}

void log_softmax_row(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  const float max = max_row_ignoring_nan(x, n);
  exp_shifted(x, max, y, n);  // y as scratch for the exps
  const float log_sum = static_cast<float>(std::log(sum_row(y, n)));
  // (x - max) first: exact for nearby values, so log_sum's rounding is the only error.
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - max) - log_sum;
}

template <void (*RowFn)(const float*, float*, int64_t)>
void softmax_kernel(const KernelArgs& args) {
  const Rows r = rows_of(args.inputs[0].shape());
  const float* x = args.inputs[0].data<float>();
  float* y = args.outputs[0].data<float>();
  parallel_for(0, r.rows, row_grain(r.cols, kGrainExpensive), [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) RowFn(x + row * r.cols, y + row * r.cols, r.cols);
  });
}

bool softmax_supported(const NodeView& node) {
  if (!all_dtype(node, DType::kF32)) return false;
  const int rank = static_cast<int>(node.input_types[0].shape.size());
  const int64_t axis = node.node.attrs.i("axis");
  return rank >= 1 && (axis == -1 || axis == rank - 1);
}

// ---- layer_norm ----

void layer_norm_row(const float* __restrict__ x, const float* __restrict__ gamma,
                    const float* __restrict__ beta, float* __restrict__ y, int64_t n,
                    double epsilon) {
  const double mean = sum_row(x, n) / static_cast<double>(n);
  const float mean_f = static_cast<float>(mean);
  // Squares about the rounded mean; the correction (mean - mean_f)^2 makes it the variance
  // about the exact one.
  const double shift = mean - static_cast<double>(mean_f);
  const double variance =
      blocked_sum(n, [&](int64_t i) {
        const float d = x[i] - mean_f;
        return d * d;
      }) / static_cast<double>(n) -
      shift * shift;
  const float inv_std = static_cast<float>(1.0 / std::sqrt(std::max(variance, 0.0) + epsilon));
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean_f) * inv_std * gamma[i] + beta[i];
}

void layer_norm_kernel(const KernelArgs& args) {
  const Rows r = rows_of(args.inputs[0].shape());
  const float* x = args.inputs[0].data<float>();
  const float* gamma = args.inputs[1].data<float>();
  const float* beta = args.inputs[2].data<float>();
  float* y = args.outputs[0].data<float>();
  const double epsilon = args.attrs.f("epsilon");
  parallel_for(0, r.rows, row_grain(r.cols, kGrainCheap), [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row)
      layer_norm_row(x + row * r.cols, gamma, beta, y + row * r.cols, r.cols, epsilon);
  });
}

bool layer_norm_supported(const NodeView& node) {
  if (!all_dtype(node, DType::kF32) || node.input_types.size() != 3) return false;
  const Shape& x = node.input_types[0].shape;
  if (x.empty() || x.back() == 0) return false;
  const Shape row{x.back()};
  return node.input_types[1].shape == row && node.input_types[2].shape == row;
}

// ---- cross_entropy ----

// logsumexp(row) - row[label], in f64.
double cross_entropy_row(const float* __restrict__ x, int64_t n, int64_t label) {
  const float max = max_row_ignoring_nan(x, n);
  const double sum = blocked_sum(n, [&](int64_t i) { return exp_f32(x[i] - max); });
  return static_cast<double>(max) + std::log(sum) - static_cast<double>(x[label]);
}

template <typename Label>
void cross_entropy_kernel(const KernelArgs& args) {
  const Tensor& logits = args.inputs[0];
  const Rows r = rows_of(logits.shape());
  const float* x = logits.data<float>();
  const Label* labels = args.inputs[1].data<Label>();
  float* out = args.outputs[0].data<float>();
  const int64_t ignore_index = args.attrs.i("ignore_index");
  const std::string& reduction = args.attrs.s("reduction");
  // Per-row losses in f64, summed in row order afterwards: the result does not depend on the
  // thread count.
  std::vector<double> losses(static_cast<size_t>(r.rows), 0.0);
  parallel_for(0, r.rows, row_grain(r.cols, kGrainExpensive), [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t label = static_cast<int64_t>(labels[row]);
      if (label == ignore_index) continue;
      if (label < 0 || label >= r.cols)
        fail("cross_entropy: label {} (row {}) is out of range [0, {}) and is not ignore_index {}",
             label, row, r.cols, ignore_index);
      losses[static_cast<size_t>(row)] = cross_entropy_row(x + row * r.cols, r.cols, label);
    }
  });
  if (reduction == "none") {
    for (int64_t row = 0; row < r.rows; ++row) out[row] = static_cast<float>(losses[row]);
    return;
  }
  double total = 0.0;
  int64_t counted = 0;
  for (int64_t row = 0; row < r.rows; ++row) {
    total += losses[static_cast<size_t>(row)];
    counted += static_cast<int64_t>(labels[row]) != ignore_index;
  }
  if (reduction == "mean") total = counted == 0 ? 0.0 : total / static_cast<double>(counted);
  out[0] = static_cast<float>(total);
}

bool cross_entropy_supported(const NodeView& node) {
  if (node.input_types.size() != 2) return false;
  const TensorType& logits = node.input_types[0];
  const DType labels = node.input_types[1].dtype;
  return logits.dtype == DType::kF32 && node.output_types[0].dtype == DType::kF32 &&
         logits.rank() >= 1 && logits.shape.back() >= 1 &&
         (labels == DType::kI32 || labels == DType::kI64);
}

KernelImpl fast(std::function<bool(const NodeView&)> supports, KernelFn kernel) {
  return KernelImpl{"cpu", Device::kCpu, kFastPriority, std::move(supports), std::move(kernel)};
}

}  // namespace

void register_nn_kernels(KernelRegistry& registry) {
  registry.add(Op::kSoftmax, fast(softmax_supported, softmax_kernel<softmax_row>));
  registry.add(Op::kLogSoftmax, fast(softmax_supported, softmax_kernel<log_softmax_row>));
  registry.add(Op::kLayerNorm, fast(layer_norm_supported, layer_norm_kernel));
  registry.add(Op::kCrossEntropy, fast(cross_entropy_supported, [](const KernelArgs& args) {
                 if (args.inputs[1].dtype() == DType::kI32)
                   cross_entropy_kernel<int32_t>(args);
                 else
                   cross_entropy_kernel<int64_t>(args);
               }));
}

}  // namespace kiln::cpu
