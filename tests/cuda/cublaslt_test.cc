// cuBLASLt GEMMs (backends/cuda/cublaslt/cublaslt.h): the "cublaslt" matmul dialect against the CPU
// reference matmul computed in f64 (every transpose combination, odd sizes, batches and
// broadcasts, GPT-2's shapes, f32 exact and TF32, bf16, f16); every epilogue of cuda::Gemm against
// a host computation, and bf16/f16 products written as f32 (with a bias and a C addend); the
// plan cache. (The TFLOP/s reached: bench/gpu_gemm_bench.cc.)
//
// Error measure: |gpu - exact| / sum_p |op(A)[i,p] op(B)[p,j]| per element (the scale of the
// standard GEMM error bound, computed by the same reference on |A| and |B|). Tolerances per dtype:
// f32 1e-5 (f32 accumulation), TF32 5e-3 (inputs rounded to 10-bit mantissas), bf16 5e-3
// (output rounding 2^-9), f16 1e-3 (output rounding 2^-12). Inputs are exact in their dtype (the
// oracle reads the same rounded values), outputs are poisoned with NaN before every run. f16
// outputs also get half their subnormal spacing (2^-25) of absolute slack: a product as small as
// 4e-6 (k = 1) lands among f16's subnormals, where rounding is absolute, not relative (seen on
// the H200: 2.55e-8 off, under the 2.98e-8 that rounding to nearest allows).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <optional>
#include <random>

#include "backends/cuda/cublaslt/cublaslt.h"
#include "backends/cuda/common/cuda_check.h"
#include "gpu_test_util.h"
#include "ir/op_def.h"

