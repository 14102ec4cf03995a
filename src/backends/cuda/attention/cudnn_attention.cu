// The "cudnn" attention dialect's helper kernels: converting the softmax statistic between
// cuDNN's (B, H, Tq) and kiln's "bthd" lse (B, Tq, H). One thread an element; these move a few
// hundred KiB at GPT-2 size, next to attention's milliseconds.
#include "backends/cuda/attention/cudnn_attention.cuh"

#include <algorithm>

#include "backends/cuda/common/cuda_check.h"

namespace kiln::cuda {
namespace {

// Element i of the (batch, heads, tq) tensor `from_bht` when to_bht is false (written to the
// (batch, tq, heads) tensor), and the other way round.
__global__ void transpose_stats(const float* in, float* out, int64_t batch, int64_t heads,
                                int64_t tq, bool to_bht) {
  const int64_t n = batch * heads * tq;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    // i indexes the (batch, heads, tq) tensor.
    const int64_t t = i % tq, h = (i / tq) % heads, b = i / (tq * heads);
    const int64_t j = (b * tq + t) * heads + h;  // the same element in (batch, tq, heads)
    if (to_bht)
      out[i] = in[j];
    else
      out[j] = in[i];
  }
}

void launch(const float* in, float* out, int64_t batch, int64_t heads, int64_t tq, bool to_bht,
            cudaStream_t stream) {
  const int64_t n = batch * heads * tq;
  if (n == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65535);
  transpose_stats<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(in, out, batch, heads,
                                                                         tq, to_bht);
  KILN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void cudnn_stats_to_lse(const float* stats, float* lse, int64_t batch, int64_t heads, int64_t tq,
                        cudaStream_t stream) {
  launch(stats, lse, batch, heads, tq, false, stream);
}

void cudnn_lse_to_stats(const float* lse, float* stats, int64_t batch, int64_t heads, int64_t tq,
                        cudaStream_t stream) {
  launch(lse, stats, batch, heads, tq, true, stream);
}

}  // namespace kiln::cuda
