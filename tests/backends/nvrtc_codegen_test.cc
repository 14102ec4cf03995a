// The nvrtc dialect's code generation (backends/cuda/nvrtc/codegen.h) without a GPU: what the
// generated source must contain for known bodies (vector width, broadcast index arithmetic,
// reductions, column reductions and their finish kernel), which bodies are refused and why,
// determinism, the GEMM-epilogue matcher (cuBLASLt epilogues, and a product followed by a
// generated epilogue), that no fused node of gpt2-tiny's training graph falls to the cuda-body
// fallback, and every generated source compiled by NVRTC (a host library: no device needed), so
// that syntax errors in generated code fail CI; the on-disk compile cache of CUBINs. Only in
// builds with the CUDA backend.
#ifdef KILN_HAVE_CUDA

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>

#include "backends/backend.h"
#include "backends/cuda/nvrtc/codegen.h"
#include "backends/cuda/nvrtc/nvrtc.h"
#include "ir/graph.h"
#include "models/models.h"
#include "ops/elementwise.h"
#include "passes/pipeline.h"
#include "support/compile_cache.h"
#include "test_util.h"
#include "compile/training_graph.h"

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
  if (k.scalar_source.empty()) return;
  EXPECT_NO_THROW(cubin = cuda::nvrtc_compile(k.scalar_source, "sm_90a")) << k.scalar_source;
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
  ASSERT_TRUE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why)) << why;
  GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kElementwise);
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
  EXPECT_TRUE(contains(k.source, "kiln::math::GeluTanh::apply<KilnMath>(")) << k.source;
  EXPECT_TRUE(contains(k.source, "static_cast<float>(0.5)")) << k.source;
  EXPECT_TRUE(contains(k.source, "// ops: add, gelu, full, mul, add, mul")) << k.source;
  EXPECT_TRUE(contains(k.source, "constexpr long long kElements = 256LL;")) << k.source;
  expect_compiles(k);
}

TEST(NvrtcCodegenTest, VectorWidthFollowsStorageAndRowLength) {
  // bf16: 8 elements are 16 bytes.
  GeneratedKernel bf = cuda::generate_kernel(*broadcast_chain(DType::kBF16, 64).g, FusedKind::kElementwise);
  EXPECT_EQ(bf.vector_width, 8);
  EXPECT_TRUE(contains(bf.source, "__bfloat162float(")) << bf.source;
  EXPECT_TRUE(contains(bf.source, "__float2bfloat16_rn(")) << bf.source;
  expect_compiles(bf);
  // f16 with a row of 66: 66 = 2 * 33, so 2 wide.
  GeneratedKernel h = cuda::generate_kernel(*broadcast_chain(DType::kF16, 66).g, FusedKind::kElementwise);
  EXPECT_EQ(h.vector_width, 2);
  expect_compiles(h);
  // An odd row: scalar only, a single entry point.
  GeneratedKernel odd = cuda::generate_kernel(*broadcast_chain(DType::kF32, 63).g, FusedKind::kElementwise);
  EXPECT_EQ(odd.vector_width, 1);
  EXPECT_EQ(odd.entry, "kiln_fused");
  EXPECT_TRUE(odd.scalar_entry.empty());
  expect_compiles(odd);
  // f64: 2 wide.
  EXPECT_EQ(cuda::generate_kernel(*broadcast_chain(DType::kF64, 64).g, FusedKind::kElementwise).vector_width,
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
  GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kElementwise);
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
  ASSERT_TRUE(cuda::can_generate(*b.g, FusedKind::kRows, &why)) << why;
  EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why));
  EXPECT_TRUE(contains(why, "rows")) << why;
  GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kRows);
  EXPECT_EQ(k.rows, 10);
  EXPECT_EQ(k.row_length, 96);
  EXPECT_EQ(k.blocks, 2);     // a warp per row, 8 rows per block: 10 rows in 2 blocks
  EXPECT_EQ(k.threads, 256);
  EXPECT_TRUE(contains(k.source, "one warp per row")) << k.source;
  EXPECT_TRUE(contains(k.source, "if (row >= 10LL) return;")) << k.source;
  EXPECT_TRUE(contains(k.source, "// pass 1: 1 reduction(s)")) << k.source;  // mean
  EXPECT_TRUE(contains(k.source, "// pass 2: 1 reduction(s)")) << k.source;  // variance
  EXPECT_TRUE(contains(k.source, "kiln_block_reduce<kThreads, 0>")) << k.source;
  EXPECT_TRUE(contains(k.source, "KilnMath::rsqrt(")) << k.source;
  // gamma, beta: indexed by the row's column j, not e % 96.
  EXPECT_TRUE(contains(k.source, "in2[j]")) << k.source;
  EXPECT_FALSE(contains(k.source, "(e % 96LL)")) << k.source;
  expect_compiles(k);
}

TEST(NvrtcCodegenTest, RowsSoftmaxCrossEntropyAndReductions) {
  {
    Body b;
    ValueId x = b.in("x", DType::kF32, {3, 1000}), s = b.in("scale", DType::kF32, {});
    b.out({b.op(Op::kSoftmax, {b.op(Op::kMul, {x, s})})});
    GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kRows);
    EXPECT_EQ(k.threads, 256);  // 8 warps, a row each
    EXPECT_EQ(k.blocks, 1);
    EXPECT_TRUE(contains(k.source, "kiln_block_reduce<kThreads, 1>")) << k.source;  // max
    EXPECT_TRUE(contains(k.source, "constexpr int kThreads = 32;")) << k.source;
    expect_compiles(k);
  }
  {
    // Rows longer than 1024: a block per row, about 4 elements per thread.
    Body b;
    ValueId x = b.in("x", DType::kF32, {3, 2000});
    b.out({b.op(Op::kSoftmax, {x})});
    GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kRows);
    EXPECT_EQ(k.threads, 512);
    EXPECT_EQ(k.blocks, 3);
    EXPECT_TRUE(contains(k.source, "one block of 512 threads per row")) << k.source;
    expect_compiles(k);
  }
  {
    Body b;
    ValueId logits = b.in("logits", DType::kF16, {4, 7, 50}),
            labels = b.in("labels", DType::kI64, {4, 7});
    b.out({b.op(Op::kCrossEntropy, {logits, labels}, {{"reduction", std::string("none")}})});
    GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kRows);
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
    expect_compiles(cuda::generate_kernel(*b.g, FusedKind::kRows));
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
    GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kRows);
    expect_compiles(k);
  }
}