namespace kiln {
namespace {

using cuda::Epilogue;
using cuda::Gemm;
using cuda::GemmOperands;

// ---- device memory and streams (plain cudaMalloc / cudaMemcpy: test-only helpers) ----

std::shared_ptr<std::byte[]> device_alloc(size_t bytes) {
  void* p = nullptr;
  KILN_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  return std::shared_ptr<std::byte[]>(static_cast<std::byte*>(p),
                                      [](std::byte* q) { cudaFree(q); });
}

// A device tensor whose every byte is 0xFF (NaN for every float dtype).
Tensor poisoned(const TensorType& type) {
  auto storage = device_alloc(type.bytes());
  KILN_CUDA_CHECK(cudaMemset(storage.get(), 0xFF, type.bytes()));
  return Tensor(type, storage, 0, Device::kCuda);
}

Tensor upload(const Tensor& host) {
  auto storage = device_alloc(host.bytes());
  KILN_CUDA_CHECK(cudaMemcpy(storage.get(), host.raw(), host.bytes(), cudaMemcpyHostToDevice));
  return Tensor(host.type(), storage, 0, Device::kCuda);
}

Tensor download(const Tensor& device) {
  Tensor host(device.type());
  KILN_CUDA_CHECK(cudaMemcpy(host.raw(), device.raw(), device.bytes(), cudaMemcpyDeviceToHost));
  return host;
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
  void sync() const { KILN_CUDA_CHECK(cudaStreamSynchronize(s)); }
};

// ---- precisions ----

constexpr double kF16HalfSubnormal = 2.9802322387695312e-08;  // 2^-25

struct Precision {
  DType dtype;
  bool tf32;
  double tol;
  const char* name;
  double atol = 0.0;  // absolute slack for subnormal outputs
};
constexpr Precision kF32{DType::kF32, false, 1e-5, "f32"};
constexpr Precision kTf32{DType::kF32, true, 5e-3, "tf32"};
constexpr Precision kBf16{DType::kBF16, false, 5e-3, "bf16"};
constexpr Precision kF16{DType::kF16, false, 1e-3, "f16", kF16HalfSubnormal};
constexpr Precision kAllPrecisions[] = {kF32, kTf32, kBf16, kF16};

// Largest (|got - want| - atol) / scale (NaN or a missing value count as infinity).
double worst_error(const std::vector<double>& got, const std::vector<double>& want,
                   const std::vector<double>& scale, int64_t* where = nullptr,
                   double atol = 0.0) {
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    double e = std::max(0.0, std::abs(got[i] - want[i]) - atol) / (scale[i] + 1e-30);
    if (std::isnan(got[i])) e = NAN;
    if (!(e <= worst)) {  // also NaN
      worst = std::isnan(e) ? INFINITY : e;
      if (where) *where = static_cast<int64_t>(i);
    }
  }
  return worst;
}

Tensor as_f64(const Tensor& t, bool absolute = false) {
  std::vector<double> v = t.to_f64();
  if (absolute)
    for (double& x : v) x = std::abs(x);
  return Tensor::from_f64(TensorType{DType::kF64, t.shape()}, v);
}

Attributes matmul_attrs(bool ta, bool tb) {
  return normalize_attributes(Op::kMatmul, {{"transpose_a", ta}, {"transpose_b", tb}});
}

// The exact product (the op's reference kernel in f64) and the error scale sum |a||b|.
struct Oracle {
  std::vector<double> want, scale;
};
Oracle oracle(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  Attributes attrs = matmul_attrs(ta, tb);
  return {testing::run_reference(Op::kMatmul, {as_f64(a), as_f64(b)}, attrs)[0].to_f64(),
          testing::run_reference(Op::kMatmul, {as_f64(a, true), as_f64(b, true)}, attrs)[0]
              .to_f64()};
}

const KernelImpl& cublaslt_impl(const Tensor& a, const Tensor& b, const Attributes& attrs) {
  Node node{Op::kMatmul, {}, {}, attrs, nullptr};
  std::vector<TensorType> in{a.type(), b.type()};
  std::vector<TensorType> out = infer_types(Op::kMatmul, in, attrs);
  return kernel_registry().select(NodeView{node, in, out}, Device::kCuda, {"cublaslt"});
}

// matmul through the registered cublaslt kernel, on device copies of host a and b.
Tensor gpu_matmul(const Tensor& a, const Tensor& b, bool ta, bool tb, bool tf32) {
  Attributes attrs = matmul_attrs(ta, tb);
  const KernelImpl& impl = cublaslt_impl(a, b, attrs);
  EXPECT_EQ(impl.dialect, "cublaslt");
  std::vector<Tensor> inputs{upload(a), upload(b)};
  std::vector<TensorType> out_types = infer_types(Op::kMatmul, std::vector<TensorType>{a.type(), b.type()}, attrs);
  std::vector<Tensor> outputs{poisoned(out_types[0])};
  Stream stream;
  cuda::set_matmul_allow_tf32(tf32);
  impl.kernel(KernelArgs{attrs, inputs, outputs, stream.s});
  cuda::set_matmul_allow_tf32(false);
  stream.sync();
  return download(outputs[0]);
}

uint64_t seed_of(const Shape& a, const Shape& b, int salt) {
  uint64_t s = 1234567 + salt;
  for (int64_t v : a) s = s * 31 + v;
  for (int64_t v : b) s = s * 37 + v;
  return s;
}

// One matmul case through the kernel, compared with the full reference.
void check_matmul(const Precision& p, Shape a_shape, Shape b_shape, bool ta, bool tb) {
  Tensor a = testing::rand(p.dtype, a_shape, seed_of(a_shape, b_shape, 1));
  Tensor b = testing::rand(p.dtype, b_shape, seed_of(a_shape, b_shape, 2));
  Tensor got = gpu_matmul(a, b, ta, tb, p.tf32);
  Oracle o = oracle(a, b, ta, tb);
  int64_t where = -1;
  double err = worst_error(got.to_f64(), o.want, o.scale, &where, p.atol);
  EXPECT_LE(err, p.tol) << p.name << " a " << to_string(a_shape) << " b " << to_string(b_shape)
                        << (ta ? " transpose_a" : "") << (tb ? " transpose_b" : "")
                        << ": element " << where << " got " << got.get(std::max<int64_t>(where, 0))
                        << " want " << o.want[std::max<int64_t>(where, 0)];
}

TEST(CublasLtMatmul, OddSizesEveryTransposeEveryPrecision) {
  KILN_REQUIRE_GPU();
  struct Mkn {
    int64_t m, k, n;
  };
  const Mkn sizes[] = {{1, 1, 1},   {1, 7, 33},   {7, 33, 1},   {33, 1, 7},    {7, 768, 33},
                       {33, 3072, 7}, {768, 33, 7}, {64, 96, 128}, {3, 5, 3072}};
  for (const Precision& p : kAllPrecisions)
    for (const Mkn& s : sizes)
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          Shape a = ta ? Shape{s.k, s.m} : Shape{s.m, s.k};
          Shape b = tb ? Shape{s.n, s.k} : Shape{s.k, s.n};
          check_matmul(p, a, b, ta, tb);
        }
}

