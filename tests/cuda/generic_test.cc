// The "cuda" generic dialect (backends/cuda/generic.{cu,cc}) against the CPU reference kernels:
// one table of (op, dtypes, inputs, attributes) cases, each run for every dtype it lists, on
// seeded random inputs (never all zeros; positive where the op needs it, valid indices), with the
// device outputs poisoned (0xFF bytes) before the kernel runs so that an element it forgets to
// write shows up. Tolerances per output dtype (|a - b| <= atol + rtol |b|, times a per-case
// factor where an op sums many rounded terms): f32 1e-5, f64 1e-12, f16 2e-3, bf16 1e-2,
// integers and bool exact. Adding an op is one line in cases().
#include <cuda_runtime.h>

#include <functional>
#include <set>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/device_errors.h"
#include "backends/cuda/generic.cuh"
#include "gpu_test_util.h"

namespace kiln {
namespace {

using testing::make;
using testing::rand;

// ---- device tensors (plain cudaMalloc/cudaMemcpy, so the test depends on nothing else) -------

Tensor device_tensor(const TensorType& type) {
  void* p = nullptr;
  KILN_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(type.bytes(), 1)));
  std::shared_ptr<std::byte[]> storage(static_cast<std::byte*>(p),
                                       [](std::byte* q) { cudaFree(q); });
  return Tensor(type, std::move(storage), 0, Device::kCuda);
}

Tensor to_device(const Tensor& host) {
  Tensor t = device_tensor(host.type());
  if (host.bytes() > 0)
    KILN_CUDA_CHECK(cudaMemcpy(t.raw(), host.raw(), host.bytes(), cudaMemcpyHostToDevice));
  return t;
}

Tensor to_host(const Tensor& device) {
  Tensor t(device.type());
  if (t.bytes() > 0)
    KILN_CUDA_CHECK(cudaMemcpy(t.raw(), device.raw(), t.bytes(), cudaMemcpyDeviceToHost));
  return t;
}

std::vector<TensorType> types_of(const std::vector<Tensor>& tensors) {
  std::vector<TensorType> out;
  for (const Tensor& t : tensors) out.push_back(t.type());
  return out;
}

// Runs `op` through the "cuda" dialect on a stream of its own: inputs uploaded, outputs
// poisoned, synchronized, device errors checked, outputs downloaded.
std::vector<Tensor> run_cuda(Op op, const std::vector<Tensor>& host_inputs, Attributes attrs) {
  attrs = normalize_attributes(op, std::move(attrs));
  const std::vector<TensorType> in_types = types_of(host_inputs);
  const std::vector<TensorType> out_types = infer_types(op, in_types, attrs);
  Node node;
  node.op = op;
  node.attrs = attrs;
  const KernelImpl& impl =
      kernel_registry().select(NodeView{node, in_types, out_types}, Device::kCuda, {"cuda"});
  std::vector<Tensor> inputs, outputs;
  for (const Tensor& t : host_inputs) inputs.push_back(to_device(t));
  for (const TensorType& t : out_types) {
    outputs.push_back(device_tensor(t));
    KILN_CUDA_CHECK(cudaMemset(outputs.back().raw(), 0xFF, std::max<size_t>(t.bytes(), 1)));
  }
  cudaStream_t stream = nullptr;
  KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  try {
    impl.kernel(KernelArgs{attrs, inputs, outputs, stream});
  } catch (...) {
    cudaStreamDestroy(stream);
    throw;
  }
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream));
  KILN_CUDA_CHECK(cudaStreamDestroy(stream));
  cuda::check_device_errors();
  std::vector<Tensor> result;
  for (const Tensor& t : outputs) result.push_back(to_host(t));
  return result;
}

// ---- the case table -------------------------------------------------------------------------

// An input generator: the case's dtype and a seed give a host tensor.
using Gen = std::function<Tensor(DType, uint64_t)>;