TEST(NvrtcCodegenTest, RefusesWhatItCannotGenerate) {
  std::string why;
  {
    Body b;  // matmul has no elementwise emitter
    ValueId x = b.in("x", DType::kF32, {4, 8}), w = b.in("w", DType::kF32, {8, 8});
    b.out({b.op(Op::kRelu, {b.op(Op::kMatmul, {x, w})})});
    EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why));
    EXPECT_TRUE(contains(why, "matmul has no emitter")) << why;
    EXPECT_THROW(cuda::generate_kernel(*b.g, FusedKind::kElementwise), Error);
  }
  {
    Body b;  // mean cross-entropy divides by a count over all rows
    ValueId logits = b.in("logits", DType::kF32, {6, 33}), labels = b.in("labels", DType::kI32, {6});
    b.out({b.op(Op::kCrossEntropy, {logits, labels})});
    EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kRows, &why));
    EXPECT_TRUE(contains(why, "column reduction")) << why;
  }
  {
    Body b;  // a reduction over a middle axis (neither along the row nor over the rows)
    ValueId x = b.in("x", DType::kF32, {6, 4, 32});
    b.out({b.op(Op::kSum, {b.op(Op::kExp, {x})}, {{"axes", std::vector<int64_t>{1}}})});
    EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kRows, &why));
    EXPECT_TRUE(contains(why, "last axis")) << why;
  }
  {
    Body b;  // integer arithmetic is not generated
    ValueId x = b.in("x", DType::kI32, {6, 32});
    b.out({b.op(Op::kAdd, {x, x})});
    EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why));
    EXPECT_TRUE(contains(why, "only float dtypes")) << why;
  }
  EXPECT_FALSE(cuda::can_generate(*broadcast_chain(DType::kF32, 8).g, FusedKind::kGemmEpilogue, &why));
  EXPECT_TRUE(contains(why, "gemm-epilogue")) << why;
}

// A padded row output (passes/ones_column.h): concat(y, full(1)) along the last axis of a
// LayerNorm's rows kernel stores rows of n + pad at a stride of n + pad, and the pad by a lane
// per column; 4-wide stores only where the padded row keeps them aligned. Refused: elementwise
// kernels, a pad read inside the body, a second operand that is not a full.
Body padded_layer_norm(int64_t n, int64_t pad, bool read_inside) {
  Body b;
  ValueId x = b.in("x", DType::kF32, {5, 3, n}), g = b.in("gamma", DType::kF32, {n}),
          be = b.in("beta", DType::kF32, {n});
  ValueId y = b.op(Op::kCast, {b.op(Op::kLayerNorm, {x, g, be})}, {{"dtype", DType::kBF16}});
  ValueId ones = b.op(Op::kFull, {}, {{"value", 1.0}, {"dtype", DType::kBF16},
                                      {"shape", std::vector<int64_t>{5, 3, pad}}});
  ValueId padded = b.op(Op::kConcat, {y, ones}, {{"axis", int64_t{-1}}});
  if (read_inside) return b.out({b.op(Op::kNeg, {padded})});
  return b.out({padded});
}

TEST(NvrtcCodegenTest, PaddedRowOutputs) {
  {
    const GeneratedKernel k = cuda::generate_kernel(*padded_layer_norm(768, 8, false).g, FusedKind::kRows);
    EXPECT_EQ(k.vector_width, 4);
    EXPECT_TRUE(contains(k.source, "out0 + row * 776LL + j0")) << k.source;
    EXPECT_TRUE(contains(k.source, "kiln_o0.v[u] = __float2bfloat16_rn(v")) << k.source;
    EXPECT_TRUE(contains(k.source, "if (kiln_t < 8) out0[row * 776LL + kN + kiln_t]")) << k.source;
    expect_compiles(k);
  }
  // A pad of 2: rows of 770 are not 4-aligned, so scalar stores only.
  EXPECT_EQ(cuda::generate_kernel(*padded_layer_norm(768, 2, false).g, FusedKind::kRows).vector_width, 1);
  // A block per row.
  {
    const GeneratedKernel k = cuda::generate_kernel(*padded_layer_norm(2500, 4, false).g, FusedKind::kRows);
    EXPECT_TRUE(contains(k.source, "out0[row * 2504LL + j] =")) << k.source;
    expect_compiles(k);
  }
  std::string why;
  EXPECT_FALSE(cuda::can_generate(*padded_layer_norm(768, 8, true).g, FusedKind::kRows, &why));
  EXPECT_TRUE(contains(why, "read inside the body")) << why;
  {
    Body b;  // elementwise: no rows to pad
    ValueId x = b.in("x", DType::kF32, {4, 8});
    ValueId ones = b.op(Op::kFull, {}, {{"value", 1.0}, {"dtype", DType::kF32},
                                        {"shape", std::vector<int64_t>{4, 4}}});
    b.out({b.op(Op::kConcat, {b.op(Op::kExp, {x}), ones}, {{"axis", int64_t{-1}}})});
    EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why));
  }
  {
    Body b;  // the pad is an input, not a full
    ValueId x = b.in("x", DType::kF32, {4, 8}), p = b.in("p", DType::kF32, {4, 4});
    ValueId g = b.in("gamma", DType::kF32, {8}), be = b.in("beta", DType::kF32, {8});
    b.out({b.op(Op::kConcat, {b.op(Op::kLayerNorm, {x, g, be}), p}, {{"axis", int64_t{-1}}})});
    EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kRows, &why));
    EXPECT_TRUE(contains(why, "not a full")) << why;
  }
}

