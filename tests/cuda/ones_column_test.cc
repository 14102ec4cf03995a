// The ones-column pass on the GPU (passes/ones_column.h): a gpt2-tiny training step prepared for
// CUDA, with every qkv / fc bias gradient taken from its weight-gradient GEMM (LayerNorm rows
// kernels writing padded rows, cuBLASLt reading them through lda, dW and db as offset views of
// one product), against the CPU reference kernels running the graph without the pass. SGD
// without momentum hands the gradient out as the new momentum buffer, so every gradient is
// compared, scaled by its largest element: f32 (TF32 off) 2e-3, 16 bits 5e-2 (the GPU's fused
// kernels skip the reference's intermediate roundings). A wrong row of the product would be off
// by its whole size.
#include "gpu_test_util.h"
#include "training_step_util.h"

namespace kiln {
namespace {

using testing::expect_step_close;
using testing::run_step_on;

void check(const std::string& amp, double rtol) {
  SCOPED_TRACE("amp " + amp);
  const Graph forward = models::by_name("gpt2-tiny", 4, 0);
  const StepProgram program = testing::sgd_program(forward, amp);
  PassOptions off;
  off.disabled = {"ones-column"};
  const Graph with_pass = testing::prepared_for_cuda(program.graph, {});
  const Graph without = testing::prepared_for_cuda(program.graph, off);
  int padded = 0;
  for (const Node& node : with_pass.nodes)
    if (node.op == Op::kFused && node.body)
      for (const Node& n : node.body->nodes) padded += n.op == Op::kConcat;
  ASSERT_EQ(padded, 4);  // ln1 and ln2 of both layers

  const std::vector<Tensor> inputs = testing::step_inputs(program, forward, 2, 256);
  expect_step_close(run_step_on(with_pass, inputs, Device::kCuda), run_step_on(without, inputs, Device::kCpu),
                    rtol);
}

TEST(CudaOnesColumn, Gpt2TinyStepMatchesTheReferenceWithoutThePass) {
  KILN_REQUIRE_GPU();
  check("off", 2e-3);
  check("bf16", 5e-2);
}

}  // namespace
}  // namespace kiln
