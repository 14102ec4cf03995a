#include <algorithm>
#include <cmath>
#include <cstring>

#include "models/models.h"
#include "support/parallel.h"
#include "support/philox.h"
#include "support/error.h"
#include "tensor/host_memory.h"

namespace kiln::models {

GptConfig gpt_config(const std::string& name) {
  if (name == "gpt2-tiny") return GptConfig{4, 64, 256, 2, 4, 64, 0.0};
  if (name == "gpt2") return GptConfig{8, 1024, 50304, 12, 12, 768, 0.0};
  if (name == "gpt2-medium") return GptConfig{8, 1024, 50304, 24, 16, 1024, 0.0};
  if (name == "gpt2-large") return GptConfig{8, 1024, 50304, 36, 20, 1280, 0.0};
  if (name == "gpt2-xl") return GptConfig{8, 1024, 50304, 48, 25, 1600, 0.0};
  fail("unknown GPT config '{}' (expected gpt2-tiny, gpt2, gpt2-medium, gpt2-large or gpt2-xl)", name);
}

Graph gpt(const GptConfig& c) {
  KILN_CHECK(c.d_model % c.heads == 0, "gpt: d_model {} is not divisible by heads {}", c.d_model,
             c.heads);
  const int64_t B = c.batch, T = c.seq, C = c.d_model, H = c.heads, D = C / H;
  Builder b("gpt");
  auto param = [&](const std::string& name, Shape shape) { return b.param(name, std::move(shape), c.dtype); };
  Expr wte = param("wte", {c.vocab, C});
  Expr wpe = param("wpe", {T, C});
  struct Block {
    Expr ln1_g, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_g, ln2_b, w_fc, b_fc, w_fc2, b_fc2;
  };
  std::vector<Block> blocks;
  for (int64_t l = 0; l < c.layers; ++l) {
    auto p = [&](const char* name, Shape shape) { return param(fmt::format("h{}.{}", l, name), shape); };
    blocks.push_back(Block{p("ln1.weight", {C}), p("ln1.bias", {C}), p("attn.weight", {C, 3 * C}),
                           p("attn.bias", {3 * C}), p("proj.weight", {C, C}), p("proj.bias", {C}),
                           p("ln2.weight", {C}), p("ln2.bias", {C}), p("fc.weight", {C, 4 * C}),
                           p("fc.bias", {4 * C}), p("fc2.weight", {4 * C, C}), p("fc2.bias", {C})});
  }
  Expr lnf_g = param("lnf.weight", {C});
  Expr lnf_b = param("lnf.bias", {C});
  Expr idx = b.data("idx", {B, T}, DType::kI64);
  Expr targets = b.data("targets", {B, T}, DType::kI64);

  Expr rng_offset = c.dropout > 0 ? b.state("rng.offset", {}, DType::kI64) : Expr();
  auto maybe_dropout = [&](Expr x, int64_t seed) {
    return c.dropout > 0 ? dropout(x, c.dropout, seed, rng_offset) : x;
  };
  // (B, T, C) + (T, C): token plus position embeddings.
  Expr x = gather(wte, idx) + gather(wpe, b.iota({T}));
  x = maybe_dropout(x, 0);
  auto heads_first = [&](Expr t) { return transpose(reshape(t, {B, T, H, D}), {0, 2, 1, 3}); };
  for (int64_t l = 0; l < c.layers; ++l) {
    const Block& k = blocks[l];
    Expr h = layer_norm(x, k.ln1_g, k.ln1_b);
    std::vector<Expr> qkv = split(matmul(h, k.w_qkv) + k.b_qkv, {C, C, C}, 2);
    Expr y = attention(heads_first(qkv[0]), heads_first(qkv[1]), heads_first(qkv[2]), true);
    y = reshape(transpose(y, {0, 2, 1, 3}), {B, T, C});  // (B, H, T, D) -> (B, T, C)
    x = x + maybe_dropout(matmul(y, k.w_proj) + k.b_proj, 2 * l + 1);
    h = layer_norm(x, k.ln2_g, k.ln2_b);
    Expr m = matmul(gelu(matmul(h, k.w_fc) + k.b_fc, "tanh"), k.w_fc2) + k.b_fc2;
    x = x + maybe_dropout(m, 2 * l + 2);
  }
  x = layer_norm(x, lnf_g, lnf_b);
  Expr logits = matmul(x, wte, false, true).named("logits");  // tied LM head: (B, T, V)
  Expr loss = cross_entropy(logits, targets).named("loss");
  return b.finish({loss, logits});
}

namespace {

// t = std * N(0, 1) by Box-Muller in f32 on Philox-4x32-10 (support/philox.h): elements
// 4b .. 4b+3 come from counter block (b, 0) keyed by the tensor's seed, two pairs of 24-bit
// uniforms, so the values depend on neither the thread count nor the order. Cost per value on
// one core: ~10 ns (one log, sqrt and sincos in f32 per pair; Philox 2 ns), against ~27 for
// std::normal_distribution<double> on mt19937_64, which made GPT-2's 124M values most of
// `kiln bench`'s setup (~1 s on the GPU machine). The smallest u1 is 2^-24: |z| <= 5.8.
// Elements [begin, begin + out.numel()) of a tensor so drawn (out may be a shard's slice of
// it): every block overlapping the range is drawn and only its elements in the range kept.
void fill_normal(Tensor& out, int64_t begin, uint64_t seed, double std) {
  const int64_t count = out.numel();
  if (count == 0) return;
  float* f32 = out.dtype() == DType::kF32 ? out.data<float>() : nullptr;
  const PhiloxKey key{{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}};
  const float scale = static_cast<float>(std);
  const int64_t first = begin / 4, last = (begin + count - 1) / 4;
  parallel_for(first, last + 1, int64_t{1} << 13, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t b = block_begin; b < block_end; ++b) {
      const uint64_t ub = static_cast<uint64_t>(b);
      const PhiloxBlock r = philox4x32_10(PhiloxBlock{{uint32_t(ub), uint32_t(ub >> 32), 0u, 0u}}, key);
      float z[4];
      for (int pair = 0; pair < 2; ++pair) {
        const float u1 = (static_cast<float>(r.word[2 * pair] >> 8) + 1.0f) * 0x1p-24f;  // (0, 1]: finite log
        const float u2 = static_cast<float>(r.word[2 * pair + 1] >> 8) * 0x1p-24f;
        const float radius = scale * std::sqrt(-2.0f * std::log(u1));
        const float angle = 6.2831853f * u2;
        z[2 * pair] = radius * std::cos(angle);
        z[2 * pair + 1] = radius * std::sin(angle);
      }
      for (int k = 0; k < 4; ++k) {
        const int64_t i = 4 * b + k - begin;
        if (i < 0 || i >= count) continue;
        if (f32) f32[i] = z[k];
        else out.set(i, z[k]);
      }
    }
  });
}