TEST(NvrtcCodegenTest, DeterministicSourceAndEveryEmitterListed) {
  const std::string a = cuda::generate_kernel(*broadcast_chain(DType::kF32, 64).g, FusedKind::kElementwise).source;
  const std::string b = cuda::generate_kernel(*broadcast_chain(DType::kF32, 64).g, FusedKind::kElementwise).source;
  EXPECT_EQ(a, b);
  const std::vector<Op> ops = cuda::ops_with_emitters();
  EXPECT_GE(ops.size(), 40u);
  EXPECT_NE(std::find(ops.begin(), ops.end(), Op::kLayerNorm), ops.end());
  EXPECT_EQ(std::find(ops.begin(), ops.end(), Op::kMatmul), ops.end());
}

// Every op that is a line of ops/elementwise_math.h generates (each form of gelu and gelu_grad)
// as a call of its line, and NVRTC compiles it: a new line needs nothing in codegen.cc.
TEST(NvrtcCodegenTest, EveryMathLineGeneratesAsACallOfItsLine) {
  const std::vector<Op> emitted = cuda::ops_with_emitters();
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    if (!ops::is_math_op(op)) continue;
    EXPECT_NE(std::find(emitted.begin(), emitted.end(), op), emitted.end()) << op_name(op);
    const bool has_forms = op == Op::kGelu || op == Op::kGeluGrad;
    for (const char* approximate : {"none", "tanh"}) {
      if (!has_forms && std::string(approximate) == "tanh") continue;
      const Attributes attrs =
          has_forms ? Attributes{{"approximate", std::string(approximate)}} : Attributes{};
      SCOPED_TRACE(std::string(op_name(op)) + " " + approximate);
      Body b;
      std::vector<ValueId> ins;
      for (int k = 0; k < op_info(op).min_inputs; ++k)
        ins.push_back(b.in("x" + std::to_string(k), DType::kBF16, {4, 64}));
      b.out({b.op(op, ins, attrs)});
      std::string why;
      ASSERT_TRUE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why)) << why;
      GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kElementwise);
      math::visit(*ops::elementwise_fn(op, normalize_attributes(op, attrs)), [&](auto line) {
        const std::string call =
            std::string("kiln::math::") + decltype(line)::name() + "::apply<KilnMath>(";
        EXPECT_TRUE(contains(k.source, call)) << call << "\n" << k.source;
      });
      expect_compiles(k);
    }
  }
}

TEST(NvrtcCodegenTest, LayersWithTheSameBodyShareOneSource) {
  // Layer l's LayerNorm reads h<l>.ln.weight: the names differ, the bodies do not. The source is
  // the compile caches' key, so it must not carry the names (GPT-2 compiled 74 kernels instead
  // of 7 when it did); the listing names them for the reader.
  auto layer_norm = [](const std::string& layer) {
    Body b;
    ValueId x = b.in(layer + ".x", DType::kF32, {64, 256});
    ValueId g = b.in(layer + ".ln.weight", DType::kF32, {256});
    ValueId beta = b.in(layer + ".ln.bias", DType::kF32, {256});
    return b.out({b.op(Op::kCast, {b.op(Op::kLayerNorm, {x, g, beta})}, {{"dtype", DType::kBF16}})});
  };
  Body a = layer_norm("h0"), b = layer_norm("h1");
  EXPECT_EQ(cuda::generate_kernel(*a.g, FusedKind::kRows).source, cuda::generate_kernel(*b.g, FusedKind::kRows).source);
  EXPECT_FALSE(contains(cuda::generate_kernel(*a.g, FusedKind::kRows).source, "h0.")) << "names in the source";
  const std::string listing = cuda::fused_kernel_listing(*b.g, FusedKind::kRows);
  EXPECT_TRUE(contains(listing, "in1 %h1.ln.weight")) << listing;
  EXPECT_TRUE(contains(listing, cuda::generate_kernel(*b.g, FusedKind::kRows).source)) << listing;
}

TEST(NvrtcCodegenTest, CompileErrorsNameTheLine) {
  if (!headers_available()) GTEST_SKIP() << "no CUDA headers for NVRTC here";
  const std::string source = "// line 1\n__global__ void k() {\n  int x = undefined_name;\n}\n";
  const std::string message = testing::error_of([&] { cuda::nvrtc_compile(source, "sm_90a"); });
  EXPECT_TRUE(contains(message, "undefined_name")) << message;
  EXPECT_TRUE(contains(message, "source line 3")) << message;
}