TEST(CublasLtMatmul, BatchedAndBroadcast) {
  KILN_REQUIRE_GPU();
  struct Case {
    Shape a, b;  // as stored for (ta, tb) = (false, false); transposes swap the last two dims
  };
  const Case cases[] = {
      {{3, 7, 33}, {33, 5}},              // b shared: folded into one (21, 33) GEMM
      {{2, 3, 7, 33}, {2, 3, 33, 5}},     // full batch
      {{7, 33}, {4, 33, 5}},              // a shared: stride 0
      {{1, 7, 33}, {3, 33, 5}},           // a broadcast through a size-1 dim
      {{4, 9, 16}, {1, 16, 24}},          // b broadcast through a size-1 dim
      {{2, 1, 7, 33}, {1, 1, 33, 5}},     // size-1 dims on both sides
  };
  auto swap_last = [](Shape s) {
    std::swap(s[s.size() - 1], s[s.size() - 2]);
    return s;
  };
  for (const Precision& p : {kF32, kBf16, kF16})
    for (const Case& c : cases)
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          check_matmul(p, ta ? swap_last(c.a) : c.a, tb ? swap_last(c.b) : c.b, ta, tb);
}

TEST(CublasLtMatmul, UnexpressibleBroadcastIsNotSupported) {
  KILN_REQUIRE_GPU();
  Tensor a = testing::rand(DType::kF32, {2, 1, 4, 8}, 1);
  Tensor b = testing::rand(DType::kF32, {1, 3, 8, 5}, 2);
  Attributes attrs = matmul_attrs(false, false);
  std::vector<TensorType> in{a.type(), b.type()};
  std::vector<TensorType> out = infer_types(Op::kMatmul, in, attrs);
  Node node{Op::kMatmul, {}, {}, attrs, nullptr};
  bool found = false;
  for (const KernelImpl* impl : kernel_registry().candidates(Op::kMatmul, Device::kCuda)) {
    if (impl->dialect != "cublaslt") continue;
    found = true;
    EXPECT_FALSE(impl->supports(NodeView{node, in, out}));
    Tensor i32a = testing::rand(DType::kI32, {4, 8}, 1);
    EXPECT_FALSE(impl->supports(NodeView{node, std::vector<TensorType>{i32a.type(), i32a.type()},
                                         out}));
  }
  EXPECT_TRUE(found) << "no cublaslt matmul registered";
  EXPECT_THROW(cublaslt_impl(a, b, attrs), Error);
}

TEST(CublasLtMatmul, EmptyInnerDimWritesZeros) {
  KILN_REQUIRE_GPU();
  Tensor a(TensorType{DType::kBF16, {5, 0}}), b(TensorType{DType::kBF16, {0, 7}});
  Tensor got = gpu_matmul(a, b, false, false, false);
  for (int64_t i = 0; i < got.numel(); ++i) ASSERT_EQ(got.get(i), 0.0) << i;
}

// GPT-2 (C = 768) at B*T = 8192: the forward GEMMs and the two backward forms of the QKV one.
// The reference checks 8 sampled rows of each output (a full f64 reference would take minutes).
TEST(CublasLtMatmul, Gpt2ShapesSampledRows) {
  KILN_REQUIRE_GPU();
  struct Case {
    int64_t m, k, n;
    bool ta, tb;
    const char* what;
  };
  const Case cases[] = {
      {8192, 768, 2304, false, false, "qkv  x @ w_attn"},
      {8192, 768, 768, false, false, "attn proj"},
      {8192, 768, 3072, false, false, "fc"},
      {8192, 3072, 768, false, false, "fc proj"},
      {8192, 2304, 768, false, true, "dx = dqkv @ w_attn^T"},
      {768, 8192, 2304, true, false, "dw = x^T @ dqkv"},
  };
  std::mt19937_64 rng(7);
  for (const Precision& p : {kF32, kTf32, kBf16})
    for (const Case& c : cases) {
      Shape a_shape = c.ta ? Shape{c.k, c.m} : Shape{c.m, c.k};
      Shape b_shape = c.tb ? Shape{c.n, c.k} : Shape{c.k, c.n};
      Tensor a = testing::rand(p.dtype, a_shape, seed_of(a_shape, b_shape, 3));
      Tensor b = testing::rand(p.dtype, b_shape, seed_of(a_shape, b_shape, 4));
      Tensor got = gpu_matmul(a, b, c.ta, c.tb, p.tf32);
      // Rows of op(A) as an untransposed (rows, k) matrix.
      std::vector<int64_t> rows{0, c.m - 1};
      while (rows.size() < 8) rows.push_back(static_cast<int64_t>(rng() % c.m));
      Tensor a_rows(TensorType{p.dtype, {static_cast<int64_t>(rows.size()), c.k}});
      for (size_t r = 0; r < rows.size(); ++r)
        for (int64_t q = 0; q < c.k; ++q)
          a_rows.set(r * c.k + q, a.get(c.ta ? q * c.m + rows[r] : rows[r] * c.k + q));
      Oracle o = oracle(a_rows, b, false, c.tb);
      std::vector<double> got_rows;
      for (int64_t row : rows)
        for (int64_t j = 0; j < c.n; ++j) got_rows.push_back(got.get(row * c.n + j));
      EXPECT_LE(worst_error(got_rows, o.want, o.scale), p.tol)
          << p.name << " " << c.what << " (" << c.m << "x" << c.k << " @ " << c.k << "x" << c.n
          << ")";
    }
}

