// The "nvrtc" dialect (backends/cuda/nvrtc/{codegen,nvrtc}) on the GPU: fused nodes of several bodies
// against the fused reference kernel (ops/fused.cc: every op's reference kernel on whole
// tensors) on random inputs, outputs poisoned with 0xFF bytes first (an unwritten element reads
// as NaN). Bodies: every math line alone (ops/elementwise_math.h), elementwise chains with
// (N,), (R, 1), scalar and middle-axis broadcasts in f32/bf16/f16 (vector widths 8, 4, 2, 1),
// residual + layer_norm, softmax of a scaled input, cross-entropy rows (with ignored labels)
// and its gradient, a mean-centred row reduction, column reductions (bias gradients, LayerNorm
// dgamma/dbeta) in elementwise and rows kernels, and GEMM epilogues (bias, tanh gelu, gelu aux,
// dgelu + bias gradient, a bf16/f16 product cast to f32 with a bias or an addend) through
// cuBLASLt, and products followed by a generated epilogue.
//
// Tolerances (max_scaled_error <= 1): the generated kernels compute in f32 and round once per
// output; the reference computes each op in f64 and rounds every intermediate to its storage
// type. So f32: 1e-5 / 1e-4; f16: 4e-3 / 8e-3 and bf16: 3e-2 / 3e-2 (a chain's intermediates
// rounded by the reference and not by us differ by up to an ulp or two of the storage type:
// 2^-11 and 2^-8 relative). GEMMs: the same, f32 without TF32.
// Column sums of R terms: |got - want| <= rel * R * (bound on |term|) per column, rel = 1e-5 for
// f32 (blocked f32 accumulation: each term goes through at most ~150 additions, 2^-24 each),
// 2^-9 for f16 and 2^-7 for bf16 (the reference rounds each term to the storage type before
// summing and we do not, 2^-9 for bf16; both round the sum once, differently).
#include <cuda_runtime.h>

#include <cstring>

#include "backends/cuda/nvrtc/codegen.h"
#include "backends/cuda/cublaslt/cublaslt.h"
#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/runtime/memory.h"
#include "backends/cuda/nvrtc/nvrtc.h"
#include "gpu_test_util.h"
#include "ops/elementwise.h"

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

std::vector<Tensor> run_reference(const Body& b, FusedKind kind,
                                  const std::vector<Tensor>& inputs) {
  const Attributes attrs = fused_attrs(kind);
  std::vector<Tensor> outputs;
  for (ValueId id : b.g->outputs) outputs.emplace_back(b.g->type(id));
  op_def(Op::kFused).reference(KernelArgs{attrs, inputs, outputs, nullptr, b.g.get()});
  return outputs;
}

// A device tensor one element off 16-byte alignment (cudaMalloc's are 256-byte aligned): what
// sends a generated kernel to its scalar entry.
Tensor misaligned_device_tensor(const TensorType& t) {
  void* p = nullptr;
  KILN_CUDA_CHECK(cudaMalloc(&p, t.bytes() + 16));
  std::shared_ptr<std::byte[]> storage(static_cast<std::byte*>(p), [](std::byte* q) { cudaFree(q); });
  return Tensor(t, storage, dtype_size(t.dtype), Device::kCuda);
}

std::vector<Tensor> run_nvrtc(const Body& b, FusedKind kind,
                              const std::vector<Tensor>& inputs,
                              const std::string& dialect = "nvrtc", bool misaligned = false) {
  const Attributes attrs = fused_attrs(kind);
  std::vector<TensorType> in_types, out_types;
  for (const Tensor& t : inputs) in_types.push_back(t.type());
  for (ValueId id : b.g->outputs) out_types.push_back(b.g->type(id));
  Node node{Op::kFused, {}, {}, attrs, b.g};
  const KernelImpl& impl =
      kernel_registry().select(NodeView{node, in_types, out_types}, Device::kCuda, {dialect});
  EXPECT_EQ(impl.dialect, dialect);
  std::vector<Tensor> device_inputs, outputs;
  for (const Tensor& t : inputs) {
    if (!misaligned) {
      device_inputs.push_back(cuda::to_device(t));
      continue;
    }
    device_inputs.push_back(misaligned_device_tensor(t.type()));
    KILN_CUDA_CHECK(cudaMemcpy(device_inputs.back().raw(), t.raw(), t.bytes(), cudaMemcpyHostToDevice));
  }
  for (const TensorType& t : out_types) {
    outputs.push_back(misaligned ? misaligned_device_tensor(t) : cuda::device_tensor(t, /*zero=*/false));
    KILN_CUDA_CHECK(cudaMemset(outputs.back().raw(), 0xFF, std::max<size_t>(t.bytes(), 1)));
  }
  cuda::Stream stream;
  impl.kernel(KernelArgs{attrs, device_inputs, outputs, stream.handle(), b.g.get()});
  stream.synchronize();
  std::vector<Tensor> host;
  for (const Tensor& t : outputs) host.push_back(cuda::to_host(t));
  return host;
}