// The on-disk compile cache (support/compile_cache.h) through KILN_CACHE_DIR: the second
// compile of a source is a hit with the first's bytes; another arch is another entry; a compile
// error stores nothing; a damaged entry is compiled again and rewritten.
TEST(NvrtcCodegenTest, DiskCacheHitsTheSecondCompileWithTheSameBytes) {
  if (!headers_available()) GTEST_SKIP() << "no CUDA headers for NVRTC here";
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() /
      fmt::format("kiln_nvrtc_cache_test_{}_{}", ::getpid(), std::random_device{}());
  const char* old = std::getenv("KILN_CACHE_DIR");
  const std::optional<std::string> saved = old ? std::optional<std::string>(old) : std::nullopt;
  ::setenv("KILN_CACHE_DIR", dir.c_str(), 1);
  struct Restore {
    fs::path dir;
    std::optional<std::string> saved;
    ~Restore() {
      if (saved) {
        ::setenv("KILN_CACHE_DIR", saved->c_str(), 1);
      } else {
        ::unsetenv("KILN_CACHE_DIR");
      }
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } restore{dir, saved};

  CompileCache& cache = CompileCache::global("nvrtc");
  ASSERT_EQ(cache.dir(), dir / "nvrtc");
  const std::string source = cuda::generate_kernel(*broadcast_chain(DType::kF32, 64).g,
                                                   FusedKind::kElementwise).source;
  const std::string first = cuda::nvrtc_compile_cached(source, "sm_90a");
  EXPECT_GT(first.size(), 100u);
  EXPECT_EQ(cache.stats().misses, 1u);
  EXPECT_EQ(cache.stats().writes, 1u);
  EXPECT_EQ(cache.stats().hits, 0u);
  const std::string second = cuda::nvrtc_compile_cached(source, "sm_90a");
  EXPECT_EQ(cache.stats().hits, 1u);
  EXPECT_EQ(cache.stats().writes, 1u);
  EXPECT_EQ(second, first);
  EXPECT_TRUE(fs::exists(cache.path_for(cuda::nvrtc_cache_key(source, "sm_90a"))));

  // The key names what determines the CUBIN.
  const std::string key = cuda::nvrtc_cache_key(source, "sm_90a");
  EXPECT_TRUE(contains(key, "arch sm_90a")) << key;
  EXPECT_TRUE(contains(key, "--gpu-architecture=sm_90a")) << key;
  EXPECT_TRUE(contains(key, "--include-path=" + cuda::cuda_include_dir())) << key;
  EXPECT_TRUE(contains(key, "\nnvrtc ")) << key;
  EXPECT_TRUE(contains(key, source)) << key;
  EXPECT_NE(key, cuda::nvrtc_cache_key(source, "sm_80"));

  // Another arch: another entry.
  const std::string ampere = cuda::nvrtc_compile_cached(source, "sm_80");
  EXPECT_EQ(cache.stats().misses, 2u);
  EXPECT_EQ(cache.stats().writes, 2u);
  EXPECT_NE(ampere, first);

  // A compile error throws as before and stores nothing.
  EXPECT_THROW(cuda::nvrtc_compile_cached("__global__ void k() { int x = nope; }\n", "sm_90a"),
               Error);
  EXPECT_EQ(cache.stats().writes, 2u);

  // A truncated entry is a miss: compiled again, rewritten whole.
  const fs::path file = cache.path_for(key);
  fs::resize_file(file, fs::file_size(file) / 2);
  EXPECT_EQ(cuda::nvrtc_compile_cached(source, "sm_90a"), first);
  EXPECT_EQ(cache.stats().corrupt, 1u);
  EXPECT_EQ(cache.stats().writes, 3u);
  EXPECT_EQ(cuda::nvrtc_compile_cached(source, "sm_90a"), first);
  EXPECT_EQ(cache.stats().hits, 2u);
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

// ---- column reductions ----

// GPT-2's MLP backward: dy through gelu_grad at the pre-activation x, the bias gradient (sum
// over the leading axes) and the gradient; under bf16 amp (dy bf16, x f32), dy is cast to f32
// first and the gradient back to bf16.
Body gelu_grad_bias(DType dy_type, DType x_type, Shape shape) {
  Body b;
  ValueId dy = b.in("dy", dy_type, shape), x = b.in("x", x_type, shape);
  std::vector<int64_t> axes;
  for (size_t d = 0; d + 1 < shape.size(); ++d) axes.push_back(static_cast<int64_t>(d));
  if (dy_type != x_type) dy = b.op(Op::kCast, {dy}, {{"dtype", x_type}});
  ValueId dx = b.op(Op::kGeluGrad, {x, dy}, {{"approximate", std::string("tanh")}});
  ValueId db = b.op(Op::kSum, {dx}, {{"axes", axes}});
  if (dy_type != x_type) dx = b.op(Op::kCast, {dx}, {{"dtype", dy_type}});
  return b.out({db, dx});
}

TEST(NvrtcCodegenTest, ColumnSumElementwiseKernelStructure) {
  // 4 x 64 = 256 rows of 3072, bf16 dy and f32 x: 4-wide (16 bytes of f32), a warp of 32
  // threads x 4 columns = 128 columns per strip, 24 strips; 1024 / 24 = 42 tiles wanted, so
  // ceil(256 / 42) = 7 rows, rounded up to a multiple of kTY = 8: 8-row tiles, 32 of them.
  Body b = gelu_grad_bias(DType::kBF16, DType::kF32, {4, 64, 3072});
  std::string why;
  ASSERT_TRUE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why)) << why;
  GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kElementwise);
  EXPECT_EQ(k.column_outputs, std::vector<int>{0});
  EXPECT_EQ(k.vector_width, 4);
  EXPECT_EQ(k.threads, 256);
  EXPECT_EQ(k.blocks, 24);
  EXPECT_EQ(k.blocks_y, 32);
  EXPECT_EQ(k.partial_tiles, 32);
  EXPECT_EQ(k.partials_bytes, size_t{32} * 3072 * 4);
  EXPECT_EQ(k.entry, "kiln_fused_columns_vec");
  EXPECT_EQ(k.scalar_entry, "kiln_fused_columns");
  EXPECT_EQ(k.finish_entry, "kiln_fused_columns_finish");
  EXPECT_EQ(k.finish_blocks, 96);  // 3072 columns / 32 per block
  // One parameter per body tensor, then the partials.
  EXPECT_EQ(k.param_element_bytes, (std::vector<int>{2, 4, 4, 2}));
  EXPECT_TRUE(contains(k.source, "constexpr long long kRows = 256LL, kN = 3072LL, kRowTile = 8LL;"))
      << k.source;
  EXPECT_TRUE(contains(k.source, "constexpr int kTX = 32, kTY = 8, kV = 4, kStrip = 128;"))
      << k.source;
  EXPECT_TRUE(contains(k.source, "float* __restrict__ kiln_partials")) << k.source;
  // The per-element output is stored as a vector; the column term accumulates in registers.
  EXPECT_TRUE(contains(k.source, "*reinterpret_cast<KilnPack<kV, __nv_bfloat16>*>(out1 + i) = r1;"))
      << k.source;
  EXPECT_TRUE(contains(k.source, "c0[v] += ")) << k.source;
  EXPECT_TRUE(contains(k.source, "kiln::math::GeluGradTanh::apply<KilnMath>(")) << k.source;
  // The block's partial goes to tile blockIdx.y of the scratch buffer; the finish kernel adds
  // tiles in a fixed order; no atomics anywhere.
  EXPECT_TRUE(contains(k.source, "kiln_partials[(0LL + blockIdx.y) * kN")) << k.source;
  EXPECT_TRUE(contains(k.source, "for (long long t = ty; t < 32LL; t += 8)")) << k.source;
  EXPECT_TRUE(contains(k.source, "out0[c] = s;")) << k.source;
  EXPECT_FALSE(contains(k.source, "atomic")) << k.source;
  EXPECT_TRUE(contains(k.source, "// ops: cast, gelu_grad, sum, cast")) << k.source;
  expect_compiles(k);
  // Deterministic text.
  EXPECT_EQ(cuda::generate_kernel(*b.g, FusedKind::kElementwise).source, k.source);
}

