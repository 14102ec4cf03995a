// The fused classifier's CUDA kernel (backends/cuda/classifier/classifier.{cu,cc}) against the CPU oracle,
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
// Its speed at GPT-2 size against the unfused ops it replaces: bench/gpu_memory_bench.cc.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>

#include "backends/classifier_test_util.h"
#include "backends/cuda/classifier/classifier.cuh"
#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/runtime/device_errors.h"
#include "backends/cuda/runtime/memory.h"
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

}  // namespace
}  // namespace kiln
