// The "cuda-attention" dialect (backends/cuda/attention/attention.cc) against the CPU reference kernels
// of attention (out, lse) and attention_grad (ops/nn.cc): random inputs, outputs poisoned with
// NaN first, shapes with T not a multiple of the 64-row tile, causal and not, bf16 / f16 / f32,
// the tensor-core path (d == dv in {32, 64, 128}) and the simple path (other head dims, f32).
// attention_grad gets the reference forward's out and lse (what it is defined on), and once a
// deliberately shifted lse (it must use the one given).
// Error measure: max |gpu - ref| / max |ref| over a tensor ("scaled error").
// Tolerances: bf16 1.5e-2 (forward) and 2.5e-2 (backward): P and dS are rounded to bf16
// (8 significant bits) before their matmuls; f16 4e-3 / 6e-3 (11 bits); f32 2e-4 (f32 sums
// over up to 1024 keys against the reference's double). lse 1e-5 for every dtype: the scores
// are f32 sums of exact products of the (same) rounded inputs, then an f32 log.
// (TFLOP/s at GPT-2 size: bench/gpu_attention_bench.cc.)
// attention_qkv / attention_qkv_grad (q, k, v and dq, dk, dv strided inside one packed
// (B, T, 3, H, D) tensor): against their reference kernels with the same tolerances (dq, dk, dv
// compared part by part), and bit for bit against the plain "bthd" kernels on the unpacked parts
// (the same kernels and arithmetic, only the row addressing differs).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "backends/cuda/common/cuda_check.h"

