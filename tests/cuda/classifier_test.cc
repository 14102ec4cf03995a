// The fused classifier's CUDA kernel (backends/cuda/classifier.{cu,cc}) against the CPU oracle,
// the fused reference kernel (ops/fused.cc: the body's reference kernels in f64), on random
// inputs: f32/bf16/f16 logits, a bf16 gradient of f32 logits, vocabularies 1 to 50304 (odd ones
// start rows misaligned: the scalar head/tail), both shared-memory and re-read paths (f32 rows
// of 50304 do not fit in shared memory), every reduction, ignored rows; in place (the gradient
// over the logits, "none"'s loss over dloss); a misaligned view (the scalar fallback); a label
// out of range (a device data error, NaN loss); bitwise repeatability. Outputs are poisoned with
// 0xFF bytes first, so an unwritten element shows as NaN.
//
// Tolerances: the kernel computes in f32 with __expf (relative error ~1e-6 for the arguments
// x - max in [-12, 0] used here) and rounds once to the gradient's type; the reference computes
// in f64 and rounds (through f32) once. Loss: rtol 1e-5. Gradient: atol 1e-6 * max |gradient|
// (elements that cancel at the label) plus rtol 1e-4 (f32), 2^-7 (bf16: the roundings may land
// one ulp apart), 2^-9 (f16).
//
// DISABLED_Bandwidth (run with --gtest_also_run_disabled_tests) times the kernel at GPT-2 size,
// B*T = 32768 rows of V = 50304, and the unfused ops it replaces.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>

#include "backends/classifier_test_util.h"
#include "backends/cuda/classifier.cuh"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/device_errors.h"
#include "backends/cuda/memory.h"
#include "gpu_test_util.h"

namespace kiln {
namespace {

using testing::ClassifierCase;
using testing::classifier_graph;
using testing::classifier_inputs;

std::vector<TensorType> types_of(const Graph& g, const std::vector<ValueId>& ids) {
  std::vector<TensorType> out;
  for (ValueId id : ids) out.push_back(g.type(id));
  return out;
}

const KernelImpl& cuda_kernel(const Graph& g) {
  const Node& node = g.nodes.at(0);
  const std::vector<TensorType> in = types_of(g, node.inputs), out = types_of(g, node.outputs);
  const KernelImpl& impl = kernel_registry().select(NodeView{node, in, out}, Device::kCuda, {});
  EXPECT_EQ(impl.dialect, "cuda-nn");
  EXPECT_EQ(impl.priority, 50);
  EXPECT_TRUE(impl.in_place_ok);
  return impl;
}

std::vector<Tensor> reference(const Graph& g, const std::vector<Tensor>& inputs) {
  std::vector<Tensor> out;
  for (const TensorType& t : types_of(g, g.nodes[0].outputs)) out.emplace_back(t);
  const Node& node = g.nodes[0];
  op_def(Op::kFused).reference(KernelArgs{node.attrs, inputs, out, nullptr, node.body.get()});
  return out;
}

std::vector<Tensor> poisoned_outputs(const Graph& g) {
  std::vector<Tensor> out;
  for (const TensorType& t : types_of(g, g.nodes[0].outputs)) {
    out.push_back(cuda::device_tensor(t, /*zero=*/false));
    KILN_CUDA_CHECK(cudaMemset(out.back().raw(), 0xFF, std::max<size_t>(t.bytes(), 1)));
  }
  return out;
}

// Runs the node's CUDA kernel on device inputs into device outputs; waits.
void run(const Graph& g, const std::vector<Tensor>& device_in, std::vector<Tensor>& device_out) {
  const Node& node = g.nodes[0];
  cuda::Stream stream;
  cuda_kernel(g).kernel(KernelArgs{node.attrs, device_in, device_out, stream.handle(),
                                   node.body.get()});
  stream.synchronize();
}

std::vector<Tensor> to_host(const std::vector<Tensor>& device) {
  std::vector<Tensor> out;
  for (const Tensor& t : device) out.push_back(cuda::to_host(t));
  return out;
}

double grad_rtol(DType d) {
  return d == DType::kBF16 ? 1.0 / 128 : d == DType::kF16 ? 1.0 / 512 : 1e-4;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.get(i)));
  return m;
}

void expect_close(const std::vector<Tensor>& got, const std::vector<Tensor>& want,
                  const ClassifierCase& c) {
  ASSERT_EQ(got.size(), 2u);
  EXPECT_TRUE(testing::all_close(got[0], want[0], 1e-6, 1e-5)) << "loss, " << c.describe();
  EXPECT_TRUE(testing::all_close(got[1], want[1], 1e-6 * max_abs(want[1]), grad_rtol(c.grad)))
      << "gradient, " << c.describe();
}

