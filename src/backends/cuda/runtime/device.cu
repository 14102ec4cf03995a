// Device discovery and a smoke-test kernel: the first piece of the CUDA backend, so that the
// CUDA build path (nvcc, cudart, sm_90a) is exercised in every CI build.
#include <cmath>
#include <vector>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/runtime/device.h"

namespace kiln::cuda {
namespace {

__global__ void saxpy_kernel(int n, float a, const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

void launch_saxpy(int n, float a, const float* x, float* y) {
  const int threads = 256;
  saxpy_kernel<<<(n + threads - 1) / threads, threads>>>(n, a, x, y);
  KILN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool built_with_cuda() { return true; }

int device_count() {
  int count = 0;
  // No driver or no GPU is not an error here: it means zero devices.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::string describe_device(int device) {
  if (device >= device_count()) return "no CUDA device";
  cudaDeviceProp prop;
  KILN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return fmt::format("{}, sm_{}{}, {:.1f} GiB", prop.name, prop.major, prop.minor,
                     static_cast<double>(prop.totalGlobalMem) / (1 << 30));
}

int compute_capability(int device) {
  if (device >= device_count()) return 0;
  int major = 0, minor = 0;
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return 10 * major + minor;
}

int current_device() {
  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void set_current_device(int device) { KILN_CUDA_CHECK(cudaSetDevice(device)); }

double smoke_test_saxpy(int n) {
  KILN_CHECK(device_count() > 0, "no CUDA device");
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) {
    x[i] = 0.5f + static_cast<float>(i % 17);
    y[i] = 1.0f - static_cast<float>(i % 13);
  }
  float *dx = nullptr, *dy = nullptr;
  KILN_CUDA_CHECK(cudaMalloc(&dx, n * sizeof(float)));
  KILN_CUDA_CHECK(cudaMalloc(&dy, n * sizeof(float)));
  KILN_CUDA_CHECK(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  KILN_CUDA_CHECK(cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  launch_saxpy(n, 2.0f, dx, dy);
  std::vector<float> out(n);
  KILN_CUDA_CHECK(cudaMemcpy(out.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost));
  KILN_CUDA_CHECK(cudaFree(dx));
  KILN_CUDA_CHECK(cudaFree(dy));
  double worst = 0;
  for (int i = 0; i < n; ++i) worst = std::max(worst, std::abs(static_cast<double>(out[i]) - (2.0 * x[i] + y[i])));
  return worst;
}

}  // namespace kiln::cuda