void expect_matches(const Body& b, FusedKind kind, const std::vector<Tensor>& inputs,
                    const std::string& what, bool misaligned = false) {
  SCOPED_TRACE(what);
  std::string why;
  if (kind != FusedKind::kGemmEpilogue) {
    ASSERT_TRUE(cuda::can_generate(*b.g, kind, &why)) << why;
  }
  const std::vector<Tensor> expected = run_reference(b, kind, inputs);
  const std::vector<Tensor> actual = run_nvrtc(b, kind, inputs, "nvrtc", misaligned);
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

// The cuda-body fallback (backends/cuda/nvrtc/fused_body.cc): a body nvrtc cannot generate (a column
// sum read inside the body), whose outputs include a body input passed through and one value
// listed twice, runs op by op on the GPU and matches the fused reference kernel.
TEST(NvrtcTest, CudaBodyFallbackRunsWhatNvrtcCannot) {
  KILN_REQUIRE_GPU();
  for (DType d : {DType::kF32, DType::kBF16}) {
    Body b;
    ValueId x = b.in("x", d, {300, 96}), dy = b.in("dy", d, {300, 96});
    ValueId dx = b.op(Op::kGeluGrad, {x, dy}, {{"approximate", std::string("tanh")}});
    ValueId db = b.op(Op::kSum, {dx}, {{"axes", std::vector<int64_t>{0}}, {"keepdims", true}});
    b.out({dx, b.op(Op::kSub, {dx, db}), x, dx});
    std::string why;
    EXPECT_FALSE(cuda::can_generate(*b.g, FusedKind::kElementwise, &why));
    const std::vector<Tensor> inputs = random_inputs(*b.g, 91);
    const std::vector<Tensor> expected = run_reference(b, FusedKind::kElementwise, inputs);
    const std::vector<Tensor> actual = run_nvrtc(b, FusedKind::kElementwise, inputs, "cuda-body");
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t i = 0; i < actual.size(); ++i) {
      // The column sum adds 300 rounded terms: 4x the elementwise tolerance.
      const Tolerance tol = tolerance(expected[i].dtype());
      EXPECT_LE(max_scaled_error(actual[i], expected[i], 4 * tol.atol, 4 * tol.rtol), 1.0)
          << dtype_name(d) << " output " << i;
    }
  }
}

// Every op that is a line of ops/elementwise_math.h (each form of gelu and gelu_grad), generated
// alone, against its reference kernel in f32 and bf16, on inputs in [-3, 3] (NaN where the line
// is undefined, in both): a new line is covered here without a line of this file.
TEST(NvrtcTest, EveryMathLineMatchesTheReference) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 500;
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    if (!ops::is_math_op(op)) continue;
    const bool has_forms = op == Op::kGelu || op == Op::kGeluGrad;
    for (const char* approximate : {"none", "tanh"}) {
      if (!has_forms && std::string(approximate) == "tanh") continue;
      const Attributes attrs =
          has_forms ? Attributes{{"approximate", std::string(approximate)}} : Attributes{};
      for (DType d : {DType::kF32, DType::kBF16}) {
        Body b;
        std::vector<ValueId> ins;
        std::vector<Tensor> inputs;
        for (int k = 0; k < op_info(op).min_inputs; ++k) {
          ins.push_back(b.in("x" + std::to_string(k), d, {5, 96}));
          inputs.push_back(rand(d, {5, 96}, ++seed, -3.0, 3.0));
        }
        b.out({b.op(op, ins, attrs)});
        expect_matches(b, FusedKind::kElementwise, inputs,
                       std::string(op_name(op)) + " " + approximate + " " +
                           std::string(dtype_name(d)));
      }
    }
  }
}

TEST(NvrtcTest, ElementwiseChainsWithBroadcasts) {
  KILN_REQUIRE_GPU();
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t n : {64, 66, 63, 1024}) {
      Body b = broadcast_chain(d, 37, n);
      expect_matches(b, FusedKind::kElementwise, random_inputs(*b.g, 10 + n),
                     fmt::format("{} n={}", dtype_name(d), n));
    }
  }
  // A large one: the grid-stride loop covers more elements than one wave of blocks.
  Body big = broadcast_chain(DType::kBF16, 4096, 3072);
  expect_matches(big, FusedKind::kElementwise, random_inputs(*big.g, 3), "bf16 4096 x 3072");
}

