// Dialect "cublaslt": matmul through cuBLASLt, and the GEMM layer (cuda::Gemm, cublaslt.h) that
// the fused GEMM-epilogue nodes use too. The row-major to column-major mapping is described once,
// in cublaslt.h; the code below follows it: cuBLASLt's A is kiln's B, its B is kiln's A.
//
// matmul(a, b){transpose_a, transpose_b} maps onto one strided-batched GEMM when each operand's
// batch is either the whole output batch or a single matrix (broadcast at stride 0); other
// broadcasts (a (B, 1, M, K) @ b (1, H, K, N)) are not supported here (supports() is false and a
// lower-priority dialect takes the node). When b is a single matrix and a is batched and not
// transposed, the batch folds into M: (B, T, C) @ (C, D) is one (B*T, C) @ (C, D) GEMM.
#include "backends/cuda/cublaslt/cublaslt.h"

#include "backends/cuda/runtime/device.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/cublaslt/fp8.cuh"
#include "backends/cuda/movement/movement.cuh"
#include "backends/cuda/registration.h"
#include "backends/cuda/common/scratch.cuh"

namespace kiln::cuda {

const char* cublas_status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_<unknown>";
}

const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::kNone: return "none";
    case Epilogue::kBias: return "bias";
    case Epilogue::kGelu: return "gelu";
    case Epilogue::kGeluBias: return "gelu_bias";
    case Epilogue::kGeluAux: return "gelu_aux";
    case Epilogue::kGeluAuxBias: return "gelu_aux_bias";
    case Epilogue::kDGelu: return "dgelu";
    case Epilogue::kDGeluBGrad: return "dgelu_bgrad";
    case Epilogue::kBGradA: return "bgrad_a";
    case Epilogue::kBGradB: return "bgrad_b";
  }
  return "?";
}

bool epilogue_reads_bias(Epilogue e) {
  return e == Epilogue::kBias || e == Epilogue::kGeluBias || e == Epilogue::kGeluAuxBias;
}
bool epilogue_writes_bias(Epilogue e) {
  return e == Epilogue::kDGeluBGrad || e == Epilogue::kBGradA || e == Epilogue::kBGradB;
}
bool epilogue_writes_aux(Epilogue e) {
  return e == Epilogue::kGeluAux || e == Epilogue::kGeluAuxBias;
}
bool epilogue_reads_aux(Epilogue e) {
  return e == Epilogue::kDGelu || e == Epilogue::kDGeluBGrad;
}

namespace {

// ---- settings ----

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::string(v) != "0";
}

std::atomic<int>& autotune_setting() {  // -1: not read yet
  static std::atomic<int> v{-1};
  return v;
}
std::atomic<int>& tf32_setting() {
  static std::atomic<int> v{-1};
  return v;
}

// ---- mapping kiln's description onto cuBLASLt ----

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kF64: return CUDA_R_64F;
    case DType::kF16: return CUDA_R_16F;
    case DType::kBF16: return CUDA_R_16BF;
    default: fail("cublaslt: dtype {} has no GEMM, expected f32, f64, f16 or bf16", dtype_name(t));
  }
}

// An operand's type as cuBLASLt reads it: its fp8 format when quantized, else `t`.
cudaDataType_t operand_type(Fp8Format f, DType t) {
  return f == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : f == Fp8Format::kE5M2 ? CUDA_R_8F_E5M2 : cuda_type(t);
}
size_t operand_size(Fp8Format f, DType t) { return f == Fp8Format::kNone ? dtype_size(t) : 1; }

bool supported_types(DType a, DType d) {
  switch (a) {
    case DType::kF32: return d == DType::kF32;
    case DType::kF64: return d == DType::kF64;
    case DType::kF16:
    case DType::kBF16: return d == a || d == DType::kF32;
    default: return false;
  }
}

