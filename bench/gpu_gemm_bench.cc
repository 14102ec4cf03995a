// cuBLASLt GEMM speed (backends/cuda/cublaslt/cublaslt.h) at GPT-2's shapes, bf16: TFLOP/s of the
// heuristic's plan and of the autotuned one per product and epilogue; the residual projections
// as one call (f32 D = A B + bf16 bias + f32 C) against the bare product; the weight-gradient
// product's variants (f32 or bf16 output, a ones column for the bias gradient, a padded lda).
// And fp8 (ops/fp8.h) against bf16 at LLaMA-1B's and GPT-2's linear layers: the whole fp8 product
// (amax, quantization, FP8 GEMM), its FP8 GEMM alone and its quantization alone.
// Prints numbers (moved from tests/cuda/cublaslt_test.cc); runs on the GPU machine.
//
// Usage: gpu_gemm_bench [tflops | residual | weight-gradients | fp8]...   (none: all)
#include "backends/cuda/cublaslt/cublaslt.h"
#include "backends/cuda/cublaslt/fp8.cuh"
#include "gpu_bench_util.h"

namespace kiln {
namespace {

using bench::time_ms;
using cuda::Epilogue;
using cuda::Gemm;
using cuda::GemmOperands;

// bf16 values in [-1, 1): a 4 MiB random block copied over the buffer (as pairs of bf16, also
// f32 values in [-1, 1) where the buffer is read as f32).
void fill_random(void* p, size_t bytes, uint64_t seed) {
  const size_t block = std::min<size_t>(bytes, size_t{4} << 20);
  const Tensor host = random_tensor({DType::kBF16, {static_cast<int64_t>(block / 2)}}, seed);
  for (size_t off = 0; off < bytes; off += block)
    KILN_CUDA_CHECK(cudaMemcpy(static_cast<std::byte*>(p) + off, host.raw(),
                               std::min(block, bytes - off), cudaMemcpyHostToDevice));
}

std::shared_ptr<std::byte[]> random_buffer(size_t bytes, uint64_t seed) {
  auto p = cuda::allocate(bytes);
  fill_random(p.get(), bytes, seed);
  return p;
}

double gemm_ms(const Gemm& g, const GemmOperands& ops, cudaStream_t s, int reps) {
  return time_ms(s, reps, [&] { g.run(ops, s); });
}

void print_speed(const std::string& what, Gemm g, int reps) {
  const size_t a_bytes = g.m * g.k * 2, b_bytes = g.k * g.n * 2, d_bytes = g.m * g.n * 2;
  auto a = random_buffer(a_bytes, 1), b = random_buffer(b_bytes, 2),
       bias = random_buffer(std::max(g.m, g.n) * 2, 3), aux = random_buffer(d_bytes, 4);
  auto d = cuda::allocate(d_bytes);
  GemmOperands ops{a.get(), b.get(), nullptr, d.get()};
  if (cuda::epilogue_reads_bias(g.epilogue)) ops.bias = bias.get();
  if (cuda::epilogue_writes_bias(g.epilogue)) ops.bias_grad = bias.get();
  ops.aux = aux.get();
  cuda::Stream stream;
  const auto s = static_cast<cudaStream_t>(stream.handle());
  const double flop = 2.0 * g.m * g.n * g.k;
  const double heuristic = gemm_ms(g, ops, s, reps);
  const std::string heuristic_algo = g.plan(ops, s).algorithm();
  cuda::set_gemm_autotune(true);
  g.plan(ops, s);
  cuda::set_gemm_autotune(false);
  const double tuned = gemm_ms(g, ops, s, reps);
  fmt::print(
      "{:<34} {:>5}x{:<5}x{:>5} {:<14}: heuristic {:7.1f} TFLOP/s ({:.3f} ms), "
      "tuned {:7.1f} TFLOP/s ({:.3f} ms)\n    heuristic {}\n    tuned     {}\n",
      what, g.m, g.n, g.k, cuda::epilogue_name(g.epilogue), flop / heuristic * 1e-9, heuristic,
      flop / tuned * 1e-9, tuned, heuristic_algo, g.plan(ops, s).algorithm());
}

Gemm bf16_gemm(int64_t m, int64_t n, int64_t k, bool ta, bool tb, Epilogue e) {
  Gemm g;
  g.m = m, g.n = n, g.k = k, g.transpose_a = ta, g.transpose_b = tb;
  g.a_type = g.d_type = DType::kBF16;
  g.epilogue = e;
  return g;
}

// A square product, then GPT-2 124M's four linear layers at B*T = 32768, C = 768 (weights
// stored (in, out) as kiln's x @ w): forward bare and with its epilogue, dx, dw with bgrad.
void tflops() {
  print_speed("square bf16", bf16_gemm(8192, 8192, 8192, false, false, Epilogue::kNone), 20);
  const int64_t bt = 32768, c = 768;
  struct Layer {
    const char* name;
    int64_t in, out;
    Epilogue forward;
  };
  const Layer layers[] = {{"qkv", c, 3 * c, Epilogue::kBias},
                          {"attn proj", c, c, Epilogue::kBias},
                          {"fc", c, 4 * c, Epilogue::kGeluAuxBias},
                          {"fc proj", 4 * c, c, Epilogue::kBias}};
  for (const Layer& l : layers) {
    print_speed(fmt::format("{} forward", l.name),
                bf16_gemm(bt, l.out, l.in, false, false, Epilogue::kNone), 50);
    print_speed(fmt::format("{} forward +epilogue", l.name),
                bf16_gemm(bt, l.out, l.in, false, false, l.forward), 50);
    print_speed(fmt::format("{} dx = dy w^T", l.name),
                bf16_gemm(bt, l.in, l.out, false, true,
                          l.forward == Epilogue::kBias && l.in == 4 * c ? Epilogue::kDGeluBGrad
                                                                        : Epilogue::kNone),
                50);
    print_speed(fmt::format("{} dw = x^T dy +bgrad", l.name),
                bf16_gemm(l.in, l.out, bt, true, false, Epilogue::kBGradB), 50);
  }
}

// GPT-2's residual projections at B*T = 32768, C = 768 (attention proj k 768, fc2 k 3072): the
// bare bf16 product against the one call the nvrtc dialect binds x + f32(y W + b) to (f32 D,
// bf16 bias, f32 C).
void residual_projections() {
  const int64_t m = 32768, n = 768;
  for (int64_t k : {int64_t{768}, int64_t{3072}}) {
    auto a = random_buffer(m * k * 2, 1), b = random_buffer(k * n * 2, 2),
         bias = random_buffer(n * 2, 3);
    auto c = random_buffer(m * n * 4, 4);  // pairs of bf16 in [-1, 1): f32 values in [-1, 1)
    auto d = cuda::allocate(m * n * 4);
    cuda::Stream stream;
    const auto s = static_cast<cudaStream_t>(stream.handle());
    Gemm bare;
    bare.m = m, bare.n = n, bare.k = k, bare.a_type = bare.d_type = DType::kBF16;
    const double bare_ms = gemm_ms(bare, GemmOperands{a.get(), b.get(), nullptr, d.get()}, s, 50);
    Gemm fused = bare;
    fused.d_type = DType::kF32;
    fused.epilogue = Epilogue::kBias;
    fused.bias_type = DType::kBF16;
    GemmOperands ops{a.get(), b.get(), c.get(), d.get()};
    ops.beta = 1.0;
    ops.bias = bias.get();
    const double fused_ms = gemm_ms(fused, ops, s, 50);
    fmt::print(
        "residual projection {}x{}x{}: bf16 product alone {:.1f} us; f32 D = A B + bf16 "
        "bias + f32 C in one call {:.1f} us\n    {}\n",
        m, n, k, bare_ms * 1e3, fused_ms * 1e3, fused.plan(ops, s).algorithm());
  }
}

// The weight-gradient product's variants at GPT-2's shapes: the f32 output kiln's dW groups
// write against a bf16 one, and the bias gradient taken as an extra row of the product by a
// ones column appended to the activation (m = 776: one ones column padded to 8 for 16-byte
// rows), with the forward product reading that activation through lda = 776.
void weight_gradients() {
  const int64_t bt = 32768, c = 768, padded = 776;
  cuda::Stream stream;
  const auto s = static_cast<cudaStream_t>(stream.handle());
  auto a = random_buffer(bt * 3072 * 2, 1), b = random_buffer(bt * 3072 * 2, 2);
  auto d = cuda::allocate(bt * 3072 * 4);
  GemmOperands ops{a.get(), b.get(), nullptr, d.get()};
  auto us = [&](const Gemm& g) { return gemm_ms(g, ops, s, 50) * 1e3; };
  for (int64_t out : {3 * c, 4 * c, c}) {
    Gemm g;
    g.m = c, g.n = out, g.k = bt, g.transpose_a = true;
    g.a_type = DType::kBF16;
    g.d_type = DType::kF32;
    const double f32_out = us(g);
    g.d_type = DType::kBF16;
    const double bf16_out = us(g);
    g.m = padded;
    const double ones = us(g);
    g.d_type = DType::kF32;
    const double ones_f32 = us(g);
    Gemm f;  // forward: (bt, c) x (c, out), the activation read with lda 776 or packed
    f.m = bt, f.n = out, f.k = c;
    f.a_type = f.d_type = DType::kBF16;
    const double packed = us(f);
    f.lda = padded;
    const double strided = us(f);
    f.lda = 0;
    f.k = padded;
    const double wider = us(f);
    fmt::print(
        "dW {}x{}x{}: f32 out {:.1f} us, bf16 out {:.1f} us, m=776 bf16 {:.1f} us, m=776 "
        "f32 {:.1f} us; forward packed {:.1f} us, lda 776 {:.1f} us, k=776 {:.1f} us\n",
        c, out, bt, f32_out, bf16_out, ones, ones_f32, packed, strided, wider);
  }
}

// One linear layer's three products (forward x w, dx = dy w^T, dw = x^T dy; w stored (in, out)),
// bf16 against fp8 (e4m3 forward, e5m2 for dy), at `tokens` rows.
void fp8_layer(const char* name, int64_t tokens, int64_t in, int64_t out) {
  struct Product {
    const char* what;
    int64_t m, n, k;
    bool ta, tb;
    Fp8Format fa, fb;
  };
  const Fp8Format e4 = Fp8Format::kE4M3, e5 = Fp8Format::kE5M2;
  const Product products[] = {{"forward", tokens, out, in, false, false, e4, e4},
                              {"dx", tokens, in, out, false, true, e5, e4},
                              {"dw", in, out, tokens, true, false, e4, e5}};
  cuda::Stream stream;
  const auto s = static_cast<cudaStream_t>(stream.handle());
  double total_bf16 = 0, total_fp8 = 0;
  for (const Product& p : products) {
    auto a = random_buffer(p.m * p.k * 2, 1), b = random_buffer(p.k * p.n * 2, 2);
    auto d = cuda::allocate(p.m * p.n * 2);
    Gemm g = bf16_gemm(p.m, p.n, p.k, p.ta, p.tb, Epilogue::kNone);
    const GemmOperands ops{a.get(), b.get(), nullptr, d.get()};
    const double bf16 = gemm_ms(g, ops, s, 20);
    g.fp8_a = p.fa, g.fp8_b = p.fb;
    const double fp8 = gemm_ms(g, ops, s, 20);
    // The parts: quantization alone (amax and both operands, as Gemm::run does), then the FP8
    // GEMM alone on operands quantized once.
    auto scalars = cuda::allocate(64);
    auto qa = cuda::allocate(p.m * p.k), qb = cuda::allocate(p.n * p.k);
    float* f = reinterpret_cast<float*>(scalars.get());
    auto quantize = [&] {
      KILN_CUDA_CHECK(cudaMemsetAsync(f, 0, 32, s));
      cuda::fp8::amax(DType::kBF16, a.get(), p.m * p.k, f, s);
      cuda::fp8::amax(DType::kBF16, b.get(), p.n * p.k, f + 4, s);
      cuda::fp8::quantize(DType::kBF16, p.fa, a.get(), p.ta ? p.k : p.m, p.ta ? p.m : p.k, p.ta, f,
                          reinterpret_cast<uint8_t*>(qa.get()), f + 8, s);
      cuda::fp8::quantize(DType::kBF16, p.fb, b.get(), p.tb ? p.n : p.k, p.tb ? p.k : p.n, !p.tb, f + 4,
                          reinterpret_cast<uint8_t*>(qb.get()), f + 12, s);
    };
    const double quantize_ms = time_ms(s, 20, quantize);
    Gemm q = g;
    q.transpose_a = false, q.transpose_b = true;
    GemmOperands qops{qa.get(), qb.get(), nullptr, d.get()};
    qops.scale_a = f + 8, qops.scale_b = f + 12;
    const double gemm_only = gemm_ms(q, qops, s, 20);
    const double flop = 2.0 * p.m * p.n * p.k;
    const double bytes = 5.0 * (p.m * p.k + p.n * p.k);  // amax 2 + read 2 + write 1 per element
    fmt::print("{:<10} {:<8} {:>5}x{:<5}x{:>5}: bf16 {:7.3f} ms ({:5.0f} TFLOP/s) | fp8 {:7.3f} ms = "
               "quantize {:6.3f} ms ({:4.0f} GB/s) + gemm {:6.3f} ms ({:5.0f} TFLOP/s)\n",
               name, p.what, p.m, p.n, p.k, bf16, flop / bf16 * 1e-9, fp8, quantize_ms,
               bytes / quantize_ms * 1e-6, gemm_only, flop / gemm_only * 1e-9);
    total_bf16 += bf16, total_fp8 += fp8;
  }
  fmt::print("{:<10} layer: bf16 {:.3f} ms, fp8 {:.3f} ms ({:.2f}x)\n", name, total_bf16, total_fp8,
             total_bf16 / total_fp8);
}

void fp8() {
  fp8_layer("llama qkv", 8192, 2048, 3072);
  fp8_layer("llama o", 8192, 2048, 2048);
  fp8_layer("llama w13", 8192, 2048, 16384);
  fp8_layer("llama w2", 8192, 8192, 2048);
  fp8_layer("gpt2 qkv", 32768, 768, 2304);
  fp8_layer("gpt2 fc", 32768, 768, 3072);
  fp8_layer("gpt2 proj", 32768, 3072, 768);
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  return kiln::bench::run_sections("gpu_gemm_bench", argc, argv,
                                   {{"tflops", kiln::tflops},
                                    {"residual", kiln::residual_projections},
                                    {"weight-gradients", kiln::weight_gradients},
                                    {"fp8", kiln::fp8}});
}
