// The "cuda-nn" dialect (backends/cuda/nn/nn.{cu,cc}) against the CPU reference kernels: every op,
// f32/bf16/f16, row lengths that take the warp path (<= 1024), the block path, odd lengths
// (rows that start misaligned, so the scalar head/tail is exercised) and a misaligned view
// (the scalar fallback). Outputs are poisoned with 0xFF bytes first, so an unwritten element
// shows as NaN. Data errors (bad gather/scatter_add index, bad label): the documented output
// and kiln::cuda::check_device_errors() throwing. (GB/s at GPT-2 sizes: bench/gpu_memory_bench.cc.)
//
// Tolerances (max_scaled_error <= 1 with atol, rtol): the kernels compute in f32 and round once
// to the storage type; the reference computes in f64 and rounds once. So f32: 1e-5/1e-4 (f32
// accumulation over up to 50257 terms); f16: 2e-3/4e-3 (1 ulp = 2^-11 relative, plus f32 error
// amplified by the cancellations in the grads); bf16: 1.6e-2/1.6e-2 (1 ulp = 2^-8 relative; the
// two roundings may land one ulp apart).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/runtime/device_errors.h"
#include "backends/cuda/runtime/memory.h"
#include "gpu_test_util.h"

namespace kiln {
namespace {


using testing::rand;

struct Tolerance {
  double atol, rtol;
};
Tolerance tolerance(DType d) {
  switch (d) {
    case DType::kF16:
      return {2e-3, 4e-3};
    case DType::kBF16:
      return {1.6e-2, 1.6e-2};
    default:
      return {1e-5, 1e-4};
  }
}

constexpr DType kFloatTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// Runs `op` through `dialect` (it must be the one chosen) on device copies of `inputs`;
// outputs poisoned with 0xFF first; returns them on the host. Leaves the device error slots
// alone (the data-error tests look at the outputs, then at the error).
std::vector<Tensor> run_unchecked(Op op, const std::vector<Tensor>& inputs, Attributes attrs = {},
                                  std::vector<Tensor> device_inputs = {},
                                  const std::string& dialect = "cuda-nn") {
  attrs = normalize_attributes(op, std::move(attrs));
  std::vector<TensorType> in_types;
  for (const Tensor& t : inputs) in_types.push_back(t.type());
  const std::vector<TensorType> out_types = infer_types(op, in_types, attrs);
  Node node{op, {}, {}, attrs, nullptr};
  const KernelImpl& impl =
      kernel_registry().select(NodeView{node, in_types, out_types}, Device::kCuda, {dialect});
  EXPECT_EQ(impl.dialect, dialect);
  if (device_inputs.empty())
    for (const Tensor& t : inputs) device_inputs.push_back(cuda::to_device(t));
  std::vector<Tensor> outputs;
  for (const TensorType& t : out_types) {
    outputs.push_back(cuda::device_tensor(t, /*zero=*/false));
    KILN_CUDA_CHECK(cudaMemset(outputs.back().raw(), 0xFF, std::max<size_t>(t.bytes(), 1)));
  }
  cuda::Stream stream;
  impl.kernel(KernelArgs{attrs, device_inputs, outputs, stream.handle()});
  stream.synchronize();
  std::vector<Tensor> host;
  for (const Tensor& t : outputs) host.push_back(cuda::to_host(t));
  return host;
}

// The same through "cuda-nn", then the device error check (throws kiln::Error on a data error).
std::vector<Tensor> run_cuda_nn(Op op, const std::vector<Tensor>& inputs, Attributes attrs = {},
                                std::vector<Tensor> device_inputs = {}) {
  std::vector<Tensor> host = run_unchecked(op, inputs, std::move(attrs), std::move(device_inputs));
  cuda::check_device_errors();
  return host;
}

// Every output of the dialect matches the reference within the tolerance of `dtype`.
void expect_matches(Op op, const std::vector<Tensor>& inputs, Attributes attrs, DType dtype,
                    const std::string& what) {
  SCOPED_TRACE(what);
  const std::vector<Tensor> expected = testing::run_reference(op, inputs, attrs);
  const std::vector<Tensor> actual = run_cuda_nn(op, inputs, attrs);
  ASSERT_EQ(actual.size(), expected.size());
  const Tolerance tol = tolerance(dtype);
  for (size_t i = 0; i < actual.size(); ++i) {
    const double err = max_scaled_error(actual[i], expected[i], tol.atol, tol.rtol);
    EXPECT_LE(err, 1.0) << "output " << i << ": " << summarize(actual[i]) << " vs expected "
                        << summarize(expected[i]);
  }
}

std::string label(DType d, int64_t rows, int64_t cols) {
  return fmt::format("{} rows {} cols {}", dtype_name(d), rows, cols);
}

// (rows, cols): warp path, block path, odd lengths, a single element.
const std::vector<std::pair<int64_t, int64_t>> kRowShapes = {
    {1, 1}, {3, 7}, {67, 768}, {5, 1000}, {9, 1025}, {4, 4099}, {2, 50257}};

TEST(CudaNn, LayerNorm) {
  KILN_REQUIRE_GPU();
  for (DType d : kFloatTypes) {
    for (auto [rows, cols] : kRowShapes) {
      Tensor x = rand(d, {rows, cols}, 1, -2.0, 3.0);
      Tensor gamma = rand(d, {cols}, 2, 0.5, 1.5), beta = rand(d, {cols}, 3);
      expect_matches(Op::kLayerNorm, {x, gamma, beta}, {}, d, label(d, rows, cols));
    }
  }
  // Rank 3 and a non-default epsilon.
  Tensor x = rand(DType::kF32, {2, 3, 64}, 4);
  expect_matches(Op::kLayerNorm, {x, rand(DType::kF32, {64}, 5), rand(DType::kF32, {64}, 6)},
                 {{"epsilon", 1e-2}}, DType::kF32, "rank 3, epsilon 1e-2");
}

TEST(CudaNn, LayerNormGrad) {
  KILN_REQUIRE_GPU();
  std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},    {3, 7},    {67, 768}, {9, 1025},
                                                     {4, 4099}, {3, 6144}, {3000, 64}};
  for (DType d : kFloatTypes) {
    for (auto [rows, cols] : shapes) {
      Tensor x = rand(d, {rows, cols}, 11, -2.0, 3.0);
      Tensor gamma = rand(d, {cols}, 12, 0.5, 1.5), dy = rand(d, {rows, cols}, 13);
      expect_matches(Op::kLayerNormGrad, {x, gamma, dy}, {}, d, label(d, rows, cols));
    }
  }
}