namespace kiln {
namespace {

using testing::rand;
using testing::run_reference;

using testing::poisoned_device;
using testing::scaled_error;
using cuda::to_device;
using cuda::to_host;

const KernelImpl& attention_impl(Op op) { return testing::dialect_impl("cuda-attention", op); }

std::vector<Tensor> run_gpu(Op op, const std::vector<Tensor>& inputs, Attributes attrs) {
  return testing::run_attention_dialect("cuda-attention", op, inputs, std::move(attrs));
}

struct Case {
  DType dtype;
  int64_t batch, heads, tq, tk, d, dv;
  bool causal;
  double scale = 0.0;  // 0: the default 1/sqrt(d)
  bool bthd = false;   // layout "bthd": (B, T, H, D) tensors, lse (B, Tq, H)
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " B=" + std::to_string(c.batch) +
         " H=" + std::to_string(c.heads) + " Tq=" + std::to_string(c.tq) +
         " Tk=" + std::to_string(c.tk) + " d=" + std::to_string(c.d) +
         " dv=" + std::to_string(c.dv) + (c.causal ? " causal" : "") +
         (c.scale != 0.0 ? " scale=" + std::to_string(c.scale) : "") + (c.bthd ? " bthd" : "");
}

double forward_tolerance(DType dtype) {
  return dtype == DType::kBF16 ? 1.5e-2 : dtype == DType::kF16 ? 4e-3 : 2e-4;
}
double backward_tolerance(DType dtype) {
  return dtype == DType::kBF16 ? 2.5e-2 : dtype == DType::kF16 ? 6e-3 : 2e-4;
}
constexpr double kLseTolerance = 1e-5;

void check_case(const Case& c, bool backward, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  // q and k in [-2, 2]: scores of a few units, so the softmax is far from uniform.
  auto shape = [&](int64_t t, int64_t d) {
    return c.bthd ? Shape{c.batch, t, c.heads, d} : Shape{c.batch, c.heads, t, d};
  };
  const Tensor q = rand(c.dtype, shape(c.tq, c.d), seed, -2.0, 2.0);
  const Tensor k = rand(c.dtype, shape(c.tk, c.d), seed + 1, -2.0, 2.0);
  const Tensor v = rand(c.dtype, shape(c.tk, c.dv), seed + 2);
  Attributes attrs{{"causal", c.causal}};
  if (c.scale != 0.0) attrs.set("scale", c.scale);
  if (c.bthd) attrs.set("layout", std::string("bthd"));

  const std::vector<Tensor> ref = run_reference(Op::kAttention, {q, k, v}, attrs);
  const std::vector<Tensor> gpu = run_gpu(Op::kAttention, {q, k, v}, attrs);
  ASSERT_EQ(gpu.size(), 2u);
  ASSERT_EQ(gpu[1].type(), (TensorType{DType::kF32, c.bthd ? Shape{c.batch, c.tq, c.heads}
                                                            : Shape{c.batch, c.heads, c.tq}}));
  const double err = scaled_error(gpu[0], ref[0]), lse_err = scaled_error(gpu[1], ref[1]);
  std::printf("  attention      %-52s out %.2e lse %.2e\n", describe(c).c_str(), err, lse_err);
  EXPECT_LE(err, forward_tolerance(c.dtype)) << "out";
  EXPECT_LE(lse_err, kLseTolerance) << "lse";
  if (!backward) return;

  const Tensor dout = rand(c.dtype, shape(c.tq, c.dv), seed + 3);
  const std::vector<Tensor> grad_in = {q, k, v, ref[0], dout, ref[1]};
  const std::vector<Tensor> gref = run_reference(Op::kAttentionGrad, grad_in, attrs);
  const std::vector<Tensor> ggpu = run_gpu(Op::kAttentionGrad, grad_in, attrs);
  const char* names[3] = {"dq", "dk", "dv"};
  double errs[3];
  for (int i = 0; i < 3; ++i) {
    errs[i] = scaled_error(ggpu[i], gref[i]);
    EXPECT_LE(errs[i], backward_tolerance(c.dtype)) << names[i];
  }
  std::printf("  attention_grad %-52s dq %.2e dk %.2e dv %.2e\n", describe(c).c_str(), errs[0],
              errs[1], errs[2]);
}

TEST(CudaAttention, TensorCoresMatchReference) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 100;
  for (DType dtype : {DType::kBF16, DType::kF16})
    for (bool causal : {false, true}) {
      for (int64_t t : {1, 17, 64, 100, 200})
        check_case({dtype, 2, 3, t, t, 64, 64, causal}, true, seed += 10);
      check_case({dtype, 1, 2, 100, 37, 64, 64, causal}, true, seed += 10);   // Tq > Tk
      check_case({dtype, 1, 2, 17, 130, 64, 64, causal}, true, seed += 10);   // Tq < Tk
      check_case({dtype, 2, 2, 100, 100, 32, 32, causal}, true, seed += 10);
      check_case({dtype, 2, 2, 100, 100, 128, 128, causal}, true, seed += 10);
    }
  check_case({DType::kBF16, 1, 2, 77, 77, 64, 64, true, 0.3}, true, seed += 10);
  check_case({DType::kBF16, 1, 1, 50, 50, 64, 64, false, -0.2}, true, seed += 10);
}

// Layout "bthd" ((B, T, H, D), what the simplifier gives a model's heads): problems H rows
// apart, on the tensor-core path and the simple path.
TEST(CudaAttention, BthdLayoutMatchesReference) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 900;
  for (bool causal : {false, true}) {
    check_case({DType::kBF16, 2, 3, 100, 100, 64, 64, causal, 0.0, true}, true, seed += 10);
    check_case({DType::kF16, 1, 2, 17, 130, 32, 32, causal, 0.0, true}, true, seed += 10);
    check_case({DType::kBF16, 1, 12, 256, 256, 64, 64, causal, 0.0, true}, true, seed += 10);
    check_case({DType::kF32, 2, 3, 33, 40, 40, 24, causal, 0.0, true}, true, seed += 10);
  }
}

TEST(CudaAttention, LongSequenceMatchesReference) {
  KILN_REQUIRE_GPU();
  check_case({DType::kBF16, 1, 1, 1024, 1024, 64, 64, true}, true, 7);
  check_case({DType::kBF16, 1, 1, 1024, 1024, 64, 64, false}, true, 8);
  check_case({DType::kF16, 1, 1, 1000, 1000, 64, 64, true}, false, 9);
}