// ---- epilogues ----

double gelu_tanh(double x) {
  const double u = std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + std::tanh(u));
}
double gelu_tanh_derivative(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  const double t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x);
}
double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x / std::numbers::sqrt2)); }

struct EpilogueResult {
  double d_error = 0, aux_error = 0, bias_grad_error = 0;
  double gelu_vs_tanh = 0, gelu_vs_erf = 0;  // max |D - form(pre)| for kGelu
  std::string algorithm;                      // the plan's GemmPlan::algorithm()
  bool widens_bias = false;                   // the plan's GemmPlan::widens_bias()
};

// Runs one epilogue GEMM (batch products, each with its own bias / bias_grad) and compares D,
// the aux output and the bias gradient with a host computation in double. `out` is the dtype of
// D, C, bias, bias_grad and aux (default: the inputs'); with_c adds a random C (beta 1);
// bias_type sets Gemm::bias_type (the bias is then drawn in that dtype).
EpilogueResult run_epilogue(Epilogue e, DType dtype, int64_t m, int64_t n, int64_t k, bool ta,
                            bool tb, int64_t batch = 1, std::optional<DType> out_type = {},
                            bool with_c = false, std::optional<DType> bias_type = {}) {
  const DType od = out_type.value_or(dtype);
  Gemm g;
  g.m = m, g.n = n, g.k = k, g.transpose_a = ta, g.transpose_b = tb;
  g.a_type = dtype;
  g.d_type = od;
  g.epilogue = e;
  g.bias_type = bias_type;
  const int64_t bias_len = e == Epilogue::kBGradA ? m : n;
  if (batch > 1) {
    g.batch = batch, g.stride_a = m * k, g.stride_b = k * n, g.stride_bias = bias_len;
  }
  const uint64_t seed = 1000 + static_cast<uint64_t>(e) * 17 + m * 3 + n * 5 + k * 7 + ta * 2 + tb;
  Tensor a = testing::rand(dtype, ta ? Shape{batch, k, m} : Shape{batch, m, k}, seed);
  Tensor b = testing::rand(dtype, tb ? Shape{batch, n, k} : Shape{batch, k, n}, seed + 1);
  Tensor bias = testing::rand(bias_type.value_or(od), {batch, bias_len}, seed + 2);
  Tensor aux_in = testing::rand(od, {batch, m, n}, seed + 3, -3.0, 3.0);
  Tensor c_in = testing::rand(od, {batch, m, n}, seed + 4);
  const TensorType out{od, {batch, m, n}};

  Tensor da = upload(a), db = upload(b), dbias = upload(bias), dd = poisoned(out);
  Tensor daux = cuda::epilogue_reads_aux(e) ? upload(aux_in) : poisoned(out);
  Tensor dbias_grad = poisoned(TensorType{od, {batch, bias_len}});
  Tensor dc = upload(c_in);
  GemmOperands ops{da.raw(), db.raw(), nullptr, dd.raw()};
  if (with_c) {
    ops.c = dc.raw();
    ops.beta = 1.0;
  }
  if (cuda::epilogue_reads_bias(e)) ops.bias = dbias.raw();
  if (cuda::epilogue_writes_bias(e)) ops.bias_grad = dbias_grad.raw();
  if (cuda::epilogue_reads_aux(e) || cuda::epilogue_writes_aux(e)) ops.aux = daux.raw();
  Stream stream;
  g.run(ops, stream.s);
  stream.sync();
  EpilogueResult r;
  r.algorithm = g.plan(ops, stream.s).algorithm();
  r.widens_bias = g.plan(ops, stream.s).widens_bias();
  const std::vector<double> d = download(dd).to_f64(), aux = download(daux).to_f64(),
                            bias_grad = download(dbias_grad).to_f64();

  const std::vector<double> av = a.to_f64(), bv = b.to_f64(), biasv = bias.to_f64(),
                            auxv = aux_in.to_f64(), cv = c_in.to_f64();
  std::vector<double> want_d(out.numel()), scale_d(out.numel()), want_aux(out.numel());
  std::vector<double> want_bg(batch * bias_len, 0.0), scale_bg(batch * bias_len, 0.0);
  for (int64_t t = 0; t < batch; ++t) {
    auto opa = [&](int64_t i, int64_t p) {
      return av[t * m * k + (ta ? p * m + i : i * k + p)];
    };
    auto opb = [&](int64_t p, int64_t j) {
      return bv[t * k * n + (tb ? j * k + p : p * n + j)];
    };
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double pre = 0, s = 0;
        for (int64_t p = 0; p < k; ++p) {
          pre += opa(i, p) * opb(p, j);
          s += std::abs(opa(i, p) * opb(p, j));
        }
        const int64_t o = (t * m + i) * n + j;
        const double bj = cuda::epilogue_reads_bias(e) ? biasv[t * n + j] : 0.0;
        pre += bj;
        s += std::abs(bj);
        if (with_c) {
          pre += cv[o];
          s += std::abs(cv[o]);
        }
        double want = pre;
        switch (e) {
          case Epilogue::kGelu:
          case Epilogue::kGeluBias:
          case Epilogue::kGeluAux:
          case Epilogue::kGeluAuxBias:
            want = gelu_tanh(pre);
            s *= 1.2;  // |gelu'| <= 1.13: an error in pre grows at most that much
            break;
          case Epilogue::kDGelu:
          case Epilogue::kDGeluBGrad:
            want = pre * gelu_tanh_derivative(auxv[o]);
            s *= std::max(1.0, std::abs(gelu_tanh_derivative(auxv[o])));
            break;
          default:
            break;
        }
        want_d[o] = want;
        scale_d[o] = s;
        want_aux[o] = pre;
        if (e == Epilogue::kGelu) {
          r.gelu_vs_tanh = std::max(r.gelu_vs_tanh, std::abs(d[o] - gelu_tanh(pre)));
          r.gelu_vs_erf = std::max(r.gelu_vs_erf, std::abs(d[o] - gelu_erf(pre)));
        }
        if (e == Epilogue::kDGeluBGrad) {
          want_bg[t * n + j] += want;
          scale_bg[t * n + j] += s;
        }
      }
    if (e == Epilogue::kBGradA)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t p = 0; p < k; ++p) {
          want_bg[t * m + i] += opa(i, p);
          scale_bg[t * m + i] += std::abs(opa(i, p));
        }
    if (e == Epilogue::kBGradB)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t p = 0; p < k; ++p) {
          want_bg[t * n + j] += opb(p, j);
          scale_bg[t * n + j] += std::abs(opb(p, j));
        }
  }
  const double atol = od == DType::kF16 ? kF16HalfSubnormal : 0.0;
  r.d_error = worst_error(d, want_d, scale_d, nullptr, atol);
  if (cuda::epilogue_writes_aux(e)) {
    std::vector<double> scale_aux(scale_d.size());
    for (size_t i = 0; i < scale_aux.size(); ++i) scale_aux[i] = scale_d[i];
    r.aux_error = worst_error(aux, want_aux, scale_aux, nullptr, atol);
  }
  if (cuda::epilogue_writes_bias(e))
    r.bias_grad_error = worst_error(bias_grad, want_bg, scale_bg, nullptr, atol);
  return r;
}

