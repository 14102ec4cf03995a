// The "nvrtc" dialect (backends/cuda/{codegen,nvrtc}) on the GPU: fused nodes of several bodies
// against the fused reference kernel (ops/fused.cc: every op's reference kernel on whole
// tensors) on random inputs, outputs poisoned with 0xFF bytes first (an unwritten element reads
// as NaN). Bodies: elementwise chains with (N,), (R, 1), scalar and middle-axis broadcasts in
// f32/bf16/f16 (vector widths 8, 4, 2, 1), residual + layer_norm, softmax of a scaled input,
// cross-entropy rows (with ignored labels) and its gradient, a mean-centred row reduction, and
// GEMM epilogues (bias, tanh gelu, gelu aux, dgelu + bias gradient) through cuBLASLt.
//
// Tolerances (max_scaled_error <= 1): the generated kernels compute in f32 and round once per
// output; the reference computes each op in f64 and rounds every intermediate to its storage
// type. So f32: 1e-5 / 1e-4; f16: 4e-3 / 8e-3 and bf16: 3e-2 / 3e-2 (a chain's intermediates
// rounded by the reference and not by us differ by up to an ulp or two of the storage type:
// 2^-11 and 2^-8 relative). GEMMs: the same, f32 without TF32.
#include <cuda_runtime.h>

#include <cstring>

#include "backends/cuda/codegen.h"
#include "backends/cuda/cublaslt.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/memory.h"
#include "backends/cuda/nvrtc.h"
#include "gpu_test_util.h"