TEST(CudaNn, LayerNormGradIsDeterministic) {
  KILN_REQUIRE_GPU();
  Tensor x = rand(DType::kF32, {4000, 768}, 14), gamma = rand(DType::kF32, {768}, 15);
  Tensor dy = rand(DType::kF32, {4000, 768}, 16);
  auto a = run_cuda_nn(Op::kLayerNormGrad, {x, gamma, dy});
  auto b = run_cuda_nn(Op::kLayerNormGrad, {x, gamma, dy});
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(std::memcmp(a[i].raw(), b[i].raw(), a[i].bytes()), 0) << "output " << i;
}

TEST(CudaNn, SoftmaxAndLogSoftmax) {
  KILN_REQUIRE_GPU();
  for (DType d : kFloatTypes) {
    for (auto [rows, cols] : kRowShapes) {
      Tensor x = rand(d, {rows, cols}, 21, -4.0, 4.0);
      expect_matches(Op::kSoftmax, {x}, {}, d, "softmax " + label(d, rows, cols));
      expect_matches(Op::kLogSoftmax, {x}, {}, d, "log_softmax " + label(d, rows, cols));
    }
  }
  Tensor x = rand(DType::kF32, {2, 3, 33}, 22);
  expect_matches(Op::kSoftmax, {x}, {{"axis", int64_t{2}}}, DType::kF32, "axis 2 of rank 3");
}

TEST(CudaNn, SoftmaxRefusesOtherAxes) {
  KILN_REQUIRE_GPU();
  Attributes attrs = normalize_attributes(Op::kSoftmax, {{"axis", int64_t{0}}});
  std::vector<TensorType> in{{DType::kF32, {4, 5}}};
  Node node{Op::kSoftmax, {}, {}, attrs, nullptr};
  EXPECT_THROW(kernel_registry().select(NodeView{node, in, in}, Device::kCuda, {"cuda-nn"}), Error);
}