TEST(NvrtcCodegenTest, ColumnSumGeometryForOddAndNarrowShapes) {
  {
    // 37 rows of 33 (odd): scalar only; 33 columns -> a warp per strip of 32 columns, 2 strips.
    Body b = gelu_grad_bias(DType::kF32, DType::kF32, {37, 33});
    GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kElementwise);
    EXPECT_EQ(k.vector_width, 1);
    EXPECT_EQ(k.entry, "kiln_fused_columns");
    EXPECT_TRUE(k.scalar_entry.empty());
    EXPECT_EQ(k.blocks, 2);
    // 1024 / 2 = 512 tiles wanted: 1-row tiles rounded up to kTY = 8 rows: ceil(37 / 8) = 5.
    EXPECT_EQ(k.blocks_y, 5);
    EXPECT_TRUE(contains(k.source, "kTX = 32, kTY = 8, kV = 1, kStrip = 32;")) << k.source;
    expect_compiles(k);
  }
  {
    // bf16 only, rows of 64: 8 wide, 8 threads across the row, 32 rows of threads.
    Body b = gelu_grad_bias(DType::kBF16, DType::kBF16, {100, 64});
    GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kElementwise);
    EXPECT_EQ(k.vector_width, 8);
    EXPECT_EQ(k.blocks, 1);
    EXPECT_TRUE(contains(k.source, "kTX = 8, kTY = 32, kV = 8, kStrip = 64;")) << k.source;
    expect_compiles(k);
  }
}

TEST(NvrtcCodegenTest, ColumnMeanKeepdimsAndBodiesOfOnlyColumnOutputs) {
  // Only column outputs (the iteration space comes from the reductions' input), one a mean
  // with keepdims (divided by the 6 * 5 = 30 rows in the finish kernel), over a (6, 5, 40) x
  // times a (40,) row.
  Body b;
  ValueId x = b.in("x", DType::kF32, {6, 5, 40}), w = b.in("w", DType::kF32, {40});
  ValueId p = b.op(Op::kMul, {x, w});
  ValueId s = b.op(Op::kSum, {p}, {{"axes", std::vector<int64_t>{0, 1}}});
  ValueId m = b.op(Op::kMean, {x}, {{"axes", std::vector<int64_t>{1, 0}}, {"keepdims", true}});
  b.out({s, m});
  std::string why;
  ASSERT_TRUE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why)) << why;
  GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kElementwise);
  EXPECT_EQ(k.rows, 30);
  EXPECT_EQ(k.row_length, 40);
  EXPECT_EQ(k.column_outputs, (std::vector<int>{0, 1}));
  EXPECT_EQ(k.vector_width, 4);
  EXPECT_TRUE(contains(k.source, "in1 + ((i % 40LL))")) << k.source;
  EXPECT_TRUE(contains(k.source, "c1[v] += ")) << k.source;
  EXPECT_TRUE(contains(k.source, "(s / static_cast<float>(30.0))")) << k.source;
  EXPECT_EQ(k.partials_bytes, size_t{2} * static_cast<size_t>(k.partial_tiles) * 40 * 4);
  expect_compiles(k);
}

