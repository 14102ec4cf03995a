// The cuBLASLt GEMM layer of the CUDA backend: cuda::Gemm describes one (strided-batched) product
// with an optional fused epilogue, in kiln's row-major terms; Gemm::run enqueues it on a stream.
// Descriptors, layouts and the chosen algorithm are built once per description and cached (one
// cuBLASLt handle and one 32 MiB workspace per device). The "cublaslt" matmul dialect
// (cublaslt.cc) and the fused GEMM-epilogue nodes both go through it.
//
// Row-major on column-major (how kiln's tensors reach cuBLASLt): a row-major (R, C) matrix with
// row stride ld is, byte for byte, the column-major (C, R) matrix with leading dimension ld, i.e.
// its transpose. So D = op(A) op(B) (row-major, (m, n)) is computed as the column-major product
// D^T = op(B)^T op(A)^T: cuBLASLt's "A" is kiln's B and its "B" is kiln's A, its m is our n and
// its n our m, and the transpose flags carry over unchanged (a row-major B stored (k, n) is the
// column-major (n, k) matrix op(B)^T, which needs no transpose; stored (n, k) it needs one).
// Consequences for the epilogues, stated here once in row-major terms:
//   * cuBLASLt's bias runs along D's column-major rows = our columns: bias has length n and is
//     added to every row of D (a linear layer's bias).
//   * cuBLASLt's BGRADA reduces its A (= our B) over k: our kBGradB, length n, the column sums
//     of op(B); its BGRADB is our kBGradA, length m, the row sums of op(A).
//   * The GELU aux matrix has D's shape (m, n), row-major with row stride ld_aux (cuBLASLt: its
//     leading dimension, which must be a multiple of 8, so n % 8 == 0 when packed).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "ir/dtype.h"
#include "ops/fp8.h"
#include "support/error.h"

namespace kiln::cuda {

// The name of a cuBLAS status ("CUBLAS_STATUS_NOT_SUPPORTED"); cublasGetStatusName lives in
// libcublas, which kiln does not link.
const char* cublas_status_name(cublasStatus_t status);

}  // namespace kiln::cuda

