// The nvrtc dialect's code generation (backends/cuda/codegen.h) without a GPU: what the
// generated source must contain for known bodies (vector width, broadcast index arithmetic,
// reductions), which bodies are refused and why, determinism, the GEMM-epilogue matcher, and
// every generated source compiled by NVRTC (a host library: no device needed), so that syntax
// errors in generated code fail CI. Only in builds with the CUDA backend.
#ifdef KILN_HAVE_CUDA

#include <gtest/gtest.h>

#include <memory>

#include "backends/cuda/codegen.h"
#include "backends/cuda/nvrtc.h"
#include "ir/graph.h"
#include "test_util.h"

namespace kiln {
namespace {

using cuda::GeneratedKernel;

// A small body builder: inputs are data, outputs set explicitly.
struct Body {
  std::shared_ptr<Graph> g = std::make_shared<Graph>();
  ValueId in(const std::string& name, DType d, Shape s) {
    return g->add_input(name, TensorType{d, std::move(s)}, Role::kData);
  }
  ValueId op(Op o, std::vector<ValueId> ins, Attributes a = {}) { return g->add(o, ins, a); }
  std::vector<ValueId> ops(Op o, std::vector<ValueId> ins, Attributes a = {}) {
    return g->add_node(o, ins, a);
  }
  Body& out(std::vector<ValueId> ids) {
    g->outputs = std::move(ids);
    return *this;
  }
};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Compiles with NVRTC for Hopper when the toolkit's headers are here; returns false (and the
// caller skips) when they are not.
bool headers_available() {
  try {
    (void)cuda::cuda_include_dir();
    return true;
  } catch (const Error&) {
    return false;
  }
}

void expect_compiles(const GeneratedKernel& k) {
  if (!headers_available()) return;
  std::string cubin;
  EXPECT_NO_THROW(cubin = cuda::nvrtc_compile(k.source, "sm_90a")) << k.source;
  EXPECT_GT(cubin.size(), 100u);
}

// x (4, 64) + b (64,), tanh gelu, times a (4, 1) column and a scalar full: f32.
Body broadcast_chain(DType d, int64_t n) {
  Body b;
  ValueId x = b.in("x", d, {4, n}), bias = b.in("bias", d, {n}), col = b.in("col", d, {4, 1});
  ValueId s = b.in("s", d, {});
  ValueId y = b.op(Op::kGelu, {b.op(Op::kAdd, {x, bias})}, {{"approximate", std::string("tanh")}});
  ValueId half = b.op(Op::kFull, {}, {{"value", 0.5}, {"dtype", d}, {"shape", std::vector<int64_t>{}}});
  ValueId z = b.op(Op::kMul, {b.op(Op::kMul, {y, col}), b.op(Op::kAdd, {s, half})});
  return b.out({z});
}

TEST(NvrtcCodegenTest, ElementwiseF32UsesFourWideVectorsAndBroadcastIndexing) {
  Body b = broadcast_chain(DType::kF32, 64);
  std::string why;
  ASSERT_TRUE(cuda::can_generate(*b.g, "elementwise", &why)) << why;
  GeneratedKernel k = cuda::generate_kernel(*b.g, "elementwise");
  EXPECT_EQ(k.vector_width, 4);  // 16 bytes of f32
  EXPECT_EQ(k.entry, "kiln_fused_vec");
  EXPECT_EQ(k.scalar_entry, "kiln_fused");
  EXPECT_EQ(k.rows, 4);
  EXPECT_EQ(k.row_length, 64);
  // x is read at i, the bias at i % 64, the column at i / 64, the scalar at 0.
  EXPECT_TRUE(contains(k.source, "in0 + (i)")) << k.source;
  EXPECT_TRUE(contains(k.source, "in1 + ((i % 64LL))")) << k.source;
  EXPECT_TRUE(contains(k.source, "in2[(i / 64LL)]")) << k.source;
  EXPECT_TRUE(contains(k.source, "in3[0]")) << k.source;
  EXPECT_TRUE(contains(k.source, "kiln_gelu_tanh(")) << k.source;
  EXPECT_TRUE(contains(k.source, "static_cast<float>(0.5)")) << k.source;
  EXPECT_TRUE(contains(k.source, "// ops: add, gelu, full, mul, add, mul")) << k.source;
  EXPECT_TRUE(contains(k.source, "constexpr long long kElements = 256LL;")) << k.source;
  expect_compiles(k);
}

TEST(NvrtcCodegenTest, VectorWidthFollowsStorageAndRowLength) {
  // bf16: 8 elements are 16 bytes.
  GeneratedKernel bf = cuda::generate_kernel(*broadcast_chain(DType::kBF16, 64).g, "elementwise");
  EXPECT_EQ(bf.vector_width, 8);
  EXPECT_TRUE(contains(bf.source, "__bfloat162float(")) << bf.source;
  EXPECT_TRUE(contains(bf.source, "__float2bfloat16_rn(")) << bf.source;
  expect_compiles(bf);
  // f16 with a row of 66: 66 = 2 * 33, so 2 wide.
  GeneratedKernel h = cuda::generate_kernel(*broadcast_chain(DType::kF16, 66).g, "elementwise");
  EXPECT_EQ(h.vector_width, 2);
  expect_compiles(h);
  // An odd row: scalar only, a single entry point.
  GeneratedKernel odd = cuda::generate_kernel(*broadcast_chain(DType::kF32, 63).g, "elementwise");
  EXPECT_EQ(odd.vector_width, 1);
  EXPECT_EQ(odd.entry, "kiln_fused");
  EXPECT_TRUE(odd.scalar_entry.empty());
  expect_compiles(odd);
  // f64: 2 wide.
  EXPECT_EQ(cuda::generate_kernel(*broadcast_chain(DType::kF64, 64).g, "elementwise").vector_width,
            2);
}

TEST(NvrtcCodegenTest, MiddleAxisBroadcastAndMixedDtypes) {
  // (2, 3, 8) * (2, 1, 8): the middle axis broadcast needs the general index product; then a
  // cast to bf16, a comparison and a where.
  Body b;
  ValueId x = b.in("x", DType::kF32, {2, 3, 8}), y = b.in("y", DType::kF32, {2, 1, 8});
  ValueId p = b.op(Op::kMul, {x, y});
  ValueId c = b.op(Op::kCast, {p}, {{"dtype", DType::kBF16}});
  ValueId pos = b.op(Op::kGt, {x, y});
  ValueId w = b.op(Op::kWhere, {pos, x, p});
  b.out({c, w});
  GeneratedKernel k = cuda::generate_kernel(*b.g, "elementwise");
  EXPECT_EQ(k.vector_width, 4);  // f32 is the widest stored type; 8 % 4 == 0
  EXPECT_TRUE(contains(k.source, "(i % 8LL) + (i / 24LL) * 8LL")) << k.source;
  EXPECT_TRUE(contains(k.source, "__float2bfloat16_rn")) << k.source;
  expect_compiles(k);
}

TEST(NvrtcCodegenTest, RowsLayerNormWithResidual) {
  Body b;
  ValueId x = b.in("x", DType::kBF16, {2, 5, 96}), r = b.in("res", DType::kBF16, {2, 5, 96});
  ValueId g = b.in("gamma", DType::kBF16, {96}), be = b.in("beta", DType::kBF16, {96});
  ValueId h = b.op(Op::kAdd, {x, r});
  ValueId y = b.op(Op::kLayerNorm, {h, g, be});
  b.out({h, y});
  std::string why;
  ASSERT_TRUE(cuda::can_generate(*b.g, "rows", &why)) << why;
  EXPECT_FALSE(cuda::can_generate(*b.g, "elementwise", &why));
  EXPECT_TRUE(contains(why, "rows")) << why;
  GeneratedKernel k = cuda::generate_kernel(*b.g, "rows");
  EXPECT_EQ(k.rows, 10);
  EXPECT_EQ(k.row_length, 96);
  EXPECT_EQ(k.blocks, 10);
  EXPECT_EQ(k.threads, 32);  // 96 / 4 = 24 -> one warp
  EXPECT_TRUE(contains(k.source, "// pass 1: 1 reduction(s)")) << k.source;  // mean
  EXPECT_TRUE(contains(k.source, "// pass 2: 1 reduction(s)")) << k.source;  // variance
  EXPECT_TRUE(contains(k.source, "kiln_block_reduce<kThreads, 0>")) << k.source;
  EXPECT_TRUE(contains(k.source, "kiln_rsqrt(")) << k.source;
  EXPECT_TRUE(contains(k.source, "(e % 96LL)")) << k.source;  // gamma, beta
  expect_compiles(k);
}

TEST(NvrtcCodegenTest, RowsSoftmaxCrossEntropyAndReductions) {
  {
    Body b;
    ValueId x = b.in("x", DType::kF32, {3, 1000}), s = b.in("scale", DType::kF32, {});
    b.out({b.op(Op::kSoftmax, {b.op(Op::kMul, {x, s})})});
    GeneratedKernel k = cuda::generate_kernel(*b.g, "rows");
    EXPECT_EQ(k.threads, 256);
    EXPECT_TRUE(contains(k.source, "kiln_block_reduce<kThreads, 1>")) << k.source;  // max
    expect_compiles(k);
  }
  {
    Body b;
    ValueId logits = b.in("logits", DType::kF16, {4, 7, 50}),
            labels = b.in("labels", DType::kI64, {4, 7});
    b.out({b.op(Op::kCrossEntropy, {logits, labels}, {{"reduction", std::string("none")}})});
    GeneratedKernel k = cuda::generate_kernel(*b.g, "rows");
    EXPECT_EQ(k.rows, 28);
    EXPECT_TRUE(contains(k.source, "out0[row] =")) << k.source;
    EXPECT_TRUE(contains(k.source, "in1[row]")) << k.source;
    expect_compiles(k);
  }
  {
    Body b;
    ValueId logits = b.in("logits", DType::kF32, {6, 33}), labels = b.in("labels", DType::kI32, {6});
    ValueId dl = b.in("dloss", DType::kF32, {});
    b.out({b.op(Op::kCrossEntropyGrad, {logits, labels, dl}, {{"reduction", std::string("sum")}})});
    expect_compiles(cuda::generate_kernel(*b.g, "rows"));
  }
  {
    // x - mean(x, keepdims), sum without keepdims as a second (per-row) output, log_softmax_grad.
    Body b;
    ValueId x = b.in("x", DType::kF32, {5, 40}), dy = b.in("dy", DType::kF32, {5, 40});
    ValueId m = b.op(Op::kMean, {x}, {{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}});
    ValueId c = b.op(Op::kSub, {x, m});
    ValueId s = b.op(Op::kSum, {c}, {{"axes", std::vector<int64_t>{1}}});
    ValueId g = b.op(Op::kLogSoftmaxGrad, {c, dy});
    b.out({g, s});
    GeneratedKernel k = cuda::generate_kernel(*b.g, "rows");
    expect_compiles(k);
  }
}

TEST(NvrtcCodegenTest, RefusesWhatItCannotGenerate) {
  std::string why;
  {
    Body b;  // matmul has no elementwise emitter
    ValueId x = b.in("x", DType::kF32, {4, 8}), w = b.in("w", DType::kF32, {8, 8});
    b.out({b.op(Op::kRelu, {b.op(Op::kMatmul, {x, w})})});
    EXPECT_FALSE(cuda::can_generate(*b.g, "elementwise", &why));
    EXPECT_TRUE(contains(why, "matmul has no emitter")) << why;
    EXPECT_THROW(cuda::generate_kernel(*b.g, "elementwise"), Error);
  }
  {
    Body b;  // mean cross-entropy divides by a count over all rows
    ValueId logits = b.in("logits", DType::kF32, {6, 33}), labels = b.in("labels", DType::kI32, {6});
    b.out({b.op(Op::kCrossEntropy, {logits, labels})});
    EXPECT_FALSE(cuda::can_generate(*b.g, "rows", &why));
    EXPECT_TRUE(contains(why, "column reduction")) << why;
  }
  {
    Body b;  // a column reduction (over rows)
    ValueId x = b.in("x", DType::kF32, {6, 32});
    b.out({b.op(Op::kSum, {b.op(Op::kExp, {x})}, {{"axes", std::vector<int64_t>{0}}})});
    EXPECT_FALSE(cuda::can_generate(*b.g, "rows", &why));
    EXPECT_TRUE(contains(why, "last axis")) << why;
  }
  {
    Body b;  // integer arithmetic is not generated
    ValueId x = b.in("x", DType::kI32, {6, 32});
    b.out({b.op(Op::kAdd, {x, x})});
    EXPECT_FALSE(cuda::can_generate(*b.g, "elementwise", &why));
    EXPECT_TRUE(contains(why, "only float dtypes")) << why;
  }
  EXPECT_FALSE(cuda::can_generate(*broadcast_chain(DType::kF32, 8).g, "gemm-epilogue", &why));
  EXPECT_TRUE(contains(why, "gemm-epilogue")) << why;
}

TEST(NvrtcCodegenTest, DeterministicSourceAndEveryEmitterListed) {
  const std::string a = cuda::generate_kernel(*broadcast_chain(DType::kF32, 64).g, "elementwise").source;
  const std::string b = cuda::generate_kernel(*broadcast_chain(DType::kF32, 64).g, "elementwise").source;
  EXPECT_EQ(a, b);
  const std::vector<Op> ops = cuda::ops_with_emitters();
  EXPECT_GE(ops.size(), 40u);
  EXPECT_NE(std::find(ops.begin(), ops.end(), Op::kLayerNorm), ops.end());
  EXPECT_EQ(std::find(ops.begin(), ops.end(), Op::kMatmul), ops.end());
}

TEST(NvrtcCodegenTest, CompileErrorsNameTheLine) {
  if (!headers_available()) GTEST_SKIP() << "no CUDA headers for NVRTC here";
  const std::string source = "// line 1\n__global__ void k() {\n  int x = undefined_name;\n}\n";
  const std::string message = testing::error_of([&] { cuda::nvrtc_compile(source, "sm_90a"); });
  EXPECT_TRUE(contains(message, "undefined_name")) << message;
  EXPECT_TRUE(contains(message, "source line 3")) << message;
}

// ---- GEMM epilogues ----

Body gemm_body(DType d, bool bias, const std::string& gelu, bool aux) {
  Body b;
  ValueId x = b.in("x", d, {2, 16, 32}), w = b.in("w", d, {32, 64});
  ValueId pre = b.op(Op::kMatmul, {x, w});
  if (bias) pre = b.op(Op::kAdd, {pre, b.in("bias", d, {64})});
  if (gelu.empty()) return b.out({pre});
  ValueId y = b.op(Op::kGelu, {pre}, {{"approximate", gelu}});
  return aux ? b.out({y, pre}) : b.out({y});
}

TEST(NvrtcCodegenTest, GemmEpiloguePatterns) {
  std::string why;
  EXPECT_TRUE(cuda::gemm_epilogue_supported(*gemm_body(DType::kBF16, true, "tanh", false).g, &why))
      << why;
  EXPECT_TRUE(contains(cuda::describe_gemm_epilogue(*gemm_body(DType::kBF16, true, "tanh", true).g),
                       "gelu"));
  EXPECT_TRUE(cuda::gemm_epilogue_supported(*gemm_body(DType::kF32, true, "", false).g, &why)) << why;
  EXPECT_FALSE(cuda::gemm_epilogue_supported(*gemm_body(DType::kF32, true, "none", false).g, &why));
  EXPECT_TRUE(contains(why, "tanh")) << why;
  {
    // dgelu + bias gradient.
    Body b;
    ValueId dy = b.in("dy", DType::kBF16, {32, 16}), w = b.in("w", DType::kBF16, {64, 16});
    ValueId pre = b.in("pre", DType::kBF16, {32, 64});
    ValueId dh = b.op(Op::kMatmul, {dy, w}, {{"transpose_b", true}});
    ValueId dx = b.op(Op::kGeluGrad, {pre, dh}, {{"approximate", std::string("tanh")}});
    ValueId db = b.op(Op::kSum, {dx}, {{"axes", std::vector<int64_t>{0}}});
    b.out({dx, db});
    EXPECT_TRUE(cuda::gemm_epilogue_supported(*b.g, &why)) << why;
  }
  {
    // Something after the matmul with no epilogue.
    Body b;
    ValueId x = b.in("x", DType::kF32, {8, 8}), w = b.in("w", DType::kF32, {8, 8});
    b.out({b.op(Op::kExp, {b.op(Op::kMatmul, {x, w})})});
    EXPECT_FALSE(cuda::gemm_epilogue_supported(*b.g, &why));
    EXPECT_TRUE(contains(why, "exp")) << why;
  }
}

}  // namespace
}  // namespace kiln

#endif  // KILN_HAVE_CUDA