TEST(CudaAttention, SimplePathMatchesReference) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 500;
  for (bool causal : {false, true}) {
    for (int64_t t : {1, 17, 100})
      check_case({DType::kF32, 2, 2, t, t, 64, 64, causal}, true, seed += 10);
    check_case({DType::kF32, 1, 2, 33, 70, 6, 10, causal}, true, seed += 10);
    check_case({DType::kF32, 1, 2, 70, 33, 40, 40, causal}, true, seed += 10);
    check_case({DType::kBF16, 2, 1, 50, 50, 40, 24, causal}, true, seed += 10);  // d != dv
    check_case({DType::kF16, 1, 2, 45, 45, 256, 256, causal}, true, seed += 10);
    // Odd head dims: the backward takes them too (no dq-row alignment needed any more).
    check_case({DType::kF32, 1, 1, 20, 20, 3, 5, causal}, true, seed += 10);
    check_case({DType::kBF16, 1, 2, 30, 30, 6, 6, causal}, true, seed += 10);
    check_case({DType::kF16, 1, 1, 9, 9, 1, 1, causal}, true, seed += 10);
  }
}

// attention_grad is defined on the lse it is given: with lse + ln 2 every P halves, so the
// kernel must agree with the reference on those inputs (and dv must halve).
TEST(CudaAttention, BackwardUsesTheGivenLse) {
  KILN_REQUIRE_GPU();
  for (int64_t d : {int64_t{64}, int64_t{40}}) {  // tensor cores, then the simple path
    SCOPED_TRACE("d = " + std::to_string(d));
    const DType dt = DType::kBF16;
    const Tensor q = rand(dt, {1, 2, 100, d}, 901, -2.0, 2.0);
    const Tensor k = rand(dt, {1, 2, 100, d}, 902, -2.0, 2.0);
    const Tensor v = rand(dt, {1, 2, 100, d}, 903);
    const Tensor dout = rand(dt, {1, 2, 100, d}, 904);
    const Attributes attrs{{"causal", true}};
    const std::vector<Tensor> fwd = run_reference(Op::kAttention, {q, k, v}, attrs);
    Tensor lse = fwd[1].clone();
    for (int64_t i = 0; i < lse.numel(); ++i) lse.set(i, lse.get(i) + std::log(2.0));
    const std::vector<Tensor> in = {q, k, v, fwd[0], dout, lse};
    const std::vector<Tensor> gref = run_reference(Op::kAttentionGrad, in, attrs);
    const std::vector<Tensor> ggpu = run_gpu(Op::kAttentionGrad, in, attrs);
    for (int i = 0; i < 3; ++i) EXPECT_LE(scaled_error(ggpu[i], gref[i]), 2.5e-2) << i;
    const std::vector<Tensor> dv_full =
        run_reference(Op::kAttentionGrad, {q, k, v, fwd[0], dout, fwd[1]}, attrs);
    double max_half = 0.0, max_full = 0.0;
    for (int64_t i = 0; i < dv_full[2].numel(); ++i) {
      max_half = std::max(max_half, std::abs(ggpu[2].get(i)));
      max_full = std::max(max_full, std::abs(dv_full[2].get(i)));
    }
    EXPECT_NEAR(max_half / max_full, 0.5, 0.02);
  }
}

// ---- attention_qkv: q, k, v read in place from the packed (B, T, 3, H, D) ----

struct QkvCase {
  DType dtype;
  Shape lead;  // leading dims before T
  int64_t t, heads, d;
  bool causal;
};

std::string describe(const QkvCase& c) {
  return std::string(dtype_name(c.dtype)) + " lead=" + to_string(c.lead) +
         " T=" + std::to_string(c.t) + " H=" + std::to_string(c.heads) +
         " d=" + std::to_string(c.d) + (c.causal ? " causal" : "");
}

// Part `which` (0 q, 1 k, 2 v) of a packed (..., T, 3, H, D) host tensor, as (..., T, H, D).
Tensor unpack(const Tensor& qkv, int which) {
  Shape shape = qkv.shape();
  shape.erase(shape.end() - 3);
  Tensor part(TensorType{qkv.dtype(), shape});
  const int64_t hd = shape[shape.size() - 2] * shape.back();
  for (int64_t pos = 0; pos < part.numel() / hd; ++pos)
    for (int64_t e = 0; e < hd; ++e) part.set(pos * hd + e, qkv.get((pos * 3 + which) * hd + e));
  return part;
}