struct EpiloguePrecision {
  DType dtype;
  double tol;
  const char* name;
};
constexpr EpiloguePrecision kEpiloguePrecisions[] = {
    {DType::kBF16, 1e-2, "bf16"}, {DType::kF16, 5e-3, "f16"}, {DType::kF32, 2e-5, "f32"}};

constexpr Epilogue kForwardAndDGelu[] = {
    Epilogue::kNone,   Epilogue::kBias,        Epilogue::kGelu,  Epilogue::kGeluBias,
    Epilogue::kGeluAux, Epilogue::kGeluAuxBias, Epilogue::kDGelu, Epilogue::kDGeluBGrad};

void expect_epilogue(const EpiloguePrecision& p, Epilogue e, int64_t m, int64_t n, int64_t k,
                     bool ta, bool tb, int64_t batch = 1) {
  SCOPED_TRACE(fmt::format("{} {} m {} n {} k {}{}{} batch {}", p.name, cuda::epilogue_name(e), m,
                           n, k, ta ? " transpose_a" : "", tb ? " transpose_b" : "", batch));
  EpilogueResult r;
  try {
    r = run_epilogue(e, p.dtype, m, n, k, ta, tb, batch);
  } catch (const Error& error) {
    ADD_FAILURE() << error.what();
    return;
  }
  EXPECT_LE(r.d_error, p.tol);
  EXPECT_LE(r.aux_error, p.tol);
  EXPECT_LE(r.bias_grad_error, p.tol);
}

TEST(CublasLtEpilogue, ForwardAndDGeluEveryTranspose) {
  KILN_REQUIRE_GPU();
  for (const EpiloguePrecision& p : kEpiloguePrecisions)
    for (Epilogue e : kForwardAndDGelu)
      for (bool ta : {false, true})
        for (bool tb : {false, true}) expect_epilogue(p, e, 33, 64, 40, ta, tb);
}

