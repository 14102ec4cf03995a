// ONNX's node conformance tests (tests/frontend/onnx_node_tests.h) on CUDA: every case that
// passes on the CPU must pass on the GPU too (same expected outputs and tolerances), so an
// imported model computes the same numbers on either device. Cases the CPU does not pass are
// run as well and must end cleanly (a result or an error, never a crash). Needs the ONNX front
// end (on the GPU machine: Debian's packages carried, scripts/gpu-check.sh) and the node tests
// ($KILN_ONNX_NODE_TESTS or Debian's folder); skips without them.
#include <cstdio>
#include <string>
#include <vector>

#include "frontend/onnx/onnx_import.h"
#include "frontend/onnx_node_tests.h"
#include "gpu_test_util.h"

namespace kiln::testing {
namespace {

TEST(CudaOnnxConformance, CpuPassingNodeTestsPassOnTheGpu) {
  KILN_REQUIRE_GPU();
  if (!onnx::onnx_available()) GTEST_SKIP() << "kiln is built without the ONNX front end (libonnx-dev)";
  std::string where;
  const auto cases = onnx_node_test_cases(&where);
  if (cases.empty()) GTEST_SKIP() << where << " is missing (libonnx-testdata)";
  int cpu_passed = 0, gpu_passed = 0, gpu_only = 0;
  for (const auto& dir : cases) {
    const std::string name = dir.filename().string();
    const NodeTestResult cpu = run_onnx_node_test(dir, Device::kCpu);
    const NodeTestResult gpu = run_onnx_node_test(dir, Device::kCuda);
    cpu_passed += cpu.outcome == NodeTestOutcome::kPass;
    gpu_passed += gpu.outcome == NodeTestOutcome::kPass;
    gpu_only += gpu.outcome == NodeTestOutcome::kPass && cpu.outcome != NodeTestOutcome::kPass;
    if (cpu.outcome == NodeTestOutcome::kPass)
      EXPECT_EQ(gpu.outcome, NodeTestOutcome::kPass) << name << ": " << outcome_word(gpu.outcome) << " on CUDA: "
                                                     << gpu.reason;
  }
  std::printf("ONNX node tests on CUDA: %d of %zu pass (the CPU: %d; passing on CUDA only: %d)\n", gpu_passed,
              cases.size(), cpu_passed, gpu_only);
}

}  // namespace
}  // namespace kiln::testing
