// The fused classifier (loss and logits gradient in one pass) on the GPU: the "cuda-nn" kernel
// for `fused` nodes of kind "classifier" (ops/fused/classifier.h), launched through
// classifier::fused_classifier (classifier.cu). Every classifier body is taken: logits f32, bf16
// or f16, a gradient of the logits' type (or 16 bits from f32 logits), i32/i64 labels, every
// reduction. dloss stays on the device.
#include "backends/cuda/classifier/classifier.cuh"

#include <cuda_runtime.h>

#include "backends/cuda/registration.h"
#include "ops/fused/classifier.h"
#include "ops/fused/kind.h"

namespace kiln::cuda {
namespace {

// Above every other CUDA dialect, the nvrtc dialect's kGeneratedPriority (40) included: a
// classifier node is a fused node, so nvrtc and cuda-body are candidates for it too, and either
// would run the body's ops one after the other (an f32 gradient stored and cast again). This
// kernel is the reason the node exists, so it must win wherever it supports the node.
constexpr int kClassifierPriority = kGeneratedPriority + 10;  // 50

bool storage_float(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }

std::optional<ClassifierBody> body_of(const Node& node) {
  if (!is_fused(node, FusedKind::kClassifier)) return std::nullopt;
  std::optional<ClassifierBody> spec = match_classifier_body(*node.body);
  if (!spec || !storage_float(spec->logits) || !storage_float(spec->grad)) return std::nullopt;
  if (spec->grad != spec->logits && spec->logits != DType::kF32) return std::nullopt;
  return spec;
}

classifier::Reduction reduction_of(const std::string& r) {
  if (r == "sum") return classifier::Reduction::kSum;
  if (r == "none") return classifier::Reduction::kNone;
  return classifier::Reduction::kMean;
}

void run_classifier(const KernelArgs& args) {
  KILN_CHECK(args.body != nullptr, "fused classifier: the kernel was called without the body");
  const std::optional<ClassifierBody> spec = match_classifier_body(*args.body);
  KILN_CHECK(spec.has_value(), "fused classifier: the body @{} is not a classifier body",
             args.body->name);
  classifier::Problem p;
  p.logits_t = spec->logits;
  p.logits = args.inputs[0].raw();
  p.grad_t = spec->grad;
  p.dlogits = args.outputs[1].raw();
  p.labels64 = spec->labels == DType::kI64;
  p.labels = args.inputs[1].raw();
  p.dloss = args.inputs[2].data<float>();
  p.loss = args.outputs[0].data<float>();
  p.rows = spec->rows;
  p.vocab = spec->vocab;
  p.ignore_index = spec->ignore_index;
  p.reduction = reduction_of(spec->reduction);
  classifier::fused_classifier(p, static_cast<cudaStream_t>(args.stream));
}

}  // namespace

void register_classifier_kernels(KernelRegistry& registry) {
  registry.add(Op::kFused,
               KernelImpl{"cuda-nn", Device::kCuda, kClassifierPriority,
                          [](const NodeView& view) { return body_of(view.node).has_value(); },
                          run_classifier, /*in_place_ok=*/true});
}

}  // namespace kiln::cuda
