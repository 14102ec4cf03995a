// The CUDA build path: a kernel compiled by nvcc runs and matches the host. Skips cleanly on a
// machine without a GPU (CI, the development machines).
#include "backends/cuda/device.h"
#include "test_util.h"

namespace kiln {
namespace {

TEST(CudaSmoke, SaxpyMatchesHost) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  EXPECT_LE(cuda::smoke_test_saxpy(1000003), 1e-6);
  EXPECT_NE(cuda::describe_device(0).find("sm_"), std::string::npos);
}

TEST(CudaSmoke, QueriesNeverThrowWithoutADevice) {
  int n = cuda::device_count();
  EXPECT_GE(n, 0);
  if (n == 0) {
    EXPECT_FALSE(cuda::describe_device(0).empty());
    EXPECT_THROW(cuda::smoke_test_saxpy(10), Error);
  }
}

}  // namespace
}  // namespace kiln