// bf16 / f16 inputs with f32 outputs (a product cast to f32 under amp): D, C and the bias in
// f32, accumulated in f32 and not rounded to 16 bits: f32's tolerance. The epilogues the nvrtc
// dialect maps for such products (none, bias; a C addend) are asserted; the others are probed
// and printed.
TEST(CublasLtEpilogue, SixteenBitInputsF32Output) {
  KILN_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const EpiloguePrecision p{dtype, 2e-5, dtype == DType::kBF16 ? "bf16->f32" : "f16->f32"};
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (Epilogue e : {Epilogue::kNone, Epilogue::kBias})
          for (bool with_c : {false, true}) {
            SCOPED_TRACE(fmt::format("{} {} ta {} tb {} c {}", p.name, cuda::epilogue_name(e), ta,
                                     tb, with_c));
            EpilogueResult r;
            try {
              r = run_epilogue(e, dtype, 37, 24, 150, ta, tb, 1, DType::kF32, with_c);
            } catch (const Error& error) {
              ADD_FAILURE() << error.what();
              continue;
            }
            EXPECT_LE(r.d_error, p.tol);
          }
    // GPT-2's largest: the tied embedding's gradient (50304 x 768, k = tokens) on a slice.
    EpilogueResult r = run_epilogue(Epilogue::kNone, dtype, 96, 768, 512, true, false, 1,
                                    DType::kF32, true);
    EXPECT_LE(r.d_error, p.tol) << p.name << " wte-like";
    for (Epilogue e : {Epilogue::kGeluAuxBias, Epilogue::kDGelu, Epilogue::kDGeluBGrad,
                       Epilogue::kBGradA, Epilogue::kBGradB}) {
      std::string outcome;
      try {
        EpilogueResult q = run_epilogue(e, dtype, 64, 96, 40, true, false, 1, DType::kF32);
        outcome = fmt::format("d error {:.2e}, aux {:.2e}, bias_grad {:.2e}", q.d_error,
                              q.aux_error, q.bias_grad_error);
      } catch (const Error& error) {
        outcome = std::string("unsupported: ") + error.what();
      }
      fmt::print("[probe] {} {}: {}\n", p.name, cuda::epilogue_name(e), outcome);
    }
  }
}

// GPT-2's residual projections under bf16 amp, x (f32) + f32(y W + b) with a bf16 bias b: one
// product D (f32) = A B + bias (bf16, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE) + C (f32, beta 1),
// against the exact sum in double from the same inputs. Nothing is rounded to 16 bits, so f32's
// tolerance (a rounding of the product or of product + bias to bf16 would be ~2^-8 relative:
// 200x over it). Every transpose at odd sizes, then GPT-2's layouts (A (M, K) row-major, B
// (K, N)): attention proj (k 768) and fc2 (k 3072) on 256 rows, and a batch of 3 with a bias
// each. Prints whether cuBLASLt read the 16-bit bias itself or the plan widened it first (the
// H100 with CUDA 13 refused the 16-bit bias: INVALID_VALUE from the heuristic).
TEST(CublasLtEpilogue, SixteenBitBiasOnF32OutputWithC) {
  KILN_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const double tol = 2e-5;
    auto expect = [&](int64_t m, int64_t n, int64_t k, bool ta, bool tb, int64_t batch,
                      bool with_c = true) {
      SCOPED_TRACE(fmt::format("{}->f32, {} bias, m {} n {} k {}{}{} batch {}{}",
                               dtype_name(dtype), dtype_name(dtype), m, n, k,
                               ta ? " transpose_a" : "", tb ? " transpose_b" : "", batch,
                               with_c ? " + C" : ""));
      EpilogueResult r;
      try {
        r = run_epilogue(Epilogue::kBias, dtype, m, n, k, ta, tb, batch, DType::kF32, with_c,
                         dtype);
      } catch (const Error& error) {
        ADD_FAILURE() << error.what();
        return;
      }
      EXPECT_LE(r.d_error, tol);
      fmt::print("[bias16] {}->f32 {} bias m {} n {} k {}{}{} batch {}{}: d error {:.2e}; {}\n",
                 dtype_name(dtype), dtype_name(dtype), m, n, k, ta ? " ta" : "", tb ? " tb" : "",
                 batch, with_c ? " + C" : "", r.d_error, r.algorithm);
    };
    for (bool ta : {false, true})
      for (bool tb : {false, true}) expect(37, 24, 150, ta, tb, 1);
    expect(37, 24, 150, false, false, 1, /*with_c=*/false);  // a linear layer written as f32
    expect(256, 768, 768, false, false, 1);   // attention proj
    expect(256, 768, 3072, false, false, 1);  // fc2
    expect(17, 24, 40, false, false, 3);
  }
}

