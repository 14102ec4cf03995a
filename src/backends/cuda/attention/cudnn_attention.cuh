// Launchers for the "cudnn" attention dialect's helper kernels (cudnn_attention.cu), callable
// from C++20 code. cuDNN's softmax statistic (Stats) is (B, H, Tq) f32; kiln's lse of layout
// "bthd" is (B, Tq, H). When the cuDNN build at hand refuses a strided Stats tensor, the dialect
// keeps Stats packed in its workspace and converts with these.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::cuda {

// lse[(b * tq + t) * heads + h] = stats[(b * heads + h) * tq + t]. Enqueued on `stream`.
void cudnn_stats_to_lse(const float* stats, float* lse, int64_t batch, int64_t heads, int64_t tq,
                        cudaStream_t stream);
// The other way round: stats[(b * heads + h) * tq + t] = lse[(b * tq + t) * heads + h].
void cudnn_lse_to_stats(const float* lse, float* stats, int64_t batch, int64_t heads, int64_t tq,
                        cudaStream_t stream);

}  // namespace kiln::cuda