TEST(CudaNn, SoftmaxMisalignedViewUsesScalarPath) {
  KILN_REQUIRE_GPU();
  // The input starts 4 bytes into its allocation, the output at a fresh one: their addresses
  // differ modulo 16, so no shared vector split exists.
  const TensorType type{DType::kF32, {6, 300}};
  Tensor x = rand(DType::kF32, {6, 300}, 23, -3.0, 3.0);
  auto storage = cuda::allocate(type.bytes() + 16);
  Tensor view(type, storage, 4, Device::kCuda);
  KILN_CUDA_CHECK(cudaMemcpy(view.raw(), x.raw(), type.bytes(), cudaMemcpyHostToDevice));
  const auto expected = testing::run_reference(Op::kSoftmax, {x});
  const auto actual = run_cuda_nn(Op::kSoftmax, {x}, {}, {view});
  EXPECT_LE(max_scaled_error(actual[0], expected[0], 1e-5, 1e-4), 1.0);
}

TEST(CudaNn, SoftmaxGradAndLogSoftmaxGrad) {
  KILN_REQUIRE_GPU();
  for (DType d : kFloatTypes) {
    for (auto [rows, cols] : kRowShapes) {
      Tensor x = rand(d, {rows, cols}, 31, -4.0, 4.0), dy = rand(d, {rows, cols}, 32);
      Tensor y = testing::run_reference(Op::kSoftmax, {x})[0];
      Tensor log_y = testing::run_reference(Op::kLogSoftmax, {x})[0];
      expect_matches(Op::kSoftmaxGrad, {y, dy}, {}, d, "softmax_grad " + label(d, rows, cols));
      expect_matches(Op::kLogSoftmaxGrad, {log_y, dy}, {}, d,
                     "log_softmax_grad " + label(d, rows, cols));
    }
  }
}

// Labels in [0, vocab), every fifth row ignore_index (-100) when `ignore`.
Tensor labels_for(DType label_type, int64_t rows, int64_t vocab, uint64_t seed, bool ignore) {
  Tensor labels = rand(label_type, {rows}, seed, 0.0, static_cast<double>(vocab));
  if (ignore)
    for (int64_t r = 0; r < rows; r += 5) labels.set(r, -100.0);
  return labels;
}

const std::vector<std::pair<int64_t, int64_t>> kLossShapes = {
    {1, 1}, {4, 7}, {37, 768}, {6, 1025}, {3, 50257}};

TEST(CudaNn, CrossEntropy) {
  KILN_REQUIRE_GPU();
  for (DType d : kFloatTypes) {
    for (DType lt : {DType::kI32, DType::kI64}) {
      for (auto [rows, vocab] : kLossShapes) {
        for (std::string reduction : {"mean", "sum", "none"}) {
          Tensor logits = rand(d, {rows, vocab}, 41, -5.0, 5.0);
          Tensor labels = labels_for(lt, rows, vocab, 42, rows > 1);
          expect_matches(
              Op::kCrossEntropy, {logits, labels}, {{"reduction", reduction}}, d,
              fmt::format("{} labels {} {}", reduction, dtype_name(lt), label(d, rows, vocab)));
        }
      }
    }
  }
}

TEST(CudaNn, CrossEntropyAllIgnoredMeanIsZero) {
  KILN_REQUIRE_GPU();
  Tensor logits = rand(DType::kF32, {3, 10}, 43);
  Tensor labels = testing::make(DType::kI64, {3}, {-100, -100, -100});
  EXPECT_EQ(run_cuda_nn(Op::kCrossEntropy, {logits, labels})[0].get(0), 0.0);
}

TEST(CudaNn, CrossEntropyGrad) {
  KILN_REQUIRE_GPU();
  for (DType d : kFloatTypes) {
    for (DType lt : {DType::kI32, DType::kI64}) {
      for (auto [rows, vocab] : kLossShapes) {
        for (std::string reduction : {"mean", "sum", "none"}) {
          Tensor logits = rand(d, {rows, vocab}, 51, -5.0, 5.0);
          Tensor labels = labels_for(lt, rows, vocab, 52, rows > 1);
          Tensor dloss =
              reduction == "none" ? rand(d, {rows}, 53, 0.5, 2.0) : rand(d, {}, 54, 0.5, 2.0);
          expect_matches(
              Op::kCrossEntropyGrad, {logits, labels, dloss}, {{"reduction", reduction}}, d,
              fmt::format("{} labels {} {}", reduction, dtype_name(lt), label(d, rows, vocab)));
        }
      }
    }
  }
}

