// The "cudnn" dialect (backends/cuda/attention/cudnn_attention.cc) against the CPU reference kernels of
// attention (out, lse) and attention_grad (ops/nn.cc): random inputs, outputs poisoned with NaN
// first; bf16 and f16, layouts "bhtd" and "bthd", causal and not, a GPT-2-like shape and odd
// ones (T = 77, d = 32 and 128, Tq != Tk). Each kernel is prepared first (the executor does
// that at construction: the cuDNN graph is built there). Which dialect the registry picks for
// supported and unsupported nodes; attention forward + backward through the CUDA executor (a
// captured CUDA graph, replayed) against the CPU executor. Prints each cuDNN graph's status
// (cuDNN itself, or the cuda-attention fallback and why). The packed forms (attention_qkv and
// its gradient) likewise. (Its speed against cuda-attention: bench/gpu_attention_bench.cc.)
// Error measure: max |gpu - ref| / max |ref| over a tensor ("scaled error"). Tolerances as for
// cuda-attention (tests/cuda/attention_test.cc), which has the same precision story (P and dS
// rounded to 16 bits before their matmuls): bf16 1.5e-2 forward, 2.5e-2 backward; f16 4e-3 /
// 6e-3. lse 1e-4: cuDNN's softmax statistic is f32 (it may work in base 2 and convert); a
// different definition (base-2 log, the scale left out, the max alone) is off by O(1).
// Skips without a GPU, and when this build has no cuDNN.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "backends/cuda/attention/cudnn_attention.h"
#include "attention_test_util.h"
#include "backends/cuda/runtime/memory.h"
#include "ir/text.h"
#include "runtime/executor.h"

#define KILN_REQUIRE_CUDNN()                                                                 \
  do {                                                                                       \
    KILN_REQUIRE_GPU();                                                                      \
    if (!::kiln::cuda::built_with_cudnn()) GTEST_SKIP() << "built without cuDNN";            \
  } while (0)

namespace kiln {
namespace {

using testing::rand;
using testing::run_reference;

using testing::poisoned_device;
using testing::scaled_error;

void print_plans() {
  for (const std::string& line : cuda::cudnn_attention_plans())
    std::printf("  cudnn plan: %s\n", line.c_str());
}

std::vector<Tensor> run_cudnn(Op op, const std::vector<Tensor>& inputs, Attributes attrs) {
  return testing::run_attention_dialect("cudnn", op, inputs, std::move(attrs));
}

struct Case {
  DType dtype;
  int64_t batch, heads, tq, tk, d;
  bool causal;
  bool bthd;
  double scale = 0.0;  // 0: the default 1/sqrt(d)
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " B=" + std::to_string(c.batch) +
         " H=" + std::to_string(c.heads) + " Tq=" + std::to_string(c.tq) +
         " Tk=" + std::to_string(c.tk) + " d=" + std::to_string(c.d) +
         (c.causal ? " causal" : "") + (c.bthd ? " bthd" : " bhtd") +
         (c.scale != 0.0 ? " scale=" + std::to_string(c.scale) : "");
}

double forward_tolerance(DType dtype) { return dtype == DType::kBF16 ? 1.5e-2 : 4e-3; }
double backward_tolerance(DType dtype) { return dtype == DType::kBF16 ? 2.5e-2 : 6e-3; }
constexpr double kLseTolerance = 1e-4;

Attributes attrs_of(const Case& c) {
  Attributes attrs{{"causal", c.causal}};
  if (c.scale != 0.0) attrs.set("scale", c.scale);
  if (c.bthd) attrs.set("layout", std::string("bthd"));
  return attrs;
}

void check_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  // q and k in [-2, 2]: scores of a few units, so the softmax is far from uniform.
  auto shape = [&](int64_t t) {
    return c.bthd ? Shape{c.batch, t, c.heads, c.d} : Shape{c.batch, c.heads, t, c.d};
  };
  const Tensor q = rand(c.dtype, shape(c.tq), seed, -2.0, 2.0);
  const Tensor k = rand(c.dtype, shape(c.tk), seed + 1, -2.0, 2.0);
  const Tensor v = rand(c.dtype, shape(c.tk), seed + 2);
  const Attributes attrs = attrs_of(c);

