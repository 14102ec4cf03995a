// LLaMA weights to and from transformers' LlamaForCausalLM layout (hf_llama.h).
#include "train/checkpoint/hf_llama.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "support/error.h"
#include "train/checkpoint/safetensors.h"

namespace kiln::train {
namespace {

// One kiln param and its transformers name, and whether the layouts are transposes.
struct NamePair {
  std::string kiln, hf;
  bool transposed;
};

std::vector<NamePair> name_pairs(int64_t layers) {
  std::vector<NamePair> pairs = {{"emb.weight", "model.embed_tokens.weight", false},
                                 {"norm.weight", "model.norm.weight", false},
                                 {"head.weight", "lm_head.weight", true}};
  for (int64_t l = 0; l < layers; ++l) {
    const std::string k = fmt::format("h{}.", l), h = fmt::format("model.layers.{}.", l);
    pairs.push_back({k + "n1.weight", h + "input_layernorm.weight", false});
    pairs.push_back({k + "n2.weight", h + "post_attention_layernorm.weight", false});
    for (const char* p : {"q", "k", "v", "o"})
      pairs.push_back({k + p + ".weight", h + "self_attn." + p + "_proj.weight", true});
    pairs.push_back({k + "w1.weight", h + "mlp.gate_proj.weight", true});
    pairs.push_back({k + "w3.weight", h + "mlp.up_proj.weight", true});
    pairs.push_back({k + "w2.weight", h + "mlp.down_proj.weight", true});
  }
  return pairs;
}

// kiln's shape of each param of `c` (matrices (in, out)).
std::map<std::string, Shape> kiln_shapes(const models::LlamaConfig& c) {
  const int64_t C = c.d_model, kv = c.kv_heads * (c.d_model / c.heads);
  std::map<std::string, Shape> shapes = {
      {"emb.weight", {c.vocab, C}}, {"norm.weight", {C}}, {"head.weight", {C, c.vocab}}};
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string k = fmt::format("h{}.", l);
    shapes[k + "n1.weight"] = shapes[k + "n2.weight"] = {C};
    shapes[k + "q.weight"] = shapes[k + "o.weight"] = {C, C};
    shapes[k + "k.weight"] = shapes[k + "v.weight"] = {C, kv};
    shapes[k + "w1.weight"] = shapes[k + "w3.weight"] = {C, c.hidden};
    shapes[k + "w2.weight"] = {c.hidden, C};
  }
  return shapes;
}

// `t` (R, C) as f32 (C, R).
Tensor transposed_f32(const Tensor& t) {
  const int64_t rows = t.shape()[0], cols = t.shape()[1];
  Tensor out(TensorType{DType::kF32, {cols, rows}});
  float* to = out.data<float>();
  if (t.dtype() == DType::kF32) {
    const float* from = t.data<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) to[c * rows + r] = from[r * cols + c];
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) to[c * rows + r] = static_cast<float>(t.get(r * cols + c));
  }
  return out;
}

Tensor as_f32(const Tensor& t) {
  if (t.dtype() == DType::kF32) return t;
  Tensor out(TensorType{DType::kF32, t.shape()});
  for (int64_t i = 0; i < t.numel(); ++i) out.data<float>()[i] = static_cast<float>(t.get(i));
  return out;
}