TEST(CublasLtEpilogue, Batched) {
  KILN_REQUIRE_GPU();
  for (Epilogue e : {Epilogue::kBias, Epilogue::kGeluAuxBias, Epilogue::kDGeluBGrad})
    expect_epilogue(kEpiloguePrecisions[0], e, 17, 24, 40, false, false, 3);
}

// BGRAD: the layouts a linear layer's weight gradient has are asserted (kBGradB: dW = x^T dy
// with dy as B; kBGradA: dW^T = dy^T x with dy as A, transposed); the other transposes are probed
// and printed. On an H200 (CUDA 13) cuBLASLt had no algorithm for kBGradB with transpose_b or
// kBGradA without transpose_a, in every dtype; Gemm now rejects those with its own message.
TEST(CublasLtEpilogue, BiasGradients) {
  KILN_REQUIRE_GPU();
  for (const EpiloguePrecision& p : kEpiloguePrecisions) {
    expect_epilogue(p, Epilogue::kBGradB, 64, 96, 40, true, false);
    expect_epilogue(p, Epilogue::kBGradA, 64, 96, 40, true, false);
    for (Epilogue e : {Epilogue::kBGradA, Epilogue::kBGradB})
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          std::string outcome;
          try {
            EpilogueResult r = run_epilogue(e, p.dtype, 64, 96, 40, ta, tb);
            outcome = fmt::format("bias_grad error {:.2e}, d error {:.2e}", r.bias_grad_error,
                                  r.d_error);
          } catch (const Error& error) {
            outcome = std::string("unsupported: ") + error.what();
          }
          fmt::print("[probe] {} {} ta {} tb {}: {}\n", p.name, cuda::epilogue_name(e), ta, tb,
                     outcome);
        }
  }
}

// GPT-2's MLP at 128 rows: fc forward with GELU_AUX_BIAS, its backward (dpre = (dy @ w_proj^T)
// * gelu'(pre) with the bias gradient), and the weight gradient with the bias gradient.
TEST(CublasLtEpilogue, Gpt2Mlp) {
  KILN_REQUIRE_GPU();
  const EpiloguePrecision& bf16 = kEpiloguePrecisions[0];
  expect_epilogue(bf16, Epilogue::kGeluAuxBias, 128, 3072, 768, false, false);
  expect_epilogue(bf16, Epilogue::kDGeluBGrad, 128, 3072, 768, false, true);
  expect_epilogue(bf16, Epilogue::kBGradB, 768, 3072, 128, true, false);
}

TEST(CublasLtEpilogue, GeluIsTheTanhForm) {
  KILN_REQUIRE_GPU();
  EpilogueResult r = run_epilogue(Epilogue::kGelu, DType::kF32, 64, 64, 64, false, false);
  fmt::print("[gelu] f32 epilogue: max |D - gelu_tanh(pre)| {:.3e}, max |D - gelu_erf(pre)| "
             "{:.3e}\n",
             r.gelu_vs_tanh, r.gelu_vs_erf);
  EXPECT_LT(r.gelu_vs_tanh, r.gelu_vs_erf);
}

// ---- the plan cache ----

TEST(CublasLtPlan, CachedPerDescriptionAndTuned) {
  KILN_REQUIRE_GPU();
  Tensor a = upload(testing::rand(DType::kBF16, {96, 64}, 1));
  Tensor b = upload(testing::rand(DType::kBF16, {64, 80}, 2));
  Tensor d = poisoned(TensorType{DType::kBF16, {96, 80}});
  Gemm g;
  g.m = 96, g.n = 80, g.k = 64, g.a_type = g.d_type = DType::kBF16;
  GemmOperands ops{a.raw(), b.raw(), nullptr, d.raw()};
  Stream stream;
  const size_t before = cuda::gemm_plan_cache_size();
  const cuda::GemmPlan* first = &g.plan(ops, stream.s);
  const cuda::GemmPlan* second = &g.plan(ops, stream.s);
  EXPECT_EQ(first, second);
  EXPECT_EQ(cuda::gemm_plan_cache_size(), before + 1);
  EXPECT_FALSE(first->tuned());
  fmt::print("[plan] {}: {}\n", g.to_string(), first->algorithm());

  Gemm other = g;
  other.transpose_b = true;
  EXPECT_NE(&other.plan(ops, stream.s), first);

  // Autotuning replaces the algorithm of the same cached plan; results stay right.
  cuda::set_gemm_autotune(true);
  const cuda::GemmPlan* tuned = &g.plan(ops, stream.s);
  g.run(ops, stream.s);
  cuda::set_gemm_autotune(false);
  stream.sync();
  EXPECT_EQ(tuned, first);
  EXPECT_TRUE(tuned->tuned());
  EXPECT_GT(tuned->tuned_ms(), 0.0f);
  fmt::print("[plan] tuned: {} ({:.4f} ms)\n", tuned->algorithm(), tuned->tuned_ms());
  Tensor got = download(d);
  Oracle o = oracle(download(a), download(b), false, false);
  EXPECT_LE(worst_error(got.to_f64(), o.want, o.scale), kBf16.tol);
}