TEST(NvrtcTest, MiddleAxisBroadcastCastAndWhere) {
  KILN_REQUIRE_GPU();
  Body b;
  ValueId x = b.in("x", DType::kF32, {4, 9, 16}), y = b.in("y", DType::kF32, {4, 1, 16});
  ValueId p = b.op(Op::kMul, {x, y});
  ValueId c = b.op(Op::kCast, {b.op(Op::kSigmoid, {p})}, {{"dtype", DType::kBF16}});
  ValueId w = b.op(Op::kWhere, {b.op(Op::kGt, {x, y}), x, b.op(Op::kMaximum, {p, y})});
  b.out({c, w});
  expect_matches(b, FusedKind::kElementwise, random_inputs(*b.g, 5), "mul/cast/where");
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
      // Rows of 96 and 768 take the 4-wide entry when aligned, the scalar one when not.
      for (bool misaligned : {false, true})
        expect_matches(b, FusedKind::kRows, random_inputs(*b.g, 20 + n),
                       fmt::format("{} n={} misaligned {}", dtype_name(d), n, misaligned),
                       misaligned);
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
      expect_matches(b, FusedKind::kRows, random_inputs(*b.g, 30 + n),
                     fmt::format("softmax {} n={}", dtype_name(d), n));
    }
  }
  Body b;
  ValueId x = b.in("x", DType::kF32, {9, 300}), dy = b.in("dy", DType::kF32, {9, 300});
  ValueId m = b.op(Op::kMean, {x}, {{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}});
  ValueId c = b.op(Op::kSub, {x, m});
  ValueId s = b.op(Op::kMax, {c}, {{"axes", std::vector<int64_t>{1}}});
  b.out({b.op(Op::kLogSoftmaxGrad, {c, dy}), s, b.op(Op::kRmsNorm, {x, b.in("g", DType::kF32, {300})})});
  expect_matches(b, FusedKind::kRows, random_inputs(*b.g, 7), "mean/max/log_softmax_grad/rms_norm");
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
        expect_matches(b, FusedKind::kRows, {logits, labels},
                       fmt::format("cross_entropy {} V={}", dtype_name(d), vocab));
      }
      {
        Body b;
        ValueId x = b.in("logits", d, {3, 4, vocab}), l = b.in("labels", DType::kI64, {3, 4});
        ValueId dl = b.in("dloss", d, {});
        b.out({b.op(Op::kCrossEntropyGrad, {x, l, dl}, {{"reduction", std::string("sum")}})});
        expect_matches(b, FusedKind::kRows, {logits, labels, rand(d, {}, 9, 0.5, 2.0)},
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
      expect_matches(b, FusedKind::kGemmEpilogue, random_inputs(*b.g, 50 + variant),
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
    const std::vector<Tensor> expected = run_reference(b, FusedKind::kGemmEpilogue, inputs);
    const std::vector<Tensor> actual = run_nvrtc(b, FusedKind::kGemmEpilogue, inputs);
    EXPECT_LE(max_scaled_error(actual[0], expected[0], 3e-2, 3e-2), 1.0);
    EXPECT_LE(max_scaled_error(actual[1], expected[1], 1e-1, 3e-2), 1.0)
        << summarize(actual[1]) << " vs " << summarize(expected[1]);
  }
}

TEST(NvrtcTest, CompilesEachDistinctBodyOnce) {
  KILN_REQUIRE_GPU();
  Body a = broadcast_chain(DType::kF32, 5, 128);
  Body b = broadcast_chain(DType::kF32, 5, 128);  // equal body, another graph object
  expect_matches(a, FusedKind::kElementwise, random_inputs(*a.g, 1), "first");
  const size_t after_first = cuda::nvrtc_cache_size();
  expect_matches(b, FusedKind::kElementwise, random_inputs(*b.g, 2), "same body again");
  EXPECT_EQ(cuda::nvrtc_cache_size(), after_first);
  Body c = broadcast_chain(DType::kF32, 5, 256);  // another shape: another kernel
  expect_matches(c, FusedKind::kElementwise, random_inputs(*c.g, 3), "another shape");
  EXPECT_EQ(cuda::nvrtc_cache_size(), after_first + 1);
}

// ---- column reductions ----

// Column outputs (listed in `columns`) within rel * rows * term_bound of the reference; every
// other output within the per-dtype elementwise tolerance.
void expect_columns_match(const Body& b, FusedKind kind, const std::vector<Tensor>& inputs,
                          const std::vector<int>& columns, int64_t rows, double term_bound,
                          DType compute, const std::string& what, bool misaligned = false) {
  SCOPED_TRACE(what);
  std::string why;
  ASSERT_TRUE(cuda::can_generate(*b.g, kind, &why)) << why;
  EXPECT_EQ(cuda::generate_kernel(*b.g, kind).column_outputs, columns);
  const std::vector<Tensor> expected = run_reference(b, kind, inputs);
  const std::vector<Tensor> actual = run_nvrtc(b, kind, inputs, "nvrtc", misaligned);
  ASSERT_EQ(actual.size(), expected.size());
  const double rel =
      compute == DType::kBF16 ? 1.0 / 128 : compute == DType::kF16 ? 1.0 / 512 : 1e-5;
  for (size_t i = 0; i < actual.size(); ++i) {
    const bool column =
        std::find(columns.begin(), columns.end(), static_cast<int>(i)) != columns.end();
    const Tolerance tol = tolerance(expected[i].dtype());
    const double err =
        column ? max_scaled_error(actual[i], expected[i],
                                  rel * static_cast<double>(rows) * term_bound, 0.0)
               : max_scaled_error(actual[i], expected[i], tol.atol, tol.rtol);
    EXPECT_LE(err, 1.0) << "output " << i << (column ? " (column sum)" : "") << ": "
                        << summarize(actual[i]) << " vs expected " << summarize(expected[i]);
  }
}

// dx = gelu_grad(x, dy) and its bias gradient db = sum over the leading axes, in one dtype; or,
// as GPT-2 under bf16 amp, dy cast from bf16 to f32 first and dx cast back to bf16.
Body gelu_grad_bias(DType d, Shape shape, bool amp) {
  Body b;
  std::vector<int64_t> axes;
  for (size_t k = 0; k + 1 < shape.size(); ++k) axes.push_back(static_cast<int64_t>(k));
  ValueId dy = b.in("dy", amp ? DType::kBF16 : d, shape), x = b.in("x", d, shape);
  if (amp) dy = b.op(Op::kCast, {dy}, {{"dtype", DType::kF32}});
  ValueId dx = b.op(Op::kGeluGrad, {x, dy}, {{"approximate", std::string("tanh")}});
  ValueId db = b.op(Op::kSum, {dx}, {{"axes", axes}});
  if (amp) dx = b.op(Op::kCast, {dx}, {{"dtype", DType::kBF16}});
  return b.out({db, dx});
}

TEST(NvrtcTest, ColumnSumsInElementwiseKernels) {
  KILN_REQUIRE_GPU();
  // |gelu'| <= 1.13 and |dy| <= 1: every term is below 1.2.
  const std::vector<Shape> shapes = {{300, 96}, {37, 33}, {3, 50, 3072}, {1000, 64}, {5, 8},
                                     {2, 129, 200}};
  for (const Shape& shape : shapes) {
    const int64_t rows = numel(shape) / shape.back();
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
      Body b = gelu_grad_bias(d, shape, false);
      expect_columns_match(b, FusedKind::kElementwise, random_inputs(*b.g, 70 + rows), {0}, rows, 1.2, d,
                           fmt::format("{} {}", dtype_name(d), to_string(shape)));
    }
    Body amp = gelu_grad_bias(DType::kF32, shape, true);
    expect_columns_match(amp, FusedKind::kElementwise, random_inputs(*amp.g, 80 + rows), {0}, rows, 1.2,
                         DType::kF32, fmt::format("bf16 amp {}", to_string(shape)));
  }
  {
    // Only column outputs: a sum of x * w (w a row) and a keepdims mean (|x| <= 1).
    Body b;
    ValueId x = b.in("x", DType::kF32, {6, 51, 40}), w = b.in("w", DType::kF32, {40});
    ValueId s = b.op(Op::kSum, {b.op(Op::kMul, {x, w})}, {{"axes", std::vector<int64_t>{0, 1}}});
    ValueId m = b.op(Op::kMean, {x}, {{"axes", std::vector<int64_t>{0, 1}}, {"keepdims", true}});
    b.out({s, m});
    expect_columns_match(b, FusedKind::kElementwise, random_inputs(*b.g, 90), {0, 1}, 306, 1.0,
                         DType::kF32, "sum and mean");
  }
}