TEST(CudaNn, GeluAndGeluGrad) {
  KILN_REQUIRE_GPU();
  for (DType d : kFloatTypes) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000003}}) {
      for (std::string approximate : {"tanh", "none"}) {
        Tensor x = rand(d, {n}, 61, -6.0, 6.0), dy = rand(d, {n}, 62);
        const std::string what = fmt::format("{} {} n {}", approximate, dtype_name(d), n);
        expect_matches(Op::kGelu, {x}, {{"approximate", approximate}}, d, "gelu " + what);
        expect_matches(Op::kGeluGrad, {x, dy}, {{"approximate", approximate}}, d,
                       "gelu_grad " + what);
      }
    }
  }
}

// (param, grad, state) type combinations the updates support.
const std::vector<std::array<DType, 3>> kUpdateTypes = {
    {DType::kF32, DType::kF32, DType::kF32},  {DType::kBF16, DType::kBF16, DType::kBF16},
    {DType::kF16, DType::kF16, DType::kF16},  {DType::kBF16, DType::kBF16, DType::kF32},
    {DType::kF32, DType::kBF16, DType::kF32}, {DType::kF32, DType::kF16, DType::kF32}};

// The looser tolerance of the types involved.
DType loosest(const std::array<DType, 3>& types) {
  for (DType d : {DType::kBF16, DType::kF16})
    for (DType t : types)
      if (t == d) return d;
  return DType::kF32;
}

TEST(CudaNn, AdamwUpdate) {
  KILN_REQUIRE_GPU();
  for (const auto& types : kUpdateTypes) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
      Tensor param = rand(types[0], {n}, 71), grad = rand(types[1], {n}, 72);
      Tensor m = rand(types[2], {n}, 73, -0.1, 0.1), v = rand(types[2], {n}, 74, 1e-4, 1e-2);
      Tensor lr = testing::make(DType::kF32, {}, {1e-2});
      Tensor step = testing::make(n == 7 ? DType::kF64 : DType::kF32, {}, {3.0});
      expect_matches(Op::kOptimizerUpdate, {param, grad, m, v, lr, step},
                     {{"optimizer", "adamw"}, {"weight_decay", 0.1}, {"beta2", 0.95}}, loosest(types),
                     fmt::format("types {} {} {} n {}", dtype_name(types[0]), dtype_name(types[1]),
                                 dtype_name(types[2]), n));
    }
  }
}

TEST(CudaNn, SgdUpdate) {
  KILN_REQUIRE_GPU();
  struct Config {
    double momentum;
    bool nesterov;
  };
  for (const auto& types : kUpdateTypes) {
    if (types[2] != types[0]) continue;  // the buffer has the param's dtype here
    for (Config c : {Config{0.0, false}, Config{0.9, false}, Config{0.9, true}}) {
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
        Tensor param = rand(types[0], {n}, 81), grad = rand(types[1], {n}, 82);
        Tensor buf = rand(types[2], {n}, 83);
        Tensor lr = testing::make(DType::kBF16, {}, {0.125});
        Tensor step = testing::make(DType::kF32, {}, {2.0});
        expect_matches(
            Op::kOptimizerUpdate, {param, grad, buf, lr, step},
            {{"optimizer", "sgd"}, {"momentum", c.momentum}, {"nesterov", c.nesterov}, {"weight_decay", 0.01}},
            loosest(types),
            fmt::format("types {} {} {} momentum {} nesterov {} n {}", dtype_name(types[0]),
                        dtype_name(types[1]), dtype_name(types[2]), c.momentum, c.nesterov, n));
      }
    }
  }
}

TEST(CudaNn, Gather) {
  KILN_REQUIRE_GPU();
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI64, DType::kU8}) {
    for (int64_t cols : {int64_t{768}, int64_t{7}, int64_t{1}}) {
      for (DType it : {DType::kI32, DType::kI64}) {
        Tensor table = rand(d, {1000, cols}, 91, 0.0, 100.0);
        Tensor indices = rand(it, {4, 9}, 92, 0.0, 1000.0);
        const auto expected = testing::run_reference(Op::kGather, {table, indices});
        const auto actual = run_cuda_nn(Op::kGather, {table, indices});
        EXPECT_EQ(max_scaled_error(actual[0], expected[0], 0.0, 0.0), 0.0)
            << dtype_name(d) << " cols " << cols << " indices " << dtype_name(it);
      }
    }
  }
  // A middle axis.
  Tensor table = rand(DType::kF32, {3, 50, 5}, 93);
  Tensor indices = rand(DType::kI64, {11}, 94, 0.0, 50.0);
  Attributes axis1{{"axis", int64_t{1}}};
  const auto expected = testing::run_reference(Op::kGather, {table, indices}, axis1);
  EXPECT_EQ(
      max_scaled_error(run_cuda_nn(Op::kGather, {table, indices}, axis1)[0], expected[0], 0.0, 0.0),
      0.0);
}

