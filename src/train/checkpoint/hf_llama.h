// LLaMA weights in Hugging Face transformers' layout: LlamaForCausalLM's safetensors names and
// its config.json, so that a model kiln trained loads there (from_pretrained) and a model from
// there trains here.
//
// kiln's llama (models/llama.cc) and transformers' compute the same function: pre-RMSNorm
// blocks, rotary embeddings by rotate-half (no permutation of q and k: transformers' own
// checkpoints are already in that convention), grouped-query attention, SwiGLU, no biases, an
// untied head. Only the layout differs: kiln's matrices are (in, out) for x @ w, transformers'
// nn.Linear weights are (out, in), so every projection and the head are transposed; the
// embedding is (vocab, C) in both.
//
//   kiln                  transformers
//   emb.weight            model.embed_tokens.weight
//   h{l}.n1.weight        model.layers.{l}.input_layernorm.weight
//   h{l}.q/k/v/o.weight   model.layers.{l}.self_attn.{q,k,v,o}_proj.weight   (transposed)
//   h{l}.n2.weight        model.layers.{l}.post_attention_layernorm.weight
//   h{l}.w1/w3/w2.weight  model.layers.{l}.mlp.{gate,up,down}_proj.weight    (transposed)
//   norm.weight           model.norm.weight
//   head.weight           lm_head.weight                                      (transposed)
#pragma once

#include <map>
#include <string>
#include <vector>

#include "models/models.h"
#include "tensor/tensor.h"

namespace kiln::train {

// A LLaMA model's config and params, by kiln's names (host tensors).
struct LlamaWeights {
  models::LlamaConfig config;
  std::map<std::string, Tensor> params;
};

// config.json of `config` as LlamaForCausalLM reads it (max_position_embeddings = config.seq).
std::string hf_llama_config_json(const models::LlamaConfig& config);
// The config in a config.json's text; kiln::Error naming `source` and the field for what kiln's
// llama does not compute (another model_type, rope scaling, biases, tied embeddings, ...).
models::LlamaConfig llama_config_from_hf_json(const std::string& text, const std::string& source);

// kiln's params (every one of `config`'s, each (in, out); other tensors, such as a checkpoint's
// optimizer state, are left out) to transformers' names and layouts, and back. Throws kiln::Error
// naming a missing tensor or one of another shape.
std::map<std::string, Tensor> to_hf_llama(const models::LlamaConfig& config, const std::map<std::string, Tensor>& params);
std::map<std::string, Tensor> from_hf_llama(const models::LlamaConfig& config, const std::map<std::string, Tensor>& hf);

// kiln's names of a llama's params with `layers` blocks.
std::vector<std::string> llama_param_names(int64_t layers);

// `dir`/model.safetensors and `dir`/config.json (the directory is made).
void export_hf_llama(const LlamaWeights& weights, const std::string& dir);
// A transformers LlamaForCausalLM directory: config.json and model.safetensors (or the shards
// model.safetensors.index.json names). f16 and bf16 weights become f32.
LlamaWeights import_hf_llama(const std::string& dir);

// The config of a kiln llama checkpoint's params: sizes from the tensors' shapes, heads from
// `heads` (their shapes hold C = heads * head_dim, not the split), seq from `seq`.
models::LlamaConfig llama_config_of(const std::map<std::string, Tensor>& params, int64_t heads, int64_t seq);

}  // namespace kiln::train