std::vector<ClassifierCase> cases() {
  std::vector<ClassifierCase> out;
  const std::pair<DType, DType> types[] = {{DType::kF32, DType::kF32},
                                           {DType::kBF16, DType::kBF16},
                                           {DType::kF16, DType::kF16},
                                           {DType::kF32, DType::kBF16}};
  const int64_t vocabs[] = {1, 7, 256, 1001, 4099, 50257, 50304};
  const char* reductions[] = {"mean", "sum", "none"};
  int k = 0;
  for (auto [logits, grad] : types)
    for (int64_t vocab : vocabs) {
      ClassifierCase c;
      c.logits = logits;
      c.grad = grad;
      c.vocab = vocab;
      c.labels = k % 2 ? DType::kI32 : DType::kI64;
      c.reduction = reductions[k % 3];
      c.rows = vocab > 10000 ? Shape{3} : k % 2 ? Shape{3, 5} : Shape{9};
      ++k;
      out.push_back(c);
    }
  return out;
}

using cuda::classifier::RowPath;

// Sets the row path for one test; back to the default at the end.
struct ScopedRowPath {
  explicit ScopedRowPath(RowPath path) { cuda::classifier::set_row_path(path); }
  ~ScopedRowPath() { cuda::classifier::set_row_path(RowPath::kShared); }  // the default
};

constexpr RowPath kPaths[] = {RowPath::kReread, RowPath::kShared};

TEST(ClassifierGpu, MatchesCpuReference) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 300;
  for (RowPath path : kPaths)
  for (const ClassifierCase& c : cases()) {
    const ScopedRowPath scoped(path);
    SCOPED_TRACE(c.describe() + (path == RowPath::kShared ? ", rows in shared memory" : ""));
    Graph g = classifier_graph(c);
    const std::vector<Tensor> inputs = classifier_inputs(g, c, seed += 10);
    std::vector<Tensor> device_in;
    for (const Tensor& t : inputs) device_in.push_back(cuda::to_device(t));
    std::vector<Tensor> device_out = poisoned_outputs(g);
    run(g, device_in, device_out);
    cuda::check_device_errors();
    expect_close(to_host(device_out), reference(g, inputs), c);
  }
}

TEST(ClassifierGpu, RunsInPlaceAndRepeatsBitwise) {
  KILN_REQUIRE_GPU();
  for (RowPath path : kPaths)
  for (ClassifierCase c : cases()) {
    if (c.grad != c.logits) continue;
    const ScopedRowPath scoped(path);
    for (const char* reduction : {"mean", "none"}) {
      c.reduction = reduction;
      SCOPED_TRACE(c.describe() + (path == RowPath::kShared ? ", rows in shared memory" : ""));
      Graph g = classifier_graph(c);
      const std::vector<Tensor> inputs = classifier_inputs(g, c, 11);
      const std::vector<Tensor> want = reference(g, inputs);
      std::vector<Tensor> first;
      for (int run_index = 0; run_index < 2; ++run_index) {
        std::vector<Tensor> device_in;
        for (const Tensor& t : inputs) device_in.push_back(cuda::to_device(t));
        // The gradient over the logits; "none": the loss over dloss; else a separate scalar.
        std::vector<Tensor> device_out = poisoned_outputs(g);
        device_out[1] = device_in[0];
        if (c.reduction == "none") device_out[0] = device_in[2];
        run(g, device_in, device_out);
        cuda::check_device_errors();
        std::vector<Tensor> got = to_host(device_out);
        expect_close(got, want, c);
        if (run_index == 0) {
          first = got;
        } else {
          for (size_t i = 0; i < got.size(); ++i)
            EXPECT_TRUE(testing::all_close(got[i], first[i], 0, 0)) << "output " << i << " differs";
        }
      }
    }
  }
}