TEST(CudaNn, ScatterAdd) {
  KILN_REQUIRE_GPU();
  for (DType d : kFloatTypes) {
    for (int64_t cols : {int64_t{768}, int64_t{7}}) {
      for (DType it : {DType::kI32, DType::kI64}) {
        // 300 indices into 100 rows: many repeats, and rows nobody names.
        Tensor base = rand(d, {100, cols}, 101);
        Tensor indices = rand(it, {300}, 102, 0.0, 70.0);
        Tensor updates = rand(d, {300, cols}, 103);
        const std::string what =
            fmt::format("{} cols {} indices {}", dtype_name(d), cols, dtype_name(it));
        if (d == DType::kF32) {
          expect_matches(Op::kScatterAdd, {base, indices, updates}, {}, d, what);
          continue;
        }
        // 16-bit: the reference rounds to the storage type after every addition; the kernel
        // accumulates in f32 and rounds once. So the expectation is the reference on f32
        // copies (the same additions in the same order), rounded once to d.
        auto f32 = [](const Tensor& t) {
          return Tensor::from_f64(TensorType{DType::kF32, t.shape()}, t.to_f64());
        };
        const Tensor sum32 =
            testing::run_reference(Op::kScatterAdd, {f32(base), indices, f32(updates)})[0];
        const Tensor expected = Tensor::from_f64(TensorType{d, sum32.shape()}, sum32.to_f64());
        const Tensor actual = run_cuda_nn(Op::kScatterAdd, {base, indices, updates})[0];
        const Tolerance tol = tolerance(d);
        EXPECT_LE(max_scaled_error(actual, expected, tol.atol, tol.rtol), 1.0) << what;
      }
    }
  }
  Tensor base = rand(DType::kF32, {3, 50, 5}, 104);
  Tensor indices = rand(DType::kI32, {2, 11}, 105, 0.0, 50.0);
  Tensor updates = rand(DType::kF32, {3, 2, 11, 5}, 106);
  expect_matches(Op::kScatterAdd, {base, indices, updates}, {{"axis", int64_t{1}}}, DType::kF32,
                 "axis 1");
}

// Runs of equal indices far longer than the kernel's chunks (a token-type embedding: the whole
// batch names row 0), runs crossing chunk boundaries at every offset, out-of-range rows' neighbours,
// and a leading axis (outer > 1).
TEST(CudaNn, ScatterAddLongRuns) {
  KILN_REQUIRE_GPU();
  std::vector<double> same(5000, 1.0), mixed;
  std::mt19937 rng(7);
  for (int64_t row = 0; mixed.size() < 3000; ++row)
    mixed.insert(mixed.end(), std::uniform_int_distribution<int>(1, 150)(rng), static_cast<double>(row % 40));
  std::shuffle(mixed.begin(), mixed.end(), rng);
  for (const auto& [what, ids] : {std::pair{"one run", same}, std::pair{"mixed runs", mixed}}) {
    const int64_t n = static_cast<int64_t>(ids.size());
    Tensor indices = testing::make(DType::kI64, {n}, ids);
    Tensor base = rand(DType::kF32, {40, 96}, 111);
    Tensor updates = rand(DType::kF32, {n, 96}, 112);
    expect_matches(Op::kScatterAdd, {base, indices, updates}, {}, DType::kF32, what);
    Tensor base3 = rand(DType::kF32, {2, 40, 33}, 113);
    Tensor updates3 = rand(DType::kF32, {2, n, 33}, 114);
    expect_matches(Op::kScatterAdd, {base3, indices, updates3}, {{"axis", int64_t{1}}}, DType::kF32,
                   std::string(what) + ", axis 1");
  }
}

