// The LLaMA family on the GPU (skips without one): grouped-query attention through each
// attention dialect (cuda-attention's flash kernels, cuDNN's SDPA) against the CPU reference at
// llama-160m's and llama-1b's head geometry (12 query heads on 4 key/value heads, 32 on 8,
// D = 64), bf16, causal, "bthd"; and llama-tiny's loss and every gradient, through the default
// pipeline prepared for CUDA (fusion, nvrtc rows kernels for RMSNorm and the residual adds,
// SwiGLU's elementwise group, rotary embeddings, cuDNN or flash attention), against the CPU
// reference kernels. The op-level sweep (tests/cuda/conformance_test.cc) covers
// rotary_embedding and the GQA cases of tests/conformance_cases.cc at every float dtype.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "backends/cuda/attention/cudnn_attention.h"
#include "backends/cuda/runtime/memory.h"
#include "gpu_test_util.h"
#include "models/models.h"
#include "passes/autodiff.h"
#include "runtime/executor.h"
#include "training_step_util.h"

namespace kiln {
namespace {

using testing::rand;
using testing::run_reference;
using testing::scaled_error;

// Forward and backward of GQA attention (B, T, H, D) with k, v (B, T, Hkv, D) through `dialect`
// against the reference; tolerances as tests/cuda/attention_test.cc's for bf16 (P and dS rounded
// to 16 bits before their products; dk and dv sum H / Hkv heads' worth more terms).
void check_gqa(const std::string& dialect, int64_t batch, int64_t t, int64_t heads,
               int64_t kv_heads, int64_t d, uint64_t seed) {
  const std::string what = fmt::format("{} B={} T={} H={} Hkv={} D={}", dialect, batch, t, heads,
                                       kv_heads, d);
  SCOPED_TRACE(what);
  const DType bf16 = DType::kBF16;
  const Tensor q = rand(bf16, {batch, t, heads, d}, seed, -2.0, 2.0);
  const Tensor k = rand(bf16, {batch, t, kv_heads, d}, seed + 1, -2.0, 2.0);
  const Tensor v = rand(bf16, {batch, t, kv_heads, d}, seed + 2);
  const Attributes attrs{{"causal", true}, {"layout", std::string("bthd")}};
  const std::vector<Tensor> ref = run_reference(Op::kAttention, {q, k, v}, attrs);
  const std::vector<Tensor> gpu = testing::run_attention_dialect(dialect, Op::kAttention, {q, k, v}, attrs);
  const double out_err = scaled_error(gpu[0], ref[0]), lse_err = scaled_error(gpu[1], ref[1]);
  EXPECT_LE(out_err, 1.5e-2) << "out";
  EXPECT_LE(lse_err, 1e-4) << "lse";
  const Tensor dout = rand(bf16, {batch, t, heads, d}, seed + 3);
  const std::vector<Tensor> in = {q, k, v, ref[0], dout, ref[1]};
  const std::vector<Tensor> gref = run_reference(Op::kAttentionGrad, in, attrs);
  const std::vector<Tensor> ggpu = testing::run_attention_dialect(dialect, Op::kAttentionGrad, in, attrs);
  const char* names[3] = {"dq", "dk", "dv"};
  double errs[3];
  for (int i = 0; i < 3; ++i) {
    errs[i] = scaled_error(ggpu[i], gref[i]);
    EXPECT_LE(errs[i], 2.5e-2) << names[i];
  }
  std::printf("  %-45s out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", what.c_str(), out_err,
              lse_err, errs[0], errs[1], errs[2]);
}

TEST(LlamaGpu, GroupedQueryFlashAttentionMatchesReference) {
  KILN_REQUIRE_GPU();
  check_gqa("cuda-attention", 1, 200, 12, 4, 64, 100);  // llama-160m's heads
  check_gqa("cuda-attention", 1, 130, 32, 8, 64, 110);  // llama-1b's heads
  check_gqa("cuda-attention", 2, 77, 4, 1, 32, 120);    // one key/value head (MQA)
}

TEST(LlamaGpu, GroupedQueryCudnnMatchesReference) {
  KILN_REQUIRE_GPU();
  if (!cuda::built_with_cudnn()) GTEST_SKIP() << "built without cuDNN";
  check_gqa("cudnn", 1, 200, 12, 4, 64, 200);
  check_gqa("cudnn", 1, 130, 32, 8, 64, 210);
  for (const std::string& line : cuda::cudnn_attention_plans())
    std::printf("  cudnn plan: %s\n", line.c_str());
}

// llama-tiny's loss and gradients, on the GPU with the pipeline for CUDA (f32), against the CPU
// reference kernels on the graph as autodiff wrote it.
TEST(LlamaGpu, TinyLossAndGradientsMatchCpuReference) {
  KILN_REQUIRE_GPU();
  models::LlamaConfig c = models::llama_config("llama-tiny");
  c.batch = 2;
  c.seq = 32;
  const Graph forward = models::llama(c);
  std::vector<ValueId> wrt;
  for (const GraphInput& in : forward.inputs)
    if (in.role == Role::kParam) wrt.push_back(in.value);
  AutodiffResult ad = autodiff(forward, forward.outputs[0], wrt);
  Graph g = ad.graph;
  g.outputs = {forward.outputs[0]};
  g.outputs.insert(g.outputs.end(), ad.gradients.begin(), ad.gradients.end());
  const std::vector<Tensor> params = models::init_params(forward, 5, c.layers);
  std::vector<Tensor> host_inputs, device_inputs;
  size_t p = 0;
  for (const GraphInput& in : g.inputs) {
    const TensorType& t = g.type(in.value);
    host_inputs.push_back(in.role == Role::kParam
                              ? params.at(p++)
                              : random_tensor(t, 70 + host_inputs.size(), 0, static_cast<double>(c.vocab)));
    device_inputs.push_back(cuda::to_device(host_inputs.back()));
  }
  const std::vector<Tensor> want = Executor(g, ExecutorOptions{Device::kCpu, {"reference"}}).run(host_inputs);
  Executor gpu(testing::prepared_for_cuda(g, PassOptions{}), ExecutorOptions{Device::kCuda, {}});
  const std::vector<Tensor> got = gpu.run(device_inputs);
  gpu.synchronize();
  ASSERT_EQ(got.size(), want.size());
  const double loss = want[0].get(0);
  EXPECT_NEAR(cuda::to_host(got[0]).get(0), loss, 1e-4 * std::abs(loss));
  for (size_t i = 1; i < want.size(); ++i) {
    double scale = 0;
    for (double v : want[i].to_f64()) scale = std::max(scale, std::abs(v));
    EXPECT_LE(max_scaled_error(cuda::to_host(got[i]), want[i], 1e-3 * scale, 1e-3), 1.0)
        << "gradient of " << g.value(wrt[i - 1]).name << " (max |g| " << scale << ")";
  }
}

}  // namespace
}  // namespace kiln