// Renames and lays out `from` (by one side's names) into the other side's: `to_hf` says which.
std::map<std::string, Tensor> convert(const models::LlamaConfig& config, const std::map<std::string, Tensor>& from,
                                      bool to_hf) {
  const std::map<std::string, Shape> shapes = kiln_shapes(config);
  std::map<std::string, Tensor> out;
  for (const NamePair& pair : name_pairs(config.layers)) {
    const std::string& source = to_hf ? pair.kiln : pair.hf;
    auto it = from.find(source);
    KILN_CHECK(it != from.end(), "{} weights have no '{}'", to_hf ? "kiln's llama" : "the LlamaForCausalLM", source);
    Shape want = shapes.at(pair.kiln);
    if (!to_hf && pair.transposed) want = {want[1], want[0]};
    KILN_CHECK(it->second.shape() == want && is_float(it->second.dtype()), "'{}' is {}, expected a float tensor of shape [{}]",
               source, to_string(it->second.type()), fmt::join(want, ","));
    out[to_hf ? pair.hf : pair.kiln] = pair.transposed ? transposed_f32(it->second) : as_f32(it->second);
  }
  return out;
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  KILN_CHECK(in.good(), "cannot read '{}'", path.string());
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

std::string hf_llama_config_json(const models::LlamaConfig& c) {
  nlohmann::ordered_json j = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", c.vocab},
      {"hidden_size", c.d_model},
      {"intermediate_size", c.hidden},
      {"num_hidden_layers", c.layers},
      {"num_attention_heads", c.heads},
      {"num_key_value_heads", c.kv_heads},
      {"head_dim", c.d_model / c.heads},
      {"hidden_act", "silu"},
      {"max_position_embeddings", c.seq},
      {"rms_norm_eps", c.norm_epsilon},
      // transformers 5 reads rope_parameters, earlier versions rope_theta.
      {"rope_theta", c.rope_base},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_base}}},
      {"rope_scaling", nullptr},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"tie_word_embeddings", false},
      {"torch_dtype", "float32"},
  };
  return j.dump(2) + "\n";
}

models::LlamaConfig llama_config_from_hf_json(const std::string& text, const std::string& source) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  KILN_CHECK(j.is_object(), "{}: not a JSON object", source);
  const auto integer = [&](const char* key) -> int64_t {
    KILN_CHECK(j.contains(key) && j[key].is_number_integer() && j[key].get<int64_t>() > 0,
               "{}: '{}' must be a positive integer, got {}", source, key, j.contains(key) ? j[key].dump() : "nothing");
    return j[key].get<int64_t>();
  };
  const auto value_or = [&](const char* key, const nlohmann::json& fallback) {
    return j.contains(key) && !j[key].is_null() ? j[key] : fallback;
  };
  KILN_CHECK(value_or("model_type", "llama") == "llama", "{}: model_type is {}, expected \"llama\"", source,
             j["model_type"].dump());
  models::LlamaConfig c;
  c.vocab = integer("vocab_size");
  c.d_model = integer("hidden_size");
  c.hidden = integer("intermediate_size");
  c.layers = integer("num_hidden_layers");
  c.heads = integer("num_attention_heads");
  c.kv_heads = j.contains("num_key_value_heads") ? integer("num_key_value_heads") : c.heads;
  c.seq = j.contains("max_position_embeddings") ? integer("max_position_embeddings") : c.seq;
  c.norm_epsilon = value_or("rms_norm_eps", 1e-6).get<double>();
  nlohmann::json rope = value_or("rope_parameters", value_or("rope_scaling", nlohmann::json::object()));
  c.rope_base = rope.value("rope_theta", value_or("rope_theta", 10000.0).get<double>());
  const std::string rope_type = rope.value("rope_type", rope.value("type", std::string("default")));
  KILN_CHECK(rope_type == "default", "{}: rope type '{}' (kiln's llama has the default rotary embeddings only)", source,
             rope_type);
  KILN_CHECK(value_or("hidden_act", "silu") == "silu", "{}: hidden_act {}, kiln's llama has silu (SwiGLU)", source,
             j["hidden_act"].dump());
  KILN_CHECK(c.d_model % c.heads == 0 && value_or("head_dim", c.d_model / c.heads) == c.d_model / c.heads,
             "{}: head_dim {} is not hidden_size / num_attention_heads = {} (kiln's llama splits d_model over heads)",
             source, value_or("head_dim", 0).dump(), c.d_model / c.heads);
  for (const char* flag : {"attention_bias", "mlp_bias", "tie_word_embeddings"})
    KILN_CHECK(!value_or(flag, false).get<bool>(), "{}: {} is true; kiln's llama has no biases and an untied head", source,
               flag);
  return c;
}

