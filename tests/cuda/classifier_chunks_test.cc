// The classifier-chunks pass on the GPU (passes/classifier_chunks.h): gpt2-tiny's training step
// prepared for CUDA with its head in chunks (batch 3: 192 rows in chunks of 128 and 64; the
// flat activation and labels sliced as offset views, each chunk's weight-gradient product added
// to the last through cuBLASLt's C, the tied embedding's scatter into that sum, the input
// gradients concatenated, the "mean" count from the labels) against the CPU reference kernels
// running the unchunked graph. Tolerances as the ones-column test's: f32 (TF32 off) 2e-3, bf16
// 5e-2; a chunk's rows misplaced or its gradient scaled wrong is off by far more.
#include "gpu_test_util.h"
#include "passes/classifier.h"
#include "training_step_util.h"

namespace kiln {
namespace {

using testing::expect_step_close;
using testing::run_step_on;

void check(const std::string& amp, double rtol) {
  SCOPED_TRACE("amp " + amp);
  const Graph forward = models::by_name("gpt2-tiny", 3, 0);
  const StepProgram program = testing::sgd_program(forward, amp);
  PassOptions chunked, whole;
  chunked.logits_chunk_bytes = 128 * 256 * (amp == "off" ? 4 : 2);
  whole.logits_chunk_bytes = 0;
  const Graph with = testing::prepared_for_cuda(program.graph, chunked);
  const Graph without = testing::prepared_for_cuda(program.graph, whole);
  int classifiers = 0;
  for (const Node& node : with.nodes)
    classifiers += node.op == Op::kFused && node.attrs.s("kind") == "classifier";
  ASSERT_EQ(classifiers, 2);

  const std::vector<Tensor> inputs = testing::step_inputs(program, forward, 2, 256);
  expect_step_close(run_step_on(with, inputs, Device::kCuda), run_step_on(without, inputs, Device::kCpu), rtol);
}

TEST(CudaClassifierChunks, Gpt2TinyStepMatchesTheUnchunkedReference) {
  KILN_REQUIRE_GPU();
  check("off", 2e-3);
  check("bf16", 5e-2);
}

}  // namespace
}  // namespace kiln
