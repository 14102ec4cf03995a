// The fused classifier (loss and logits gradient in one pass) on the CPU: dialect "cpu" for
// `fused` nodes of kind "classifier" (passes/classifier.h builds them; their contract,
// ops/fused/classifier.h, says which bodies, and this kernel takes every one of them).
//
// Per row, in f32 (the body's compute dtype): the row as f32 (converted from bf16/f16 into a
// per-thread buffer; f32 rows are read in place), its max, e_i = exp(x_i - max) into the buffer
// with their sum (blocks of f32 lanes added in f64, row_ops.h), the row loss
// max + log(sum) - x[label] in f64, then dlogits_i = e_i * (scale / sum), minus scale at the
// label, stored in the gradient's dtype. scale = dloss / counted rows ("mean"), dloss ("sum") or
// dloss[row] ("none"); ignored rows get a zero gradient and add nothing. Rows are split over the
// threads (support/parallel.h); per-row losses are kept and summed in row order afterwards, so
// the loss does not depend on the thread count.
//
// In place: the gradient may share memory with the logits (the memory plan puts it there when
// the logits die at the node: in_place_ok), and "none"'s per-row loss may share memory with the
// per-row dloss. Each row is read whole (into the buffer, or its max and exps from the row)
// before any element of it is written, no loop reads one array while writing the other, and
// dloss[row] is read before any loss is written (after the row loop).
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/fast_math.h"
#include "backends/cpu/row_ops.h"
#include "ops/fused/classifier.h"
#include "ops/fused/kind.h"
#include "support/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {
namespace {

// e[i] = exp(x[i] - max) for i < n, returning their sum; x may be e (same index only).
double exp_and_sum(const float* x, float max, float* e, int64_t n) {
  double total = 0.0;
  for (int64_t start = 0; start < n; start += kSumBlock) {
    const int64_t end = std::min(n, start + kSumBlock);
    float block = 0.0f;
#pragma omp simd reduction(+ : block)
    for (int64_t i = start; i < end; ++i) {
      const float v = exp_f32(x[i] - max);
      e[i] = v;
      block += v;
    }
    total += block;
  }
  return total;
}

template <typename T>
float to_f32(T v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, BFloat16>) return bfloat16_to_float(v);
  else return half_to_float(v);
}
template <typename T>
T from_f32(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, BFloat16>) return float_to_bfloat16(v);
  else return float_to_half(v);
}

template <typename T>
void load_row(const T* __restrict__ x, float* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_f32(x[i]);
}

// g[i] = e[i] * k, then g[label] -= scale; g is not e.
template <typename G>
void store_grad(const float* __restrict__ e, float k, float scale, int64_t label,
                G* __restrict__ g, int64_t n) {
  if constexpr (std::is_same_v<G, float>) {
    for (int64_t i = 0; i < n; ++i) g[i] = e[i] * k;
    g[label] = e[label] * k - scale;
  } else {
    for (int64_t i = 0; i < n; ++i) g[i] = from_f32<G>(e[i] * k);
    g[label] = from_f32<G>(e[label] * k - scale);
  }
}