TEST(NvrtcTest, ColumnSumsAreDeterministicAndAlignmentIndependent) {
  KILN_REQUIRE_GPU();
  // The same inputs twice, and once through pointers one element off 16-byte alignment (the
  // scalar entry, same geometry): bit-equal column sums.
  Body b = gelu_grad_bias(DType::kF32, {700, 96}, false);
  const std::vector<Tensor> inputs = random_inputs(*b.g, 5);
  const std::vector<Tensor> first = run_nvrtc(b, FusedKind::kElementwise, inputs);
  const std::vector<Tensor> second = run_nvrtc(b, FusedKind::kElementwise, inputs);
  ASSERT_EQ(first[0].bytes(), second[0].bytes());
  EXPECT_EQ(std::memcmp(first[0].raw(), second[0].raw(), first[0].bytes()), 0);
  // Misaligned copies: allocate one element more and view from element 1.
  std::vector<Tensor> device_inputs, outputs;
  auto misaligned = [](const TensorType& t) { return misaligned_device_tensor(t); };
  for (const Tensor& t : inputs) {
    Tensor d = misaligned(t.type());
    KILN_CUDA_CHECK(cudaMemcpy(d.raw(), t.raw(), t.bytes(), cudaMemcpyHostToDevice));
    device_inputs.push_back(d);
  }
  for (ValueId id : b.g->outputs) outputs.push_back(misaligned(b.g->type(id)));
  const Attributes attrs = fused_attrs(FusedKind::kElementwise);
  cuda::Stream stream;
  cuda::launch_generated(cuda::generate_kernel(*b.g, FusedKind::kElementwise),
                         KernelArgs{attrs, device_inputs, outputs, stream.handle(), b.g.get()});
  stream.synchronize();
  const Tensor third = cuda::to_host(outputs[0]), dx = cuda::to_host(outputs[1]);
  EXPECT_EQ(std::memcmp(first[0].raw(), third.raw(), first[0].bytes()), 0);
  EXPECT_EQ(std::memcmp(first[1].raw(), dx.raw(), first[1].bytes()), 0);
}