TEST(CudaNn, ScatterAddIsDeterministic) {
  KILN_REQUIRE_GPU();
  Tensor base = rand(DType::kF32, {50, 768}, 107);
  Tensor indices = rand(DType::kI64, {8192}, 108, 0.0, 50.0);
  Tensor updates = rand(DType::kF32, {8192, 768}, 109);
  auto a = run_cuda_nn(Op::kScatterAdd, {base, indices, updates});
  auto b = run_cuda_nn(Op::kScatterAdd, {base, indices, updates});
  EXPECT_EQ(std::memcmp(a[0].raw(), b[0].raw(), a[0].bytes()), 0);
}

TEST(CudaNn, ScatterAddInPlaceOverItsBase) {
  // The memory plan may put the output over the base (in_place_ok): rows no index names keep
  // the base's values without a copy, named rows get base + updates.
  KILN_REQUIRE_GPU();
  Tensor base = rand(DType::kF32, {100, 96}, 110);
  Tensor indices = rand(DType::kI64, {300}, 111, 0.0, 70.0);
  Tensor updates = rand(DType::kF32, {300, 96}, 112);
  const Tensor expected = testing::run_reference(Op::kScatterAdd, {base, indices, updates})[0];
  Node node{Op::kScatterAdd, {}, {}, normalize_attributes(Op::kScatterAdd, {}), nullptr};
  const std::vector<TensorType> in_types{base.type(), indices.type(), updates.type()},
      out_types{base.type()};
  const KernelImpl& impl = kernel_registry().select(NodeView{node, in_types, out_types},
                                                    Device::kCuda, {"cuda-nn"});
  ASSERT_TRUE(impl.in_place_ok);
  Tensor shared = cuda::to_device(base);
  std::vector<Tensor> inputs{shared, cuda::to_device(indices), cuda::to_device(updates)};
  std::vector<Tensor> outputs{shared};
  cuda::Stream stream;
  impl.kernel(KernelArgs{node.attrs, inputs, outputs, stream.handle()});
  stream.synchronize();
  cuda::check_device_errors();
  EXPECT_LE(max_scaled_error(cuda::to_host(shared), expected, 1e-5, 1e-4), 1.0);
}

// ---- data errors ----------------------------------------------------------------------------
//
// Each bad element still gets the documented output (nn.cuh), and the error reaches the host
// through the one check that also reads the generic kernels' errors.

// Whether every byte of element i of t is 0xFF.
bool all_ff(const Tensor& t, int64_t i) {
  const size_t size = dtype_size(t.dtype());
  const auto* bytes = reinterpret_cast<const unsigned char*>(t.raw()) + i * size;
  for (size_t b = 0; b < size; ++b)
    if (bytes[b] != 0xFF) return false;
  return true;
}

TEST(CudaNnErrors, GatherIndexOutOfRangeThrowsAfterSync) {
  KILN_REQUIRE_GPU();
  cuda::check_device_errors();  // nothing left over from earlier tests
  const Tensor table = rand(DType::kF32, {10, 4}, 111);
  const Tensor out =
      run_unchecked(Op::kGather, {table, testing::make(DType::kI64, {3}, {2, 12, 0})})[0];
  // Rows 0 and 2 are table rows 2 and 0; row 1 (index 12) is 0xFF bytes.
  for (int64_t c = 0; c < 4; ++c) {
    EXPECT_EQ(out.get(0 * 4 + c), table.get(2 * 4 + c)) << "column " << c;
    EXPECT_TRUE(all_ff(out, 1 * 4 + c)) << "column " << c;
    EXPECT_EQ(out.get(2 * 4 + c), table.get(0 * 4 + c)) << "column " << c;
  }
  EXPECT_KILN_ERROR(cuda::check_device_errors(), "gather", "index 12", "position 1",
                    "dim of 10", "0..9");
  EXPECT_NO_THROW(cuda::check_device_errors());  // consumed
  // A middle axis, i32 indices, a negative index: run_cuda_nn checks and throws.
  EXPECT_KILN_ERROR(run_cuda_nn(Op::kGather,
                                {rand(DType::kBF16, {3, 6, 2}, 112),
                                 testing::make(DType::kI32, {2}, {0, -3})},
                                {{"axis", int64_t{1}}}),
                    "gather", "index -3", "position 1", "0..5");
  EXPECT_NO_THROW(cuda::check_device_errors());
}