TEST(NvrtcCodegenTest, RowsKernelWithColumnSums) {
  // training-rewrites' LayerNorm backward: a row pass (two means) with dgamma and dbeta as
  // column sums, 2 x 700 = 1400 rows of 96: a warp per row, 175 blocks of 8 warps, each lane
  // summing its 3 columns in registers.
  Body b;
  ValueId dy = b.in("dy", DType::kBF16, {2, 700, 96}), g = b.in("gamma", DType::kF32, {96});
  ValueId xhat = b.in("xhat", DType::kF32, {2, 700, 96});
  ValueId rstd = b.in("rstd", DType::kF32, {2, 700, 1});
  const Attributes mean_last{{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}};
  const Attributes lead{{"axes", std::vector<int64_t>{0, 1}}};
  ValueId d = b.op(Op::kCast, {dy}, {{"dtype", DType::kF32}});
  ValueId dg = b.op(Op::kMul, {d, g});
  ValueId m1 = b.op(Op::kMean, {dg}, mean_last);
  ValueId m2 = b.op(Op::kMean, {b.op(Op::kMul, {dg, xhat})}, mean_last);
  ValueId centred = b.op(Op::kSub, {b.op(Op::kSub, {dg, m1}), b.op(Op::kMul, {xhat, m2})});
  ValueId dx = b.op(Op::kMul, {rstd, centred});
  ValueId dgamma = b.op(Op::kSum, {b.op(Op::kMul, {d, xhat})}, lead);
  ValueId dbeta = b.op(Op::kSum, {d}, lead);
  b.out({dx, dgamma, dbeta});
  std::string why;
  ASSERT_TRUE(cuda::can_generate(*b.g, FusedKind::kRows, &why)) << why;
  GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kRows);
  EXPECT_EQ(k.column_outputs, (std::vector<int>{1, 2}));
  // With column sums a block is 4 warps (a row each): 1400 rows in 350 blocks.
  EXPECT_EQ(k.threads, 128);
  EXPECT_EQ(k.blocks, 350);
  EXPECT_EQ(k.partial_tiles, 350);
  EXPECT_EQ(k.partials_bytes, size_t{2} * 350 * 96 * 4);
  EXPECT_EQ(k.finish_entry, "kiln_fused_columns_finish");
  EXPECT_EQ(k.finish_blocks, 3);
  // Each warp's sums in shared memory, [output][lane element][lane]: 2 outputs x 4 elements
  // (the 4-wide entry's; the scalar one has 3) x 32 lanes, for 4 warps.
  EXPECT_TRUE(contains(k.source, "__shared__ float kiln_col[1024LL];")) << k.source;
  EXPECT_TRUE(contains(k.source, "for (long long row = static_cast<long long>(blockIdx.x) * 4 + "
                                 "(threadIdx.x >> 5); row < 1400LL; row += 1400LL)"))
      << k.source;
  EXPECT_TRUE(contains(k.source, "kiln_cw[(0LL + m) * 32] += ")) << k.source;
  EXPECT_TRUE(contains(k.source, "kiln_cw[(4LL + m) * 32] += ")) << k.source;  // 4-wide entry
  EXPECT_TRUE(contains(k.scalar_source, "kiln_cw[(3LL + m) * 32] += ")) << k.scalar_source;
  EXPECT_TRUE(contains(k.source, "kiln_block_reduce<kThreads, 0>")) << k.source;
  // Rows of 96 (a multiple of 4): the entry takes 4 adjacent columns per lane and step, one
  // 16-byte access per input and output; the scalar entry (any alignment) one column per step,
  // in a source of its own (compiled only for unaligned pointers), with the finish kernel.
  EXPECT_EQ(k.vector_width, 4);
  EXPECT_EQ(k.scalar_entry, "kiln_fused_rows_scalar");
  EXPECT_EQ(k.scalar_blocks, 350);
  EXPECT_TRUE(contains(k.source, "kiln_o0.v[u] = ")) << k.source;
  EXPECT_TRUE(contains(k.source, "*reinterpret_cast<KilnPack<4, float>*>(out0 + base + j0) = "
                                 "kiln_o0;"))
      << k.source;
  EXPECT_TRUE(contains(k.scalar_source, "*reinterpret_cast<KilnPack<1, float>*>(out0 + base + "
                                        "j0) = kiln_o0;"))
      << k.scalar_source;
  EXPECT_FALSE(contains(k.source, "kiln_fused_rows_scalar")) << k.source;
  EXPECT_TRUE(contains(k.scalar_source, "kiln_fused_columns_finish")) << k.scalar_source;
  EXPECT_FALSE(contains(k.source, "atomic")) << k.source;
  expect_compiles(k);
  // 1400 rows of 3000 (over a warp's 1024): a block of 1024 threads per row, 1024 blocks
  // looping over the rows, the column sums in shared memory.
  Body wide;
  ValueId w = wide.in("w", DType::kF32, {1400, 3000});
  ValueId sw = wide.op(Op::kSoftmax, {w});
  wide.out({sw, wide.op(Op::kSum, {sw}, {{"axes", std::vector<int64_t>{0}}})});
  GeneratedKernel kw = cuda::generate_kernel(*wide.g, FusedKind::kRows);
  EXPECT_EQ(kw.threads, 1024);
  EXPECT_EQ(kw.blocks, 1024);
  EXPECT_EQ(kw.partial_tiles, 1024);
  EXPECT_TRUE(contains(kw.source, "for (long long row = blockIdx.x; row < 1400LL; row += 1024LL)"))
      << kw.source;
  EXPECT_TRUE(contains(kw.source, "kiln_col[0LL + j] += ")) << kw.source;
  expect_compiles(kw);
  // Fewer rows than a block's 4 warps: one block.
  Body small;
  ValueId x = small.in("x", DType::kF32, {3, 40});
  ValueId sm = small.op(Op::kSoftmax, {x});
  small.out({sm, small.op(Op::kSum, {sm}, {{"axes", std::vector<int64_t>{0}}})});
  GeneratedKernel ks = cuda::generate_kernel(*small.g, FusedKind::kRows);
  EXPECT_EQ(ks.blocks, 1);
  EXPECT_EQ(ks.column_outputs, std::vector<int>{1});
  expect_compiles(ks);
}

TEST(NvrtcCodegenTest, NormGradientsAreRowOpsWithColumnOutputs) {
  // layer_norm_grad and rms_norm_grad generate directly (dgamma, dbeta as column sums), with
  // GPT-2's residual add, bf16 copy and bias gradient after them.
  for (Op op : {Op::kLayerNormGrad, Op::kRmsNormGrad}) {
    SCOPED_TRACE(op_name(op));
    Body b;
    ValueId x = b.in("x", DType::kF32, {4, 256, 768}), g = b.in("gamma", DType::kF32, {768});
    ValueId dy = b.in("dy", DType::kF32, {4, 256, 768});
    ValueId res = b.in("res", DType::kF32, {4, 256, 768});
    std::vector<ValueId> grads = b.g->add_node(op, {x, g, dy});
    ValueId sum = b.op(Op::kAdd, {grads[0], res});
    std::vector<ValueId> outs = {sum, b.op(Op::kCast, {sum}, {{"dtype", DType::kBF16}}),
                                 b.op(Op::kSum, {sum}, {{"axes", std::vector<int64_t>{0, 1}}})};
    outs.insert(outs.end(), grads.begin() + 1, grads.end());
    b.out(outs);
    std::string why;
    ASSERT_TRUE(cuda::can_generate(*b.g, FusedKind::kRows, &why)) << why;
    GeneratedKernel k = cuda::generate_kernel(*b.g, FusedKind::kRows);
    EXPECT_EQ(k.column_outputs, op == Op::kLayerNormGrad ? (std::vector<int>{2, 3, 4})
                                                         : (std::vector<int>{2, 3}));
    EXPECT_EQ(k.rows, 1024);
    EXPECT_EQ(k.row_length, 768);
    EXPECT_EQ(k.blocks, 256);  // a warp per row, 4 to a block (column sums): 1024 / 4
    // 3 (2) column outputs x 24 elements per lane x 32 lanes x 4 warps, in shared memory.
    EXPECT_TRUE(contains(k.source, op == Op::kLayerNormGrad ? "__shared__ float kiln_col[9216LL];"
                                                            : "__shared__ float kiln_col[6144LL];"))
        << k.source;
    // LayerNorm: mean, then the variance and mean(g), then mean(g * x_hat): 3 passes + 1.
    if (op == Op::kLayerNormGrad) {
      EXPECT_TRUE(contains(k.source, "4 pass(es)")) << k.source;
    }
    expect_compiles(k);
  }
}