// training-rewrites' LayerNorm backward: dx from two row means, dgamma = sum(dy * xhat) and
// dbeta = sum(dy) over the rows, with the residual gradient added.
Body layer_norm_backward(DType dy_type, Shape shape) {
  Body b;
  const int64_t c = shape.back();
  Shape col = shape;
  col.back() = 1;
  ValueId dy = b.in("dy", dy_type, shape), g = b.in("gamma", DType::kF32, {c});
  ValueId xhat = b.in("xhat", DType::kF32, shape), rstd = b.in("rstd", DType::kF32, col);
  ValueId res = b.in("res", DType::kF32, shape);
  const Attributes mean_last{{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}};
  std::vector<int64_t> lead;
  for (size_t k = 0; k + 1 < shape.size(); ++k) lead.push_back(static_cast<int64_t>(k));
  ValueId d = dy_type == DType::kF32 ? dy : b.op(Op::kCast, {dy}, {{"dtype", DType::kF32}});
  ValueId dg = b.op(Op::kMul, {d, g});
  ValueId m1 = b.op(Op::kMean, {dg}, mean_last);
  ValueId m2 = b.op(Op::kMean, {b.op(Op::kMul, {dg, xhat})}, mean_last);
  ValueId dx = b.op(Op::kMul,
                    {rstd, b.op(Op::kSub, {b.op(Op::kSub, {dg, m1}), b.op(Op::kMul, {xhat, m2})})});
  ValueId dgamma = b.op(Op::kSum, {b.op(Op::kMul, {d, xhat})}, {{"axes", lead}});
  ValueId dbeta = b.op(Op::kSum, {d}, {{"axes", lead}});
  return b.out({dgamma, dbeta, b.op(Op::kAdd, {res, dx})});
}

TEST(NvrtcTest, ColumnSumsInRowsKernels) {
  KILN_REQUIRE_GPU();
  // Terms dy * xhat and dy: |.| <= 1. 1400 and 2100 rows loop over the 1024-block grid.
  for (const Shape& shape : {Shape{2, 700, 96}, Shape{3, 5, 33}, Shape{2100, 768}, Shape{7, 1000}})
    for (DType d : {DType::kF32, DType::kBF16}) {
      Body b = layer_norm_backward(d, shape);
      expect_columns_match(b, FusedKind::kRows, random_inputs(*b.g, 30), {0, 1},
                           numel(shape) / shape.back(), 1.0, DType::kF32,
                           fmt::format("dy {} {}", dtype_name(d), to_string(shape)));
    }
  // The mlp's softmax-gradient rows under amp: a column sum (bias gradient) next to a row op.
  Body b;
  ValueId logits = b.in("logits", DType::kF32, {45, 10});
  ValueId onehot = b.in("onehot", DType::kF32, {45, 10});
  ValueId g = b.op(Op::kSub, {b.op(Op::kSoftmax, {logits}), onehot});
  b.out({b.op(Op::kSum, {g}, {{"axes", std::vector<int64_t>{0}}}),
         b.op(Op::kCast, {g}, {{"dtype", DType::kBF16}})});
  expect_columns_match(b, FusedKind::kRows, random_inputs(*b.g, 31), {0}, 45, 2.0, DType::kF32, "softmax");
}

// The norm gradient ops themselves (not decomposed: training-rewrites off, as on CUDA), with
// GPT-2's backward around them: the residual gradient added, a bf16 copy for the next GEMMs
// and the bias gradient of the sum. Outputs: sum, copy, bias gradient, then dgamma (, dbeta).
Body norm_grad_backward(Op op, Shape shape) {
  Body b;
  const int64_t c = shape.back();
  std::vector<int64_t> lead;
  for (size_t k = 0; k + 1 < shape.size(); ++k) lead.push_back(static_cast<int64_t>(k));
  ValueId x = b.in("x", DType::kF32, shape), g = b.in("gamma", DType::kF32, {c});
  ValueId dy = b.in("dy", DType::kF32, shape), res = b.in("res", DType::kF32, shape);
  std::vector<ValueId> grads = b.g->add_node(op, {x, g, dy});
  ValueId sum = b.op(Op::kAdd, {grads[0], res});
  std::vector<ValueId> outs = {sum, b.op(Op::kCast, {sum}, {{"dtype", DType::kBF16}}),
                               b.op(Op::kSum, {sum}, {{"axes", lead}})};
  outs.insert(outs.end(), grads.begin() + 1, grads.end());
  return std::move(b.out(outs));
}