TEST(ClassifierGpu, MisalignedViewTakesTheScalarPath) {
  KILN_REQUIRE_GPU();
  ClassifierCase c;
  c.logits = c.grad = DType::kBF16;
  c.vocab = 1000;
  c.rows = {4};
  Graph g = classifier_graph(c);
  const std::vector<Tensor> inputs = classifier_inputs(g, c, 21);
  // Logits and gradient 2 bytes past a 16-byte boundary.
  Tensor host_padded(TensorType{DType::kBF16, {4 * 1000 + 8}});
  for (int64_t i = 0; i < 4000; ++i) host_padded.set(i + 1, inputs[0].get(i));
  Tensor padded = cuda::to_device(host_padded);
  // Views of the device buffers at element 1 (the deleters keep the buffers alive).
  std::shared_ptr<std::byte[]> storage(padded.raw(), [padded](std::byte*) {});
  Tensor logits(inputs[0].type(), storage, 2, Device::kCuda);
  Tensor grad_buffer = cuda::device_tensor(TensorType{DType::kBF16, {4 * 1000 + 8}});
  std::shared_ptr<std::byte[]> grad_storage(grad_buffer.raw(), [grad_buffer](std::byte*) {});
  std::vector<Tensor> device_in = {logits, cuda::to_device(inputs[1]), cuda::to_device(inputs[2])};
  std::vector<Tensor> device_out = poisoned_outputs(g);
  device_out[1] = Tensor(inputs[0].type(), grad_storage, 2, Device::kCuda);
  run(g, device_in, device_out);
  cuda::check_device_errors();
  expect_close(to_host(device_out), reference(g, inputs), c);
}

TEST(ClassifierGpu, LabelOutOfRangeIsADeviceDataError) {
  KILN_REQUIRE_GPU();
  ClassifierCase c;
  c.logits = c.grad = DType::kBF16;
  c.vocab = 300;
  Graph g = classifier_graph(c);
  std::vector<Tensor> inputs = classifier_inputs(g, c, 31);
  inputs[1].set(2, 300);
  std::vector<Tensor> device_in;
  for (const Tensor& t : inputs) device_in.push_back(cuda::to_device(t));
  std::vector<Tensor> device_out = poisoned_outputs(g);
  run(g, device_in, device_out);
  EXPECT_KILN_ERROR(cuda::check_device_errors(), "cross_entropy", "label 300", "row 2");
  cuda::check_device_errors();  // cleared
  std::vector<Tensor> got = to_host(device_out);
  EXPECT_TRUE(std::isnan(got[0].get(0)));
  EXPECT_TRUE(std::isnan(got[1].get(2 * 300)));
}

// ---- benchmark ---------------------------------------------------------------------------

// Milliseconds per call of fn on `stream`, median of 3 batches of 10 after 3 warm-up calls.
template <typename Fn>
double time_ms(cudaStream_t stream, Fn&& fn) {
  for (int i = 0; i < 3; ++i) fn();
  cudaEvent_t start, stop;
  KILN_CUDA_CHECK(cudaEventCreate(&start));
  KILN_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int batch = 0; batch < 3; ++batch) {
    KILN_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < 10; ++i) fn();
    KILN_CUDA_CHECK(cudaEventRecord(stop, stream));
    KILN_CUDA_CHECK(cudaEventSynchronize(stop));
    float elapsed = 0;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
    ms.push_back(elapsed / 10.0);
  }
  KILN_CUDA_CHECK(cudaEventDestroy(start));
  KILN_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[1];
}

const KernelImpl& op_kernel(Op op, const std::vector<TensorType>& in, const Attributes& attrs) {
  static std::vector<std::unique_ptr<Node>> nodes;  // kept alive for the NodeView
  nodes.push_back(std::make_unique<Node>(Node{op, {}, {}, attrs, nullptr}));
  const std::vector<TensorType> out = infer_types(op, in, attrs);
  return kernel_registry().select(NodeView{*nodes.back(), in, out}, Device::kCuda, {});
}

