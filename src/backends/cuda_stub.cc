// The CUDA device queries in a build without the CUDA backend (-DKILN_CUDA=OFF or no nvcc).
#ifndef KILN_HAVE_CUDA
#include "backends/backend.h"
#include "backends/cuda/device.h"
#include "backends/cuda/device_errors.h"
#include "support/error.h"

namespace kiln::cuda {
bool built_with_cuda() { return false; }
int device_count() { return 0; }
std::string describe_device(int) { return "this build has no CUDA backend"; }
// No CUDA kernel ever ran, so none recorded a data error.
void check_device_errors() {}
double smoke_test_saxpy(int) { fail("this build has no CUDA backend (configure with -DKILN_CUDA=ON)"); }
}  // namespace kiln::cuda

namespace kiln {
void register_cuda_kernels(KernelRegistry&) {}
}  // namespace kiln
#endif
