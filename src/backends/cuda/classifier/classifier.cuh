// Launcher of the fused classifier kernel (backends/cuda/classifier/classifier.cu; registered by
// classifier.cc for `fused` nodes of kind "classifier", ops/fused/classifier.h). C++17-clean:
// plain pointers, int64_t, cudaStream_t.
//
// One call computes, for logits (rows, vocab) and labels (rows):
//   loss      logsumexp(row) - row[label] per row ("none"), or their sum ("sum") or mean over
//             the rows whose label is not ignore_index ("mean"; 0 when there is none), f32;
//   dlogits   (softmax(row) - one_hot(label)) * scale in grad_t, scale = dloss[row] ("none"),
//             dloss[0] ("sum"), dloss[0] / counted rows ("mean"); 0 in ignored rows.
// dloss is read on the device. dlogits may be the logits' own buffer (same type): each row is
// read whole before any of it is written. loss may be dloss's buffer ("none": each row's dloss
// is read before its loss is written). A label outside [0, vocab) that is not ignore_index is
// recorded as a device data error (device_errors.h) and gives a NaN loss and a NaN row.
// Deterministic: per-row losses reduced in a fixed order, no floating-point atomics.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ir/dtype.h"

namespace kiln::cuda::classifier {

enum class Reduction : int { kMean, kSum, kNone };

struct Problem {
  DType logits_t = DType::kF32;  // f32, f16 or bf16
  const void* logits = nullptr;  // (rows, vocab)
  DType grad_t = DType::kF32;    // logits_t, or 16 bits for f32 logits
  void* dlogits = nullptr;       // (rows, vocab); may be `logits` when the types agree
  bool labels64 = true;          // i64 labels, else i32
  const void* labels = nullptr;  // (rows)
  const float* dloss = nullptr;  // rows values ("none") or one
  float* loss = nullptr;         // rows values ("none") or one; may be dloss
  int64_t rows = 0, vocab = 0, ignore_index = -100;
  Reduction reduction = Reduction::kMean;
};

void fused_classifier(const Problem& problem, cudaStream_t stream);

// How fused_classifier runs a problem of this shape (for the benchmark's report): threads per
// block, and whether the row is kept in shared memory between its two passes (else read twice).
struct LaunchInfo {
  int threads = 0;
  bool row_in_shared_memory = false;
  int64_t shared_bytes = 0;
};
LaunchInfo launch_info(DType logits_t, int64_t vocab);

// How a row travels between the kernel's two passes. kShared (the default): copied once into
// shared memory (cp.async) when it fits (kMaxSharedRowBytes in classifier.cu), so DRAM sees it
// once; else, and with kReread, read twice from global memory (the second time mostly from L2).
// On an H100 at GPT-2 size (bf16 in place, 32768 x 50304) kShared takes 2.30 ms, kReread 2.77
// (`ClassifierGpu.DISABLED_Bandwidth`; an H200 had measured kShared slower before
// the store fix of classifier.cu). KILN_CLASSIFIER_ROW_PATH=reread makes kReread the process's
// default. Not thread-safe against running launches.
enum class RowPath : int { kReread, kShared };
void set_row_path(RowPath path);

}  // namespace kiln::cuda::classifier