TEST(ClassifierGpu, DISABLED_Bandwidth) {
  KILN_REQUIRE_GPU();
  const int64_t rows = 32768, vocab = 50304;
  cuda::Stream stream_owner;
  const auto stream = static_cast<cudaStream_t>(stream_owner.handle());
  std::printf("device: %s\n", cuda::describe_device(0).c_str());
  const Shape logits_shape = {rows, vocab};
  Tensor labels = cuda::to_device(random_tensor({DType::kI64, {rows}}, 1, 0, vocab));
  Tensor dloss = cuda::to_device(testing::make(DType::kF32, {}, {1.0}));
  Tensor loss = cuda::device_tensor({DType::kF32, {}});
  for (int variant = 0; variant < 3; ++variant) {
    // bf16 logits, gradient in place (the form with both casts absorbed), the row kept in
    // shared memory or read twice; f32 logits with a bf16 gradient (the form when the step also
    // returns the f32 logits).
    const DType logits_t = variant < 2 ? DType::kBF16 : DType::kF32;
    const ScopedRowPath scoped(variant == 0 ? RowPath::kShared : RowPath::kReread);
    Tensor logits = cuda::device_tensor({logits_t, logits_shape}, /*zero=*/false);
    {
      // 16 random rows repeated (the kernel's speed does not depend on the values).
      std::vector<Tensor> host;
      for (int k = 0; k < 16; ++k) host.push_back(random_tensor({logits_t, {vocab}}, 2 + k, -6.0, 6.0));
      for (int64_t r = 0; r < rows; ++r)
        KILN_CUDA_CHECK(cudaMemcpy(logits.raw() + r * vocab * dtype_size(logits_t),
                                   host[r % 16].raw(), host[r % 16].bytes(),
                                   cudaMemcpyHostToDevice));
    }
    Tensor grad = logits_t == DType::kBF16 ? logits
                                           : cuda::device_tensor({DType::kBF16, logits_shape}, false);
    cuda::classifier::Problem p;
    p.logits_t = logits_t;
    p.logits = logits.raw();
    p.grad_t = DType::kBF16;
    p.dlogits = grad.raw();
    p.labels = labels.raw();
    p.dloss = dloss.data<float>();
    p.loss = loss.data<float>();
    p.rows = rows;
    p.vocab = vocab;
    const double ms = time_ms(stream, [&] { cuda::classifier::fused_classifier(p, stream); });
    const double logits_bytes = static_cast<double>(logits.bytes());
    const double grad_bytes = static_cast<double>(rows * vocab * 2);
    const cuda::classifier::LaunchInfo info = cuda::classifier::launch_info(p.logits_t, vocab);
    std::printf(
        "fused classifier, %s logits -> bf16 grad%s, %lld x %lld: %.3f ms; "
        "bytes (logits read twice + grad written once) %.2f GB -> %.0f GB/s; "
        "DRAM bytes if the row is read once %.2f GB -> %.0f GB/s (threads %d, row in shared "
        "memory: %s)\n",
        std::string(dtype_name(logits_t)).c_str(), logits_t == DType::kBF16 ? " in place" : "",
        static_cast<long long>(rows), static_cast<long long>(vocab), ms,
        (2 * logits_bytes + grad_bytes) / 1e9, (2 * logits_bytes + grad_bytes) / ms / 1e6,
        (logits_bytes + grad_bytes) / 1e9, (logits_bytes + grad_bytes) / ms / 1e6, info.threads,
        info.row_in_shared_memory ? "yes" : "no");
  }
  cuda::check_device_errors();
  // The unfused ops it replaces, as the bf16 step runs them today: cast bf16 -> f32,
  // cross_entropy, cross_entropy_grad (f32), cast f32 -> bf16.
  {
    Tensor bf = cuda::device_tensor({DType::kBF16, logits_shape});
    Tensor f32 = cuda::device_tensor({DType::kF32, logits_shape});
    Tensor g32 = cuda::device_tensor({DType::kF32, logits_shape});
    Tensor gbf = cuda::device_tensor({DType::kBF16, logits_shape});
    const Attributes ce = normalize_attributes(Op::kCrossEntropy, {});
    const Attributes to_f32 = normalize_attributes(Op::kCast, {{"dtype", DType::kF32}});
    const Attributes to_bf16 = normalize_attributes(Op::kCast, {{"dtype", DType::kBF16}});
    const KernelImpl& cast_up = op_kernel(Op::kCast, {bf.type()}, to_f32);
    const KernelImpl& loss_k = op_kernel(Op::kCrossEntropy, {f32.type(), labels.type()}, ce);
    const KernelImpl& grad_k =
        op_kernel(Op::kCrossEntropyGrad, {f32.type(), labels.type(), dloss.type()}, ce);
    const KernelImpl& cast_down = op_kernel(Op::kCast, {g32.type()}, to_bf16);
    auto call = [&](const KernelImpl& k, const Attributes& a, std::vector<Tensor> in,
                    std::vector<Tensor> out) {
      k.kernel(KernelArgs{a, in, out, stream, nullptr});
    };
    const double ms = time_ms(stream, [&] {
      call(cast_up, to_f32, {bf}, {f32});
      call(loss_k, ce, {f32, labels}, {loss});
      call(grad_k, ce, {f32, labels, dloss}, {g32});
      call(cast_down, to_bf16, {g32}, {gbf});
    });
    std::printf("unfused: cast (%s) + cross_entropy (%s) + cross_entropy_grad (%s) + cast (%s): "
                "%.3f ms\n",
                cast_up.dialect.c_str(), loss_k.dialect.c_str(), grad_k.dialect.c_str(),
                cast_down.dialect.c_str(), ms);
  }
  cuda::check_device_errors();
}

}  // namespace
}  // namespace kiln