// Whether a and b hold the same bytes (bit-identical results).
bool same_bits(const Tensor& a, const Tensor& b) {
  return a.type() == b.type() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

void check_qkv_case(const QkvCase& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  Shape packed = c.lead, part = c.lead;
  packed.insert(packed.end(), {c.t, 3, c.heads, c.d});
  part.insert(part.end(), {c.t, c.heads, c.d});
  // Scores of a few units (q, k in [-2, 2]), as check_case.
  const Tensor qkv = rand(c.dtype, packed, seed, -2.0, 2.0);
  const Attributes attrs{{"causal", c.causal}};
  Attributes bthd = attrs;
  bthd.set("layout", std::string("bthd"));

  const std::vector<Tensor> ref = run_reference(Op::kAttentionQkv, {qkv}, attrs);
  const std::vector<Tensor> gpu = run_gpu(Op::kAttentionQkv, {qkv}, attrs);
  ASSERT_EQ(gpu.size(), 2u);
  ASSERT_EQ(gpu[0].type(), (TensorType{c.dtype, part}));
  const double err = scaled_error(gpu[0], ref[0]), lse_err = scaled_error(gpu[1], ref[1]);
  std::printf("  attention_qkv      %-44s out %.2e lse %.2e\n", describe(c).c_str(), err,
              lse_err);
  EXPECT_LE(err, forward_tolerance(c.dtype)) << "out";
  EXPECT_LE(lse_err, kLseTolerance) << "lse";
  const Tensor q = unpack(qkv, 0), k = unpack(qkv, 1), v = unpack(qkv, 2);
  const std::vector<Tensor> plain = run_gpu(Op::kAttention, {q, k, v}, bthd);
  EXPECT_TRUE(same_bits(gpu[0], plain[0])) << "out differs from attention{bthd}'s";
  EXPECT_TRUE(same_bits(gpu[1], plain[1])) << "lse differs from attention{bthd}'s";

  const Tensor dout = rand(c.dtype, part, seed + 1);
  const std::vector<Tensor> grad_in = {qkv, ref[0], dout, ref[1]};
  const std::vector<Tensor> gref = run_reference(Op::kAttentionQkvGrad, grad_in, attrs);
  const std::vector<Tensor> ggpu = run_gpu(Op::kAttentionQkvGrad, grad_in, attrs);
  ASSERT_EQ(ggpu.size(), 1u);
  ASSERT_EQ(ggpu[0].type(), qkv.type());
  const std::vector<Tensor> gplain =
      run_gpu(Op::kAttentionGrad, {q, k, v, ref[0], dout, ref[1]}, bthd);
  const char* names[3] = {"dq", "dk", "dv"};
  double errs[3];
  for (int i = 0; i < 3; ++i) {
    const Tensor g = unpack(ggpu[0], i);
    errs[i] = scaled_error(g, unpack(gref[0], i));
    EXPECT_LE(errs[i], backward_tolerance(c.dtype)) << names[i];
    EXPECT_TRUE(same_bits(g, gplain[i])) << names[i] << " differs from attention_grad{bthd}'s";
  }
  std::printf("  attention_qkv_grad %-44s dq %.2e dk %.2e dv %.2e\n", describe(c).c_str(),
              errs[0], errs[1], errs[2]);
}

// The tensor-core path: 16-bit types, d in {32, 64, 128}; T not a multiple of the 64-row tile.
TEST(CudaAttention, QkvTensorCoresMatchReference) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 1300;
  for (DType dtype : {DType::kBF16, DType::kF16})
    for (bool causal : {false, true}) {
      check_qkv_case({dtype, {2}, 100, 3, 64, causal}, seed += 10);
      check_qkv_case({dtype, {1}, 17, 2, 32, causal}, seed += 10);
      check_qkv_case({dtype, {2}, 130, 2, 128, causal}, seed += 10);
    }
  check_qkv_case({DType::kBF16, {1}, 1, 4, 64, true}, seed += 10);  // one position
  check_qkv_case({DType::kBF16, {2, 2}, 70, 3, 64, true}, seed += 10);  // two leading dims
}

// The simple path: f32 at any d, and d = 40 (no tensor-core tile) for every dtype.
TEST(CudaAttention, QkvSimplePathMatchesReference) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 1700;
  for (bool causal : {false, true}) {
    check_qkv_case({DType::kF32, {2}, 100, 3, 64, causal}, seed += 10);
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
      check_qkv_case({dtype, {2}, 77, 3, 40, causal}, seed += 10);
    check_qkv_case({DType::kF32, {1}, 33, 2, 7, causal}, seed += 10);  // odd d
  }
}