// Uniform values: floats in [lo, hi); integers in [ilo, ihi) (u8 from max(ilo, 0)); bools half.
Gen uniform(Shape shape, double lo = -2.0, double hi = 2.0, double ilo = -20, double ihi = 20) {
  return [=](DType t, uint64_t seed) {
    if (is_float(t)) return rand(t, shape, seed, lo, hi);
    if (t == DType::kU8) return rand(t, shape, seed, std::max(ilo, 0.0), std::min(ihi, 256.0));
    return rand(t, shape, seed, ilo, ihi);
  };
}
Gen positive(Shape shape) { return uniform(std::move(shape), 0.25, 3.0, 1, 20); }
// A fixed dtype regardless of the case's (bool conditions, indices, scalars).
Gen fixed(DType type, Shape shape, double lo, double hi) {
  return [=](DType, uint64_t seed) { return rand(type, shape, seed, lo, hi); };
}
Gen values(DType type, Shape shape, std::vector<double> v) {
  return [=](DType, uint64_t) { return make(type, shape, v); };
}

struct Case {
  std::string name;
  Op op;
  std::vector<DType> dtypes;
  std::vector<Gen> inputs;
  Attributes attrs = {};
  double tolerance = 1.0;    // factor on the dtype's tolerances
  bool dtype_attr = false;   // set attrs["dtype"] to the case's dtype (sources, one_hot)
};

const std::vector<DType> kFloats = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16};
const std::vector<DType> kArith = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                                   DType::kI32, DType::kI64, DType::kU8};
const std::vector<DType> kAll = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                                 DType::kI32, DType::kI64, DType::kU8, DType::kBool};
const std::vector<DType> kNoBytes = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                                     DType::kI32, DType::kI64};

using Ints = std::vector<int64_t>;

