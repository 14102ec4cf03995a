// The LLaMA family: pre-RMSNorm decoder blocks, rotary position embeddings (rotate-half, base
// 10000; Llama 3's 500000 for llama-8b), causal grouped-query attention, a SwiGLU MLP, no biases,
// an untied LM head. The same model as ../shared/bench/torch_llama.py (tests/reference/ checks
// llama-tiny against it) and bench/torch_fsdp_llama.py.
//
// Layout: q, k, v stay (B, T, heads, D) from their projections' reshapes: rotary_embedding and
// attention take that layout ("bthd"), so the graph holds no transposes. SwiGLU is
// silu(h W1) * (h W3), two elementwise ops that fusion puts into one kernel (with the product
// that feeds them where it can).
#include "models/models.h"
#include "support/error.h"

namespace kiln::models {

LlamaConfig llama_config(const std::string& name) {
  // batch, seq, vocab, layers, heads, kv_heads, d_model, hidden
  if (name == "llama-tiny") return LlamaConfig{4, 64, 256, 2, 4, 2, 64, 128};
  if (name == "llama-160m") return LlamaConfig{8, 2048, 32000, 12, 12, 4, 768, 2048};
  if (name == "llama-1b") return LlamaConfig{4, 2048, 32000, 16, 32, 8, 2048, 8192};
  // Llama 3 8B's sizes and rotary base (its 8192 positions cut to 2048, as the others'); --layers
  // picks how many of its blocks fit the devices at hand.
  if (name == "llama-8b") return LlamaConfig{4, 2048, 128256, 32, 32, 8, 4096, 14336, 500000.0};
  fail("unknown LLaMA config '{}' (expected llama-tiny, llama-160m, llama-1b or llama-8b)", name);
}

Graph llama(const LlamaConfig& c) {
  KILN_CHECK(c.heads > 0 && c.kv_heads > 0 && c.d_model % c.heads == 0,
             "llama: d_model {} is not divisible by heads {}", c.d_model, c.heads);
  KILN_CHECK(c.heads % c.kv_heads == 0,
             "llama: heads {} is not a multiple of kv_heads {} (each key/value head serves a group "
             "of query heads)", c.heads, c.kv_heads);
  const int64_t B = c.batch, T = c.seq, C = c.d_model, H = c.heads, Hkv = c.kv_heads, D = C / H;
  KILN_CHECK(D % 2 == 0, "llama: head dim {} (d_model / heads) is odd: rotary embeddings rotate "
             "pairs", D);
  Builder b("llama");
  auto param = [&](const std::string& name, Shape shape) {
    return b.param(name, std::move(shape), c.dtype);
  };
  Expr emb = param("emb.weight", {c.vocab, C});
  struct Block {
    Expr n1, q, k, v, o, n2, w1, w3, w2;
  };
  std::vector<Block> blocks;
  for (int64_t l = 0; l < c.layers; ++l) {
    auto p = [&](const char* name, Shape shape) {
      return param(fmt::format("h{}.{}", l, name), std::move(shape));
    };
    // Weights are (in, out): x @ w.
    blocks.push_back(Block{p("n1.weight", {C}), p("q.weight", {C, C}), p("k.weight", {C, Hkv * D}),
                           p("v.weight", {C, Hkv * D}), p("o.weight", {C, C}), p("n2.weight", {C}),
                           p("w1.weight", {C, c.hidden}), p("w3.weight", {C, c.hidden}),
                           p("w2.weight", {c.hidden, C})});
  }
  Expr norm = param("norm.weight", {C});
  Expr head = param("head.weight", {C, c.vocab});
  Expr idx = b.data("idx", {B, T}, DType::kI64);
  Expr targets = b.data("targets", {B, T}, DType::kI64);

  Expr x = gather(emb, idx);  // (B, T, C)
  for (const Block& k : blocks) {
    Expr h = rms_norm(x, k.n1, c.norm_epsilon);
    Expr q = rotary_embedding(reshape(matmul(h, k.q), {B, T, H, D}), c.rope_base, "bthd");
    Expr key = rotary_embedding(reshape(matmul(h, k.k), {B, T, Hkv, D}), c.rope_base, "bthd");
    Expr value = reshape(matmul(h, k.v), {B, T, Hkv, D});
    Expr y = attention(q, key, value, /*causal=*/true, 0.0, "bthd");  // (B, T, H, D)
    x = x + matmul(reshape(y, {B, T, C}), k.o);
    h = rms_norm(x, k.n2, c.norm_epsilon);
    x = x + matmul(silu(matmul(h, k.w1)) * matmul(h, k.w3), k.w2);
  }
  x = rms_norm(x, norm, c.norm_epsilon);
  Expr logits = matmul(x, head).named("logits");  // (B, T, V)
  Expr loss = cross_entropy(logits, targets).named("loss");
  return b.finish({loss, logits});
}

}  // namespace kiln::models