TEST(NvrtcCodegenTest, RefusesColumnReductionsItCannotGenerate) {
  std::string why;
  {
    // A column sum read inside the body (x - colsum(x)): complete only after the whole kernel.
    Body b;
    ValueId x = b.in("x", DType::kF32, {6, 32});
    ValueId s = b.op(Op::kSum, {x}, {{"axes", std::vector<int64_t>{0}}, {"keepdims", true}});
    b.out({b.op(Op::kSub, {x, s})});
    EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why));
    EXPECT_TRUE(contains(why, "column reduction's result")) << why;
  }
  {
    // Rows kernels keep column sums in 32 KiB of shared memory: 3 of 4096 f32 columns do not fit.
    Body b;
    ValueId x = b.in("x", DType::kF32, {4, 4096});
    ValueId sm = b.op(Op::kSoftmax, {x});
    const Attributes lead{{"axes", std::vector<int64_t>{0}}};
    b.out({b.op(Op::kSum, {sm}, lead), b.op(Op::kSum, {x}, lead),
           b.op(Op::kSum, {b.op(Op::kExp, {x})}, lead)});
    EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kRows, &why));
    EXPECT_TRUE(contains(why, "shared memory")) << why;
    EXPECT_TRUE(contains(why, "4096")) << why;
  }
  {
    // A middle-axis sum is neither a row nor a column reduction.
    Body b;
    ValueId x = b.in("x", DType::kF32, {6, 4, 32});
    b.out({b.op(Op::kSum, {x}, {{"axes", std::vector<int64_t>{1}}})});
    EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why));
  }
}

// ---- GEMM products with a cast to f32, addends, and generated epilogues ----

TEST(NvrtcCodegenTest, GemmCastToF32AndAddendMapOntoCublasLt) {
  std::string why;
  {
    // GPT-2's weight gradient under amp: x^T dy in bf16, cast to f32.
    Body b;
    ValueId x = b.in("x", DType::kBF16, {512, 256}), dy = b.in("dy", DType::kBF16, {512, 64});
    ValueId mm = b.op(Op::kMatmul, {x, dy}, {{"transpose_a", true}});
    b.out({b.op(Op::kCast, {mm}, {{"dtype", DType::kF32}})});
    ASSERT_TRUE(cuda::gemm_epilogue_supported(*b.g, &why)) << why;
    const std::string d = cuda::describe_gemm_epilogue(*b.g);
    EXPECT_TRUE(contains(d, "(m 256, n 64, k 512) transpose_a bf16->f32")) << d;
    EXPECT_FALSE(contains(d, "epilogue")) << d;
    EXPECT_TRUE(cuda::nvrtc_supports(*b.g, FusedKind::kGemmEpilogue));
  }
  {
    // ... plus the f32 gradient of the tied embedding (an addend of the product's shape: C).
    Body b;
    ValueId x = b.in("x", DType::kBF16, {512, 96}), dy = b.in("dy", DType::kBF16, {512, 64});
    ValueId other = b.in("other", DType::kF32, {96, 64});
    ValueId mm = b.op(Op::kMatmul, {x, dy}, {{"transpose_a", true}});
    b.out({b.op(Op::kAdd, {b.op(Op::kCast, {mm}, {{"dtype", DType::kF32}}), other})});
    ASSERT_TRUE(cuda::gemm_epilogue_supported(*b.g, &why)) << why;
  }
  {
    // Forward linear layer under amp: bf16 product, cast, f32 bias: the BIAS epilogue in f32.
    Body b;
    ValueId x = b.in("x", DType::kBF16, {8, 784}), w = b.in("w", DType::kBF16, {784, 256});
    ValueId bias = b.in("bias", DType::kF32, {256});
    ValueId mm = b.op(Op::kMatmul, {x, w});
    b.out({b.op(Op::kAdd, {b.op(Op::kCast, {mm}, {{"dtype", DType::kF32}}), bias})});
    ASSERT_TRUE(cuda::gemm_epilogue_supported(*b.g, &why)) << why;
    EXPECT_TRUE(contains(cuda::describe_gemm_epilogue(*b.g), "bf16->f32 epilogue bias"));
  }
  {
    // A bf16 bias after a cast to f32 is in neither dtype the epilogue takes.
    Body b;
    ValueId x = b.in("x", DType::kBF16, {8, 16}), w = b.in("w", DType::kBF16, {16, 32});
    ValueId bias = b.in("bias", DType::kBF16, {32});
    ValueId mm = b.op(Op::kMatmul, {x, w});
    ValueId c = b.op(Op::kCast, {mm}, {{"dtype", DType::kF32}});
    b.out({b.op(Op::kAdd, {c, b.op(Op::kCast, {bias}, {{"dtype", DType::kF32}})})});
    EXPECT_FALSE(cuda::gemm_epilogue_supported(*b.g, &why));
  }
}