  const std::vector<Tensor> ref = run_reference(Op::kAttention, {q, k, v}, attrs);
  const std::vector<Tensor> gpu = run_cudnn(Op::kAttention, {q, k, v}, attrs);
  ASSERT_EQ(gpu.size(), 2u);
  const double err = scaled_error(gpu[0], ref[0]), lse_err = scaled_error(gpu[1], ref[1]);
  EXPECT_LE(err, forward_tolerance(c.dtype)) << "out";
  EXPECT_LE(lse_err, kLseTolerance) << "lse";

  // The backward on the reference's out and lse (what attention_grad is defined on).
  const Tensor dout = rand(c.dtype, shape(c.tq), seed + 3);
  const std::vector<Tensor> grad_in = {q, k, v, ref[0], dout, ref[1]};
  const std::vector<Tensor> gref = run_reference(Op::kAttentionGrad, grad_in, attrs);
  const std::vector<Tensor> ggpu = run_cudnn(Op::kAttentionGrad, grad_in, attrs);
  const char* names[3] = {"dq", "dk", "dv"};
  double errs[3];
  for (int i = 0; i < 3; ++i) {
    errs[i] = scaled_error(ggpu[i], gref[i]);
    EXPECT_LE(errs[i], backward_tolerance(c.dtype)) << names[i];
  }
  std::printf("  %-50s out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", describe(c).c_str(), err,
              lse_err, errs[0], errs[1], errs[2]);
}

TEST(CudnnAttention, MatchesReference) {
  KILN_REQUIRE_CUDNN();
  uint64_t seed = 2000;
  for (DType dtype : {DType::kBF16, DType::kF16})
    for (bool bthd : {true, false})
      for (bool causal : {true, false}) {
        check_case({dtype, 2, 4, 256, 256, 64, causal, bthd}, seed += 10);  // GPT-2-like
        check_case({dtype, 1, 3, 77, 77, 32, causal, bthd}, seed += 10);
        check_case({dtype, 2, 2, 77, 77, 128, causal, bthd}, seed += 10);
      }
  check_case({DType::kBF16, 1, 2, 77, 77, 64, true, true, 0.3}, seed += 10);
  print_plans();
}

// attention_qkv / attention_qkv_grad: q, k, v read in place from one packed (B, T, 3, H, D)
// tensor and dq, dk, dv written in place into dqkv (cuDNN strides; the parts of dqkv cuDNN does
// not write would stay NaN). Against the packed reference kernels.
void check_packed_case(DType dtype, int64_t batch, int64_t heads, int64_t t, int64_t d,
                       bool causal, uint64_t seed) {
  const std::string what = std::string(dtype_name(dtype)) + " packed B=" +
                           std::to_string(batch) + " H=" + std::to_string(heads) +
                           " T=" + std::to_string(t) + " d=" + std::to_string(d) +
                           (causal ? " causal" : "");
  SCOPED_TRACE(what);
  const Tensor qkv = rand(dtype, {batch, t, 3, heads, d}, seed, -2.0, 2.0);
  const Attributes attrs{{"causal", causal}};
  const std::vector<Tensor> ref = run_reference(Op::kAttentionQkv, {qkv}, attrs);
  const std::vector<Tensor> gpu = run_cudnn(Op::kAttentionQkv, {qkv}, attrs);
  ASSERT_EQ(gpu.size(), 2u);
  const double err = scaled_error(gpu[0], ref[0]), lse_err = scaled_error(gpu[1], ref[1]);
  EXPECT_LE(err, forward_tolerance(dtype)) << "out";
  EXPECT_LE(lse_err, kLseTolerance) << "lse";
  const Tensor dout = rand(dtype, {batch, t, heads, d}, seed + 1);
  const std::vector<Tensor> grad_in = {qkv, ref[0], dout, ref[1]};
  const Tensor gref = run_reference(Op::kAttentionQkvGrad, grad_in, attrs)[0];
  const Tensor ggpu = run_cudnn(Op::kAttentionQkvGrad, grad_in, attrs)[0];
  const double gerr = scaled_error(ggpu, gref);
  EXPECT_LE(gerr, backward_tolerance(dtype)) << "dqkv";
  std::printf("  %-50s out %.2e lse %.2e dqkv %.2e\n", what.c_str(), err, lse_err, gerr);
}

TEST(CudnnAttention, PackedQkvMatchesReference) {
  KILN_REQUIRE_CUDNN();
  uint64_t seed = 2500;
  for (DType dtype : {DType::kBF16, DType::kF16})
    for (bool causal : {true, false}) {
      check_packed_case(dtype, 2, 4, 256, 64, causal, seed += 10);  // GPT-2-like
      check_packed_case(dtype, 1, 3, 77, 32, causal, seed += 10);
      check_packed_case(dtype, 2, 2, 77, 128, causal, seed += 10);
    }
  print_plans();
}

// Tq != Tk: the causal mask is top-left aligned (key j > query i masked), as the op defines.
// cuDNN may refuse some of these (the node then runs cuda-attention); either way it must match.
TEST(CudnnAttention, UnequalLengthsMatchReference) {
  KILN_REQUIRE_CUDNN();
  uint64_t seed = 3000;
  for (bool causal : {true, false})
    for (bool bthd : {true, false}) {
      check_case({DType::kBF16, 1, 2, 100, 37, 64, causal, bthd}, seed += 10);  // Tq > Tk
      check_case({DType::kBF16, 1, 2, 17, 130, 64, causal, bthd}, seed += 10);  // Tq < Tk
    }
  print_plans();
}

// attention_grad is defined on the lse it is given: with lse + ln 2 every P halves, so dv must
// halve too and the kernel must agree with the reference on those inputs.
TEST(CudnnAttention, BackwardUsesTheGivenLse) {
  KILN_REQUIRE_CUDNN();
  for (bool bthd : {false, true}) {
    SCOPED_TRACE(bthd ? "bthd" : "bhtd");
    const DType dt = DType::kBF16;
    const Shape shape = bthd ? Shape{1, 100, 2, 64} : Shape{1, 2, 100, 64};
    const Tensor q = rand(dt, shape, 901, -2.0, 2.0);
    const Tensor k = rand(dt, shape, 902, -2.0, 2.0);
    const Tensor v = rand(dt, shape, 903);
    const Tensor dout = rand(dt, shape, 904);
    Attributes attrs{{"causal", true}};
    if (bthd) attrs.set("layout", std::string("bthd"));
    const std::vector<Tensor> fwd = run_reference(Op::kAttention, {q, k, v}, attrs);
    Tensor lse = fwd[1].clone();
    for (int64_t i = 0; i < lse.numel(); ++i) lse.set(i, lse.get(i) + std::log(2.0));
    const std::vector<Tensor> in = {q, k, v, fwd[0], dout, lse};
    const std::vector<Tensor> gref = run_reference(Op::kAttentionGrad, in, attrs);
    const std::vector<Tensor> ggpu = run_cudnn(Op::kAttentionGrad, in, attrs);
    for (int i = 0; i < 3; ++i) EXPECT_LE(scaled_error(ggpu[i], gref[i]), 2.5e-2) << i;
    const std::vector<Tensor> full =
        run_reference(Op::kAttentionGrad, {q, k, v, fwd[0], dout, fwd[1]}, attrs);
    double max_half = 0.0, max_full = 0.0;
    for (int64_t i = 0; i < full[2].numel(); ++i) {
      max_half = std::max(max_half, std::abs(ggpu[2].get(i)));
      max_full = std::max(max_full, std::abs(full[2].get(i)));
    }
    EXPECT_NEAR(max_half / max_full, 0.5, 0.02);
  }
  print_plans();
}

// The registry picks cudnn where it applies and cuda-attention for the rest (no GPU calls).
TEST(CudnnAttention, ChosenOverCudaAttentionWhereSupported) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  if (!cuda::built_with_cudnn()) GTEST_SKIP() << "built without cuDNN";
  auto chosen = [](Op op, DType dtype, int64_t d, const std::string& layout) {
    const DType lse = dtype == DType::kF64 ? DType::kF64 : DType::kF32;
    const Shape x = layout == "bthd" ? Shape{2, 16, 3, d} : Shape{2, 3, 16, d};
    const Shape l = layout == "bthd" ? Shape{2, 16, 3} : Shape{2, 3, 16};
    const std::vector<TensorType> all = {{dtype, x}, {dtype, x}, {dtype, x},
                                         {dtype, x}, {dtype, x}, {lse, l}};
    const std::vector<TensorType> in(all.begin(), all.begin() + (op == Op::kAttention ? 3 : 6));
    Node node{op, {}, {}, normalize_attributes(op, {{"causal", true}, {"layout", layout}}),
              nullptr};
    const std::vector<TensorType> out = infer_types(op, in, node.attrs);
    return kernel_registry().select(NodeView{node, in, out}, Device::kCuda, {}).dialect;
  };
  for (Op op : {Op::kAttention, Op::kAttentionGrad})
    for (const char* layout : {"bthd", "bhtd"}) {
      SCOPED_TRACE(std::string(op_info(op).name) + " " + layout);
      EXPECT_EQ(chosen(op, DType::kBF16, 64, layout), "cudnn");
      EXPECT_EQ(chosen(op, DType::kF16, 128, layout), "cudnn");
      EXPECT_EQ(chosen(op, DType::kBF16, 36, layout), "cuda-attention");   // d % 8 != 0
      EXPECT_EQ(chosen(op, DType::kBF16, 256, layout), "cuda-attention");  // d > 128
      EXPECT_EQ(chosen(op, DType::kF32, 64, layout), "cuda-attention");
    }
}

