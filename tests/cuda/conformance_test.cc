// The conformance sweep on the GPU (tests/conformance.h): every case of the table through every
// CUDA kernel (dialects "cuda", "cuda-movement", "cuda-nn", "cublaslt", "cuda-attention",
// "cuda-conv", "cudnn", "nvrtc", "cuda-body") whose supports() takes it, inputs uploaded,
// outputs poisoned with 0xFF bytes, against the op's CPU reference kernel; and the coverage of
// both devices, printed.
#include "conformance.h"
#include "gpu_test_util.h"

namespace kiln {
namespace {

namespace conformance = testing::conformance;

class CudaConformance : public ::testing::TestWithParam<Op> {};

TEST_P(CudaConformance, KernelsMatchReference) {
  KILN_REQUIRE_GPU();
  conformance::expect_kernels_match_reference(GetParam(), Device::kCuda);
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaConformance, ::testing::ValuesIn(conformance::ops_with_cases()),
                         [](const ::testing::TestParamInfo<Op>& info) {
                           return std::string(op_name(info.param));
                         });

// The table the issue quotes: per op, the nodes each dialect of each device runs (the CPU
// columns run in kiln_tests); the kernels no case reached. supports() reads only types and
// attributes, so this needs the CUDA build, not a device.
TEST(CudaConformanceTable, PrintsCoverage) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  const conformance::Coverage coverage = conformance::coverage({Device::kCpu, Device::kCuda});
  std::cout << coverage.table;
  for (const std::string& kernel : coverage.unreached) std::cout << "unreached: " << kernel << "\n";
}

}  // namespace
}  // namespace kiln