template <typename T, typename G, typename Label>
void classifier_kernel(const KernelArgs& args, const ClassifierBody& spec) {
  const T* logits = args.inputs[0].data<T>();
  const Label* labels = args.inputs[1].data<Label>();
  const float* dloss = args.inputs[2].data<float>();
  float* loss = args.outputs[0].data<float>();
  G* grad = args.outputs[1].data<G>();
  const int64_t rows = spec.rows, vocab = spec.vocab, ignore = spec.ignore_index;
  const bool none = spec.reduction == "none", mean = spec.reduction == "mean";
  int64_t counted = 0;
  for (int64_t r = 0; r < rows; ++r) counted += static_cast<int64_t>(labels[r]) != ignore;
  // Read now: a scalar dloss may share memory with the scalar loss written at the end.
  const double shared_scale =
      none || rows == 0 ? 0.0
                        : (mean ? (counted == 0 ? 0.0 : dloss[0] / static_cast<double>(counted))
                                : static_cast<double>(dloss[0]));
  std::vector<double> row_loss(static_cast<size_t>(rows), 0.0);
  const int64_t grain = std::max<int64_t>(1, kGrainExpensive / std::max<int64_t>(vocab, 1));
  parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> buffer(static_cast<size_t>(vocab));
    float* e = buffer.data();
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t label = static_cast<int64_t>(labels[r]);
      G* g = grad + r * vocab;
      if (label == ignore) {
        for (int64_t i = 0; i < vocab; ++i) g[i] = from_f32<G>(0.0f);
        continue;
      }
      if (label < 0 || label >= vocab)
        fail("cross_entropy: label {} (row {}) is out of range [0, {}) and is not ignore_index {}",
             label, r, vocab, ignore);
      const double scale = none ? static_cast<double>(dloss[r]) : shared_scale;
      const float* x = nullptr;
      if constexpr (std::is_same_v<T, float>) {
        x = logits + r * vocab;  // read in place; exps go to the buffer
      } else {
        load_row(logits + r * vocab, e, vocab);
        x = e;  // exps overwrite the converted row
      }
      const float at_label = x[label];
      const float max = max_row_ignoring_nan(x, vocab);
      const double sum = exp_and_sum(x, max, e, vocab);
      row_loss[static_cast<size_t>(r)] =
          static_cast<double>(max) + std::log(sum) - static_cast<double>(at_label);
      store_grad<G>(e, static_cast<float>(scale / sum), static_cast<float>(scale), label, g, vocab);
    }
  });
  if (none) {
    for (int64_t r = 0; r < rows; ++r) loss[r] = static_cast<float>(row_loss[static_cast<size_t>(r)]);
    return;
  }
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r) total += row_loss[static_cast<size_t>(r)];
  if (mean) total = counted == 0 ? 0.0 : total / static_cast<double>(counted);
  loss[0] = static_cast<float>(total);
}

template <typename T, typename G>
void dispatch_labels(const KernelArgs& args, const ClassifierBody& spec) {
  if (spec.labels == DType::kI32) classifier_kernel<T, G, int32_t>(args, spec);
  else classifier_kernel<T, G, int64_t>(args, spec);
}

template <typename T>
void dispatch_grad(const KernelArgs& args, const ClassifierBody& spec) {
  switch (spec.grad) {
    case DType::kBF16: return dispatch_labels<T, BFloat16>(args, spec);
    case DType::kF16: return dispatch_labels<T, Half>(args, spec);
    default: return dispatch_labels<T, float>(args, spec);
  }
}

bool classifier_supported(const NodeView& view) {
  const Node& node = view.node;
  return is_fused(node, FusedKind::kClassifier) && match_classifier_body(*node.body).has_value();
}

void run_classifier(const KernelArgs& args) {
  KILN_CHECK(args.body != nullptr, "fused classifier: the kernel was called without the body");
  const std::optional<ClassifierBody> spec = match_classifier_body(*args.body);
  KILN_CHECK(spec.has_value(), "fused classifier: the body @{} is not a classifier body",
             args.body->name);
  switch (spec->logits) {
    case DType::kBF16: return dispatch_grad<BFloat16>(args, *spec);
    case DType::kF16: return dispatch_grad<Half>(args, *spec);
    default: return dispatch_grad<float>(args, *spec);
  }
}

}  // namespace

void register_classifier_kernels(KernelRegistry& registry) {
  // Registered before the generic fused kernel (fast_kernels.cc runs first), so at the same
  // priority this one is chosen for classifier bodies.
  registry.add(Op::kFused, KernelImpl{"cpu", Device::kCpu, kFastPriority, classifier_supported,
                                      run_classifier, /*in_place_ok=*/true});
}

}  // namespace kiln::cpu