TEST(NvrtcTest, NormGradientsInRowsKernels) {
  KILN_REQUIRE_GPU();
  // Inputs in [-1, 1): |x_hat| stays below ~2 for these rows, so every column term (dy * x_hat,
  // dy, the sum's entries up to ~|g| + |res|) is within 4. 2100 rows loop over the grid.
  for (Op op : {Op::kLayerNormGrad, Op::kRmsNormGrad})
    for (const Shape& shape : {Shape{2100, 768}, Shape{3, 5, 33}, Shape{2, 700, 96}}) {
      Body b = norm_grad_backward(op, shape);
      const std::vector<int> columns =
          op == Op::kLayerNormGrad ? std::vector<int>{2, 3, 4} : std::vector<int>{2, 3};
      for (bool misaligned : {false, true})
        expect_columns_match(b, FusedKind::kRows, random_inputs(*b.g, 40), columns,
                             numel(shape) / shape.back(), 4.0, DType::kF32,
                             fmt::format("{} {} misaligned {}", op_name(op), to_string(shape),
                                         misaligned),
                             misaligned);
    }
}

// ---- GEMM-epilogue bodies beyond the cuBLASLt epilogues of one dtype ----

// Output i within tols[i] (or tols[0] for all) of the fused reference.
void expect_gemm_close(const Body& b, const std::vector<Tensor>& inputs,
                       const std::vector<Tolerance>& tols, bool split, const std::string& what) {
  SCOPED_TRACE(what + ": " + cuda::fused_kernel_listing(*b.g, FusedKind::kGemmEpilogue).substr(0, 400));
  std::string why;
  if (split) {
    EXPECT_FALSE(cuda::gemm_epilogue_supported(*b.g));
    ASSERT_TRUE(cuda::gemm_split_supported(*b.g, &why)) << why;
  } else {
    ASSERT_TRUE(cuda::gemm_epilogue_supported(*b.g, &why)) << why;
  }
  const std::vector<Tensor> expected = run_reference(b, FusedKind::kGemmEpilogue, inputs);
  const std::vector<Tensor> actual = run_nvrtc(b, FusedKind::kGemmEpilogue, inputs);
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i)
    EXPECT_LE(max_scaled_error(actual[i], expected[i], tols[tols.size() == 1 ? 0 : i].atol,
                               tols[tols.size() == 1 ? 0 : i].rtol),
              1.0)
        << "output " << i << ": " << summarize(actual[i]) << " vs expected "
        << summarize(expected[i]);
}

TEST(NvrtcTest, GemmCastToF32BiasAndAddend) {
  KILN_REQUIRE_GPU();
  cuda::set_matmul_allow_tf32(false);
  // The reference rounds the 16-bit product before the cast; cuBLASLt writes the f32
  // accumulator: they differ by the product's rounding (2^-9 bf16, 2^-12 f16 relative), and the
  // values are sums of k products of |.| <= 1: atol k * 2^-9 / 4 covers cancellation.
  for (DType d : {DType::kBF16, DType::kF16}) {
    const double rel = d == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048;
    for (int variant = 0; variant < 3; ++variant) {
      // 0: weight gradient x^T dy; 1: + an f32 addend (C); 2: forward x w + an f32 bias.
      Body b;
      const int64_t k = variant == 2 ? 72 : 150;
      ValueId x = variant == 2 ? b.in("x", d, {3, 11, k}) : b.in("x", d, {k, 40});
      ValueId w = variant == 2 ? b.in("w", d, {k, 56}) : b.in("dy", d, {k, 24});
      ValueId mm = b.op(Op::kMatmul, {x, w}, {{"transpose_a", variant != 2}});
      ValueId out = b.op(Op::kCast, {mm}, {{"dtype", DType::kF32}});
      if (variant == 1) out = b.op(Op::kAdd, {b.in("other", DType::kF32, {40, 24}), out});
      if (variant == 2) out = b.op(Op::kAdd, {out, b.in("bias", DType::kF32, {56})});
      b.out({out});
      expect_gemm_close(b, random_inputs(*b.g, 200 + variant), {{rel * k / 4, rel}}, false,
                        fmt::format("{} variant {}: {}", dtype_name(d), variant,
                                    cuda::describe_gemm_epilogue(*b.g)));
    }
  }
  // f32: the tied embedding's gradient, product + addend in one GEMM (beta 1).
  Body b;
  ValueId x = b.in("x", DType::kF32, {64, 40}), dy = b.in("dy", DType::kF32, {64, 33});
  ValueId mm = b.op(Op::kMatmul, {x, dy}, {{"transpose_a", true}});
  b.out({b.op(Op::kAdd, {mm, b.in("other", DType::kF32, {40, 33})})});
  expect_gemm_close(b, random_inputs(*b.g, 210), {{1e-5, 1e-4}}, false, "f32 addend");
}