namespace kiln {
namespace {

using testing::rand;

struct Tolerance {
  double atol, rtol;
};
Tolerance tolerance(DType d) {
  switch (d) {
    case DType::kF16: return {4e-3, 8e-3};
    case DType::kBF16: return {3e-2, 3e-2};
    default: return {1e-5, 1e-4};
  }
}

struct Body {
  std::shared_ptr<Graph> g = std::make_shared<Graph>();
  ValueId in(const std::string& name, DType d, Shape s) {
    return g->add_input(name, TensorType{d, std::move(s)}, Role::kData);
  }
  ValueId op(Op o, std::vector<ValueId> ins, Attributes a = {}) { return g->add(o, ins, a); }
  Body& out(std::vector<ValueId> ids) {
    g->outputs = std::move(ids);
    return *this;
  }
};

std::vector<Tensor> random_inputs(const Graph& body, uint64_t seed) {
  std::vector<Tensor> inputs;
  for (size_t k = 0; k < body.inputs.size(); ++k)
    inputs.push_back(rand(body.type(body.inputs[k].value).dtype,
                          body.type(body.inputs[k].value).shape, seed + k));
  return inputs;
}

std::vector<Tensor> run_reference(const Body& b, const std::string& kind,
                                  const std::vector<Tensor>& inputs) {
  const Attributes attrs = normalize_attributes(Op::kFused, {{"kind", kind}});
  std::vector<Tensor> outputs;
  for (ValueId id : b.g->outputs) outputs.emplace_back(b.g->type(id));
  op_def(Op::kFused).reference(KernelArgs{attrs, inputs, outputs, nullptr, b.g.get()});
  return outputs;
}

std::vector<Tensor> run_nvrtc(const Body& b, const std::string& kind,
                              const std::vector<Tensor>& inputs,
                              const std::string& dialect = "nvrtc") {
  const Attributes attrs = normalize_attributes(Op::kFused, {{"kind", kind}});
  std::vector<TensorType> in_types, out_types;
  for (const Tensor& t : inputs) in_types.push_back(t.type());
  for (ValueId id : b.g->outputs) out_types.push_back(b.g->type(id));
  Node node{Op::kFused, {}, {}, attrs, b.g};
  const KernelImpl& impl =
      kernel_registry().select(NodeView{node, in_types, out_types}, Device::kCuda, {dialect});
  EXPECT_EQ(impl.dialect, dialect);
  std::vector<Tensor> device_inputs, outputs;
  for (const Tensor& t : inputs) device_inputs.push_back(cuda::to_device(t));
  for (const TensorType& t : out_types) {
    outputs.push_back(cuda::device_tensor(t, /*zero=*/false));
    KILN_CUDA_CHECK(cudaMemset(outputs.back().raw(), 0xFF, std::max<size_t>(t.bytes(), 1)));
  }
  cuda::Stream stream;
  impl.kernel(KernelArgs{attrs, device_inputs, outputs, stream.handle(), b.g.get()});
  stream.synchronize();
  std::vector<Tensor> host;
  for (const Tensor& t : outputs) host.push_back(cuda::to_host(t));
  return host;
}

void expect_matches(const Body& b, const std::string& kind, const std::vector<Tensor>& inputs,
                    const std::string& what) {
  SCOPED_TRACE(what);
  std::string why;
  if (kind != "gemm-epilogue") {
    ASSERT_TRUE(cuda::can_generate(*b.g, kind, &why)) << why;
  }
  const std::vector<Tensor> expected = run_reference(b, kind, inputs);
  const std::vector<Tensor> actual = run_nvrtc(b, kind, inputs);
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    const Tolerance tol = tolerance(expected[i].dtype());
    const double err = max_scaled_error(actual[i], expected[i], tol.atol, tol.rtol);
    EXPECT_LE(err, 1.0) << "output " << i << ": " << summarize(actual[i]) << " vs expected "
                        << summarize(expected[i]);
  }
}

// (x + bias) -> tanh gelu -> * col * (s + 0.5): bias (N,), col (R, 1), s a scalar.
Body broadcast_chain(DType d, int64_t rows, int64_t n) {
  Body b;
  ValueId x = b.in("x", d, {rows, n}), bias = b.in("bias", d, {n}),
          col = b.in("col", d, {rows, 1}), s = b.in("s", d, {});
  ValueId y = b.op(Op::kGelu, {b.op(Op::kAdd, {x, bias})}, {{"approximate", std::string("tanh")}});
  ValueId half =
      b.op(Op::kFull, {}, {{"value", 0.5}, {"dtype", d}, {"shape", std::vector<int64_t>{}}});
  return b.out({b.op(Op::kMul, {b.op(Op::kMul, {y, col}), b.op(Op::kAdd, {s, half})})});
}

// The cuda-body fallback (backends/cuda/fused_body.cc): a body nvrtc cannot generate (a column
// sum), whose outputs include a body input passed through and one value listed twice, runs op
// by op on the GPU and matches the fused reference kernel.
TEST(NvrtcTest, CudaBodyFallbackRunsWhatNvrtcCannot) {
  KILN_REQUIRE_GPU();
  for (DType d : {DType::kF32, DType::kBF16}) {
    Body b;
    ValueId x = b.in("x", d, {300, 96}), dy = b.in("dy", d, {300, 96});
    ValueId dx = b.op(Op::kGeluGrad, {x, dy}, {{"approximate", std::string("tanh")}});
    ValueId db = b.op(Op::kSum, {dx}, {{"axes", std::vector<int64_t>{0}}});
    b.out({dx, db, x, dx});
    std::string why;
    EXPECT_FALSE(cuda::can_generate(*b.g, "elementwise", &why));
    const std::vector<Tensor> inputs = random_inputs(*b.g, 91);
    const std::vector<Tensor> expected = run_reference(b, "elementwise", inputs);
    const std::vector<Tensor> actual = run_nvrtc(b, "elementwise", inputs, "cuda-body");
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t i = 0; i < actual.size(); ++i) {
      // The column sum adds 300 rounded terms: 4x the elementwise tolerance.
      const Tolerance tol = tolerance(expected[i].dtype());
      EXPECT_LE(max_scaled_error(actual[i], expected[i], 4 * tol.atol, 4 * tol.rtol), 1.0)
          << dtype_name(d) << " output " << i;
    }
  }
}

TEST(NvrtcTest, ElementwiseChainsWithBroadcasts) {
  KILN_REQUIRE_GPU();
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t n : {64, 66, 63, 1024}) {
      Body b = broadcast_chain(d, 37, n);
      expect_matches(b, "elementwise", random_inputs(*b.g, 10 + n),
                     fmt::format("{} n={}", dtype_name(d), n));
    }
  }
  // A large one: the grid-stride loop covers more elements than one wave of blocks.
  Body big = broadcast_chain(DType::kBF16, 4096, 3072);
  expect_matches(big, "elementwise", random_inputs(*big.g, 3), "bf16 4096 x 3072");
}

