// CPU benchmark: measured memory bandwidth (STREAM-like copy and triad), GEMM GFLOP/s through
// the "openblas" kernel, and GB/s of the f32 fast kernels ("cpu") next to the reference kernels
// for elementwise ops, reductions and row ops. Prints one markdown table (bench/log/sessions-1-12.md keeps
// a run and its reading).
//
// Each figure is bytes moved / best time, where "bytes moved" is the least traffic the op needs
// (each input read once, each output written once; write-allocate reads are not counted, as in
// STREAM), and is shown as a fraction of the measured triad bandwidth. GEMM is also shown as a
// fraction of an estimated f32 peak: cores * MHz from /proc/cpuinfo * 32 flop/cycle (two 8-lane
// FMA pipes, as on AVX2 Zen and Intel cores; only a label, not a measurement).
//
// Usage: cpu_bench [--quick]   (--quick: smaller sizes and fewer repetitions, for a smoke run)
// Threads: OMP_NUM_THREADS for the "cpu" kernels, OPENBLAS_NUM_THREADS for GEMM (default: all).
#include <fmt/core.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "ir/op_def.h"
#include "support/parallel.h"
#include "tensor/tensor.h"

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;

// Best wall time of `reps` calls of fn, after one warm-up call when `warm_up`, in seconds.
double best_time(int reps, const std::function<void()>& fn, bool warm_up = true) {
  if (warm_up) fn();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

// One kernel of one dialect bound to inputs and preallocated outputs, so that timing measures
// the kernel only (not allocation and zero-filling of its outputs).
class KernelCall {
 public:
  KernelCall(const std::string& dialect, Op op, std::vector<Tensor> inputs, Attributes attrs = {})
      : attrs_(normalize_attributes(op, std::move(attrs))), inputs_(std::move(inputs)) {
    std::vector<TensorType> in_types;
    for (const Tensor& t : inputs_) in_types.push_back(t.type());
    std::vector<TensorType> out_types = infer_types(op, in_types, attrs_);
    for (const TensorType& t : out_types) outputs_.emplace_back(t);
    Node node{op, {}, {}, attrs_};
    impl_ = &kernel_registry().select(NodeView{node, in_types, out_types}, Device::kCpu, {dialect});
  }
  void operator()() { impl_->kernel(KernelArgs{attrs_, inputs_, outputs_}); }

 private:
  Attributes attrs_;
  std::vector<Tensor> inputs_, outputs_;
  const KernelImpl* impl_ = nullptr;
};

struct Row {
  std::string name, shape, dialect;
  double seconds = 0, bytes = 0, flops = 0;
};

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

double cpu_mhz() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("cpu MHz", 0) == 0) return std::stod(line.substr(line.find(':') + 2));
  return 0;
}

// STREAM-like copy (b = a) and triad (a = b + s*c) over arrays far larger than the caches,
// split across threads like the kernels are.
std::vector<Row> measure_bandwidth(int64_t n, int reps) {
  std::vector<float> a(n), b(n), c(n);
  parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {  // first touch by the same threads
    for (int64_t i = lo; i < hi; ++i) {
      a[i] = 1.0f + static_cast<float>(i % 7);
      b[i] = 2.0f;
      c[i] = 0.5f;
    }
  });
  float* pa = a.data();
  float* pb = b.data();
  float* pc = c.data();
  const std::string shape = fmt::format("{}M f32", n >> 20);
  Row copy{"stream copy", shape, "-"};
  copy.seconds = best_time(reps, [&] {
    parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
      std::memcpy(pb + lo, pa + lo, static_cast<size_t>(hi - lo) * sizeof(float));
    });
  });
  copy.bytes = 2.0 * n * sizeof(float);
  Row triad{"stream triad", shape, "-"};
  triad.seconds = best_time(reps, [&] {
    parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
      const float s = 3.0f;
      float* __restrict__ out = pa;
      for (int64_t i = lo; i < hi; ++i) out[i] = pb[i] + s * pc[i];
    });
  });
  triad.bytes = 3.0 * n * sizeof(float);
  return {copy, triad};
}

std::string shape_text(const Shape& s) { return to_string(s); }

Row time_kernel(const std::string& name, const std::string& dialect, Op op,
                std::vector<Tensor> inputs, Attributes attrs, double bytes, int reps,
                double flops = 0) {
  Row row{name, shape_text(inputs[0].shape()), dialect};
  KernelCall call(dialect, op, std::move(inputs), std::move(attrs));
  row.seconds = best_time(reps, [&] { call(); }, /*warm_up=*/reps > 1);
  row.bytes = bytes;
  row.flops = flops;
  return row;
}

