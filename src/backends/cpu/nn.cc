// Dialect "cpu", row-wise nn ops in f32 over the last axis: softmax, log_softmax, layer_norm,
// rms_norm (and its gradient), rotary_embedding and cross_entropy. Each works on (rows, C) with one row at a time in cache: a max pass, an exp
// pass, a scale pass, all vectorized (fast_math.h, row_ops.h); rows are split across threads.
// Row statistics (sums, means, variances, losses) are accumulated in f64 across blocks, so they
// stay close to the f64 reference for long rows.
// softmax/log_softmax over another axis are refused by supports() (the reference serves them).
#include <algorithm>
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

// ---- rms_norm, rms_norm_grad ----

double inverse_rms(const float* __restrict__ x, int64_t n, double epsilon) {
  const double mean_square = blocked_sum(n, [&](int64_t i) { return x[i] * x[i]; }) / static_cast<double>(n);
  return 1.0 / std::sqrt(mean_square + epsilon);
}

void rms_norm_kernel(const KernelArgs& args) {
  const Rows r = rows_of(args.inputs[0].shape());
  const float* x = args.inputs[0].data<float>();
  const float* gamma = args.inputs[1].data<float>();
  float* y = args.outputs[0].data<float>();
  const double epsilon = args.attrs.f("epsilon");
  parallel_for(0, r.rows, row_grain(r.cols, kGrainCheap), [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      const float* xr = x + row * r.cols;
      float* yr = y + row * r.cols;
      const float inv = static_cast<float>(inverse_rms(xr, r.cols, epsilon));
      for (int64_t i = 0; i < r.cols; ++i) yr[i] = xr[i] * inv * gamma[i];
    }
  });
}

// dx = inv g - inv^3 x sum(g x) / C with g = dy gamma; dgamma = sum over rows of dy x inv. The
// column sums go per thread chunk into f64 partials, added in chunk order (deterministic).
void rms_norm_grad_kernel(const KernelArgs& args) {
  const Rows r = rows_of(args.inputs[0].shape());
  const float* x = args.inputs[0].data<float>();
  const float* gamma = args.inputs[1].data<float>();
  const float* dy = args.inputs[2].data<float>();
  float* dx = args.outputs[0].data<float>();
  float* dgamma = args.outputs[1].data<float>();
  const double epsilon = args.attrs.f("epsilon");
  const int64_t grain = row_grain(r.cols, kGrainCheap);
  const int64_t chunks = (r.rows + grain - 1) / grain;
  std::vector<double> partial(static_cast<size_t>(std::max<int64_t>(chunks, 1) * r.cols), 0.0);
  parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      double* sums = partial.data() + chunk * r.cols;
      for (int64_t row = chunk * grain; row < std::min(r.rows, (chunk + 1) * grain); ++row) {
        const float* xr = x + row * r.cols;
        const float* dyr = dy + row * r.cols;
        float* dxr = dx + row * r.cols;
        const double inv = inverse_rms(xr, r.cols, epsilon);
        const double dot = blocked_sum(r.cols, [&](int64_t i) { return dyr[i] * gamma[i] * xr[i]; });
        const float inv_f = static_cast<float>(inv);
        const float correction = static_cast<float>(inv * inv * inv * dot / static_cast<double>(r.cols));
        for (int64_t i = 0; i < r.cols; ++i) {
          dxr[i] = inv_f * dyr[i] * gamma[i] - correction * xr[i];
          sums[i] += static_cast<double>(dyr[i] * xr[i] * inv_f);
        }
      }
    }
  });
  for (int64_t i = 0; i < r.cols; ++i) {
    double total = 0.0;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) total += partial[chunk * r.cols + i];
    dgamma[i] = static_cast<float>(total);
  }
}

bool rms_norm_supported(const NodeView& node) {
  if (!all_dtype(node, DType::kF32)) return false;
  const Shape& x = node.input_types[0].shape;
  return !x.empty() && x.back() > 0 && node.input_types[1].shape == Shape{x.back()};
}

// ---- rotary_embedding ----

// Rows of D elements at position (row / heads) % T; one cos/sin table of T x D/2 per call
// (angles in f64, as the reference), shared by every row.
void rotary_kernel(const KernelArgs& args) {
  const Tensor& x_t = args.inputs[0];
  const Shape& shape = x_t.shape();
  const bool bthd = args.attrs.s("layout") == "bthd";
  const size_t rank = shape.size();
  const int64_t d = shape.back(), half = d / 2, t = shape[bthd ? rank - 3 : rank - 2];
  const int64_t heads = bthd ? shape[rank - 2] : 1, rows = x_t.numel() / std::max<int64_t>(d, 1);
  const double base = args.attrs.f("base"), sign = args.attrs.b("inverse") ? -1.0 : 1.0;
  std::vector<float> cos_table(static_cast<size_t>(t * half)), sin_table(cos_table.size());
  for (int64_t i = 0; i < half; ++i) {
    const double frequency = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
    for (int64_t p = 0; p < t; ++p) {
      const double angle = sign * static_cast<double>(p) * frequency;
      cos_table[p * half + i] = static_cast<float>(std::cos(angle));
      sin_table[p * half + i] = static_cast<float>(std::sin(angle));
    }
  }
  const float* x = x_t.data<float>();
  float* y = args.outputs[0].data<float>();
  parallel_for(0, rows, row_grain(d, kGrainCheap), [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      const float* c = cos_table.data() + (row / heads % t) * half;
      const float* s = sin_table.data() + (row / heads % t) * half;
      const float* x1 = x + row * d;
      const float* x2 = x1 + half;
      float* y1 = y + row * d;
      float* y2 = y1 + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        y1[i] = a * c[i] - b * s[i];
        y2[i] = b * c[i] + a * s[i];
      }
    }
  });
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
  registry.add(Op::kRmsNorm, fast(rms_norm_supported, rms_norm_kernel));
  registry.add(Op::kRmsNormGrad, fast(rms_norm_supported, rms_norm_grad_kernel));
  registry.add(Op::kRotaryEmbedding,
               fast([](const NodeView& node) { return all_dtype(node, DType::kF32); }, rotary_kernel));
  registry.add(Op::kCrossEntropy, fast(cross_entropy_supported, [](const KernelArgs& args) {
                 if (args.inputs[1].dtype() == DType::kI32)
                   cross_entropy_kernel<int32_t>(args);
                 else
                   cross_entropy_kernel<int64_t>(args);
               }));
}

}  // namespace kiln::cpu