TEST(NvrtcCodegenTest, GemmWithAnEpilogueCublasLtLacksRunsAsProductPlusGeneratedKernel) {
  std::string why;
  {
    // f16 amp's weight gradient: cast to f32, then two loss-scale multiplies.
    Body b;
    ValueId x = b.in("x", DType::kF16, {64, 48}), dy = b.in("dy", DType::kF16, {64, 40});
    ValueId s1 = b.in("s1", DType::kF32, {}), s2 = b.in("s2", DType::kF32, {});
    ValueId mm = b.op(Op::kMatmul, {x, dy}, {{"transpose_a", true}});
    ValueId c = b.op(Op::kCast, {mm}, {{"dtype", DType::kF32}});
    b.out({b.op(Op::kMul, {b.op(Op::kMul, {c, s1}), s2})});
    EXPECT_FALSE(cuda::gemm_epilogue_supported(*b.g, &why));
    EXPECT_TRUE(contains(why, "mul")) << why;
    ASSERT_TRUE(cuda::gemm_split_supported(*b.g, &why)) << why;
    EXPECT_TRUE(cuda::nvrtc_supports(*b.g, FusedKind::kGemmEpilogue, &why)) << why;
    const std::string listing = cuda::fused_kernel_listing(*b.g, FusedKind::kGemmEpilogue);
    EXPECT_TRUE(contains(listing, "runs as a cuBLASLt product into a scratch buffer")) << listing;
    // The product goes through scratch in its own 16 bits (the cast's f32 value is no output,
    // so the GEMM does not absorb it): the epilogue reads it as its last input, in4, and casts.
    EXPECT_TRUE(contains(listing, "(m 48, n 40, k 64) transpose_a f16->f16")) << listing;
    EXPECT_TRUE(contains(listing, "const __half* __restrict__ in4")) << listing;
    EXPECT_TRUE(contains(listing, "// ops: cast, mul, mul")) << listing;
    if (headers_available()) {
      EXPECT_NO_THROW(cuda::nvrtc_compile(listing, "sm_90a")) << listing;
    }
  }
  {
    // mlp under bf16 amp: dgelu in f32 with the bias gradient and a bf16 cast: the product,
    // then a column-sum kernel.
    Body b;
    ValueId dy = b.in("dy", DType::kBF16, {8, 10}), w = b.in("w", DType::kBF16, {256, 10});
    ValueId pre = b.in("pre", DType::kF32, {8, 256});
    ValueId mm = b.op(Op::kMatmul, {dy, w}, {{"transpose_b", true}});
    ValueId c = b.op(Op::kCast, {mm}, {{"dtype", DType::kF32}});
    ValueId dx = b.op(Op::kGeluGrad, {pre, c}, {{"approximate", std::string("tanh")}});
    ValueId db = b.op(Op::kSum, {dx}, {{"axes", std::vector<int64_t>{0}}});
    b.out({db, b.op(Op::kCast, {dx}, {{"dtype", DType::kBF16}})});
    EXPECT_FALSE(cuda::gemm_epilogue_supported(*b.g, &why));
    ASSERT_TRUE(cuda::gemm_split_supported(*b.g, &why)) << why;
    const std::string listing = cuda::fused_kernel_listing(*b.g, FusedKind::kGemmEpilogue);
    EXPECT_TRUE(contains(listing, "kiln_fused_columns_finish")) << listing;
    if (headers_available()) {
      EXPECT_NO_THROW(cuda::nvrtc_compile(listing, "sm_90a")) << listing;
    }
  }
  {
    // An epilogue with an op that has no emitter is refused both ways, with both reasons.
    Body b;
    ValueId x = b.in("x", DType::kF32, {8, 8}), w = b.in("w", DType::kF32, {8, 8});
    ValueId mm = b.op(Op::kMatmul, {x, w});
    b.out({b.op(Op::kMatmul, {mm, w})});
    EXPECT_FALSE(cuda::nvrtc_supports(*b.g, FusedKind::kGemmEpilogue, &why));
    EXPECT_TRUE(contains(why, "more than one matmul")) << why;
  }
}

// The dialect the CUDA registry picks for every fused node of gpt2-tiny's training graph: the
// fusion kinds nvrtc covers (elementwise, rows, gemm-epilogue) must never fall to cuda-body.
// supports() needs no GPU, so this runs on CPU-only machines.
void expect_no_cuda_body(const std::string& amp, bool training_rewrites) {
  SCOPED_TRACE("amp " + amp + (training_rewrites ? "" : ", training-rewrites disabled"));
  OptimizerConfig config;
  config.amp = amp;
  Graph graph = build_training_graph(models::by_name("gpt2-tiny", 2), config).graph;
  PassOptions options;
  if (!training_rewrites) options.disabled = {"training-rewrites"};
  default_pipeline(options).run(graph);
  int checked = 0, columns = 0, gemms = 0;
  for (const Node& node : graph.nodes) {
    if (node.op != Op::kFused || !node.body) continue;
    const FusedKind kind = fused_kind(node);
    if (!is_fusion_group(kind)) continue;
    std::vector<TensorType> in, out;
    for (ValueId id : node.inputs) in.push_back(graph.type(id));
    for (ValueId id : node.outputs) out.push_back(graph.type(id));
    const KernelImpl& impl =
        kernel_registry().select(NodeView{node, in, out}, Device::kCuda, {});
    std::string why;
    EXPECT_EQ(impl.dialect, "nvrtc")
        << fused_kind_name(kind) << " node " << node.body->name << ": "
        << (cuda::nvrtc_supports(*node.body, kind, &why) ? "" : why);
    ++checked;
    for (const Node& n : node.body->nodes) {
      if (n.op != Op::kSum) continue;
      const int rank = node.body->type(n.inputs[0]).rank();
      if (rank >= 2 && n.attrs.ints("axes").size() + 1 == static_cast<size_t>(rank)) ++columns;
    }
    gemms += kind == FusedKind::kGemmEpilogue;
  }
  // The graph has what the profile showed on cuda-body: column sums and GEMM epilogues. (Under
  // amp without training-rewrites the bias gradients are plain sums of 16-bit gradients: the
  // linear bias runs low, passes/mixed_precision.h.)
  EXPECT_GT(checked, 10);
  if (amp == "off" || training_rewrites) {
    EXPECT_GT(columns, 0);
  }
  EXPECT_GT(gemms, 0);
}

TEST(NvrtcCodegenTest, NoFusedNodeOfGpt2TinyTrainingFallsToCudaBody) {
  expect_no_cuda_body("bf16", true);
  expect_no_cuda_body("bf16", false);
  expect_no_cuda_body("off", true);
  expect_no_cuda_body("f16", true);
}

}  // namespace
}  // namespace kiln

#endif  // KILN_HAVE_CUDA
