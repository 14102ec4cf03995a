// Attention speed at GPT-2's size (B=32, H=12, T=1024, bf16), causal and not: forward and
// backward TFLOP/s of the cuda-attention kernels (head dims 64 and 128, "bhtd"), and of cuDNN's
// against cuda-attention (head dim 64, "bthd" and "bhtd") where cuDNN is built. Prints numbers
// (moved from tests/cuda/attention_test.cc and cudnn_attention_test.cc); runs on the GPU machine.
//
// Usage: gpu_attention_bench [cuda-attention | cudnn]...   (none: both)
#include "backends/cuda/attention/cudnn_attention.h"
#include "gpu_bench_util.h"

namespace kiln {
namespace {

using bench::random_device;
using bench::time_ms;

// Forward and backward of `dialects` on q, k, v of `type` (4-D, "bthd" when `bthd`), printed
// per dialect and mask.
void attention(const std::vector<std::string>& dialects, const TensorType& type, bool bthd) {
  const Shape& s = type.shape;
  const int64_t b = s[0], t = bthd ? s[1] : s[2], h = bthd ? s[2] : s[1], d = s[3];
  const TensorType lse_type{DType::kF32, bthd ? Shape{b, t, h} : Shape{b, h, t}};
  std::vector<Tensor> out = {cuda::device_tensor(type, false),
                             cuda::device_tensor(lse_type, false)};
  // q, k, v, out, dout, lse: out and lse are what the forward writes.
  const std::vector<Tensor> in = {random_device(type, 1), random_device(type, 2),
                                  random_device(type, 3), out[0],
                                  random_device(type, 4), out[1]};
  std::vector<Tensor> grads = {cuda::device_tensor(type, false), cuda::device_tensor(type, false),
                               cuda::device_tensor(type, false)};
  const std::span<const Tensor> forward_in(in.data(), 3);
  cuda::Stream stream;
  const auto st = static_cast<cudaStream_t>(stream.handle());
  for (bool causal : {true, false}) {
    Attributes attrs{{"causal", causal}};
    if (bthd) attrs.set("layout", std::string("bthd"));
    const double flops = 4.0 * b * h * t * t * d / (causal ? 2.0 : 1.0);
    for (const std::string& dialect : dialects) {
      const bench::ChosenKernel forward =
          bench::choose_kernel(Op::kAttention, {type, type, type}, attrs, {dialect});
      const bench::ChosenKernel backward = bench::choose_kernel(
          Op::kAttentionGrad, {type, type, type, type, type, lse_type}, attrs, {dialect});
      const double forward_ms = time_ms(st, 20, [&] { forward(forward_in, out, st); });
      // (the last forward call left this mask's out and lse for the backward)
      const double backward_ms = time_ms(st, 20, [&] { backward(in, grads, st); });
      fmt::print(
          "{:<14} bf16 B={} H={} T={} D={} {} {:<10} forward {:.3f} ms {:.1f} TFLOP/s, "
          "backward {:.3f} ms {:.1f} TFLOP/s (2.5x forward FLOPs)\n",
          dialect, b, h, t, d, bthd ? "bthd" : "bhtd", causal ? "causal" : "non-causal", forward_ms,
          flops / forward_ms * 1e-9, backward_ms, 2.5 * flops / backward_ms * 1e-9);
    }
  }
  stream.synchronize();
}

void cuda_attention() {
  for (int64_t d : {64, 128})
    attention({"cuda-attention"}, {DType::kBF16, {32, 12, 1024, d}}, false);
}

void cudnn() {
  if (!cuda::built_with_cudnn()) {
    fmt::print("built without cuDNN: nothing to measure\n");
    return;
  }
  for (bool bthd : {true, false})
    attention({"cudnn", "cuda-attention"},
              {DType::kBF16, bthd ? Shape{32, 1024, 12, 64} : Shape{32, 12, 1024, 64}}, bthd);
  for (const std::string& line : cuda::cudnn_attention_plans())
    fmt::print("cudnn plan: {}\n", line);
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  return kiln::bench::run_sections(
      "gpu_attention_bench", argc, argv,
      {{"cuda-attention", kiln::cuda_attention}, {"cudnn", kiln::cudnn}});
}