// ---- errors (no GPU needed: the description is checked before any CUDA call) ----

TEST(CublasLtErrors, BadDescriptionsThrow) {
  Gemm g;
  g.m = 4, g.n = 8, g.k = 3, g.a_type = DType::kF16, g.d_type = DType::kBF16;
  int x = 0;
  GemmOperands ops{&x, &x, nullptr, &x};
  std::string msg = testing::error_of([&] { g.run(ops, nullptr); });
  EXPECT_NE(msg.find("f16"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bf16"), std::string::npos) << msg;

  g.d_type = DType::kF16;
  g.epilogue = Epilogue::kGeluAuxBias;
  ops.bias = &x;
  msg = testing::error_of([&] { g.run(ops, nullptr); });
  EXPECT_NE(msg.find("aux"), std::string::npos) << msg;

  g.n = 12;  // aux row stride 12 is not a multiple of 8
  ops.aux = &x;
  msg = testing::error_of([&] { g.run(ops, nullptr); });
  EXPECT_NE(msg.find("multiple of 8"), std::string::npos) << msg;

  g.epilogue = Epilogue::kBias;
  ops.bias = nullptr;
  msg = testing::error_of([&] { g.run(ops, nullptr); });
  EXPECT_NE(msg.find("bias"), std::string::npos) << msg;

  g.epilogue = Epilogue::kNone;
  g.lda = 2;  // shorter than a row of 3
  msg = testing::error_of([&] { g.run(ops, nullptr); });
  EXPECT_NE(msg.find("lda 2"), std::string::npos) << msg;

  g.lda = 0;
  g.epilogue = Epilogue::kBGradB;
  g.transpose_b = true;
  ops.bias_grad = &x;
  msg = testing::error_of([&] { g.run(ops, nullptr); });
  EXPECT_NE(msg.find("transpose_b false"), std::string::npos) << msg;
  g.epilogue = Epilogue::kBGradA;
  msg = testing::error_of([&] { g.run(ops, nullptr); });
  EXPECT_NE(msg.find("transpose_a true"), std::string::npos) << msg;

  // A bias in another dtype than D: only the inputs' 16-bit dtype on an f32 D, read by the
  // epilogue.
  Gemm h;
  h.m = 4, h.n = 8, h.k = 3, h.a_type = DType::kBF16, h.d_type = DType::kBF16;
  h.epilogue = Epilogue::kBias;
  h.bias_type = DType::kF32;  // an f32 bias on a bf16 D
  GemmOperands hops{&x, &x, nullptr, &x};
  hops.bias = &x;
  msg = testing::error_of([&] { h.run(hops, nullptr); });
  EXPECT_NE(msg.find("a f32 bias with bf16 inputs, a bf16 output"), std::string::npos) << msg;
  h.d_type = DType::kF32;
  h.bias_type = DType::kF16;  // not the inputs' dtype
  msg = testing::error_of([&] { h.run(hops, nullptr); });
  EXPECT_NE(msg.find("a f16 bias with bf16 inputs, a f32 output"), std::string::npos) << msg;
  h.bias_type = DType::kBF16;
  h.epilogue = Epilogue::kNone;  // no bias read
  msg = testing::error_of([&] { h.run(hops, nullptr); });
  EXPECT_NE(msg.find("epilogue none is not supported"), std::string::npos) << msg;
  h.epilogue = Epilogue::kBGradB;  // a bias gradient is written in D's dtype
  hops.bias_grad = &x;
  msg = testing::error_of([&] { h.run(hops, nullptr); });
  EXPECT_NE(msg.find("epilogue bgrad_b is not supported"), std::string::npos) << msg;
  EXPECT_NE(h.to_string().find("bf16->f32 epilogue bgrad_b (bf16 bias)"), std::string::npos)
      << h.to_string();

  EXPECT_STREQ(cuda::cublas_status_name(CUBLAS_STATUS_NOT_SUPPORTED),
               "CUBLAS_STATUS_NOT_SUPPORTED");
}

}  // namespace
}  // namespace kiln