TEST(NvrtcTest, GemmWithAGeneratedEpilogue) {
  KILN_REQUIRE_GPU();
  cuda::set_matmul_allow_tf32(false);
  {
    // f16 amp's weight gradient: cast to f32, then the loss-scale multiplies.
    Body b;
    ValueId x = b.in("x", DType::kF16, {96, 48}), dy = b.in("dy", DType::kF16, {96, 40});
    ValueId s1 = b.in("s1", DType::kF32, {}), s2 = b.in("s2", DType::kF32, {});
    ValueId mm = b.op(Op::kMatmul, {x, dy}, {{"transpose_a", true}});
    ValueId c = b.op(Op::kCast, {mm}, {{"dtype", DType::kF32}});
    b.out({b.op(Op::kMul, {b.op(Op::kMul, {c, s1}), s2})});
    expect_gemm_close(b, random_inputs(*b.g, 220), {{96.0 / 2048 / 4, 1.0 / 2048}}, true,
                      "f16 scaled");
  }
  {
    // mlp's backward under bf16 amp: dgelu in f32, its bias gradient, a bf16 copy; 37 rows.
    Body b;
    ValueId dy = b.in("dy", DType::kBF16, {37, 10}), w = b.in("w", DType::kBF16, {72, 10});
    ValueId pre = b.in("pre", DType::kF32, {37, 72});
    ValueId mm = b.op(Op::kMatmul, {dy, w}, {{"transpose_b", true}});
    ValueId c = b.op(Op::kCast, {mm}, {{"dtype", DType::kF32}});
    ValueId dx = b.op(Op::kGeluGrad, {pre, c}, {{"approximate", std::string("tanh")}});
    b.out({b.op(Op::kSum, {dx}, {{"axes", std::vector<int64_t>{0}}}),
           b.op(Op::kCast, {dx}, {{"dtype", DType::kBF16}})});
    // |dx| <= 1.13 * 10 (k = 10 products of |.| <= 1): db sums 37 terms off by up to 2^-8
    // relative; dx differs by the product's rounding and its own (2^-9 each, relative).
    expect_gemm_close(b, random_inputs(*b.g, 221), {{37 * 11.3 / 256, 0.0}, {1e-2, 3e-2}}, true,
                      "mlp dgelu");
  }
  {
    // GPT-2's backward under bf16 amp at a LayerNorm: the input gradient of the next projection
    // (a bf16 GEMM cast to f32) is the norm gradient's dy; then the residual add, the bf16 copy
    // and the bias gradient: one product and one generated rows kernel.
    Body b;
    const int64_t rows = 300, c = 64, k = 48;
    ValueId dz = b.in("dz", DType::kBF16, {3, rows / 3, k}), w = b.in("w", DType::kBF16, {c, k});
    ValueId x = b.in("x", DType::kF32, {3, rows / 3, c}), g = b.in("gamma", DType::kF32, {c});
    ValueId res = b.in("res", DType::kF32, {3, rows / 3, c});
    ValueId dy = b.op(Op::kCast, {b.op(Op::kMatmul, {dz, w}, {{"transpose_b", true}})},
                      {{"dtype", DType::kF32}});
    std::vector<ValueId> grads = b.g->add_node(Op::kLayerNormGrad, {x, g, dy});
    ValueId sum = b.op(Op::kAdd, {grads[0], res});
    b.out({sum, b.op(Op::kCast, {sum}, {{"dtype", DType::kBF16}}),
           b.op(Op::kSum, {sum}, {{"axes", std::vector<int64_t>{0, 1}}}), grads[1], grads[2]});
    // dy is a sum of k = 48 products of |.| <= 1 (|dy| <= 48), off by its bf16 rounding in the
    // reference (2^-9 relative); dx is linear in dy with rstd ~ 1.7 (x uniform in [-1, 1)) times
    // |gamma| <= 1 times at most ~4 (the three terms): within 2^-9 * 48 * 8; column sums of 300
    // such rows.
    const double dx_tol = 48.0 / 512 * 8;
    expect_gemm_close(b, random_inputs(*b.g, 223),
                      {{dx_tol, 1e-3}, {dx_tol, 1.0 / 128}, {rows * dx_tol, 0.0},
                       {rows * dx_tol * 2, 0.0}, {rows * dx_tol, 0.0}},
                      true, "gpt2 layer norm backward");
  }
  {
    // f32: the product is an output itself (written in place, read back by the epilogue) and
    // its column sum and exp are others.
    Body b;
    ValueId x = b.in("x", DType::kF32, {2, 45, 24}), w = b.in("w", DType::kF32, {24, 19});
    ValueId mm = b.op(Op::kMatmul, {x, w});
    b.out({b.op(Op::kExp, {mm}), mm, b.op(Op::kSum, {mm}, {{"axes", std::vector<int64_t>{0, 1}}})});
    // exp of sums of 24 products: |mm| <= 24; the column sum adds 90 rows of them.
    expect_gemm_close(b, random_inputs(*b.g, 222),
                      {{1e-5, 1e-4}, {1e-5, 1e-4}, {90 * 24 * 1e-6, 0.0}}, true, "f32 exp");
  }
}