cublasLtEpilogue_t cublas_epilogue(Epilogue e) {
  switch (e) {
    case Epilogue::kNone: return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::kBias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::kGelu: return CUBLASLT_EPILOGUE_GELU;
    case Epilogue::kGeluBias: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case Epilogue::kGeluAux: return CUBLASLT_EPILOGUE_GELU_AUX;
    case Epilogue::kGeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::kDGelu: return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::kDGeluBGrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    // Column-major swap: our A is cuBLASLt's B and the other way round.
    case Epilogue::kBGradA: return CUBLASLT_EPILOGUE_BGRADB;
    case Epilogue::kBGradB: return CUBLASLT_EPILOGUE_BGRADA;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// The description with every default (0 = packed) replaced by its value.
struct Resolved {
  int64_t lda, ldb, ldc, ldd, ld_aux;
  int64_t stride_c, stride_d, stride_aux;
};

Resolved resolve(const Gemm& g) {
  Resolved r;
  r.lda = g.lda ? g.lda : (g.transpose_a ? g.m : g.k);
  r.ldb = g.ldb ? g.ldb : (g.transpose_b ? g.k : g.n);
  r.ldd = g.ldd ? g.ldd : g.n;
  r.ldc = g.ldc ? g.ldc : r.ldd;
  r.ld_aux = g.ld_aux ? g.ld_aux : g.n;
  r.stride_d = g.stride_d ? g.stride_d : g.m * r.ldd;
  r.stride_c = g.stride_c ? g.stride_c : g.m * r.ldc;
  r.stride_aux = g.stride_aux ? g.stride_aux : g.m * r.ld_aux;
  return r;
}

// The largest power of two (<= 256) dividing the pointer and, when batched, the byte stride:
// the alignment every matrix of the batch has. cuBLASLt's heuristic assumes 256 unless told.
uint32_t alignment_of(const void* p, int64_t stride, size_t element, int64_t batch) {
  uint64_t v = reinterpret_cast<uintptr_t>(p);
  if (batch > 1) v |= static_cast<uint64_t>(stride) * element;
  if (v == 0) return 256;
  return static_cast<uint32_t>(std::min<uint64_t>(v & (~v + 1), 256));
}

struct PlanKey {
  Gemm gemm;
  int device = 0;
  uint32_t align_a = 0, align_b = 0, align_c = 0, align_d = 0, align_bias = 0, align_aux = 0;
  bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    const Gemm& g = k.gemm;
    for (int64_t v : {g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.ldd, g.ld_aux, g.batch, g.stride_a,
                      g.stride_b, g.stride_c, g.stride_d, g.stride_aux, g.stride_bias})
      mix(static_cast<uint64_t>(v));
    mix((uint64_t{g.transpose_a} << 1) | g.transpose_b | (uint64_t{g.tf32} << 2));
    mix((static_cast<uint64_t>(g.a_type) << 16) | (static_cast<uint64_t>(g.d_type) << 8) |
        static_cast<uint64_t>(g.epilogue));
    mix(g.bias_type ? static_cast<uint64_t>(*g.bias_type) + 1 : 0);
    mix((uint64_t{g.fp8_fast_accum} << 16) | (static_cast<uint64_t>(g.fp8_a) << 8) | static_cast<uint64_t>(g.fp8_b));
    mix(static_cast<uint64_t>(k.device));
    for (uint32_t v : {k.align_a, k.align_b, k.align_c, k.align_d, k.align_bias, k.align_aux})
      mix(v);
    return h;
  }
};

// One cuBLASLt handle and one workspace per device and stream: the GEMMs of one stream never
// overlap, so they share its workspace; two streams' may (two trainers in one process, each on
// its own stream), and one workspace for both would let one GEMM overwrite the other's partial
// sums. Made on a stream's first GEMM, which the executor runs uncaptured (its warm-up run).
struct DeviceState {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
};

struct Cache {
  std::mutex mutex;
  std::map<std::pair<int, cudaStream_t>, DeviceState> devices;  // by device and stream
  std::unordered_map<PlanKey, std::unique_ptr<GemmPlan>, PlanKeyHash> plans;
};

// Never destroyed: at exit the CUDA runtime may be torn down before static destructors run.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

DeviceState& device_state_locked(Cache& c, int device, cudaStream_t stream) {
  auto it = c.devices.find({device, stream});
  if (it != c.devices.end()) return it->second;
  DeviceState s;
  KILN_CUBLAS_CHECK(cublasLtCreate(&s.handle));
  KILN_CUDA_CHECK(cudaMalloc(&s.workspace, kGemmWorkspaceBytes));
  return c.devices.emplace(std::make_pair(device, stream), s).first->second;
}

template <typename T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                                   int64_t batch, int64_t stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type,
                                               static_cast<uint64_t>(rows),
                                               static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return layout;
}

// Alpha and beta in the scale type: double for f64 GEMMs, float otherwise.
struct Scalars {
  double alpha64, beta64;
  float alpha32, beta32;
  const void* alpha(bool f64) const { return f64 ? static_cast<const void*>(&alpha64) : &alpha32; }
  const void* beta(bool f64) const { return f64 ? static_cast<const void*>(&beta64) : &beta32; }
};

Scalars scalars_of(const GemmOperands& ops) {
  return {ops.alpha, ops.beta, static_cast<float>(ops.alpha), static_cast<float>(ops.beta)};
}

}  // namespace

namespace {
thread_local int t_tuning_scopes = 0;
}  // namespace

GemmTuningScope::GemmTuningScope() { ++t_tuning_scopes; }
GemmTuningScope::~GemmTuningScope() { --t_tuning_scopes; }

bool gemm_autotune() {
  if (t_tuning_scopes > 0) return true;
  int v = autotune_setting().load();
  if (v < 0) {
    v = env_flag("KILN_GEMM_AUTOTUNE") ? 1 : 0;
    autotune_setting().store(v);
  }
  return v == 1;
}
void set_gemm_autotune(bool on) { autotune_setting().store(on ? 1 : 0); }

int gemm_autotune_candidates() {
  static const int n = [] {
    const char* v = std::getenv("KILN_GEMM_CANDIDATES");
    const int parsed = v ? std::atoi(v) : 0;
    return parsed > 0 ? std::min(parsed, 128) : 8;
  }();
  return n;
}

bool matmul_allow_tf32() {
  int v = tf32_setting().load();
  if (v < 0) {
    v = env_flag("KILN_ALLOW_TF32") ? 1 : 0;
    tf32_setting().store(v);
  }
  return v == 1;
}
void set_matmul_allow_tf32(bool on) { tf32_setting().store(on ? 1 : 0); }

size_t gemm_plan_cache_size() {
  Cache& c = cache();
  std::lock_guard lock(c.mutex);
  return c.plans.size();
}

size_t gemm_tuned_plan_count() {
  Cache& c = cache();
  std::lock_guard lock(c.mutex);
  size_t n = 0;
  for (const auto& [key, plan] : c.plans) n += plan->tuned();
  return n;
}