TEST(CudaNnErrors, ScatterAddIndexOutOfRangeThrows) {
  KILN_REQUIRE_GPU();
  cuda::check_device_errors();
  const Tensor base = rand(DType::kF32, {4, 2}, 113);
  const Tensor updates = rand(DType::kF32, {3, 2}, 114);
  const Tensor out = run_unchecked(
      Op::kScatterAdd, {base, testing::make(DType::kI32, {3}, {1, 4, 1}), updates})[0];
  // Index 4 adds nothing; row 1 gets updates 0 and 2 (in that order), the others stay base.
  for (int64_t c = 0; c < 2; ++c) {
    const float row1 = (base.data<float>()[2 + c] + updates.data<float>()[0 * 2 + c]) +
                       updates.data<float>()[2 * 2 + c];
    EXPECT_EQ(out.get(0 * 2 + c), base.get(0 * 2 + c));
    EXPECT_EQ(out.get(1 * 2 + c), static_cast<double>(row1));
    EXPECT_EQ(out.get(2 * 2 + c), base.get(2 * 2 + c));
    EXPECT_EQ(out.get(3 * 2 + c), base.get(3 * 2 + c));
  }
  EXPECT_KILN_ERROR(cuda::check_device_errors(), "scatter_add", "index 4", "position 1",
                    "0..3");
  EXPECT_NO_THROW(cuda::check_device_errors());
}

TEST(CudaNnErrors, CrossEntropyLabelOutOfRangeThrows) {
  KILN_REQUIRE_GPU();
  cuda::check_device_errors();
  const Tensor logits = rand(DType::kF32, {3, 5}, 115);
  // Row 1's label 7 is out of range; row 2's -100 is ignore_index (fine).
  const Tensor labels = testing::make(DType::kI64, {3}, {1, 7, -100});
  const Tensor loss =
      run_unchecked(Op::kCrossEntropy, {logits, labels}, {{"reduction", std::string("none")}})[0];
  EXPECT_TRUE(std::isfinite(loss.get(0)));
  EXPECT_TRUE(std::isnan(loss.get(1)));
  EXPECT_EQ(loss.get(2), 0.0);
  EXPECT_KILN_ERROR(cuda::check_device_errors(), "cross_entropy: label 7 (row 1)", "[0, 5)",
                    "ignore_index -100");
  EXPECT_NO_THROW(cuda::check_device_errors());

  // The gradient, i32 labels, a negative label that is not ignore_index: NaN in that row.
  const Tensor labels32 = testing::make(DType::kI32, {3}, {-1, 2, -100});
  const Tensor dlogits =
      run_unchecked(Op::kCrossEntropyGrad, {logits, labels32, rand(DType::kF32, {}, 116, 0.5, 2)},
                    {{"reduction", std::string("sum")}})[0];
  EXPECT_TRUE(std::isnan(dlogits.get(0)));
  EXPECT_TRUE(std::isfinite(dlogits.get(5)));
  EXPECT_EQ(dlogits.get(10), 0.0);
  EXPECT_KILN_ERROR(cuda::check_device_errors(), "cross_entropy_grad: label -1 (row 0)",
                    "[0, 5)", "ignore_index -100");
  EXPECT_NO_THROW(cuda::check_device_errors());
}

// One check covers both families: errors pending from a cuda-nn and a generic "cuda" kernel
// are reported once (the earlier, by the device clock) and both are cleared.
TEST(CudaNnErrors, OneCheckCoversNnAndGenericKernels) {
  KILN_REQUIRE_GPU();
  cuda::check_device_errors();
  const Tensor table = rand(DType::kF32, {10, 4}, 117);
  run_unchecked(Op::kGather, {table, testing::make(DType::kI64, {1}, {10})});
  run_unchecked(Op::kDiv,
                {testing::make(DType::kI32, {2}, {7, 8}), testing::make(DType::kI32, {2}, {1, 0})},
                {}, {}, "cuda");
  EXPECT_KILN_ERROR(cuda::check_device_errors(), "gather", "index 10", "0..9");
  EXPECT_NO_THROW(cuda::check_device_errors());
  // And the generic kernel's error alone.
  run_unchecked(Op::kDiv,
                {testing::make(DType::kI32, {2}, {7, 8}), testing::make(DType::kI32, {2}, {1, 0})},
                {}, {}, "cuda");
  EXPECT_KILN_ERROR(cuda::check_device_errors(), "division by zero (8 / 0)");
  EXPECT_NO_THROW(cuda::check_device_errors());
}

}  // namespace
}  // namespace kiln
