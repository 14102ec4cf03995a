// GPT-2's residual projections under mixed precision on the "nvrtc" dialect, with
// cuda::set_mixed_bias_gemm(true): the fused gemm-epilogue body x + f32(matmul(y, W) + b) (y, W,
// b 16-bit, the residual x f32) binds to ONE cuBLASLt call, D (f32) = y W + b (16-bit bias) + x
// (C, beta 1), with no generated kernel (where cuBLASLt refuses the 16-bit bias, the plan widens
// it to f32 first: printed); run on random inputs against the fused reference kernel
// (ops/fused.cc) and against the exact result.
//
// Tolerances. The reference rounds y W to the 16-bit type, adds b and rounds again, then casts
// and adds x in f32; the GEMM adds everything to its f32 accumulator and rounds once (the
// numerics policy of GEMM groups, nvrtc.cc). With u the 16-bit unit roundoff (2^-8 bf16, 2^-11
// f16), M the largest |y W + b| and |b| <= 1, the two skipped roundings are at most
// u (|y W| + |y W + b|) <= u (2 M + 1) (1 + u) apart. Against the exact sum (double, same
// inputs): the f32 additions of k products, the bias and x, (k + 1) 2^-24 (S + 2) with S the
// largest sum_p |y_ip W_pj|, plus the final f32 rounding (2^-24 relative, under rtol 1e-6).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "backends/cuda/cublaslt/cublaslt.h"
#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/runtime/memory.h"
#include "backends/cuda/nvrtc/nvrtc.h"
#include "gpu_test_util.h"

