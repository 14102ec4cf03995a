// ONNX's node conformance tests (tests/frontend/onnx_node_tests.h) on CUDA: every case that
// passes on the CPU passes on the GPU too (same expected outputs and tolerances), convolution
// and pooling included (cuda-conv), so an imported model computes the same numbers on either
// device, or stops at one clear error naming an op the CUDA backend has no kernel for (none
// known); the summary line counts those by op. Needs the ONNX front
// end (on the GPU machine: Debian's packages carried, scripts/gpu-check.sh) and the node tests
// ($KILN_ONNX_NODE_TESTS or Debian's folder); skips without them.
#include <fmt/format.h>

#include <cstdio>
#include <map>
#include <regex>
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
  int cpu_passed = 0, gpu_passed = 0;
  std::map<std::string, int> no_kernel;  // op -> cases that stop at it (CUDA has no kernel for it)
  for (const auto& dir : cases) {
    const std::string name = dir.filename().string();
    // Which case ran last (and where), should one bring the process down or hang.
    std::fprintf(stderr, "onnx node test on the CPU: %s\n", name.c_str());
    std::fflush(stderr);
    const NodeTestResult cpu = run_onnx_node_test(dir, Device::kCpu);
    if (cpu.outcome != NodeTestOutcome::kPass) continue;
    ++cpu_passed;
    std::fprintf(stderr, "onnx node test on CUDA: %s\n", name.c_str());
    std::fflush(stderr);
    const NodeTestResult gpu = run_onnx_node_test(dir, Device::kCuda);
    gpu_passed += gpu.outcome == NodeTestOutcome::kPass;
    // An op without a CUDA kernel is a clear error naming it (counted below); anything else
    // that is no pass is a failure.
    const std::regex missing(R"(\(([a-z_0-9]+)\(.*has no cuda kernel)");
    std::smatch m;
    if (gpu.outcome == NodeTestOutcome::kError && std::regex_search(gpu.reason, m, missing)) {
      ++no_kernel[m[1].str()];
      continue;
    }
    EXPECT_EQ(gpu.outcome, NodeTestOutcome::kPass) << name << ": " << outcome_word(gpu.outcome) << " on CUDA: "
                                                   << gpu.reason;
  }
  std::string gaps;
  for (const auto& [op, count] : no_kernel) gaps += fmt::format("{}{} ({})", gaps.empty() ? "" : ", ", op, count);
  std::printf("ONNX node tests on CUDA: %d of the %d the CPU passes also pass on CUDA; the rest stop at an op without "
              "a CUDA kernel: %s\n",
              gpu_passed, cpu_passed, gaps.empty() ? "none" : gaps.c_str());
}

}  // namespace
}  // namespace kiln::testing