std::map<std::string, Tensor> to_hf_llama(const models::LlamaConfig& config, const std::map<std::string, Tensor>& params) {
  return convert(config, params, /*to_hf=*/true);
}

std::map<std::string, Tensor> from_hf_llama(const models::LlamaConfig& config, const std::map<std::string, Tensor>& hf) {
  return convert(config, hf, /*to_hf=*/false);
}

std::vector<std::string> llama_param_names(int64_t layers) {
  std::vector<std::string> names;
  for (const NamePair& pair : name_pairs(layers)) names.push_back(pair.kiln);
  return names;
}

void export_hf_llama(const LlamaWeights& weights, const std::string& dir) {
  const std::map<std::string, Tensor> hf = to_hf_llama(weights.config, weights.params);
  std::filesystem::create_directories(dir);
  save_safetensors((std::filesystem::path(dir) / "model.safetensors").string(), hf, {{"format", "pt"}});
  const std::filesystem::path config = std::filesystem::path(dir) / "config.json";
  std::ofstream out(config);
  out << hf_llama_config_json(weights.config);
  KILN_CHECK(out.good(), "cannot write '{}'", config.string());
}

LlamaWeights import_hf_llama(const std::string& dir) {
  const std::filesystem::path d = dir;
  const std::filesystem::path config_path = d / "config.json";
  LlamaWeights weights;
  weights.config = llama_config_from_hf_json(read_text(config_path), fmt::format("'{}'", config_path.string()));
  // One file, or the shards an index names (save_pretrained's max_shard_size).
  std::set<std::string> files;
  if (std::filesystem::exists(d / "model.safetensors")) {
    files.insert("model.safetensors");
  } else {
    const std::filesystem::path index = d / "model.safetensors.index.json";
    KILN_CHECK(std::filesystem::exists(index), "'{}' has neither model.safetensors nor model.safetensors.index.json",
               dir);
    const nlohmann::json j = nlohmann::json::parse(read_text(index), nullptr, false);
    KILN_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), "'{}' has no weight_map",
               index.string());
    for (const auto& [name, file] : j["weight_map"].items()) files.insert(file.get<std::string>());
  }
  std::map<std::string, Tensor> hf;
  for (const std::string& file : files) hf.merge(load_safetensors((d / file).string()).tensors);
  weights.params = from_hf_llama(weights.config, hf);
  return weights;
}

models::LlamaConfig llama_config_of(const std::map<std::string, Tensor>& params, int64_t heads, int64_t seq) {
  const auto shape = [&](const std::string& name) {
    auto it = params.find(name);
    KILN_CHECK(it != params.end() && it->second.rank() == 2, "not a llama checkpoint: no matrix '{}'", name);
    return it->second.shape();
  };
  models::LlamaConfig c;
  c.vocab = shape("emb.weight")[0];
  c.d_model = shape("emb.weight")[1];
  c.layers = 0;
  while (params.count(fmt::format("h{}.q.weight", c.layers))) ++c.layers;
  KILN_CHECK(c.layers > 0, "not a llama checkpoint: no h0.q.weight");
  c.hidden = shape("h0.w1.weight")[1];
  KILN_CHECK(heads > 0 && c.d_model % heads == 0, "heads {} does not divide d_model {}", heads, c.d_model);
  c.heads = heads;
  const int64_t head_dim = c.d_model / heads, kv = shape("h0.k.weight")[1];
  KILN_CHECK(kv % head_dim == 0, "h0.k.weight's {} columns are not a multiple of the head dim {} (d_model {} / heads {})",
             kv, head_dim, c.d_model, heads);
  c.kv_heads = kv / head_dim;
  if (seq > 0) c.seq = seq;
  return c;
}

}  // namespace kiln::train