std::string Gemm::to_string() const {
  std::string s = fmt::format("gemm (m {}, n {}, k {}){}{} {}->{}{}", m, n, k,
                              transpose_a ? " transpose_a" : "", transpose_b ? " transpose_b" : "",
                              dtype_name(a_type), dtype_name(d_type), tf32 ? " tf32" : "");
  if (fp8()) s += fmt::format(" fp8 (a {}, b {}{})", fp8_name(fp8_a), fp8_name(fp8_b), fp8_fast_accum ? ", fast accumulation" : "");
  if (epilogue != Epilogue::kNone) s += fmt::format(" epilogue {}", epilogue_name(epilogue));
  if (bias_dtype() != d_type) s += fmt::format(" ({} bias)", dtype_name(bias_dtype()));
  if (lda || ldb || ldc || ldd || ld_aux)
    s += fmt::format(" ld (a {}, b {}, c {}, d {}, aux {})", lda, ldb, ldc, ldd, ld_aux);
  if (batch != 1)
    s += fmt::format(" batch {} strides (a {}, b {}, c {}, d {}, aux {}, bias {})", batch,
                     stride_a, stride_b, stride_c, stride_d, stride_aux, stride_bias);
  return s;
}

GemmPlan::~GemmPlan() {
  // Statuses ignored: nothing useful can be done about a failed destroy.
  if (desc_) cublasLtMatmulDescDestroy(desc_);
  for (cublasLtMatrixLayout_t l : {layout_a_, layout_b_, layout_c_, layout_d_})
    if (l) cublasLtMatrixLayoutDestroy(l);
}

std::string GemmPlan::algorithm() const {
  int32_t id = -1, splitk = 1;
  uint32_t tile = 0, stages = 0;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo_, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id),
                                       &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo_, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile),
                                       &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo_, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                       sizeof(stages), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo_, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                       sizeof(splitk), &written);
  return fmt::format("algo {} tile {} stages {} splitK {} workspace {} B ({} of {} candidates){}",
                     id, tile, stages, splitk, workspace_bytes_, tuned_ ? "timed best" : "first",
                     candidates_, widens_bias_ ? ", bias widened to the output's dtype first" : "");
}

// Builds plans and runs them; a friend of GemmPlan.
struct GemmPlanAccess {
  static void check(const Gemm& g, const GemmOperands& ops);
  static std::unique_ptr<GemmPlan> build(const Gemm& g, const GemmOperands& ops,
                                         DeviceState& device,
                                         std::vector<cublasLtMatmulHeuristicResult_t>& results);
  static void set_pointers(GemmPlan& plan, const Gemm& g, const GemmOperands& ops);
  // An fp8 description given a_type operands: quantizes them, then runs the FP8 product.
  static void run_fp8(const Gemm& g, const GemmOperands& ops, cudaStream_t stream);
  static cublasStatus_t enqueue(GemmPlan& plan, const Gemm& g, const GemmOperands& ops,
                                const cublasLtMatmulAlgo_t& algo, DeviceState& device,
                                cudaStream_t stream);
  static void tune(GemmPlan& plan, const Gemm& g, const GemmOperands& ops, DeviceState& device,
                   const std::vector<cublasLtMatmulHeuristicResult_t>& results,
                   cudaStream_t stream);
  static std::pair<GemmPlan*, DeviceState*> find(const Gemm& g, const GemmOperands& ops,
                                                 cudaStream_t stream);
  // `ops`, or (when the plan widens the bias) `ops` with the bias cast to D's dtype into
  // `scratch` on `stream`.
  static GemmOperands widened(const GemmPlan& plan, const Gemm& g, const GemmOperands& ops,
                              cudaStream_t stream, std::optional<Scratch>& scratch);
};

