#include <algorithm>

#include "models/models.h"
#include "support/error.h"

namespace kiln::models {
namespace {

bool known(const std::string& name) {
  return std::find(model_names().begin(), model_names().end(), name) != model_names().end();
}
bool is_gpt(const std::string& name) { return name.rfind("gpt2", 0) == 0 && known(name); }
bool is_llama(const std::string& name) { return name.rfind("llama", 0) == 0 && known(name); }

bool any_size(const ModelSizes& s) {
  return s.layers || s.d_model || s.heads || s.kv_heads || s.hidden || s.vocab || s.seq || s.rope_base ||
         s.norm_epsilon;
}

template <class T>
void apply(T& field, T value, const char* flag) {
  KILN_CHECK(value >= 0, "{} must be > 0 (or 0: the config's), got {}", flag, value);
  if (value > 0) field = value;
}

// The sizes every language model config has (GptConfig, LlamaConfig).
template <class Config>
Config with_common_sizes(Config c, const ModelSizes& s) {
  apply(c.layers, s.layers, "layers");
  apply(c.d_model, s.d_model, "d_model");
  apply(c.heads, s.heads, "heads");
  apply(c.vocab, s.vocab, "vocab");
  apply(c.seq, s.seq, "seq");
  return c;
}

GptConfig gpt_sized(const std::string& name, const ModelSizes& s) {
  KILN_CHECK(s.kv_heads == 0 && s.hidden == 0,
             "{} has no kv_heads or hidden size (GPT-2: one key/value head per head, MLP 4 x "
             "d_model)", name);
  KILN_CHECK(s.rope_base == 0 && s.norm_epsilon == 0,
             "{} has no rotary base or RMSNorm epsilon (GPT-2: learned positions, LayerNorm)", name);
  return with_common_sizes(gpt_config(name), s);
}

LlamaConfig llama_sized(const std::string& name, const ModelSizes& s) {
  LlamaConfig c = with_common_sizes(llama_config(name), s);
  apply(c.kv_heads, s.kv_heads, "kv_heads");
  apply(c.hidden, s.hidden, "hidden");
  apply(c.rope_base, s.rope_base, "rope_theta");
  apply(c.norm_epsilon, s.norm_epsilon, "rms_eps");
  return c;
}

}  // namespace

Graph by_name(const std::string& name, int64_t batch, int64_t seq) {
  ModelSizes sizes;
  sizes.seq = seq;
  return by_name(name, batch, sizes);
}

Graph by_name(const std::string& name, int64_t batch, const ModelSizes& sizes) {
  KILN_CHECK(batch > 0, "batch must be > 0, got {}", batch);
  if (is_gpt(name)) {
    GptConfig config = gpt_sized(name, sizes);
    config.batch = batch;
    return gpt(config);
  }
  if (is_llama(name)) {
    LlamaConfig config = llama_sized(name, sizes);
    config.batch = batch;
    return llama(config);
  }
  if (name == "mlp" || name == "cnn") {
    ModelSizes no_seq = sizes;
    no_seq.seq = 0;  // a sequence length means nothing here and is ignored, as before
    KILN_CHECK(!any_size(no_seq), "model {} takes no size flags (layers, d_model, heads, ...)", name);
  }
  if (name == "mlp") return mlp(MlpConfig{batch, 784, {256}, 10});
  if (name == "cnn") {
    CnnConfig config;
    config.batch = batch;
    return cnn(config);
  }
  fail("unknown model '{}' (expected {})", name, model_names_text());
}

bool is_language_model(const std::string& name) { return is_gpt(name) || is_llama(name); }

LlamaConfig llama_config(const std::string& name, const ModelSizes& sizes) { return llama_sized(name, sizes); }

LanguageModelInfo language_model_info(const std::string& name, const ModelSizes& sizes) {
  if (is_gpt(name)) {
    const GptConfig c = gpt_sized(name, sizes);
    return {c.vocab, c.seq, c.layers, c.d_model};
  }
  if (is_llama(name)) {
    const LlamaConfig c = llama_sized(name, sizes);
    return {c.vocab, c.seq, c.layers, c.d_model};
  }
  fail("model '{}' is not a language model (expected gpt2* or llama*)", name);
}

std::vector<Tensor> init_language_model(const Graph& graph, const std::string& name, uint64_t seed,
                                        const ModelSizes& sizes) {
  return init_params(graph, seed, language_model_info(name, sizes).layers);
}

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names = {"mlp",        "cnn",        "gpt2-tiny",  "gpt2",
                                                 "gpt2-medium", "gpt2-large", "gpt2-xl",   "llama-tiny",
                                                 "llama-160m", "llama-1b",  "llama-8b"};
  return names;
}

std::string model_names_text() {
  const std::vector<std::string>& n = model_names();
  std::string text;
  for (size_t i = 0; i < n.size(); ++i) text += (i == 0 ? "" : i + 1 == n.size() ? " or " : ", ") + n[i];
  return text;
}

}  // namespace kiln::models