std::vector<Case> build_cases() {
  std::vector<Case> c;
  const Shape s{3, 70};
  // Unary.
  for (auto [name, op] : {std::pair{"erf", Op::kErf}, {"exp", Op::kExp}, {"sigmoid", Op::kSigmoid},
                          {"silu", Op::kSilu}, {"tanh", Op::kTanh}})
    c.push_back({name, op, kFloats, {uniform(s)}});
  for (auto [name, op] : {std::pair{"log", Op::kLog}, {"sqrt", Op::kSqrt}, {"rsqrt", Op::kRsqrt},
                          {"reciprocal", Op::kReciprocal}})
    c.push_back({name, op, kFloats, {positive(s)}});
  for (auto [name, op] : {std::pair{"abs", Op::kAbs}, {"neg", Op::kNeg}, {"relu", Op::kRelu},
                          {"square", Op::kSquare}})
    c.push_back({name, op, kArith, {uniform(s)}});
  c.push_back({"gelu", Op::kGelu, kFloats, {uniform(s, -4, 4)}});
  c.push_back({"gelu_tanh", Op::kGelu, kFloats, {uniform(s, -4, 4)}, {{"approximate", std::string("tanh")}}});
  c.push_back({"gelu_grad", Op::kGeluGrad, kFloats, {uniform(s, -4, 4), uniform(s)}});
  c.push_back({"gelu_grad_tanh", Op::kGeluGrad, kFloats, {uniform(s, -4, 4), uniform(s)},
               {{"approximate", std::string("tanh")}}});
  // Binary, broadcasting and not.
  for (auto [name, op] : {std::pair{"add", Op::kAdd}, {"sub", Op::kSub}, {"mul", Op::kMul},
                          {"maximum", Op::kMaximum}, {"minimum", Op::kMinimum}}) {
    c.push_back({std::string(name) + "_bcast", op, kArith, {uniform({4, 1, 5}), uniform({3, 1})}});
    c.push_back({std::string(name) + "_same", op, kArith, {uniform({2, 33}), uniform({2, 33})}});
    // Broadcast over leading dims (collapsed to rows, binary_rows_kernel), either side.
    c.push_back({std::string(name) + "_rows", op, kArith, {uniform({3, 4, 70}), uniform({4, 70})}});
    c.push_back({std::string(name) + "_rows_left", op, kArith,
                 {uniform({1, 70}), uniform({5, 1, 70})}});
  }
  c.push_back({"div", Op::kDiv, kArith, {uniform({4, 1, 5}, -2, 2, -50, 50), positive({3, 1})}});
  c.push_back({"div_negative", Op::kDiv, kArith,
               {uniform({2, 9}, -2, 2, -50, 50), uniform({9}, -3, -0.25, -9, -1)}});
  c.push_back({"pow", Op::kPow, kFloats, {positive({4, 1, 5}), uniform({3, 1})}});
  for (auto [name, op] : {std::pair{"eq", Op::kEq}, {"ne", Op::kNe}, {"lt", Op::kLt},
                          {"le", Op::kLe}, {"gt", Op::kGt}, {"ge", Op::kGe}})
    c.push_back({name, op, kAll, {uniform({4, 1, 5}, -2, 2, -3, 3), uniform({3, 1}, -2, 2, -3, 3)}});
  c.push_back({"where", Op::kWhere, kAll,
               {fixed(DType::kBool, {3, 1, 4}, 0, 1), uniform({5, 1}), uniform({4})}});
  // Casts from every dtype to each target; floats in [-300, 300) exercise u8/i32 saturation.
  for (DType to : kAll)
    c.push_back({"cast_to_" + std::string(dtype_name(to)), Op::kCast, kAll,
                 {uniform({5, 40}, -300, 300, -300, 300)}, {{"dtype", to}}});
  c.push_back({"dropout", Op::kDropout, kFloats, {uniform({7, 61})}, {{"p", 0.3}, {"seed", 7}}});
  c.push_back({"dropout_offset", Op::kDropout, kFloats,
               {uniform({7, 61}), values(DType::kI64, {}, {5})}, {{"p", 0.5}, {"seed", 11}}});
  // Sources.
  c.push_back({"full", Op::kFull, kAll, {}, {{"shape", Ints{3, 5}}, {"value", 2.5}}, 1, true});
  c.push_back({"iota", Op::kIota, kArith, {}, {{"shape", Ints{3, 4, 5}}, {"axis", 1}}, 1, true});
  c.push_back({"constant", Op::kConstant, kAll, {},
               {{"shape", Ints{2, 3}}, {"values", std::vector<double>{1, -2, 3.5, 0, 7, 1}}}, 1,
               true});
  // Shape ops.
  c.push_back({"reshape", Op::kReshape, kAll, {uniform({4, 6})}, {{"shape", Ints{2, -1, 3}}}});
  c.push_back({"transpose", Op::kTranspose, kAll, {uniform({2, 3, 4, 5})},
               {{"perm", Ints{2, 0, 3, 1}}}});
  c.push_back({"transpose_reverse", Op::kTranspose, kAll, {uniform({3, 17, 2})}});
  c.push_back({"broadcast_to", Op::kBroadcastTo, kAll, {uniform({3, 1})},
               {{"shape", Ints{2, 3, 4}}}});
  c.push_back({"slice", Op::kSlice, kAll, {uniform({6, 7, 5})},
               {{"starts", Ints{1, -5, 0}}, {"ends", Ints{5, 7, 5}}, {"steps", Ints{2, 1, 3}}}});
  c.push_back({"concat", Op::kConcat, kAll,
               {uniform({2, 3, 4}), uniform({2, 1, 4}), uniform({2, 5, 4})}, {{"axis", 1}}});
  c.push_back({"split", Op::kSplit, kAll, {uniform({2, 9, 4})},
               {{"axis", -2}, {"sizes", Ints{2, 3, 4}}}});
  c.push_back({"gather", Op::kGather, kAll, {uniform({10, 6}), fixed(DType::kI64, {3, 4}, 0, 10)}});
  c.push_back({"gather_axis1_i32", Op::kGather, kAll,
               {uniform({3, 10, 2}), fixed(DType::kI32, {7}, 0, 10)}, {{"axis", 1}}});
  // Duplicate indices: several atomics land on one row. 16-bit floats add in their own
  // precision in any order (the reference adds in index order), hence the factor.
  c.push_back({"scatter_add", Op::kScatterAdd, kNoBytes,
               {uniform({10, 6}), fixed(DType::kI64, {3, 4}, 0, 10), uniform({3, 4, 6})}, {}, 4});
  c.push_back({"scatter_add_axis1_i32", Op::kScatterAdd, kNoBytes,
               {uniform({2, 5, 3}), fixed(DType::kI32, {8}, 0, 5), uniform({2, 8, 3})},
               {{"axis", 1}}, 4});
  c.push_back({"one_hot", Op::kOneHot, kAll, {fixed(DType::kI64, {3, 5}, -2, 8)},
               {{"depth", 6}}, 1, true});
  // Reductions: small lines (a warp per output) and long ones (a block per output).
  for (auto [name, op, types] : {std::tuple{"sum", Op::kSum, kArith},
                                 {"mean", Op::kMean, kFloats}, {"max", Op::kMax, kArith}}) {
    const std::string n = name;
    c.push_back({n + "_all", op, types, {uniform({4, 5, 6})}, {}, 4});
    c.push_back({n + "_axis1", op, types, {uniform({4, 5, 6})}, {{"axes", Ints{1}}}, 4});
    c.push_back({n + "_axes02_keepdims", op, types, {uniform({4, 5, 6})},
                 {{"axes", Ints{0, -1}}, {"keepdims", true}}, 4});
    c.push_back({n + "_long_rows", op, types, {uniform({3, 3000})}, {{"axes", Ints{1}}}, 4});
    c.push_back({n + "_long_columns", op, types, {uniform({2000, 3})}, {{"axes", Ints{0}}}, 4});
    c.push_back({n + "_many_rows", op, types, {uniform({5000, 4})}, {{"axes", Ints{1}}}, 4});
  }
  // Integer ties exercise the first-index rule.
  c.push_back({"argmax", Op::kArgmax, kArith, {uniform({4, 7, 5})}, {{"axis", 1}}});
  c.push_back({"argmax_last_keepdims", Op::kArgmax, kArith, {uniform({6, 300})},
               {{"keepdims", true}}});
  // NN.
  c.push_back({"matmul", Op::kMatmul, kFloats, {uniform({3, 4, 5}), uniform({5, 6})}});
  c.push_back({"matmul_odd", Op::kMatmul, kFloats, {uniform({33, 40}), uniform({40, 17})}, {}, 2});
  c.push_back({"matmul_ta_bcast", Op::kMatmul, kFloats,
               {uniform({2, 1, 20, 18}), uniform({3, 20, 19})}, {{"transpose_a", true}}, 2});
  c.push_back({"matmul_tb", Op::kMatmul, kFloats, {uniform({2, 17, 21}), uniform({2, 9, 21})},
               {{"transpose_b", true}}, 2});
  c.push_back({"matmul_tab", Op::kMatmul, kFloats, {uniform({21, 17}), uniform({9, 21})},
               {{"transpose_a", true}, {"transpose_b", true}}, 2});
  c.push_back({"softmax", Op::kSoftmax, kFloats, {uniform({4, 37}, -4, 4)}});
  c.push_back({"softmax_axis1", Op::kSoftmax, kFloats, {uniform({3, 5, 4}, -4, 4)}, {{"axis", 1}}});
  c.push_back({"softmax_long", Op::kSoftmax, kFloats, {uniform({2, 1000}, -4, 4)}, {}, 2});
  c.push_back({"log_softmax", Op::kLogSoftmax, kFloats, {uniform({4, 37}, -4, 4)}});
  c.push_back({"log_softmax_axis0", Op::kLogSoftmax, kFloats, {uniform({6, 5}, -4, 4)},
               {{"axis", 0}}});
  c.push_back({"softmax_grad", Op::kSoftmaxGrad, kFloats, {uniform({4, 37}, 0, 1), uniform({4, 37})},
               {}, 2});
  c.push_back({"softmax_grad_axis1", Op::kSoftmaxGrad, kFloats,
               {uniform({3, 5, 4}, 0, 1), uniform({3, 5, 4})}, {{"axis", 1}}, 2});
  c.push_back({"log_softmax_grad", Op::kLogSoftmaxGrad, kFloats,
               {uniform({4, 37}, -4, 0), uniform({4, 37})}, {}, 2});
  c.push_back({"layer_norm", Op::kLayerNorm, kFloats,
               {uniform({2, 3, 50}), uniform({50}), uniform({50})}, {}, 2});
  c.push_back({"layer_norm_wide", Op::kLayerNorm, kFloats,
               {uniform({5, 700}), uniform({700}), uniform({700})}, {{"epsilon", 1e-3}}, 2});
  c.push_back({"rms_norm", Op::kRmsNorm, kFloats, {uniform({2, 3, 50}), uniform({50})}, {}, 2});
  c.push_back({"layer_norm_grad", Op::kLayerNormGrad, kFloats,
               {uniform({6, 50}), uniform({50}), uniform({6, 50})}, {}, 4});
  c.push_back({"layer_norm_grad_wide", Op::kLayerNormGrad, kFloats,
               {uniform({40, 300}), uniform({300}), uniform({40, 300})}, {}, 4});
  c.push_back({"rms_norm_grad", Op::kRmsNormGrad, kFloats,
               {uniform({6, 50}), uniform({50}), uniform({6, 50})}, {}, 4});
  const Gen labels = values(DType::kI64, {6}, {3, -100, 0, 10, 5, 7});
  const Gen labels32 = values(DType::kI32, {2, 3}, {3, -100, 0, 10, 5, 7});
  for (const char* reduction : {"mean", "sum", "none"}) {
    const std::string r = reduction;
    c.push_back({"cross_entropy_" + r, Op::kCrossEntropy, kFloats,
                 {uniform({6, 11}, -4, 4), labels}, {{"reduction", r}}, 2});
    c.push_back({"cross_entropy_i32_" + r, Op::kCrossEntropy, kFloats,
                 {uniform({2, 3, 11}, -4, 4), labels32}, {{"reduction", r}}, 2});
    c.push_back({"cross_entropy_grad_" + r, Op::kCrossEntropyGrad, kFloats,
                 {uniform({6, 11}, -4, 4), labels, uniform(r == "none" ? Shape{6} : Shape{})},
                 {{"reduction", r}}, 2});
  }
  c.push_back({"cross_entropy_all_ignored", Op::kCrossEntropy, kFloats,
               {uniform({2, 5}), values(DType::kI64, {2}, {-100, -100})}});
  c.push_back({"attention", Op::kAttention, kFloats,
               {uniform({2, 3, 5, 8}), uniform({2, 3, 7, 8}), uniform({2, 3, 7, 6})}, {}, 2});
  c.push_back({"attention_causal_scaled", Op::kAttention, kFloats,
               {uniform({2, 9, 8}), uniform({2, 9, 8}), uniform({2, 9, 8})},
               {{"causal", true}, {"scale", 0.5}}, 2});
  c.push_back({"attention_no_head_dim_out", Op::kAttention, kFloats,
               {uniform({2, 4, 8}), uniform({2, 5, 8}), uniform({2, 5, 0})}, {}, 2});
  // attention_grad is defined on the out and lse it is given (P = exp(s - lse),
  // D = dout . out), so independent random ones test it; |s| <= 8 / sqrt(8) with q, k in
  // [-1, 1], and lse in [1, 3] keeps P below e^2.
  auto lse = [](Shape shape) -> Gen {
    return [=](DType t, uint64_t seed) {
      return rand(t == DType::kF64 ? DType::kF64 : DType::kF32, shape, seed, 1.0, 3.0);
    };
  };
  c.push_back({"attention_grad", Op::kAttentionGrad, kFloats,
               {uniform({2, 3, 5, 8}, -1, 1), uniform({2, 3, 7, 8}, -1, 1), uniform({2, 3, 7, 6}),
                uniform({2, 3, 5, 6}), uniform({2, 3, 5, 6}), lse({2, 3, 5})}, {}, 4});
  c.push_back({"attention_grad_causal", Op::kAttentionGrad, kFloats,
               {uniform({2, 9, 8}, -1, 1), uniform({2, 9, 8}, -1, 1), uniform({2, 9, 8}),
                uniform({2, 9, 8}), uniform({2, 9, 8}), lse({2, 9})},
               {{"causal", true}}, 4});
  const Gen lr = fixed(DType::kF32, {}, 0.01, 0.1);
  c.push_back({"sgd_update", Op::kSgdUpdate, kFloats,
               {uniform({40}), uniform({40}), uniform({40}), lr}});
  c.push_back({"sgd_update_nesterov", Op::kSgdUpdate, kFloats,
               {uniform({40}), uniform({40}), uniform({40}), lr},
               {{"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.01}}});
  c.push_back({"adamw_update", Op::kAdamwUpdate, kFloats,
               {uniform({40}), uniform({40}), uniform({40}), positive({40}), lr,
                values(DType::kF64, {}, {3})}});
  return c;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = build_cases();
  return all;
}

// Tolerances of an output dtype (atol, rtol).
std::pair<double, double> tolerance(DType t) {
  switch (t) {
    case DType::kF32: return {1e-5, 1e-5};
    case DType::kF64: return {1e-12, 1e-12};
    case DType::kF16: return {2e-3, 2e-3};
    case DType::kBF16: return {1e-2, 1e-2};
    default: return {0.5, 0.0};  // integers and bool: exact
  }
}

struct Param {
  size_t case_index;
  DType dtype;
};

std::vector<Param> all_params() {
  std::vector<Param> out;
  for (size_t i = 0; i < cases().size(); ++i)
    for (DType t : cases()[i].dtypes) out.push_back({i, t});
  return out;
}

class CudaGeneric : public ::testing::TestWithParam<Param> {};

TEST_P(CudaGeneric, MatchesReference) {
  KILN_REQUIRE_GPU();
  const Case& c = cases()[GetParam().case_index];
  const DType dtype = GetParam().dtype;
  std::vector<Tensor> inputs;
  for (size_t k = 0; k < c.inputs.size(); ++k)
    inputs.push_back(c.inputs[k](dtype, 1000 * GetParam().case_index + 17 * k + 1));
  Attributes attrs = c.attrs;
  if (c.dtype_attr) attrs.set("dtype", dtype);
  const std::vector<Tensor> expected = testing::run_reference(c.op, inputs, attrs);
  const std::vector<Tensor> actual = run_cuda(c.op, inputs, attrs);
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t o = 0; o < expected.size(); ++o) {
    ASSERT_EQ(actual[o].type(), expected[o].type());
    auto [atol, rtol] = tolerance(expected[o].dtype());
    const double error = max_scaled_error(actual[o], expected[o], atol * c.tolerance,
                                          rtol * c.tolerance);
    EXPECT_LE(error, 1.0) << "output " << o << "\n  cuda:      " << summarize(actual[o])
                          << "\n  reference: " << summarize(expected[o]);
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaGeneric, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return cases()[info.param.case_index].name + "_" +
                                  std::string(dtype_name(info.param.dtype));
                         });

// Dropout keeps the reference's mask exactly (the same Philox words): zeros in the same places.
TEST(CudaGenericDropout, SameMaskAsReference) {
  KILN_REQUIRE_GPU();
  const Tensor x = rand(DType::kF32, {100003}, 5, 0.5, 1.5);
  const Attributes attrs{{"p", 0.25}, {"seed", 123456789}};
  const Tensor expected = testing::run_reference(Op::kDropout, {x}, attrs)[0];
  const Tensor actual = run_cuda(Op::kDropout, {x}, attrs)[0];
  int64_t dropped = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    ASSERT_EQ(actual.get(i) == 0.0, expected.get(i) == 0.0) << "element " << i;
    dropped += expected.get(i) == 0.0;
  }
  EXPECT_NEAR(static_cast<double>(dropped) / x.numel(), 0.25, 0.01);
}

// ---- data errors -----------------------------------------------------------------------------

TEST(CudaGenericErrors, GatherIndexOutOfRangeThrowsAfterSync) {
  KILN_REQUIRE_GPU();
  const Tensor table = rand(DType::kF32, {10, 4}, 1);
  EXPECT_KILN_ERROR(run_cuda(Op::kGather, {table, make(DType::kI64, {3}, {2, 12, 0})}, {}),
                    "gather", "index 12", "position 1", "0..9");
  // The error was consumed: the next call is clean.
  EXPECT_NO_THROW(run_cuda(Op::kGather, {table, make(DType::kI64, {1}, {9})}, {}));
}

TEST(CudaGenericErrors, ScatterAddNegativeIndexThrows) {
  KILN_REQUIRE_GPU();
  const Tensor base = rand(DType::kF32, {4, 2}, 1);
  EXPECT_KILN_ERROR(run_cuda(Op::kScatterAdd, {base, make(DType::kI32, {2}, {1, -1}),
                                               rand(DType::kF32, {2, 2}, 2)}, {}),
                    "scatter_add", "index -1", "position 1", "0..3");
}

TEST(CudaGenericErrors, IntegerDivisionByZeroThrows) {
  KILN_REQUIRE_GPU();
  EXPECT_KILN_ERROR(
      run_cuda(Op::kDiv, {make(DType::kI32, {3}, {7, 8, 9}), make(DType::kI32, {3}, {1, 0, 2})},
               {}),
      "division by zero (8 / 0)");
}

TEST(CudaGenericErrors, LabelOutOfRangeThrows) {
  KILN_REQUIRE_GPU();
  const Tensor logits = rand(DType::kF32, {2, 5}, 1);
  const Tensor labels = make(DType::kI64, {2}, {1, 5});
  EXPECT_KILN_ERROR(run_cuda(Op::kCrossEntropy, {logits, labels}, {}),
                    "cross_entropy: label 5 (row 1)", "[0, 5)", "ignore_index -100");
  EXPECT_KILN_ERROR(
      run_cuda(Op::kCrossEntropyGrad, {logits, labels, rand(DType::kF32, {}, 2)}, {}),
      "cross_entropy_grad: label 5 (row 1)", "[0, 5)");
}

// ---- coverage -----------------------------------------------------------------------------------

// Ops with no generic CUDA kernel (by name), each with the reason.
const std::set<std::string_view> kWithoutGenericKernel = {
    "fused",              // a subgraph: compiled by the nvrtc dialect, not a fixed kernel
    "conv2d",             // convolution and pooling: not written yet (CNN models only)
    "conv2d_grad_input",
    "conv2d_grad_weight",
    "max_pool2d",
    "max_pool2d_grad",
    "avg_pool2d",
    "avg_pool2d_grad",
    // Packed self-attention: cuda-attention (and cudnn) serve f32 / f16 / bf16 up to head dim
    // 256; like "bthd" attention, which this generic dialect does not take either, f64 or wider
    // heads have no CUDA kernel.
    "attention_qkv",
    "attention_qkv_grad",
};

bool has_generic_kernel(Op op) {
  for (const KernelImpl* impl : kernel_registry().candidates(op, Device::kCuda))
    if (impl->dialect == "cuda") return true;
  return false;
}

TEST(CudaGenericCoverage, EveryOpHasAKernelOrIsListed) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    const bool listed = kWithoutGenericKernel.count(op_name(op)) != 0;
    EXPECT_NE(has_generic_kernel(op), listed)
        << op_name(op) << (listed ? ": listed as without a kernel but has one"
                                  : ": has no cuda kernel and is not listed");
  }
}

TEST(CudaGenericCoverage, EveryKernelHasATestCase) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  std::set<Op> tested;
  for (const Case& c : cases()) tested.insert(c.op);
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    if (has_generic_kernel(op)) {
      EXPECT_TRUE(tested.count(op)) << op_name(op) << " has no case";
    }
  }
}

}  // namespace
}  // namespace kiln