// Every cuBLASLt call goes through this: a failure throws kiln::Error with file:line, the call
// and the status name.
#define KILN_CUBLAS_CHECK(call)                                                              \
  do {                                                                                       \
    cublasStatus_t kiln_cublas_status_ = (call);                                             \
    if (kiln_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                        \
      ::kiln::fail("{}:{}: {} failed: {}", __FILE__, __LINE__, #call,                        \
                   ::kiln::cuda::cublas_status_name(kiln_cublas_status_));                   \
  } while (0)

namespace kiln::cuda {

// What runs after the product, in row-major terms (see the header comment). "pre" is
// alpha op(A) op(B) + beta C; gelu is the tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// (kiln's gelu{approximate="tanh"}, GPT-2's); gelu' its derivative.
enum class Epilogue : uint8_t {
  kNone,         // D = pre
  kBias,         // D = pre + bias (bias: n values, added to every row)
  kGelu,         // D = gelu(pre)
  kGeluBias,     // D = gelu(pre + bias)
  kGeluAux,      // aux = pre, D = gelu(aux)             (aux: an output, D's shape)
  kGeluAuxBias,  // aux = pre + bias, D = gelu(aux)
  kDGelu,        // D = pre * gelu'(aux)                 (aux: an input, the forward's pre)
  kDGeluBGrad,   // D = pre * gelu'(aux), bias_grad[j] = sum_i D[i, j] (n values). Slow at
                 //   GPT-2's fc backward (32768 x 3072 x 768: 184 TFLOP/s on an H200, against
                 //   ~780 without epilogue): prefer kDGelu here and kBGradB on the dW GEMM.
  kBGradA,       // D = pre, bias_grad[i] = sum_p op(A)[i, p] (m values: row sums of op(A));
                 //   needs transpose_a (A stored (k, m), e.g. dW^T = dy^T x with dy as A)
  kBGradB,       // D = pre, bias_grad[j] = sum_p op(B)[p, j] (n values: column sums of op(B));
                 //   needs !transpose_b (B stored (k, n), e.g. dW = x^T dy with dy as B)
};
const char* epilogue_name(Epilogue epilogue);
bool epilogue_reads_bias(Epilogue e);   // kBias, kGeluBias, kGeluAuxBias
bool epilogue_writes_bias(Epilogue e);  // kDGeluBGrad, kBGradA, kBGradB
bool epilogue_writes_aux(Epilogue e);   // kGeluAux, kGeluAuxBias
bool epilogue_reads_aux(Epilogue e);    // kDGelu, kDGeluBGrad

// The device pointers of one product; alpha and beta are host values (read when enqueued).
struct GemmOperands {
  const void* a = nullptr;
  const void* b = nullptr;
  const void* c = nullptr;  // read only when beta != 0; nullptr: D is C (accumulate in place)
  void* d = nullptr;
  double alpha = 1.0;
  double beta = 0.0;
  const void* bias = nullptr;  // epilogue_reads_bias: input, dtype Gemm::bias_dtype()
  void* bias_grad = nullptr;   // epilogue_writes_bias: output, dtype d_type
  void* aux = nullptr;         // GELU aux: output (forward) or input (DGELU), dtype d_type
  // An fp8 product's quantized operands' inverse scales (device f32 scalars). Left null by
  // callers: run() quantizes an fp8 description's a_type operands and sets them itself.
  const float* scale_a = nullptr;
  const float* scale_b = nullptr;
};

class GemmPlan;

// One product D (m, n) = epilogue(alpha op(A) (m, k) op(B) (k, n) + beta C), all row-major,
// repeated over `batch` matrices at fixed element strides. Dtypes: a_type for A and B, d_type
// for C, D, bias, bias_grad and aux; supported pairs: f32/f32 (tf32 optional), bf16/bf16,
// bf16/f32, f16/f16, f16/f32 (all accumulating in f32), f64/f64. The bias an epilogue reads may
// instead be in the inputs' 16-bit dtype when D is f32 (bias_type: a bf16 linear layer's bias
// added to an f32 residual stream): it is added to the f32 accumulator, nothing is rounded to 16
// bits. cuBLASLt refused that on the H100 (CUDA 13: CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE bf16
// with an f32 D, INVALID_VALUE from the heuristic); the plan then widens the bias to f32 before
// each product (GemmPlan::widens_bias). Equality and hashing cover every field: the description is the plan cache's key (with
// the operands' pointer alignments).
struct Gemm {
  int64_t m = 0, n = 0, k = 0;
  bool transpose_a = false;  // A stored (k, m) instead of (m, k)
  bool transpose_b = false;  // B stored (n, k) instead of (k, n)
  DType a_type = DType::kF32;
  DType d_type = DType::kF32;
  bool tf32 = false;  // f32 only: inputs rounded to TF32 on the tensor cores (~1e-3 relative)
  Epilogue epilogue = Epilogue::kNone;
  // The dtype of the bias the epilogue reads; unset: d_type. Set to a_type (bf16 or f16) only
  // with d_type f32 and an epilogue that reads a bias (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE).
  std::optional<DType> bias_type;
  // Row strides in elements; 0 means packed (the stored row length).
  int64_t lda = 0, ldb = 0, ldc = 0, ldd = 0, ld_aux = 0;
  // Batching: `batch` products; strides in elements between consecutive matrices. A stride of 0
  // for A or B broadcasts that matrix over the batch; 0 for C/D/aux means packed (m * ld).
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0, stride_d = 0, stride_aux = 0;
  int64_t stride_bias = 0;  // between the bias (or bias_grad) vectors of the batch; 0: shared
  // An fp8 product (ops/fp8.h): A and B, given in a_type (f32, bf16 or f16), are quantized by
  // run() into stream-ordered scratch, K-major (cuBLASLt's FP8 kernels read A transposed and B
  // not), each with its per-tensor scale computed on the device, and multiplied by an FP8 GEMM
  // (with fast accumulation where fp8_fast_accum: ops/fp8.h). Needs batch 1, packed A and B,
  // k % 16 == 0, and an epilogue of none or bias. Both set or neither.
  Fp8Format fp8_a = Fp8Format::kNone, fp8_b = Fp8Format::kNone;
  bool fp8_fast_accum = false;

  bool operator==(const Gemm&) const = default;
  std::string to_string() const;
  DType bias_dtype() const { return bias_type.value_or(d_type); }
  bool fp8() const { return fp8_a != Fp8Format::kNone; }

  // Checks the description and the operands (throws kiln::Error naming what is wrong), finds or
  // builds the cached plan, and enqueues the product on `stream`. Never synchronizes, except
  // once per description when autotuning (gemm_autotune()) outside stream capture.
  void run(const GemmOperands& operands, cudaStream_t stream) const;
  // The cached plan run() would use for these operands (built on first use). The same object
  // is returned for the same description, device and pointer alignments.
  const GemmPlan& plan(const GemmOperands& operands, cudaStream_t stream) const;
};

// What the cache holds for one description: descriptors, layouts and the chosen algorithm.
class GemmPlan {
 public:
  ~GemmPlan();
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;

  // A short description of the algorithm chosen: "algo 21 tile 7 stages 12 splitK 1 ws 0 B".
  std::string algorithm() const;
  // How it was chosen: false by the heuristic's first answer, true by timing candidates.
  bool tuned() const { return tuned_; }
  // True when cuBLASLt offered no algorithm for a 16-bit bias on an f32 D: each run then widens
  // the bias to f32 first (a cast kernel of n elements into stream-ordered scratch) and the
  // product reads that.
  bool widens_bias() const { return widens_bias_; }
  // Time per run (ms) of the winner when tuned, else 0.
  float tuned_ms() const { return tuned_ms_; }

 private:
  friend struct Gemm;
  friend struct GemmPlanAccess;
  GemmPlan() = default;

  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t layout_a_ = nullptr, layout_b_ = nullptr;  // cuBLASLt's A and B
  cublasLtMatrixLayout_t layout_c_ = nullptr, layout_d_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  size_t workspace_bytes_ = 0;
  int candidates_ = 0;  // how many algorithms the heuristic offered
  bool tuned_ = false;
  bool widens_bias_ = false;
  float tuned_ms_ = 0.0f;
  // Held while the per-call pointers (bias, aux) are set on desc_ and the product is enqueued:
  // cuBLASLt reads the descriptor when enqueuing, so plans can be shared between threads.
  std::mutex mutex_;
};

// Sets g's fp8 formats from a matmul node's attributes (ops/fp8.h), once its shape, dtype and
// strides are set. False for an fp8 node whose description breaks the fp8 rules (Gemm::fp8_a:
// batch 1, packed A and B, k % 16 == 0, not f64): the caller then has no fp8 binding for it.
// Both the matmul dialect and the fused GEMM groups (nvrtc) decide through it.
bool set_fp8(Gemm& g, const Attributes& matmul_attrs);

// Algorithm choice by timing the heuristic's top candidates (once per description, cached).
// Default: the environment variable KILN_GEMM_AUTOTUNE=1; this overrides it. True on a thread
// holding a GemmTuningScope (device.h) whatever the setting.
bool gemm_autotune();
void set_gemm_autotune(bool on);
// How many of the heuristic's candidates autotuning times: KILN_GEMM_CANDIDATES (1-128), default 8.
int gemm_autotune_candidates();
// Whether the f32 matmul dialect uses TF32 (off by default, like PyTorch's matmul; the
// environment variable KILN_ALLOW_TF32=1 turns it on; this overrides it).
bool matmul_allow_tf32();
void set_matmul_allow_tf32(bool on);
// Number of plans in the cache (all devices): for tests and diagnostics.
size_t gemm_plan_cache_size();
// How many of those plans were tuned (their algorithm chosen by timing).
size_t gemm_tuned_plan_count();

inline constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

}  // namespace kiln::cuda