// Elements [begin, begin + out.numel()) of param `v`'s initial value (the `index`-th param);
// past the param's end (a shard's padding), zeros. Writes every element of `out`, which may
// hold anything before.
void init_param(const Value& v, uint64_t seed, uint64_t index, int64_t layers, int64_t begin, Tensor& out) {
  auto ends_with = [&](const char* suffix) {
    std::string s(suffix);
    return v.name.size() >= s.size() && v.name.compare(v.name.size() - s.size(), s.size(), s) == 0;
  };
  const int64_t n = std::clamp<int64_t>(v.type.numel() - begin, 0, out.numel());  // the rest is padding
  const size_t element = dtype_size(out.dtype());
  std::memset(out.raw() + static_cast<size_t>(n) * element, 0, static_cast<size_t>(out.numel() - n) * element);
  if (n == 0) return;
  Tensor head = out.viewed(TensorType{out.dtype(), {n}}, 0);
  if (v.type.rank() == 1) {
    // Norm gains (GPT-2's ln1/ln2/lnf, LLaMA's n1/n2/norm) 1, biases 0.
    const bool gain = ends_with("ln1.weight") || ends_with("ln2.weight") || ends_with("lnf.weight") ||
                      ends_with(".n1.weight") || ends_with(".n2.weight") || v.name == "norm.weight";
    for (int64_t i = 0; i < n; ++i) head.set(i, gain ? 1.0 : 0.0);
  } else {
    // Residual projections: GPT-2's proj and fc2, LLaMA's o and w2.
    const bool residual = ends_with("proj.weight") || ends_with("fc2.weight") || ends_with(".o.weight") ||
                          ends_with(".w2.weight");
    const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(std::max<int64_t>(layers, 1)));
    const double std = residual ? residual_std : 0.02;
    fill_normal(head, begin, seed * 1000003ull + index, std);
  }
}

// A tensor for init_param to write whole. Not zero-filled first: the draw's parallel loop is
// then the first to touch its pages, and each is written once rather than twice.
Tensor unfilled_tensor(const TensorType& type) { return Tensor(type, allocate_host(type.bytes(), false), 0); }

}  // namespace

std::vector<Tensor> init_params(const Graph& graph, uint64_t seed, int64_t layers) {
  std::vector<Tensor> out;
  uint64_t index = 0;
  for (const GraphInput& in : graph.inputs) {
    if (in.role != Role::kParam) continue;
    const Value& v = graph.value(in.value);
    Tensor t = unfilled_tensor(v.type);
    Tensor flat = t.reshaped({v.type.numel()});
    init_param(v, seed, index++, layers, 0, flat);
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<Tensor> init_param_shards(const Graph& graph, uint64_t seed, int64_t layers, int world, int rank) {
  std::vector<Tensor> out;
  uint64_t index = 0;
  for (const GraphInput& in : graph.inputs) {
    if (in.role != Role::kParam) continue;
    const Value& v = graph.value(in.value);
    const int64_t k = (v.type.numel() + world - 1) / world;  // passes/sharding.h's param_shard
    Tensor t = unfilled_tensor(TensorType{v.type.dtype, {k}});
    init_param(v, seed, index++, layers, k * rank, t);
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace kiln::models
