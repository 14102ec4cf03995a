// The model zoo: forward graphs built with the builder API, from a config. Each returns a graph
// whose outputs are (loss, logits) and whose inputs are the params followed by the data.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "ir/builder.h"
#include "tensor/tensor.h"

namespace kiln::models {

struct MlpConfig {
  int64_t batch = 32;
  int64_t inputs = 784;
  std::vector<int64_t> hidden = {128};
  int64_t classes = 10;
  DType dtype = DType::kF32;  // of params, x and logits (f64 for gradient checks)
};
// x (B, inputs) data, labels (B,) i64 data; layers: matmul + bias, gelu; last layer logits.
Graph mlp(const MlpConfig& config);

struct GptConfig {
  int64_t batch = 2;
  int64_t seq = 16;        // T, also the number of learned positions
  int64_t vocab = 64;
  int64_t layers = 2;
  int64_t heads = 2;
  int64_t d_model = 32;
  double dropout = 0.0;    // 0 = no dropout nodes
  DType dtype = DType::kF32;  // of params and activations (f64 for gradient checks)
};
// GPT-2: pre-LayerNorm blocks, learned positions, tied embedding / LM head, tanh-GELU, causal
// attention. idx (B, T) i64 and targets (B, T) i64 data. With dropout, a state input
// "rng.offset" (i64 scalar) keys the dropout masks; the training step advances it (see
// compile/training_graph.h), so every step draws new masks and a resumed run draws the same ones.
Graph gpt(const GptConfig& config);
// Named configs: gpt2-tiny (CPU tests), gpt2 (124M), gpt2-medium (350M), gpt2-large (774M),
// gpt2-xl (1.56B); the vocabulary padded to 50304 (a multiple of 128) as nanoGPT does.
GptConfig gpt_config(const std::string& name);

struct LlamaConfig {
  int64_t batch = 2;
  int64_t seq = 16;         // T (rotary positions 0 .. T-1)
  int64_t vocab = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t kv_heads = 2;     // key/value heads, dividing heads (grouped-query attention)
  int64_t d_model = 32;
  int64_t hidden = 64;      // SwiGLU's inner size
  double rope_base = 10000.0;
  double norm_epsilon = 1e-5;
  DType dtype = DType::kF32;  // of params and activations (f64 for gradient checks)
};
// LLaMA-style decoder (models/llama.cc), as ../shared/bench/torch_llama.py: pre-RMSNorm blocks,
// rotary embeddings, causal grouped-query attention, SwiGLU MLP, no biases, untied head. idx and
// targets (B, T) i64 data. Params h{l}.{n1,q,k,v,o,n2,w1,w3,w2}.weight, emb.weight,
// norm.weight, head.weight; matrices (in, out).
Graph llama(const LlamaConfig& config);
// Named configs: llama-tiny (CPU tests), llama-160m and llama-1b (torch_llama.py's), llama-8b
// (Llama 3 8B's sizes and rotary base 500000, seq 2048).
LlamaConfig llama_config(const std::string& name);

// Sizes that override a named config's (0: the config's), e.g. from the CLI's --layers flags;
// for llama* also the rotary base and RMSNorm epsilon (--rope-theta, --rms-eps: an imported
// Llama 3's 500000 and its epsilon).
struct ModelSizes {
  int64_t layers = 0, d_model = 0, heads = 0, kv_heads = 0, hidden = 0, vocab = 0, seq = 0;
  double rope_base = 0, norm_epsilon = 0;
};
// A named LLaMA config with `sizes` applied (as by_name builds it).
LlamaConfig llama_config(const std::string& name, const ModelSizes& sizes);

// What a trainer or benchmark needs to know of a language model of the zoo.
struct LanguageModelInfo {
  int64_t vocab = 0, seq = 0, layers = 0, d_model = 0;
};
// Whether `name` is a language model of the zoo (gpt2*, llama*): data idx and targets (B, T).
bool is_language_model(const std::string& name);
// The sizes of language model `name` with `sizes` applied. Throws kiln::Error for other models.
LanguageModelInfo language_model_info(const std::string& name, const ModelSizes& sizes = {});
// Initial params of a zoo language model's graph (init_params with its layer count).
std::vector<Tensor> init_language_model(const Graph& graph, const std::string& name, uint64_t seed,
                                        const ModelSizes& sizes = {});

// Initial parameter values in graph-input order (params only), deterministic in seed:
// weights normal(0, 0.02) (residual projections, GPT-2's proj/fc2 and LLaMA's o/w2, scaled by
// 1/sqrt(2 * layers)), biases 0, norm gains 1. Parameters are recognized by name.
std::vector<Tensor> init_params(const Graph& graph, uint64_t seed, int64_t layers = 1);
// Rank `rank`'s flat shards of init_params' values (passes/sharding.h's layout: each param
// flattened, zero-padded to world * k, elements [rank * k, (rank + 1) * k)), drawing only those:
// a zero3 rank's share of the work (Trainer takes a sharded param as its full value or as this).
std::vector<Tensor> init_param_shards(const Graph& graph, uint64_t seed, int64_t layers, int world, int rank);

struct CnnConfig {
  int64_t batch = 32;
  int64_t channels = 1;  // input image channels
  int64_t height = 28;
  int64_t width = 28;
  std::vector<int64_t> conv_channels = {16, 32};
  int64_t classes = 10;
  DType dtype = DType::kF32;  // of params, x and logits (f64 for gradient checks)
};
// A small convnet: per conv_channels entry, conv2d 3x3 padding 1 + bias, relu, max_pool2d 2x2;
// then flatten and one linear layer to the classes. Params conv{i}.weight (O, C, 3, 3),
// conv{i}.bias (O,), fc.weight (features, classes), fc.bias (classes,); data x (B, C, H, W) and
// labels (B,) i64.
Graph cnn(const CnnConfig& config);

// Initial parameter values in graph-input order (params only), deterministic in seed, scaled by
// fan-in (PyTorch's default for Linear and Conv2d): rank >= 2 weights uniform(-1/sqrt(fan_in),
// 1/sqrt(fan_in)), where fan_in is the first dim of a matmul weight (in, out) and the product
// of all dims but the first for a conv weight (O, C, KH, KW) (any rank >= 3); rank <= 1 params
// (biases) 0. Keeps relu activations O(1) through depth, unlike init_params' fixed 0.02.
std::vector<Tensor> init_params_fan_in(const Graph& graph, uint64_t seed);

// The model zoo by name, as the CLI knows it (model_names(): mlp (784-256-10), cnn, gpt2-tiny,
// gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-tiny, llama-160m, llama-1b, llama-8b); seq > 0
// overrides a language model's sequence length, `sizes` any of its sizes (an error for a size the
// model does not have: GPT-2 has no kv_heads, hidden, rotary base or RMSNorm, mlp and cnn take none).
Graph by_name(const std::string& name, int64_t batch, int64_t seq = 0);
Graph by_name(const std::string& name, int64_t batch, const ModelSizes& sizes);
const std::vector<std::string>& model_names();
// "mlp, cnn, ... or gpt2-xl", for error messages.
std::string model_names_text();

}  // namespace kiln::models