// Padded rows (passes/ones_column.h): a LayerNorm rows kernel storing concat(y, ones) along
// the last axis, rows of n + pad; the outputs are poisoned first, so an unwritten pad column
// reads as NaN. Warp rows (64, 768: the 4-wide entry, and the scalar one when misaligned) and a
// block per row (2500).
TEST(NvrtcTest, PaddedRowsOfALayerNorm) {
  KILN_REQUIRE_GPU();
  for (DType d : {DType::kF32, DType::kBF16}) {
    for (int64_t n : {64, 768, 2500}) {
      const int64_t pad = d == DType::kF32 ? 4 : 8;
      Body b;
      ValueId x = b.in("x", DType::kF32, {3, 7, n}), r = b.in("res", DType::kF32, {3, 7, n});
      ValueId g = b.in("gamma", DType::kF32, {n}), be = b.in("beta", DType::kF32, {n});
      ValueId h = b.op(Op::kAdd, {x, r});
      ValueId y = b.op(Op::kCast, {b.op(Op::kLayerNorm, {h, g, be})}, {{"dtype", d}});
      ValueId ones = b.op(Op::kFull, {}, {{"value", 1.0}, {"dtype", d},
                                          {"shape", std::vector<int64_t>{3, 7, pad}}});
      b.out({h, b.op(Op::kConcat, {y, ones}, {{"axis", int64_t{-1}}})});
      for (bool misaligned : {false, true})
        expect_matches(b, FusedKind::kRows, random_inputs(*b.g, 30 + n),
                       fmt::format("{} n={} misaligned {}", dtype_name(d), n, misaligned),
                       misaligned);
    }
  }
}

// A GEMM reading its A through a prefix slice of a padded activation: cuBLASLt with lda the
// padded row length, with its own epilogue (bias, gelu with aux) and with a generated rows
// epilogue after the product (a LayerNorm). Poisoned pad columns (NaN) would spoil every output
// if they were read.
TEST(NvrtcTest, GemmReadsAPrefixSliceOfItsA) {
  KILN_REQUIRE_GPU();
  cuda::set_matmul_allow_tf32(false);
  for (DType d : {DType::kF32, DType::kBF16}) {
    const int64_t k = 40, pad = d == DType::kF32 ? 4 : 8;
    for (int variant = 0; variant < 3; ++variant) {
      Body b;
      ValueId xp = b.in("xp", d, {2, 24, k + pad}), w = b.in("w", d, {k, 64}),
              bias = b.in("bias", d, {64});
      ValueId x = b.op(Op::kSlice, {xp}, {{"starts", std::vector<int64_t>{0, 0, 0}},
                                          {"ends", std::vector<int64_t>{2, 24, k}}});
      ValueId pre = b.op(Op::kAdd, {b.op(Op::kMatmul, {x, w}), bias});
      if (variant == 0) {
        b.out({pre});
      } else if (variant == 1) {
        b.out({b.op(Op::kGelu, {pre}, {{"approximate", std::string("tanh")}}), pre});
      } else {
        ValueId g = b.in("gamma", d, {64}), be = b.in("beta", d, {64});
        b.out({b.op(Op::kLayerNorm, {pre, g, be})});
      }
      std::string why;
      if (variant < 2) {
        ASSERT_TRUE(cuda::gemm_epilogue_supported(*b.g, &why)) << why;
      } else {
        ASSERT_TRUE(cuda::gemm_split_supported(*b.g, &why)) << why;
      }
      std::vector<Tensor> inputs = random_inputs(*b.g, 70 + variant);
      // The pad columns NaN: a product that read them would be NaN.
      for (int64_t i = 0; i < inputs[0].numel(); ++i)
        if (i % (k + pad) >= k) inputs[0].set(i, std::nan(""));
      // The reference slices first, so it never sees them either.
      expect_matches(b, FusedKind::kGemmEpilogue, inputs,
                     fmt::format("{} variant {}", dtype_name(d), variant));
    }
  }
}

}  // namespace
}  // namespace kiln
