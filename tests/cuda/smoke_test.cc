// The CUDA build path: a kernel compiled by nvcc runs and matches the host. Skips cleanly on a
// machine without a GPU (CI, the development machines).
#include "gpu_test_util.h"

namespace kiln {
namespace {

TEST(CudaSmoke, SaxpyMatchesHost) {
  KILN_REQUIRE_GPU();
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