void GemmPlanAccess::check(const Gemm& g, const GemmOperands& ops) {
  KILN_CHECK(g.m >= 0 && g.n >= 0 && g.k >= 0 && g.batch >= 0,
             "{}: negative size, expected m, n, k, batch >= 0", g.to_string());
  KILN_CHECK(supported_types(g.a_type, g.d_type),
             "{}: inputs {} with output {} are not supported, expected f32->f32, f64->f64, "
             "bf16->bf16|f32 or f16->f16|f32",
             g.to_string(), dtype_name(g.a_type), dtype_name(g.d_type));
  KILN_CHECK(!g.tf32 || g.a_type == DType::kF32, "{}: tf32 is set for {} inputs, expected f32",
             g.to_string(), dtype_name(g.a_type));
  // A bias in another dtype than D: only the inputs' 16-bit dtype on an f32 D (a bf16 linear
  // layer's bias added to an f32 residual), the one combination the GPU tests cover.
  const DType bias = g.bias_dtype();
  KILN_CHECK(bias == g.d_type ||
                 (epilogue_reads_bias(g.epilogue) && bias == g.a_type &&
                  (bias == DType::kBF16 || bias == DType::kF16) && g.d_type == DType::kF32),
             "{}: a {} bias with {} inputs, a {} output and epilogue {} is not supported, "
             "expected the output's dtype, or the inputs' 16-bit dtype with an f32 output and an "
             "epilogue that reads a bias",
             g.to_string(), dtype_name(bias), dtype_name(g.a_type), dtype_name(g.d_type),
             epilogue_name(g.epilogue));
  KILN_CHECK(g.k > 0,
             "{}: k is 0 (an empty sum); the caller must fill D itself (cuBLASLt needs k >= 1)",
             g.to_string());
  // Seen on an H200 with CUDA 13: cuBLASLt offers no algorithm for the other layouts.
  KILN_CHECK(g.epilogue != Epilogue::kBGradB || !g.transpose_b,
             "{}: epilogue bgrad_b needs B stored (k, n) (transpose_b false); cuBLASLt reduces "
             "the bias gradient over no other layout",
             g.to_string());
  KILN_CHECK(g.epilogue != Epilogue::kBGradA || g.transpose_a,
             "{}: epilogue bgrad_a needs A stored (k, m) (transpose_a true); cuBLASLt reduces "
             "the bias gradient over no other layout",
             g.to_string());
  if (g.fp8()) {
    KILN_CHECK(g.fp8_b != Fp8Format::kNone && !(g.fp8_a == Fp8Format::kE5M2 && g.fp8_b == Fp8Format::kE5M2),
               "{}: fp8 formats a {} and b {}: set both, not both e5m2", g.to_string(), fp8_name(g.fp8_a),
               fp8_name(g.fp8_b));
    KILN_CHECK(g.a_type != DType::kF64 && !g.tf32, "{}: fp8 operands come from f32, bf16 or f16", g.to_string());
    KILN_CHECK(g.epilogue == Epilogue::kNone || g.epilogue == Epilogue::kBias,
               "{}: an fp8 product takes epilogue none or bias, got {}", g.to_string(), epilogue_name(g.epilogue));
    KILN_CHECK(ops.scale_a && ops.scale_b && !g.transpose_a && g.transpose_b,
               "{}: the quantized product needs both scales and A (m, k), B (n, k)", g.to_string());
  }
  KILN_CHECK(g.batch <= INT32_MAX, "{}: batch {} exceeds cuBLASLt's int32 batch count",
             g.to_string(), g.batch);
  const Resolved r = resolve(g);
  const int64_t a_row = g.transpose_a ? g.m : g.k, b_row = g.transpose_b ? g.k : g.n;
  KILN_CHECK(r.lda >= a_row && r.ldb >= b_row && r.ldc >= g.n && r.ldd >= g.n,
             "{}: a row stride is shorter than its row: lda {} (row {}), ldb {} (row {}), ldc {}, "
             "ldd {} (row {})",
             g.to_string(), r.lda, a_row, r.ldb, b_row, r.ldc, r.ldd, g.n);
  KILN_CHECK(ops.a && ops.b && ops.d, "{}: a, b and d must be device pointers, got a {}, b {}, d {}",
             g.to_string(), ops.a, ops.b, static_cast<const void*>(ops.d));
  const Epilogue e = g.epilogue;
  KILN_CHECK(!epilogue_reads_bias(e) || ops.bias, "{}: epilogue {} reads a bias, none given",
             g.to_string(), epilogue_name(e));
  KILN_CHECK(!epilogue_writes_bias(e) || ops.bias_grad,
             "{}: epilogue {} writes a bias gradient, no bias_grad given", g.to_string(),
             epilogue_name(e));
  if (epilogue_reads_aux(e) || epilogue_writes_aux(e)) {
    KILN_CHECK(ops.aux, "{}: epilogue {} needs the aux matrix, none given", g.to_string(),
               epilogue_name(e));
    KILN_CHECK(r.ld_aux >= g.n && r.ld_aux % 8 == 0,
               "{}: the aux row stride is {}, expected a multiple of 8 that is >= n {} (a "
               "cuBLASLt requirement)",
               g.to_string(), r.ld_aux, g.n);
    KILN_CHECK(g.batch <= 1 || r.stride_aux % 8 == 0,
               "{}: the aux batch stride is {}, expected a multiple of 8", g.to_string(),
               r.stride_aux);
  }
}

