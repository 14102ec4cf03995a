// The device half of an fp8 product (ops/fp8.h): per-tensor amax and quantization into the
// K-major e4m3 / e5m2 operands cuBLASLt's FP8 GEMMs read. Gemm::run (cublaslt.cc) calls these
// for an fp8 description; C++17-clean for that host file. Every launcher enqueues on `stream`
// and never synchronizes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ir/dtype.h"
#include "ops/fp8.h"

namespace kiln::cuda::fp8 {

// *amax = max(*amax, max |x|) over n elements of dtype t (f32, bf16 or f16). *amax must start at
// 0 (a cudaMemsetAsync): blocks combine through an atomic max on the float's bits, which orders
// non-negative floats, NaN above infinity, so a NaN element makes a NaN amax.
void amax(DType t, const void* x, int64_t n, float* amax, cudaStream_t stream);

// q = fp8(x * s) with s = fp8_scale(*amax, fp8_max(format)) (ops/fp8.h), x stored (rows, cols)
// row-major; q is (rows, cols), or (cols, rows) when `transpose`. *inverse_scale = 1 / s.
void quantize(DType t, Fp8Format format, const void* x, int64_t rows, int64_t cols, bool transpose,
              const float* amax, uint8_t* q, float* inverse_scale, cudaStream_t stream);

}  // namespace kiln::cuda::fp8