TEST(NvrtcTest, MiddleAxisBroadcastCastAndWhere) {
  KILN_REQUIRE_GPU();
  Body b;
  ValueId x = b.in("x", DType::kF32, {4, 9, 16}), y = b.in("y", DType::kF32, {4, 1, 16});
  ValueId p = b.op(Op::kMul, {x, y});
  ValueId c = b.op(Op::kCast, {b.op(Op::kSigmoid, {p})}, {{"dtype", DType::kBF16}});
  ValueId w = b.op(Op::kWhere, {b.op(Op::kGt, {x, y}), x, b.op(Op::kMaximum, {p, y})});
  b.out({c, w});
  expect_matches(b, "elementwise", random_inputs(*b.g, 5), "mul/cast/where");
}

TEST(NvrtcTest, ResidualLayerNorm) {
  KILN_REQUIRE_GPU();
  for (DType d : {DType::kF32, DType::kBF16}) {
    for (int64_t n : {96, 768, 2500}) {
      Body b;
      ValueId x = b.in("x", d, {3, 7, n}), r = b.in("res", d, {3, 7, n});
      ValueId g = b.in("gamma", d, {n}), be = b.in("beta", d, {n});
      ValueId h = b.op(Op::kAdd, {x, r});
      b.out({h, b.op(Op::kLayerNorm, {h, g, be})});
      expect_matches(b, "rows", random_inputs(*b.g, 20 + n),
                     fmt::format("{} n={}", dtype_name(d), n));
    }
  }
}

TEST(NvrtcTest, SoftmaxOfScaledInputAndRowReductions) {
  KILN_REQUIRE_GPU();
  for (DType d : {DType::kF32, DType::kBF16}) {
    for (int64_t n : {20, 1000, 4096}) {
      Body b;
      ValueId x = b.in("x", d, {2, 5, n}), s = b.in("scale", d, {});
      b.out({b.op(Op::kSoftmax, {b.op(Op::kMul, {x, s})})});
      expect_matches(b, "rows", random_inputs(*b.g, 30 + n),
                     fmt::format("softmax {} n={}", dtype_name(d), n));
    }
  }
  Body b;
  ValueId x = b.in("x", DType::kF32, {9, 300}), dy = b.in("dy", DType::kF32, {9, 300});
  ValueId m = b.op(Op::kMean, {x}, {{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}});
  ValueId c = b.op(Op::kSub, {x, m});
  ValueId s = b.op(Op::kMax, {c}, {{"axes", std::vector<int64_t>{1}}});
  b.out({b.op(Op::kLogSoftmaxGrad, {c, dy}), s, b.op(Op::kRmsNorm, {x, b.in("g", DType::kF32, {300})})});
  expect_matches(b, "rows", random_inputs(*b.g, 7), "mean/max/log_softmax_grad/rms_norm");
}

TEST(NvrtcTest, CrossEntropyRows) {
  KILN_REQUIRE_GPU();
  for (DType d : {DType::kF32, DType::kBF16}) {
    for (int64_t vocab : {50, 50257}) {
      const int64_t rows = 12;
      std::vector<double> label_values;
      for (int64_t r = 0; r < rows; ++r)
        label_values.push_back(r % 5 == 3 ? -100.0 : static_cast<double>((r * 7919) % vocab));
      Tensor labels = testing::make(DType::kI64, {3, 4}, label_values);
      Tensor logits = rand(d, {3, 4, vocab}, 40 + vocab, -4.0, 4.0);
      {
        Body b;
        ValueId x = b.in("logits", d, {3, 4, vocab}), l = b.in("labels", DType::kI64, {3, 4});
        b.out({b.op(Op::kCrossEntropy, {x, l}, {{"reduction", std::string("none")}})});
        expect_matches(b, "rows", {logits, labels},
                       fmt::format("cross_entropy {} V={}", dtype_name(d), vocab));
      }
      {
        Body b;
        ValueId x = b.in("logits", d, {3, 4, vocab}), l = b.in("labels", DType::kI64, {3, 4});
        ValueId dl = b.in("dloss", d, {});
        b.out({b.op(Op::kCrossEntropyGrad, {x, l, dl}, {{"reduction", std::string("sum")}})});
        expect_matches(b, "rows", {logits, labels, rand(d, {}, 9, 0.5, 2.0)},
                       fmt::format("cross_entropy_grad {} V={}", dtype_name(d), vocab));
      }
    }
  }
}