std::unique_ptr<GemmPlan> GemmPlanAccess::build(
    const Gemm& g, const GemmOperands& ops, DeviceState& device,
    std::vector<cublasLtMatmulHeuristicResult_t>& results) {
  const Resolved r = resolve(g);
  const bool f64 = g.a_type == DType::kF64;
  std::unique_ptr<GemmPlan> plan(new GemmPlan);
  const cublasComputeType_t compute = f64 ? CUBLAS_COMPUTE_64F
                                      : g.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                               : CUBLAS_COMPUTE_32F;
  KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc_, compute, f64 ? CUDA_R_64F : CUDA_R_32F));
  // Column-major: cuBLASLt computes D^T = op(B)^T op(A)^T with its A = our B, its B = our A.
  const cublasOperation_t trans_a = g.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_b = g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_desc(plan->desc_, CUBLASLT_MATMUL_DESC_TRANSA, trans_a);
  set_desc(plan->desc_, CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
  set_desc(plan->desc_, CUBLASLT_MATMUL_DESC_EPILOGUE, cublas_epilogue(g.epilogue));
  const Epilogue e = g.epilogue;
  if ((epilogue_reads_bias(e) || epilogue_writes_bias(e)) && g.batch > 1)
    set_desc(plan->desc_, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, g.stride_bias);
  const bool narrow_bias = epilogue_reads_bias(e) && g.bias_dtype() != g.d_type;
  if (narrow_bias)
    set_desc(plan->desc_, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
             static_cast<int32_t>(cuda_type(g.bias_dtype())));
  if (epilogue_reads_aux(e) || epilogue_writes_aux(e)) {
    set_desc(plan->desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, r.ld_aux);
    if (g.batch > 1)
      set_desc(plan->desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, r.stride_aux);
  }
  // The heuristic reads the bias and aux pointers' alignment: set them now (run() sets its own).
  set_pointers(*plan, g, ops);
  if (g.fp8() && g.fp8_fast_accum) set_desc(plan->desc_, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t{1});

  // Layouts describe the matrices as stored, column-major: a row-major (R, C) matrix with row
  // stride ld is the column-major (C, R) matrix with leading dimension ld.
  const int64_t b_rows = g.transpose_b ? g.n : g.k, b_cols = g.transpose_b ? g.k : g.n;
  const int64_t a_rows = g.transpose_a ? g.k : g.m, a_cols = g.transpose_a ? g.m : g.k;
  plan->layout_a_ = make_layout(operand_type(g.fp8_b, g.a_type), b_cols, b_rows, r.ldb, g.batch, g.stride_b);
  plan->layout_b_ = make_layout(operand_type(g.fp8_a, g.a_type), a_cols, a_rows, r.lda, g.batch, g.stride_a);
  plan->layout_c_ = make_layout(cuda_type(g.d_type), g.n, g.m, r.ldc, g.batch, r.stride_c);
  plan->layout_d_ = make_layout(cuda_type(g.d_type), g.n, g.m, r.ldd, g.batch, r.stride_d);

  cublasLtMatmulPreference_t pref = nullptr;
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t out_size = dtype_size(g.d_type);
  const void* c = ops.c ? ops.c : ops.d;
  const uint32_t align_a = alignment_of(ops.b, g.stride_b, operand_size(g.fp8_b, g.a_type), g.batch);
  const uint32_t align_b = alignment_of(ops.a, g.stride_a, operand_size(g.fp8_a, g.a_type), g.batch);
  const uint32_t align_c = alignment_of(c, r.stride_c, out_size, g.batch);
  const uint32_t align_d = alignment_of(ops.d, r.stride_d, out_size, g.batch);
  const uint64_t workspace = kGemmWorkspaceBytes;
  try {
    KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace)));
    KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
    KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
    KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
    KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)));
    auto heuristic = [&] {
      const int kRequested = gemm_autotune() ? gemm_autotune_candidates() : 8;
      results.assign(kRequested, {});
      int returned = 0;
      const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
          device.handle, plan->desc_, plan->layout_a_, plan->layout_b_, plan->layout_c_,
          plan->layout_d_, pref, kRequested, results.data(), &returned);
      // NOT_SUPPORTED means "no algorithm": reported below with the description. So does
      // INVALID_VALUE for a 16-bit bias on an f32 D (the H100's answer, CUDA 13).
      const bool refused = status == CUBLAS_STATUS_NOT_SUPPORTED ||
                           (status == CUBLAS_STATUS_INVALID_VALUE && narrow_bias &&
                            !plan->widens_bias_);
      if (!refused) KILN_CUBLAS_CHECK(status);
      results.resize(status == CUBLAS_STATUS_SUCCESS ? returned : 0);
      std::erase_if(results, [](const auto& res) { return res.state != CUBLAS_STATUS_SUCCESS; });
    };
    heuristic();
    if (results.empty() && narrow_bias) {
      // No kernel reads a 16-bit bias into an f32 epilogue here (the H100 with CUDA 13: the
      // heuristic answers INVALID_VALUE): the bias is read in D's dtype instead, widened by each
      // run (Gemm::run) into scratch (256-byte aligned, at least the alignment the heuristic
      // sees from the caller's pointer).
      set_desc(plan->desc_, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
               static_cast<int32_t>(cuda_type(g.d_type)));
      plan->widens_bias_ = true;
      heuristic();
    }
  } catch (...) {
    cublasLtMatmulPreferenceDestroy(pref);
    throw;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  KILN_CHECK(!results.empty(),
             "cuBLASLt has no algorithm for {} (operand alignments a {}, b {}, c {}, d {} bytes)",
             g.to_string(), align_b, align_a, align_c, align_d);
  plan->algo_ = results[0].algo;
  plan->workspace_bytes_ = results[0].workspaceSize;
  plan->candidates_ = static_cast<int>(results.size());
  return plan;
}

void GemmPlanAccess::set_pointers(GemmPlan& plan, const Gemm& g, const GemmOperands& ops) {
  const Epilogue e = g.epilogue;
  if (epilogue_reads_bias(e) || epilogue_writes_bias(e))
    set_desc(plan.desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
             epilogue_reads_bias(e) ? ops.bias : static_cast<const void*>(ops.bias_grad));
  if (epilogue_reads_aux(e) || epilogue_writes_aux(e))
    set_desc(plan.desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(ops.aux));
  if (g.fp8()) {  // column-major: cuBLASLt's A is our B
    set_desc(plan.desc_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(ops.scale_b));
    set_desc(plan.desc_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(ops.scale_a));
  }
}