int run(bool quick) {
  const int threads = omp_get_max_threads();
  const double peak_gflops = threads * cpu_mhz() * 1e-3 * 32;
  fmt::print("kiln cpu_bench: {} ({} OpenMP threads, est. f32 peak {:.0f} GFLOP/s){}\n\n",
             cpu_model(), threads, peak_gflops, quick ? " [--quick]" : "");

  std::vector<Row> rows = measure_bandwidth(quick ? int64_t{1} << 22 : int64_t{1} << 25,
                                            quick ? 2 : 5);
  const double bandwidth = rows[1].bytes / rows[1].seconds;  // triad: the reference figure

  // GEMM through the "openblas" kernel.
  for (int64_t n : {256, 512, 1024, 2048}) {
    if (quick && n > 512) break;
    Tensor a = random_tensor({DType::kF32, {n, n}}, 1), b = random_tensor({DType::kF32, {n, n}}, 2);
    const double flops = 2.0 * n * n * n;
    const int reps = std::max(2, static_cast<int>(2e9 / flops));
    rows.push_back(time_kernel("matmul", "openblas", Op::kMatmul, {a, b}, {},
                               3.0 * n * n * sizeof(float), reps, flops));
  }

  // Elementwise and row ops, fast next to reference. The reference kernels run once (they are
  // ~100x slower); the fast ones best of `reps`.
  const int64_t n = quick ? int64_t{1} << 20 : int64_t{1} << 24;
  const int reps = quick ? 2 : 5;
  const double f = sizeof(float);
  const Shape flat{n};
  const Shape btc{n / 1024 / 16, 16, 1024};  // (B, T, C) with C = 1024
  Tensor x = random_tensor({DType::kF32, flat}, 3), y = random_tensor({DType::kF32, flat}, 4);
  Tensor x3 = x.reshaped(btc);
  Tensor bias = random_tensor({DType::kF32, {1024}}, 5);
  Tensor gamma = random_tensor({DType::kF32, {1024}}, 6, 0.5, 1.5);
  Tensor beta = random_tensor({DType::kF32, {1024}}, 7);
  const Attributes last_axis{{"axes", std::vector<int64_t>{-1}}};
  struct Case {
    std::string name;
    Op op;
    std::vector<Tensor> inputs;
    Attributes attrs;
    double bytes;
  };
  const std::vector<Case> cases = {
      {"add", Op::kAdd, {x, y}, {}, 3 * n * f},
      {"add (B,T,C)+(C,)", Op::kAdd, {x3, bias}, {}, 2 * n * f},
      {"mul by scalar", Op::kMul, {x, Tensor::from_f64({DType::kF32, {}}, std::vector<double>{2})},
       {}, 2 * n * f},
      {"relu", Op::kRelu, {x}, {}, 2 * n * f},
      {"exp", Op::kExp, {x}, {}, 2 * n * f},
      {"gelu (erf)", Op::kGelu, {x}, {}, 2 * n * f},
      {"gelu (tanh)", Op::kGelu, {x}, {{"approximate", std::string("tanh")}}, 2 * n * f},
      {"sum (all)", Op::kSum, {x}, {}, n * f},
      {"sum (rows)", Op::kSum, {x3}, last_axis, n * f},
      {"softmax (rows)", Op::kSoftmax, {x3}, {}, 2 * n * f},
      {"layer_norm (rows)", Op::kLayerNorm, {x3, gamma, beta}, {}, 2 * n * f},
  };
  for (const Case& c : cases) {
    rows.push_back(time_kernel(c.name, "cpu", c.op, c.inputs, c.attrs, c.bytes, reps));
    rows.push_back(time_kernel(c.name, "reference", c.op, c.inputs, c.attrs, c.bytes, 1));
  }

  fmt::print("| benchmark | shape | dialect | time (ms) | GB/s | of triad BW | GFLOP/s | of peak |\n");
  fmt::print("|---|---|---|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    const double gbps = r.bytes / r.seconds * 1e-9;
    std::string gflops = "", of_peak = "";
    if (r.flops > 0) {
      gflops = fmt::format("{:.1f}", r.flops / r.seconds * 1e-9);
      of_peak = fmt::format("{:.0f}%", 100 * r.flops / r.seconds * 1e-9 / peak_gflops);
    }
    fmt::print("| {} | {} | {} | {:.2f} | {:.2f} | {:.0f}% | {} | {} |\n", r.name, r.shape,
               r.dialect, r.seconds * 1e3, gbps, 100 * r.bytes / r.seconds / bandwidth, gflops,
               of_peak);
  }
  return 0;
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      fmt::print(stderr, "cpu_bench: unknown argument '{}' (expected --quick)\n", argv[i]);
      return 2;
    }
  }
  try {
    return kiln::run(quick);
  } catch (const std::exception& e) {
    fmt::print(stderr, "cpu_bench: {}\n", e.what());
    return 1;
  }
}