TEST(NvrtcTest, GemmEpilogues) {
  KILN_REQUIRE_GPU();
  cuda::set_matmul_allow_tf32(false);
  for (DType d : {DType::kF32, DType::kBF16}) {
    for (int variant = 0; variant < 3; ++variant) {
      // 0: + bias; 1: gelu(+ bias); 2: gelu(+ bias) with the pre-activation as aux output.
      Body b;
      ValueId x = b.in("x", d, {2, 24, 40}), w = b.in("w", d, {40, 64}),
              bias = b.in("bias", d, {64});
      ValueId pre = b.op(Op::kAdd, {b.op(Op::kMatmul, {x, w}), bias});
      if (variant == 0) {
        b.out({pre});
      } else {
        ValueId y = b.op(Op::kGelu, {pre}, {{"approximate", std::string("tanh")}});
        variant == 1 ? b.out({y}) : b.out({y, pre});
      }
      std::string why;
      ASSERT_TRUE(cuda::gemm_epilogue_supported(*b.g, &why)) << why;
      expect_matches(b, "gemm-epilogue", random_inputs(*b.g, 50 + variant),
                     fmt::format("{} variant {}: {}", dtype_name(d), variant,
                                 cuda::describe_gemm_epilogue(*b.g)));
    }
  }
  {
    // dgelu with the bias gradient: dx = gelu'(pre) * (dy w^T), db = sum over rows of dx.
    Body b;
    ValueId dy = b.in("dy", DType::kBF16, {48, 32}), w = b.in("w", DType::kBF16, {64, 32});
    ValueId pre = b.in("pre", DType::kBF16, {48, 64});
    ValueId dh = b.op(Op::kMatmul, {dy, w}, {{"transpose_b", true}});
    ValueId dx = b.op(Op::kGeluGrad, {pre, dh}, {{"approximate", std::string("tanh")}});
    b.out({dx, b.op(Op::kSum, {dx}, {{"axes", std::vector<int64_t>{0}}})});
    std::vector<Tensor> inputs = random_inputs(*b.g, 60);
    // The reference sums bf16-rounded dx over 48 rows; cuBLASLt sums f32 values: compare the
    // bias gradient with a tolerance for 48 terms.
    const std::vector<Tensor> expected = run_reference(b, "gemm-epilogue", inputs);
    const std::vector<Tensor> actual = run_nvrtc(b, "gemm-epilogue", inputs);
    EXPECT_LE(max_scaled_error(actual[0], expected[0], 3e-2, 3e-2), 1.0);
    EXPECT_LE(max_scaled_error(actual[1], expected[1], 1e-1, 3e-2), 1.0)
        << summarize(actual[1]) << " vs " << summarize(expected[1]);
  }
}

TEST(NvrtcTest, CompilesEachDistinctBodyOnce) {
  KILN_REQUIRE_GPU();
  Body a = broadcast_chain(DType::kF32, 5, 128);
  Body b = broadcast_chain(DType::kF32, 5, 128);  // equal body, another graph object
  expect_matches(a, "elementwise", random_inputs(*a.g, 1), "first");
  const size_t after_first = cuda::nvrtc_cache_size();
  expect_matches(b, "elementwise", random_inputs(*b.g, 2), "same body again");
  EXPECT_EQ(cuda::nvrtc_cache_size(), after_first);
  Body c = broadcast_chain(DType::kF32, 5, 256);  // another shape: another kernel
  expect_matches(c, "elementwise", random_inputs(*c.g, 3), "another shape");
  EXPECT_EQ(cuda::nvrtc_cache_size(), after_first + 1);
}

}  // namespace
}  // namespace kiln