// attention forward + backward as one graph on the CUDA executor (eager, then captured into a
// CUDA graph, then replayed) against the CPU executor.
TEST(CudnnAttention, ExecutorGraphMatchesCpu) {
  KILN_REQUIRE_CUDNN();
  for (const char* layout : {"bthd", "bhtd"}) {
    SCOPED_TRACE(layout);
    const std::string type = std::string(layout) == "bthd" ? "bf16[2,96,4,64]" : "bf16[2,4,96,64]";
    Graph g = parse("graph @attn(%q: " + type + " data, %k: " + type + " data, %v: " + type +
                    " data, %g: " + type + " data) {\n"
                    "  %o, %lse = attention(%q, %k, %v) {causal=true, layout=\"" + layout +
                    "\"}\n"
                    "  %dq, %dk, %dv = attention_grad(%q, %k, %v, %o, %g, %lse) {causal=true, "
                    "layout=\"" + layout + "\"}\n"
                    "  return %o, %lse, %dq, %dk, %dv\n"
                    "}\n");
    std::vector<Tensor> inputs;
    for (size_t i = 0; i < g.inputs.size(); ++i)
      inputs.push_back(rand(DType::kBF16, g.value(g.inputs[i].value).type.shape, 40 + i,
                            i < 2 ? -2.0 : -1.0, i < 2 ? 2.0 : 1.0));
    const std::vector<Tensor> cpu = Executor(g).run(inputs);
    ExecutorOptions options;
    options.device = Device::kCuda;
    options.poison_arena = true;
    Executor e(g, options);
    EXPECT_EQ(e.node_dialects(), (std::vector<std::string>{"cudnn", "cudnn"}));
    std::vector<Tensor> device;
    for (const Tensor& t : inputs) device.push_back(cuda::to_device(t));
    const double tol[5] = {1.5e-2, 1e-4, 2.5e-2, 2.5e-2, 2.5e-2};  // o, lse, dq, dk, dv
    for (int run = 0; run < 3; ++run) {  // eager, capture, replay
      SCOPED_TRACE("run " + std::to_string(run));
      const std::vector<Tensor> out = e.run(device);
      e.synchronize();
      ASSERT_EQ(out.size(), cpu.size());
      for (size_t i = 0; i < out.size(); ++i)
        EXPECT_LE(scaled_error(cuda::to_host(out[i]), cpu[i]), tol[i]) << "output " << i;
    }
  }
  print_plans();
}

}  // namespace
}  // namespace kiln
