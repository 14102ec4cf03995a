// Dialect "openblas": matmul in f32 and f64 through cblas_sgemm / cblas_dgemm.
//
// matmul(a, b){transpose_a, transpose_b}: a (..., M, K) (stored (..., K, M) when transpose_a),
// b (..., K, N) (stored (..., N, K) when transpose_b), batch dims broadcast numpy-style, output
// (batch..., M, N). Transposes are BLAS transpose arguments on the row-major data as stored (no
// copies). When b is one matrix for all batches and a is neither transposed nor broadcast, the
// batch folds into M: (B, T, C) @ (C, D) is one (B*T, C) @ (C, D) GEMM, which OpenBLAS runs far
// better than B small ones. Otherwise one GEMM per output batch, each threaded by OpenBLAS.
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <span>
#include <vector>

#include "backends/cpu/cpu_kernels.h"
#include "ops/fp8.h"
#include "tensor/tensor.h"

namespace kiln::cpu {
namespace {

struct GemmShape {
  int64_t m, n, k;
  int64_t lda, ldb;  // row lengths of a and b as stored
};

GemmShape gemm_shape(const Shape& a, const Shape& b, bool transpose_a, bool transpose_b) {
  const size_t ra = a.size(), rb = b.size();
  GemmShape g;
  g.m = transpose_a ? a[ra - 1] : a[ra - 2];
  g.k = transpose_a ? a[ra - 2] : a[ra - 1];
  g.n = transpose_b ? b[rb - 2] : b[rb - 1];
  g.lda = a[ra - 1];
  g.ldb = b[rb - 1];
  return g;
}

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans,
              transpose_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a,
              static_cast<blasint>(std::max<int64_t>(lda, 1)), b,
              static_cast<blasint>(std::max<int64_t>(ldb, 1)), 0.0f, c,
              static_cast<blasint>(std::max<int64_t>(ldc, 1)));
}

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const double* a,
          int64_t lda, const double* b, int64_t ldb, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans,
              transpose_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0, a,
              static_cast<blasint>(std::max<int64_t>(lda, 1)), b,
              static_cast<blasint>(std::max<int64_t>(ldb, 1)), 0.0, c,
              static_cast<blasint>(std::max<int64_t>(ldc, 1)));
}

// One GEMM per output batch (batch dims broadcast), each threaded by OpenBLAS.
template <typename T>
void batched_gemm(const GemmShape& g, bool transpose_a, bool transpose_b, const T* a_data,
                  const Shape& a_batch, const T* b_data, const Shape& b_batch, T* c_data,
                  const Shape& c_batch) {
  const int64_t batches = numel(c_batch);

  // Strides in whole matrices of a and b along the output's batch dims (0 where broadcast).
  const std::vector<int64_t> a_strides = broadcast_strides(a_batch, c_batch);
  const std::vector<int64_t> b_strides = broadcast_strides(b_batch, c_batch);
  const int64_t a_matrix = g.m * g.k, b_matrix = g.k * g.n, c_matrix = g.m * g.n;
  const int rank = static_cast<int>(c_batch.size());
  std::vector<int64_t> index(rank, 0);
  int64_t a_offset = 0, b_offset = 0;
  for (int64_t batch = 0; batch < batches; ++batch) {
    gemm(transpose_a, transpose_b, g.m, g.n, g.k, a_data + a_offset * a_matrix, g.lda,
         b_data + b_offset * b_matrix, g.ldb, c_data + batch * c_matrix, g.n);
    for (int d = rank - 1; d >= 0; --d) {  // odometer over the batch index
      ++index[d];
      a_offset += a_strides[d];
      b_offset += b_strides[d];
      if (index[d] < c_batch[d]) break;
      a_offset -= a_strides[d] * index[d];
      b_offset -= b_strides[d] * index[d];
      index[d] = 0;
    }
  }
}

template <typename T>
void matmul_kernel(const KernelArgs& args) {
  const Tensor& a = args.inputs[0];
  const Tensor& b = args.inputs[1];
  Tensor& c = args.outputs[0];
  const bool transpose_a = args.attrs.b("transpose_a");
  const bool transpose_b = args.attrs.b("transpose_b");
  const GemmShape g = gemm_shape(a.shape(), b.shape(), transpose_a, transpose_b);
  if (c.numel() == 0) return;
  T* c_data = c.data<T>();
  if (g.k == 0) {  // an empty sum: zeros (BLAS would also do this, but its ld checks differ)
    std::memset(c_data, 0, c.bytes());
    return;
  }
  const Shape a_batch(a.shape().begin(), a.shape().end() - 2);
  const Shape b_batch(b.shape().begin(), b.shape().end() - 2);
  const Shape c_batch(c.shape().begin(), c.shape().end() - 2);
  const int64_t batches = numel(c_batch);
  const T* a_data = a.data<T>();
  const T* b_data = b.data<T>();
  // An fp8 matmul (ops/fp8.h) multiplies quantized copies and scales the product.
  const MatmulFp8 fp8 = matmul_fp8(args.attrs);
  std::vector<T> a_fp8, b_fp8;
  T scale = 1;
  if (fp8.on()) {
    a_fp8.assign(a_data, a_data + a.numel());
    b_fp8.assign(b_data, b_data + b.numel());
    scale = static_cast<T>(static_cast<double>(fp8_quantize(a_fp8.data(), a_fp8.size(), fp8.a)) *
                           fp8_quantize(b_fp8.data(), b_fp8.size(), fp8.b));
    a_data = a_fp8.data();
    b_data = b_fp8.data();
  }

  if (numel(b_batch) == 1 && !transpose_a && numel(a_batch) == batches &&
      g.m * batches <= INT_MAX) {
    gemm(false, transpose_b, g.m * batches, g.n, g.k, a_data, g.lda, b_data, g.ldb, c_data, g.n);
  } else {
    batched_gemm(g, transpose_a, transpose_b, a_data, a_batch, b_data, b_batch, c_data, c_batch);
  }
  if (fp8.on())
    for (T& v : std::span<T>(c_data, static_cast<size_t>(c.numel()))) v *= scale;
}

// Same dtype (f32 or f64) everywhere, and every BLAS dimension fits BLAS's int.
bool matmul_supported(const NodeView& node, DType dtype) {
  if (!all_dtype(node, dtype) || node.input_types.size() != 2) return false;
  const Shape& a = node.input_types[0].shape;
  const Shape& b = node.input_types[1].shape;
  if (a.size() < 2 || b.size() < 2) return false;
  const GemmShape g = gemm_shape(a, b, node.node.attrs.b("transpose_a"),
                                 node.node.attrs.b("transpose_b"));
  for (int64_t v : {g.m, g.n, g.k, g.lda, g.ldb})
    if (v > INT_MAX) return false;
  return true;
}

}  // namespace

void register_gemm_kernels(KernelRegistry& registry) {
  registry.add(Op::kMatmul,
               KernelImpl{"openblas", Device::kCpu, kOpenBlasPriority,
                          [](const NodeView& node) {
                            return matmul_supported(node, DType::kF32) ||
                                   matmul_supported(node, DType::kF64);
                          },
                          [](const KernelArgs& args) {
                            if (args.inputs[0].dtype() == DType::kF32)
                              matmul_kernel<float>(args);
                            else
                              matmul_kernel<double>(args);
                          }});
}

}  // namespace kiln::cpu