TEST(CudaAttention, SupportsWhatItHandles) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  auto supports = [](Op op, DType dtype, int64_t d, int64_t dv) {
    const DType lse = dtype == DType::kF64 ? DType::kF64 : DType::kF32;
    const std::vector<TensorType> in = {{dtype, {2, 8, d}},  {dtype, {2, 8, d}},
                                        {dtype, {2, 8, dv}}, {dtype, {2, 8, dv}},
                                        {dtype, {2, 8, dv}}, {lse, {2, 8}}};
    const size_t n = op == Op::kAttention ? 3 : 6;
    Node node{op, {}, {}, normalize_attributes(op, {}), nullptr};
    const std::vector<TensorType> ins(in.begin(), in.begin() + n);
    const std::vector<TensorType> outs = infer_types(op, ins, node.attrs);
    return attention_impl(op).supports(NodeView{node, ins, outs});
  };
  EXPECT_TRUE(supports(Op::kAttention, DType::kBF16, 64, 64));
  EXPECT_TRUE(supports(Op::kAttention, DType::kF32, 3, 5));
  EXPECT_FALSE(supports(Op::kAttention, DType::kF64, 64, 64));
  EXPECT_FALSE(supports(Op::kAttention, DType::kBF16, 300, 64));
  EXPECT_TRUE(supports(Op::kAttentionGrad, DType::kF16, 64, 64));
  // Any head dim up to the limit: the backward keeps no statistics inside dq.
  EXPECT_TRUE(supports(Op::kAttentionGrad, DType::kF32, 3, 4));
  EXPECT_TRUE(supports(Op::kAttentionGrad, DType::kBF16, 6, 6));
  EXPECT_TRUE(supports(Op::kAttentionGrad, DType::kF16, 1, 1));
  EXPECT_FALSE(supports(Op::kAttentionGrad, DType::kF64, 64, 64));
  EXPECT_FALSE(supports(Op::kAttentionGrad, DType::kBF16, 64, 300));
}

// attention_qkv(_grad): the dtypes and head dims of attention_supported's "bthd" layout.
TEST(CudaAttention, QkvSupportsWhatItHandles) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  auto supports = [](Op op, DType dtype, int64_t d) {
    const DType lse = dtype == DType::kF64 ? DType::kF64 : DType::kF32;
    const std::vector<TensorType> in = {
        {dtype, {2, 8, 3, 4, d}}, {dtype, {2, 8, 4, d}}, {dtype, {2, 8, 4, d}}, {lse, {2, 8, 4}}};
    const size_t n = op == Op::kAttentionQkv ? 1 : 4;
    Node node{op, {}, {}, normalize_attributes(op, {}), nullptr};
    const std::vector<TensorType> ins(in.begin(), in.begin() + n);
    const std::vector<TensorType> outs = infer_types(op, ins, node.attrs);
    return attention_impl(op).supports(NodeView{node, ins, outs});
  };
  for (Op op : {Op::kAttentionQkv, Op::kAttentionQkvGrad}) {
    SCOPED_TRACE(op_info(op).name);
    EXPECT_TRUE(supports(op, DType::kBF16, 64));
    EXPECT_TRUE(supports(op, DType::kF16, 128));
    EXPECT_TRUE(supports(op, DType::kF32, 3));
    EXPECT_TRUE(supports(op, DType::kBF16, 256));
    EXPECT_FALSE(supports(op, DType::kF64, 64));
    EXPECT_FALSE(supports(op, DType::kBF16, 257));
  }
}

TEST(CudaAttention, OversizedHeadDimThrows) {
  KILN_REQUIRE_GPU();
  const Tensor q = to_device(rand(DType::kF32, {1, 2, 300}, 1));
  Tensor out = poisoned_device(q.type());
  const Attributes attrs = normalize_attributes(Op::kAttention, {});
  const std::vector<Tensor> in = {q, q, q};
  std::vector<Tensor> outs = {out, poisoned_device(TensorType{DType::kF32, {1, 2}})};
  try {
    attention_impl(Op::kAttention).kernel(KernelArgs{attrs, in, outs, nullptr});
    ADD_FAILURE() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("300"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln
