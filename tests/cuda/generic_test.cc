// The "cuda" generic dialect (backends/cuda/generic/generic.{cu,cc}): what the conformance sweep
// (tests/conformance.h, every op at every dtype against the CPU reference) does not check:
// dropout's mask is the reference's exactly, data errors (bad indices, integer division by
// zero, bad labels) reach the host as kiln::Error after a sync, and every op has a generic
// kernel or is listed with the reason it has none.
#include <set>

#include "conformance.h"
#include "gpu_test_util.h"

namespace kiln {
namespace {

using testing::make;
using testing::rand;

// Runs `op` through the "cuda" dialect as the sweep runs a kernel: inputs uploaded, outputs
// poisoned, synchronized, device errors checked (thrown), outputs downloaded.
std::vector<Tensor> run_cuda(Op op, const std::vector<Tensor>& inputs, const Attributes& attrs) {
  const testing::conformance::Instance node = testing::conformance::instance_of(op, inputs, attrs);
  const KernelImpl& impl = kernel_registry().select(node.view(), Device::kCuda, {"cuda"});
  return testing::conformance::run_kernel(Device::kCuda, impl, node);
}

// Dropout keeps the reference's mask exactly (the same Philox words): zeros in the same places.
TEST(CudaGenericDropout, SameMaskAsReference) {
  KILN_REQUIRE_GPU();
  const Tensor x = rand(DType::kF32, {100003}, 5, 0.5, 1.5);
  const Attributes attrs{{"p", 0.25}, {"seed", 123456789}};
  const Tensor expected = testing::run_reference(Op::kDropout, {x}, attrs)[0];
  const Tensor actual = run_cuda(Op::kDropout, {x}, attrs)[0];
  int64_t dropped = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    ASSERT_EQ(actual.get(i) == 0.0, expected.get(i) == 0.0) << "element " << i;
    dropped += expected.get(i) == 0.0;
  }
  EXPECT_NEAR(static_cast<double>(dropped) / x.numel(), 0.25, 0.01);
}

// ---- data errors -----------------------------------------------------------------------------

TEST(CudaGenericErrors, GatherIndexOutOfRangeThrowsAfterSync) {
  KILN_REQUIRE_GPU();
  const Tensor table = rand(DType::kF32, {10, 4}, 1);
  EXPECT_KILN_ERROR(run_cuda(Op::kGather, {table, make(DType::kI64, {3}, {2, 12, 0})}, {}),
                    "gather", "index 12", "position 1", "0..9");
  // The error was consumed: the next call is clean.
  EXPECT_NO_THROW(run_cuda(Op::kGather, {table, make(DType::kI64, {1}, {9})}, {}));
}

TEST(CudaGenericErrors, ScatterAddNegativeIndexThrows) {
  KILN_REQUIRE_GPU();
  const Tensor base = rand(DType::kF32, {4, 2}, 1);
  EXPECT_KILN_ERROR(run_cuda(Op::kScatterAdd, {base, make(DType::kI32, {2}, {1, -1}),
                                               rand(DType::kF32, {2, 2}, 2)}, {}),
                    "scatter_add", "index -1", "position 1", "0..3");
}

TEST(CudaGenericErrors, IntegerDivisionByZeroThrows) {
  KILN_REQUIRE_GPU();
  EXPECT_KILN_ERROR(
      run_cuda(Op::kDiv, {make(DType::kI32, {3}, {7, 8, 9}), make(DType::kI32, {3}, {1, 0, 2})},
               {}),
      "division by zero (8 / 0)");
}

TEST(CudaGenericErrors, LabelOutOfRangeThrows) {
  KILN_REQUIRE_GPU();
  const Tensor logits = rand(DType::kF32, {2, 5}, 1);
  const Tensor labels = make(DType::kI64, {2}, {1, 5});
  EXPECT_KILN_ERROR(run_cuda(Op::kCrossEntropy, {logits, labels}, {}),
                    "cross_entropy: label 5 (row 1)", "[0, 5)", "ignore_index -100");
  EXPECT_KILN_ERROR(
      run_cuda(Op::kCrossEntropyGrad, {logits, labels, rand(DType::kF32, {}, 2)}, {}),
      "cross_entropy_grad: label 5 (row 1)", "[0, 5)");
}

// ---- coverage -----------------------------------------------------------------------------------

// Ops with no generic CUDA kernel (by name), each with the reason.
const std::set<std::string_view> kWithoutGenericKernel = {
    "fused",              // a subgraph: compiled by the nvrtc dialect, not a fixed kernel
    // Convolution and pooling: cuda-conv serves every float dtype, all the ops take (im2col
    // and cuBLASLt products, direct pooling kernels); a simpler kernel would only be slower.
    "conv2d",
    "conv2d_grad_input",
    "conv2d_grad_weight",
    "max_pool2d",
    "max_pool2d_grad",
    "avg_pool2d",
    "avg_pool2d_grad",
    // Packed self-attention: cuda-attention (and cudnn) serve f32 / f16 / bf16 up to head dim
    // 256; like "bthd" attention, which this generic dialect does not take either, f64 or wider
    // heads have no CUDA kernel.
    "attention_qkv",
    "attention_qkv_grad",
    // Rotary position embeddings: cuda-nn serves f32 / f16 / bf16 (a grid-stride kernel as
    // simple as a generic one would be); f64 has no CUDA kernel.
    "rotary_embedding",
};

bool has_generic_kernel(Op op) {
  for (const KernelImpl* impl : kernel_registry().candidates(op, Device::kCuda))
    if (impl->dialect == "cuda") return true;
  return false;
}

TEST(CudaGenericCoverage, EveryOpHasAKernelOrIsListed) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    const bool listed = kWithoutGenericKernel.count(op_name(op)) != 0;
    EXPECT_NE(has_generic_kernel(op), listed)
        << op_name(op) << (listed ? ": listed as without a kernel but has one"
                                  : ": has no cuda kernel and is not listed");
  }
}

}  // namespace
}  // namespace kiln
