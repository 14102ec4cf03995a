// `kiln export-hf` and `kiln import-hf`: a LLaMA checkpoint to and from the layout of Hugging Face
// transformers' LlamaForCausalLM (a directory of model.safetensors and config.json;
// train/checkpoint/hf_llama.h).
#include <filesystem>

#include "options.h"
#include "support/error.h"
#include "train/checkpoint/hf_llama.h"
#include "train/checkpoint/reshard.h"
#include "train/checkpoint/safetensors.h"

namespace kiln::cli {
namespace {

int64_t metadata_int(const std::map<std::string, std::string>& metadata, const char* key) {
  auto it = metadata.find(key);
  return it == metadata.end() ? 0 : std::stoll(it->second);
}

void export_hf(const std::string& checkpoint, const std::string& out, int64_t heads, int64_t seq) {
  // A directory: its newest checkpoint (a group's rank files too, whose shards are gathered).
  std::vector<std::string> files = {checkpoint};
  if (std::filesystem::is_directory(checkpoint)) {
    const std::optional<train::CheckpointFiles> found = train::find_checkpoint(checkpoint, 1);
    KILN_CHECK(found.has_value(), "export-hf: no checkpoint in '{}'", checkpoint);
    files = found->paths;
  }
  // The params, whole (not the optimizer's state).
  const std::map<std::string, TensorType> types = train::checkpoint_types(files);
  int64_t layers = 0;
  while (types.count(fmt::format("h{}.q.weight", layers))) ++layers;
  std::map<std::string, train::TensorPart> whole;
  for (const std::string& name : train::llama_param_names(layers)) {
    auto it = types.find(name);
    KILN_CHECK(it != types.end(), "export-hf: '{}' has no '{}': not a checkpoint of kiln's llama", files[0], name);
    whole[name] = train::TensorPart{it->second, 0, it->second};
  }
  train::CheckpointRead saved = train::read_checkpoint(files, whole);
  if (heads == 0) heads = metadata_int(saved.metadata, "kiln.heads");
  KILN_CHECK(heads > 0, "export-hf: '{}' does not say its number of heads: give --heads", files[0]);
  if (seq == 0) seq = metadata_int(saved.metadata, "kiln.seq");
  train::LlamaWeights weights;
  weights.config = train::llama_config_of(saved.tensors, heads, seq);
  // Checkpoints written before these were recorded come from configs with the defaults.
  if (auto it = saved.metadata.find("kiln.rope_theta"); it != saved.metadata.end())
    weights.config.rope_base = std::stod(it->second);
  if (auto it = saved.metadata.find("kiln.rms_eps"); it != saved.metadata.end())
    weights.config.norm_epsilon = std::stod(it->second);
  weights.params = std::move(saved.tensors);
  train::export_hf_llama(weights, out);
  const models::LlamaConfig& c = weights.config;
  fmt::print("{}{}: LlamaForCausalLM, {} layers, d_model {}, {} heads ({} key/value), hidden {}, vocab {} -> {}\n",
             files[0], files.size() > 1 ? fmt::format(" and {} more", files.size() - 1) : "", c.layers, c.d_model,
             c.heads, c.kv_heads, c.hidden, c.vocab, out);
}

void import_hf(const std::string& dir, const std::string& out) {
  const train::LlamaWeights weights = train::import_hf_llama(dir);
  const models::LlamaConfig& c = weights.config;
  train::save_safetensors(out, weights.params,
                          {{"kiln.model", "llama"},
                           {"kiln.heads", std::to_string(c.heads)},
                           {"kiln.seq", std::to_string(c.seq)},
                           {"kiln.rope_theta", fmt::format("{}", c.rope_base)},
                           {"kiln.rms_eps", fmt::format("{}", c.norm_epsilon)}});
  fmt::print("{} -> {}; train it with:\n  kiln train --model llama-tiny --layers {} --d-model {} --heads {} --kv-heads {} "
             "--hidden {} --vocab {} --seq {} --rope-theta {} --rms-eps {} --init {}\n",
             dir, out, c.layers, c.d_model, c.heads, c.kv_heads, c.hidden, c.vocab, c.seq, c.rope_base, c.norm_epsilon,
             out);
}

}  // namespace

void add_hf_commands(CLI::App& app) {
  CLI::App* out = app.add_subcommand(
      "export-hf", "Write a LLaMA checkpoint as a Hugging Face LlamaForCausalLM directory (model.safetensors, config.json)");
  auto checkpoint = std::make_shared<std::string>();
  auto out_dir = std::make_shared<std::string>();
  auto heads = std::make_shared<int64_t>(0);
  auto seq = std::make_shared<int64_t>(0);
  out->add_option("CHECKPOINT", *checkpoint,
                  "A checkpoint file with whole tensors, or a --checkpoint-dir (its newest checkpoint, rank files too)")
      ->required();
  out->add_option("OUT_DIR", *out_dir, "The directory to write")->required();
  out->add_option("--heads", *heads, "Attention heads (default: the checkpoint's kiln.heads)");
  out->add_option("--seq", *seq, "max_position_embeddings (default: the checkpoint's kiln.seq)");
  out->callback([=] { export_hf(*checkpoint, *out_dir, *heads, *seq); });

  CLI::App* in = app.add_subcommand(
      "import-hf", "Read a Hugging Face LlamaForCausalLM directory into kiln's params (kiln train --init FILE)");
  auto hf_dir = std::make_shared<std::string>();
  auto file = std::make_shared<std::string>();
  in->add_option("HF_DIR", *hf_dir, "A directory with config.json and model.safetensors (or its index)")->required();
  in->add_option("OUT", *file, "The kiln params file to write (.safetensors)")->required();
  in->callback([=] { import_hf(*hf_dir, *file); });
}

}  // namespace kiln::cli