// Enqueues with the plan's descriptor; the caller holds plan.mutex_.
cublasStatus_t GemmPlanAccess::enqueue(GemmPlan& plan, const Gemm& g, const GemmOperands& ops,
                                       const cublasLtMatmulAlgo_t& algo, DeviceState& device,
                                       cudaStream_t stream) {
  set_pointers(plan, g, ops);
  const bool f64 = g.a_type == DType::kF64;
  const Scalars s = scalars_of(ops);
  const void* c = ops.c ? ops.c : ops.d;
  // Column-major: cuBLASLt's A is our B, its B our A.
  return cublasLtMatmul(device.handle, plan.desc_, s.alpha(f64), ops.b, plan.layout_a_, ops.a,
                        plan.layout_b_, s.beta(f64), c, plan.layout_c_, ops.d, plan.layout_d_,
                        &algo, device.workspace, kGemmWorkspaceBytes, stream);
}

// Times each candidate and keeps the fastest. The inputs are only read; the outputs (D, aux,
// bias_grad) are written, which is harmless because run() writes them next, except where D is
// also C (accumulating in place): then D goes to scratch and C is read from the real D. When the
// scratch does not fit, the heuristic's choice stays (tuning must not make a full device fail).
void GemmPlanAccess::tune(GemmPlan& plan, const Gemm& g, const GemmOperands& ops,
                          DeviceState& device,
                          const std::vector<cublasLtMatmulHeuristicResult_t>& results,
                          cudaStream_t stream) {
  const Resolved r = resolve(g);
  const size_t out_size = dtype_size(g.d_type);
  const size_t d_bytes = static_cast<size_t>((g.batch - 1) * r.stride_d + g.m * r.ldd) * out_size;
  std::vector<void*> scratch;
  cudaEvent_t start = nullptr, stop = nullptr;
  auto cleanup = [&] {
    for (void* p : scratch) cudaFree(p);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  };
  try {
    GemmOperands t = ops;
    const bool d_is_c = ops.beta != 0.0 && (ops.c == nullptr || ops.c == ops.d);
    if (d_is_c) {
      t.c = ops.d;  // read the real C, write the scratch D
      void* p = nullptr;
      if (cudaMalloc(&p, d_bytes) != cudaSuccess) {
        (void)cudaGetLastError();  // clear the allocation's error
        plan.tuned_ = true;        // keep the heuristic's choice; do not retry each call
        return;
      }
      scratch.push_back(p);
      t.d = p;
    }
    KILN_CUDA_CHECK(cudaEventCreate(&start));
    KILN_CUDA_CHECK(cudaEventCreate(&stop));
    // Two passes over the candidates, each keeping its faster pass: one pass in order let clock
    // drift pick a slower algorithm (an 8192^3 bf16 GEMM tuned to 701 TFLOP/s against the
    // heuristic's 804 on an H200). The heuristic's first choice is kept unless another is 3%
    // faster.
    constexpr int kPasses = 2, kTimed = 10;
    constexpr float kInfinity = std::numeric_limits<float>::infinity();
    std::vector<float> ms_of(results.size(), kInfinity);
    std::vector<bool> failed(results.size(), false);
    for (int pass = 0; pass < kPasses; ++pass)
      for (size_t i = 0; i < results.size(); ++i) {
        if (failed[i]) continue;
        bool ok = true;
        for (int w = 0; w < (pass == 0 ? 2 : 1) && ok; ++w)  // warm-up
          ok = enqueue(plan, g, t, results[i].algo, device, stream) == CUBLAS_STATUS_SUCCESS;
        if (ok) {
          KILN_CUDA_CHECK(cudaEventRecord(start, stream));
          for (int w = 0; w < kTimed && ok; ++w)
            ok = enqueue(plan, g, t, results[i].algo, device, stream) == CUBLAS_STATUS_SUCCESS;
          KILN_CUDA_CHECK(cudaEventRecord(stop, stream));
          KILN_CUDA_CHECK(cudaEventSynchronize(stop));
        }
        if (!ok) {
          failed[i] = true;
          ms_of[i] = kInfinity;
          continue;
        }
        float ms = 0.0f;
        KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        ms_of[i] = std::min(ms_of[i], ms / kTimed);
      }
    KILN_CUDA_CHECK(cudaGetLastError());
    int best = -1;
    for (size_t i = 0; i < results.size(); ++i)
      if (ms_of[i] < kInfinity && (best < 0 || ms_of[i] < ms_of[best])) best = static_cast<int>(i);
    if (best > 0 && ms_of[0] < kInfinity && ms_of[best] > 0.97f * ms_of[0]) best = 0;
    const float best_ms = best >= 0 ? ms_of[best] : 0.0f;
    if (best >= 0) {
      plan.algo_ = results[best].algo;
      plan.workspace_bytes_ = results[best].workspaceSize;
      plan.tuned_ms_ = best_ms;
    }
    plan.tuned_ = true;  // even when every candidate failed: do not retry each call
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
}

std::pair<GemmPlan*, DeviceState*> GemmPlanAccess::find(const Gemm& g, const GemmOperands& ops,
                                                        cudaStream_t stream) {
  check(g, ops);
  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  const Resolved r = resolve(g);
  const size_t out_size = dtype_size(g.d_type);
  PlanKey key{g, device};
  key.align_a = alignment_of(ops.a, g.stride_a, operand_size(g.fp8_a, g.a_type), g.batch);
  key.align_b = alignment_of(ops.b, g.stride_b, operand_size(g.fp8_b, g.a_type), g.batch);
  key.align_c = alignment_of(ops.c ? ops.c : ops.d, r.stride_c, out_size, g.batch);
  key.align_d = alignment_of(ops.d, r.stride_d, out_size, g.batch);
  if (epilogue_reads_bias(g.epilogue))
    key.align_bias = alignment_of(ops.bias, g.stride_bias, dtype_size(g.bias_dtype()), g.batch);
  if (epilogue_writes_bias(g.epilogue))
    key.align_bias = alignment_of(ops.bias_grad, g.stride_bias, out_size, g.batch);
  if (epilogue_reads_aux(g.epilogue) || epilogue_writes_aux(g.epilogue))
    key.align_aux = alignment_of(ops.aux, r.stride_aux, out_size, g.batch);

  Cache& c = cache();
  std::lock_guard lock(c.mutex);
  DeviceState& state = device_state_locked(c, device, stream);
  auto it = c.plans.find(key);
  const bool want_tuning = gemm_autotune() && (it == c.plans.end() || !it->second->tuned_);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (want_tuning) KILN_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  // Timing synchronizes, which a stream being captured into a CUDA graph cannot do.
  const bool tune_now = want_tuning && capture == cudaStreamCaptureStatusNone;
  if (it != c.plans.end() && !tune_now) return {it->second.get(), &state};

  std::vector<cublasLtMatmulHeuristicResult_t> results;
  std::unique_ptr<GemmPlan> built = build(g, ops, state, results);
  GemmPlan* plan = built.get();
  if (it == c.plans.end()) {
    it = c.plans.emplace(key, std::move(built)).first;
  } else {  // an untuned plan to tune: keep the cached object, tune with the fresh candidates
    plan = it->second.get();
    std::lock_guard plan_lock(plan->mutex_);
    // The fresh plan's descriptors equal the cached one's; only the algorithm list is needed.
    plan->candidates_ = built->candidates_;
  }
  if (tune_now) {
    std::lock_guard plan_lock(plan->mutex_);
    std::optional<Scratch> wide;
    tune(*plan, g, widened(*plan, g, ops, stream, wide), state, results, stream);
  }
  return {plan, &state};
}

GemmOperands GemmPlanAccess::widened(const GemmPlan& plan, const Gemm& g, const GemmOperands& ops,
                                     cudaStream_t stream, std::optional<Scratch>& scratch) {
  if (!plan.widens_bias_) return ops;
  const int64_t count = (g.batch - 1) * g.stride_bias + g.n;
  scratch.emplace(static_cast<size_t>(count) * dtype_size(g.d_type), stream);
  movement::cast(g.bias_dtype(), g.d_type, ops.bias, scratch->as<void>(), count, stream);
  GemmOperands wide = ops;
  wide.bias = scratch->as<void>();
  return wide;
}

const GemmPlan& Gemm::plan(const GemmOperands& operands, cudaStream_t stream) const {
  return *GemmPlanAccess::find(*this, operands, stream).first;
}

void GemmPlanAccess::run_fp8(const Gemm& g, const GemmOperands& ops, cudaStream_t stream) {
  const Resolved r = resolve(g);
  KILN_CHECK(g.batch == 1 && r.lda == (g.transpose_a ? g.m : g.k) && r.ldb == (g.transpose_b ? g.k : g.n),
             "{}: an fp8 product needs batch 1 and packed A and B (its scales are per tensor)", g.to_string());
  KILN_CHECK(g.k % 16 == 0, "{}: an fp8 product needs k % 16 == 0 (FP8 rows of 16-byte multiples)",
             g.to_string());
  // Four f32 scalars, 16 bytes apart: the amax of A and B (zeroed: an atomic max accumulates
  // them), then the inverse scales the product reads.
  Scratch scalars(16 * sizeof(float), stream);
  float* const amax_a = scalars.as<float>();
  float *const amax_b = amax_a + 4, *const inverse_a = amax_a + 8, *const inverse_b = amax_a + 12;
  Scratch qa(static_cast<size_t>(g.m * g.k), stream), qb(static_cast<size_t>(g.n * g.k), stream);
  KILN_CUDA_CHECK(cudaMemsetAsync(amax_a, 0, 8 * sizeof(float), stream));
  fp8::amax(g.a_type, ops.a, g.m * g.k, amax_a, stream);
  fp8::amax(g.a_type, ops.b, g.n * g.k, amax_b, stream);
  // K-major: A as (m, k) (stored (k, m) under transpose_a), B as (n, k) (stored (k, n) without).
  fp8::quantize(g.a_type, g.fp8_a, ops.a, g.transpose_a ? g.k : g.m, g.transpose_a ? g.m : g.k,
                g.transpose_a, amax_a, qa.as<uint8_t>(), inverse_a, stream);
  fp8::quantize(g.a_type, g.fp8_b, ops.b, g.transpose_b ? g.n : g.k, g.transpose_b ? g.k : g.n,
                !g.transpose_b, amax_b, qb.as<uint8_t>(), inverse_b, stream);
  Gemm quantized = g;
  quantized.transpose_a = false;
  quantized.transpose_b = true;
  quantized.lda = quantized.ldb = 0;
  GemmOperands q = ops;
  q.a = qa.as<void>();
  q.b = qb.as<void>();
  q.scale_a = inverse_a;
  q.scale_b = inverse_b;
  quantized.run(q, stream);
}

void Gemm::run(const GemmOperands& operands, cudaStream_t stream) const {
  if (m == 0 || n == 0 || batch == 0) return;
  if (fp8() && operands.scale_a == nullptr) return GemmPlanAccess::run_fp8(*this, operands, stream);
  auto [plan, device] = GemmPlanAccess::find(*this, operands, stream);
  std::optional<Scratch> wide;  // freed on the stream after the product
  const GemmOperands ops = GemmPlanAccess::widened(*plan, *this, operands, stream, wide);
  std::lock_guard lock(plan->mutex_);
  KILN_CUBLAS_CHECK(GemmPlanAccess::enqueue(*plan, *this, ops, plan->algo_, *device, stream));
}

bool set_fp8(Gemm& g, const Attributes& matmul_attrs) {
  const MatmulFp8 fp8 = matmul_fp8(matmul_attrs);
  if (!fp8.on()) return true;
  if (g.batch != 1 || g.lda != 0 || g.ldb != 0 || g.k % 16 != 0 || g.a_type == DType::kF64) return false;
  g.fp8_a = fp8.a;
  g.fp8_b = fp8.b;
  g.fp8_fast_accum = fp8.fast_accum;
  g.tf32 = false;
  return true;
}

// ---- the matmul dialect ----

namespace {

// The GEMM a matmul node maps onto, or nullopt when its batch broadcast is not expressible as
// one strided batch (see the file comment).
std::optional<Gemm> matmul_gemm(const Shape& a, const Shape& b, bool transpose_a,
                                bool transpose_b, DType dtype) {
  const size_t ra = a.size(), rb = b.size();
  if (ra < 2 || rb < 2) return std::nullopt;
  Gemm g;
  g.transpose_a = transpose_a;
  g.transpose_b = transpose_b;
  g.a_type = g.d_type = dtype;
  g.m = transpose_a ? a[ra - 1] : a[ra - 2];
  g.k = transpose_a ? a[ra - 2] : a[ra - 1];
  g.n = transpose_b ? b[rb - 2] : b[rb - 1];
  const Shape a_batch(a.begin(), a.end() - 2), b_batch(b.begin(), b.end() - 2);
  Shape c_batch;
  try {
    c_batch = broadcast_shapes(a_batch, b_batch);
  } catch (const Error&) {
    return std::nullopt;
  }
  const int64_t batches = numel(c_batch), na = numel(a_batch), nb = numel(b_batch);
  if ((na != 1 && na != batches) || (nb != 1 && nb != batches)) return std::nullopt;
  if (batches > INT32_MAX) return std::nullopt;
  if (nb == 1 && na == batches && !transpose_a) {
    g.m *= batches;  // (B, M, K) rows are one (B*M, K) matrix, and C likewise
    return g;
  }
  g.batch = batches;
  g.stride_a = na == 1 ? 0 : g.m * g.k;
  g.stride_b = nb == 1 ? 0 : g.k * g.n;
  return g;
}

bool matmul_dtype(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16 || d == DType::kF64;
}

// The node's GEMM with its fp8 formats (ops/fp8.h); nullopt where the strided batch cannot
// express it, or where an fp8 product's rules (set_fp8) do not hold.
std::optional<Gemm> node_gemm(const Shape& a, const Shape& b, const Attributes& attrs, DType dtype) {
  std::optional<Gemm> g = matmul_gemm(a, b, attrs.b("transpose_a"), attrs.b("transpose_b"), dtype);
  if (!g || !set_fp8(*g, attrs)) return std::nullopt;
  return g;
}

void matmul_kernel(const KernelArgs& args) {
  const Tensor &a = args.inputs[0], &b = args.inputs[1];
  Tensor& c = args.outputs[0];
  KILN_CHECK(a.device() == Device::kCuda && b.device() == Device::kCuda &&
                 c.device() == Device::kCuda,
             "cublaslt matmul: tensors on {}, {} -> {}, expected cuda", device_name(a.device()),
             device_name(b.device()), device_name(c.device()));
  std::optional<Gemm> g = node_gemm(a.shape(), b.shape(), args.attrs, a.dtype());
  KILN_CHECK(g.has_value(),
             "cublaslt matmul: a {} and b {} have batch dims no strided batch can express, or break "
             "an fp8 product's rules (batch 1, k % 16 == 0)",
             to_string(a.shape()), to_string(b.shape()));
  auto stream = static_cast<cudaStream_t>(args.stream);
  if (c.numel() == 0) return;
  if (g->k == 0) {  // an empty sum
    KILN_CUDA_CHECK(cudaMemsetAsync(c.raw(), 0, c.bytes(), stream));
    return;
  }
  g->tf32 = a.dtype() == DType::kF32 && matmul_allow_tf32() && !g->fp8();
  g->run(GemmOperands{a.raw(), b.raw(), nullptr, c.raw()}, stream);
}

}  // namespace

void register_cublaslt_kernels(KernelRegistry& registry) {
  registry.add(Op::kMatmul,
               KernelImpl{"cublaslt", Device::kCuda, kLibraryPriority,
                          [](const NodeView& node) {
                            if (node.input_types.size() != 2) return false;
                            const TensorType &a = node.input_types[0], &b = node.input_types[1];
                            if (!matmul_dtype(a.dtype) || b.dtype != a.dtype) return false;
                            return node_gemm(a.shape, b.shape, node.node.attrs, a.dtype).has_value();
                          },
                          matmul_kernel});
}

}  // namespace kiln::cuda