namespace kiln {
namespace {

struct Residual {
  std::shared_ptr<Graph> g = std::make_shared<Graph>();
  int64_t k = 0;
};

// out = x + cast_f32(matmul(y, W) + b), the residual on the left or right of the last add.
Residual residual_body(DType d, Shape y_shape, int64_t n, bool residual_left) {
  Residual r;
  Graph& g = *r.g;
  r.k = y_shape.back();
  Shape out_shape = y_shape;
  out_shape.back() = n;
  const ValueId y = g.add_input("y", TensorType{d, y_shape}, Role::kData);
  const ValueId w = g.add_input("w", TensorType{d, {r.k, n}}, Role::kData);
  const ValueId b = g.add_input("b", TensorType{d, {n}}, Role::kData);
  const ValueId x = g.add_input("x", TensorType{DType::kF32, out_shape}, Role::kData);
  const ValueId pre = g.add(Op::kAdd, {g.add(Op::kMatmul, {y, w}, {}), b}, {});
  const ValueId wide = g.add(Op::kCast, {pre}, {{"dtype", DType::kF32}});
  g.outputs = {residual_left ? g.add(Op::kAdd, {x, wide}, {}) : g.add(Op::kAdd, {wide, x}, {})};
  return r;
}

Tensor as_f64(const Tensor& t, bool absolute = false) {
  std::vector<double> v = t.to_f64();
  if (absolute)
    for (double& e : v) e = std::abs(e);
  return Tensor::from_f64(TensorType{DType::kF64, t.shape()}, v);
}

void expect_one_call(DType d, Shape y_shape, int64_t n, bool residual_left, uint64_t seed) {
  const Residual body = residual_body(d, y_shape, n, residual_left);
  const Graph& g = *body.g;
  SCOPED_TRACE(fmt::format("{} y {} n {} residual {}", dtype_name(d), to_string(y_shape), n,
                           residual_left ? "left" : "right"));
  // Bound: one cuBLASLt product with the bias and C in its epilogue, nothing generated.
  std::string why;
  ASSERT_TRUE(cuda::gemm_epilogue_supported(g, &why)) << why;
  const std::string desc = cuda::describe_gemm_epilogue(g);
  EXPECT_NE(desc.find(fmt::format("{}->f32 epilogue bias ({} bias) + c (beta 1)", dtype_name(d),
                                  dtype_name(d))),
            std::string::npos)
      << desc;
  const std::string listing = cuda::fused_kernel_listing(g, FusedKind::kGemmEpilogue);
  EXPECT_NE(listing.find("runs as one cuBLASLt product with a fused epilogue, no generated source"),
            std::string::npos)
      << listing;

  std::vector<Tensor> inputs;
  for (size_t i = 0; i < g.inputs.size(); ++i)
    inputs.push_back(testing::rand(g.type(g.inputs[i].value).dtype,
                                   g.type(g.inputs[i].value).shape, seed + i));
  const Attributes attrs = fused_attrs(FusedKind::kGemmEpilogue);
  std::vector<Tensor> expected{Tensor(g.type(g.outputs[0]))};
  op_def(Op::kFused).reference(KernelArgs{attrs, inputs, expected, nullptr, body.g.get()});

  std::vector<TensorType> in_types;
  for (const Tensor& t : inputs) in_types.push_back(t.type());
  const TensorType out_type = g.type(g.outputs[0]);
  Node node{Op::kFused, {}, {}, attrs, body.g};
  const std::vector<TensorType> out_types{out_type};
  const KernelImpl& impl = kernel_registry().select(NodeView{node, in_types, out_types},
                                                    Device::kCuda, {"nvrtc"});
  ASSERT_EQ(impl.dialect, "nvrtc");
  std::vector<Tensor> device_inputs, outputs{cuda::device_tensor(out_type, /*zero=*/false)};
  for (const Tensor& t : inputs) device_inputs.push_back(cuda::to_device(t));
  KILN_CUDA_CHECK(cudaMemset(outputs[0].raw(), 0xFF, out_type.bytes()));  // NaN if unwritten
  const size_t kernels_before = cuda::nvrtc_cache_size();
  cuda::Stream stream;
  impl.kernel(KernelArgs{attrs, device_inputs, outputs, stream.handle(), body.g.get()});
  stream.synchronize();
  EXPECT_EQ(cuda::nvrtc_cache_size(), kernels_before) << "a generated kernel was compiled";
  const Tensor got = cuda::to_host(outputs[0]);

  // The exact result and the scales of the bounds (see the file comment).
  const Attributes mm{};
  const std::vector<double> prod =
      testing::run_reference(Op::kMatmul, {as_f64(inputs[0]), as_f64(inputs[1])},
                             normalize_attributes(Op::kMatmul, mm))[0]
          .to_f64();
  const std::vector<double> prod_abs =
      testing::run_reference(Op::kMatmul, {as_f64(inputs[0], true), as_f64(inputs[1], true)},
                             normalize_attributes(Op::kMatmul, mm))[0]
          .to_f64();
  const std::vector<double> bias = inputs[2].to_f64(), x = inputs[3].to_f64();
  std::vector<double> exact(prod.size());
  double big = 0.0, scale = 0.0;
  for (size_t i = 0; i < prod.size(); ++i) {
    const double pre = prod[i] + bias[i % n];
    exact[i] = x[i] + pre;
    big = std::max(big, std::abs(pre));
    scale = std::max(scale, prod_abs[i]);
  }
  const double u = d == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048;
  // k - 1 + 2 f32 additions (the products of 16-bit values are exact in f32), each off by at
  // most 2^-24 times a partial sum, |partial| <= S + |b| + |x| <= S + 2.
  const double accumulation = static_cast<double>(body.k + 1) * std::ldexp(1.0, -24) * (scale + 2);
  const double skipped = u * (2 * big + 1) * (1 + u);
  EXPECT_LE(max_scaled_error(got, expected[0], skipped + accumulation, 1e-6), 1.0)
      << summarize(got) << " vs reference " << summarize(expected[0]);
  const Tensor want = Tensor::from_f64(TensorType{DType::kF64, out_type.shape}, exact);
  const double err = max_scaled_error(as_f64(got), want, accumulation, 1e-6);
  EXPECT_LE(err, 1.0) << summarize(got) << " vs exact " << summarize(want);
  // The reference's bf16 roundings do show (the check above is not vacuous): it is further from
  // the exact sum than the single rounding is.
  const double ref_err = max_scaled_error(as_f64(expected[0]), want, accumulation, 1e-6);
  fmt::print("[residual] {} y {} n {}: max error / f32 bound {:.3f} (reference's: {:.1f}); {}\n",
             dtype_name(d), to_string(y_shape), n, err, ref_err, desc);
  EXPECT_GT(ref_err, err);
}

TEST(NvrtcResidualTest, ProjectionPlusResidualIsOneCublasLtCall) {
  KILN_REQUIRE_GPU();
  cuda::set_matmul_allow_tf32(false);
  const bool was = cuda::mixed_bias_gemm();
  cuda::set_mixed_bias_gemm(true);
  struct Restore {
    bool was;
    ~Restore() { cuda::set_mixed_bias_gemm(was); }
  } restore{was};
  for (DType d : {DType::kBF16, DType::kF16}) {
    expect_one_call(d, {2, 37, 40}, 24, true, 10);
    expect_one_call(d, {45, 72}, 56, false, 20);
  }
  // GPT-2 124M's shapes on 4 x 64 tokens: attention proj (768 -> 768) and fc2 (3072 -> 768).
  expect_one_call(DType::kBF16, {4, 64, 768}, 768, true, 30);
  expect_one_call(DType::kBF16, {256, 3072}, 768, true, 40);
}

}  // namespace
}  // namespace kiln
