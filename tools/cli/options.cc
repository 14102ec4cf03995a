#include "options.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <iostream>
#include <sstream>

#include "ir/text.h"
#include "models/models.h"
#include "ops/optimizer/optimizers.h"
#include "passes/remat.h"
#include "support/error.h"

namespace kiln::cli {
namespace {

// A memory size flag ("512MiB", "2GiB", bytes): a CLI error (with the flag's name) when it does
// not parse.
size_t parse_size_flag(const std::string& flag, const std::string& text) {
  try {
    return parse_byte_size(text);
  } catch (const Error& e) {
    throw CLI::ValidationError(flag, e.what());
  }
}

}  // namespace

void add_model_option(CLI::App* command, std::string& model, const std::string& default_model) {
  std::string names;
  for (const std::string& name : models::model_names()) names += (names.empty() ? "" : " | ") + name;
  command->add_option("--model", model, names)
      ->check(CLI::IsMember(models::model_names()))
      ->default_val(default_model);
}

void add_model_size_options(CLI::App* command, models::ModelSizes& sizes) {
  CLI::Option_group* group = command->add_option_group("Model sizes (language models; 0: the config's)");
  group->add_option("--layers", sizes.layers, "Decoder blocks");
  group->add_option("--d-model", sizes.d_model, "Width of the residual stream");
  group->add_option("--heads", sizes.heads, "Attention (query) heads");
  group->add_option("--kv-heads", sizes.kv_heads, "Key/value heads, dividing --heads (llama*: grouped-query attention)");
  group->add_option("--hidden", sizes.hidden, "MLP hidden size (llama*: SwiGLU's)");
  group->add_option("--vocab", sizes.vocab, "Vocabulary size");
  group->add_option("--rope-theta", sizes.rope_base, "Rotary embeddings' base (llama*; Llama 3: 500000)");
  group->add_option("--rms-eps", sizes.norm_epsilon, "RMSNorm's epsilon (llama*)");
}

void add_batch_options(CLI::App* command, int64_t& batch, int64_t default_batch, int64_t& seq) {
  command->add_option("--batch", batch, "Batch size (under kiln launch: the global batch, split over the ranks)")
      ->default_val(default_batch);
  command->add_option("--seq", seq, "Sequence length for gpt2* and llama* (default: the config's)");
}

void add_optimizer_options(CLI::App* command, OptimizerConfig& config) {
  CLI::Option_group* group = command->add_option_group(
      "Optimizer (an unset hyperparameter takes the optimizer's default, PyTorch's where PyTorch has the optimizer)");
  std::vector<std::string> names;
  for (const optim::OptimizerDef& def : optim::optimizers()) names.push_back(def.name);
  std::string help;
  for (const optim::OptimizerDef& def : optim::optimizers()) help += fmt::format("{}: {}; ", def.name, def.help);
  help.resize(help.size() - 2);
  group->add_option("--optimizer", config.name, help)->check(CLI::IsMember(names))->default_val(config.name);
  group->add_option("--lr", config.lr, "Peak learning rate")->default_val(config.lr);
  for (const std::string& name : optim::hyperparameter_names()) {
    // What it means and each optimizer's default, grouped by meaning ("decoupled weight decay
    // (defaults: adamw 0.01, lion 0)").
    std::vector<std::pair<std::string, std::string>> meanings;  // help, defaults
    bool boolean = false, default_true = false;
    for (const optim::OptimizerDef& def : optim::optimizers()) {
      const optim::HyperSpec* spec = def.find_hyper(name);
      if (!spec) continue;
      boolean = spec->boolean;
      default_true = default_true || (spec->boolean && spec->default_value != 0);
      const std::string value = spec->boolean ? (spec->default_value != 0 ? "true" : "false")
                                              : fmt::format("{:g}", spec->default_value);
      auto same = std::find_if(meanings.begin(), meanings.end(), [&](const auto& m) { return m.first == spec->help; });
      if (same == meanings.end()) same = meanings.insert(meanings.end(), {spec->help, ""});
      same->second += fmt::format("{}{} {}", same->second.empty() ? "" : ", ", def.name, value);
    }
    std::string text;
    for (const auto& [help, defaults] : meanings)
      text += fmt::format("{}{} (defaults: {})", text.empty() ? "" : "; ", help, defaults);
    std::string flag = "--" + name;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (!default_true) text[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(text[0])));
    if (!boolean) {
      group->add_option_function<double>(flag, [&config, name](double v) { config.hyper[name] = v; }, text)
          ->type_name("FLOAT");
    } else if (!default_true) {
      group->add_flag_function(flag, [&config, name](int64_t) { config.hyper[name] = 1; }, text);
    } else {
      group->add_flag_function("--no-" + flag.substr(2), [&config, name](int64_t) { config.hyper[name] = 0; },
                               "Turn off: " + text);
    }
  }
  group->add_flag_function(
      "--no-decay-biases-norms-embeddings", [&config](int64_t) { config.decay_biases_norms_embeddings = false; },
      "No weight decay on biases and norm weights (params of rank < 2) and embedding tables (params an embedding "
      "lookup reads)");
}

void add_shard_option(CLI::App* command, std::string& shard) {
  command
      ->add_option("--shard", shard,
                   "Under kiln launch (or torchrun): dp (gradients all-reduced) | zero1 (AdamW state sharded) | zero2 "
                   "(+ gradients reduce-scattered) | zero3 (+ params sharded, gathered before use) | auto (dp while "
                   "params, gradients and AdamW state fit in a quarter of a device, else zero3)")
      ->check(CLI::IsMember({"auto", "dp", "zero1", "zero2", "zero3"}))
      ->default_val("auto");
}

void add_device_option(CLI::App* command, Device& device, const std::string& help, const std::string& names) {
  command
      ->add_option_function<std::string>(
          names, [&device](const std::string& name) { device = name == "cuda" ? Device::kCuda : Device::kCpu; },
          help)
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->default_str(std::string(device_name(device)));
}

void add_device_choice_option(CLI::App* command, std::string& device, const std::string& help) {
  command->add_option("--device", device, help)->check(CLI::IsMember({"auto", "cpu", "cuda"}))->default_val(device);
}

void add_amp_option(CLI::App* command, std::string& amp, const std::string& help, bool with_auto) {
  std::vector<std::string> modes{"off", "bf16", "f16", "fp8"};
  if (with_auto) modes.push_back("auto");
  command->add_option("--amp", amp, help)->check(CLI::IsMember(modes))->default_val(amp);
}

void add_fp8_options(CLI::App* command, OptimizerConfig& optimizer) {
  command->add_flag("--fp8-every-linear", optimizer.fp8_every_linear,
                    "With --amp fp8: every linear layer in FP8, not only those the cost model finds faster "
                    "(passes/fp8_linear.h); for studies of FP8's speed and loss");
  command->add_option("--fp8-grad", optimizer.fp8_grad,
                      "With --amp fp8: the gradients' FP8 format in the backward products (e4m3: torchao's "
                      "tensorwise recipe; e5m2: more range, less precision)")
      ->check(CLI::IsMember({"e4m3", "e5m2"}))
      ->default_val(optimizer.fp8_grad);
}

void add_dialects_option(CLI::App* command, std::vector<std::string>& dialects) {
  command->add_option("--dialects", dialects, "Kernel dialects to choose from, e.g. reference,cpu,openblas (default: all)")
      ->delimiter(',')
      ->type_name("DIALECT");
}

void add_pass_options(CLI::App* command, PassOptions& passes) {
  CLI::Option_group* group = command->add_option_group("Pass pipeline");
  group->add_option_function<std::vector<std::string>>(
          "--disable-pass", [&passes](const std::vector<std::string>& names) { passes.disabled.insert(names.begin(), names.end()); },
          "Skip these passes ('all': every one)")
      ->delimiter(',')
      ->type_name("PASS");
  group->add_option_function<std::vector<std::string>>(
          "--print-after",
          [&passes](const std::vector<std::string>& names) { passes.print_after.insert(names.begin(), names.end()); },
          "Print the IR after these passes ('all': after each)")
      ->delimiter(',')
      ->type_name("PASS");
  group->add_option_function<std::string>(
      "--memory-budget",
      [&passes](const std::string& text) { passes.memory_budget = parse_size_flag("--memory-budget", text); },
      "Recompute activations so that the step's planned arena fits, e.g. 512MiB, 2GiB, bytes (with --offload "
      "auto: also the device memory the whole step may use)")
      ->type_name("SIZE");
  group->add_option_function<std::string>(
          "--offload",
          [&passes](const std::string& mode) {
            passes.offload = mode == "auto" ? OffloadMode::kAuto : mode == "all" ? OffloadMode::kAll : OffloadMode::kOff;
          },
          "Optimizer state in pinned host memory: off | auto (only while the step does not fit the device: "
          "--memory-budget, else 90% of its memory) | all")
      ->check(CLI::IsMember({"off", "auto", "all"}))
      ->type_name("MODE");
  group->add_option_function<std::string>(
      "--logits-chunk",
      [&passes](const std::string& text) {
        passes.logits_chunk_bytes = text == "0" ? 0 : parse_size_flag("--logits-chunk", text);
      },
      "Compute a language model's logits, loss and their gradients in row chunks of at most this size, e.g. "
      "256MiB (default 2GiB; 0: all rows at once)")
      ->type_name("SIZE");
}

Graph parse_file(const std::string& path) {
  std::stringstream text;
  if (path == "-") {
    text << std::cin.rdbuf();
  } else {
    std::ifstream in(path, std::ios::binary);
    KILN_CHECK(in.good(), "cannot open '{}'", path);
    text << in.rdbuf();
  }
  try {
    return parse(text.str());
  } catch (const ParseError& e) {
    throw Error(path + ":" + e.what());
  }
}

void add_onnx_options(CLI::App* command, onnx::ImportOptions& options) {
  CLI::Option_group* group = command->add_option_group("ONNX models");
  group->add_option_function<std::vector<std::string>>(
          "--shape",
          [&options](const std::vector<std::string>& items) {
            for (const std::string& item : items) {
              const size_t eq = item.find('=');
              if (eq == std::string::npos || eq == 0) throw CLI::ValidationError("--shape", "expected NAME=D0,D1,..., got '" + item + "'");
              Shape shape;
              std::stringstream dims(item.substr(eq + 1));
              std::string dim;
              while (std::getline(dims, dim, ',')) {
                try {
                  shape.push_back(std::stoll(dim));
                } catch (const std::exception&) {
                  throw CLI::ValidationError("--shape", "'" + dim + "' in '" + item + "' is not a number");
                }
              }
              options.shapes[item.substr(0, eq)] = shape;
            }
          },
          "A graph input's shape (NAME=D0,D1,...) or a dynamic dim's size (NAME=N), for ONNX inputs with dynamic dims")
      ->type_name("NAME=DIMS")
      ->take_all();
  group->add_option("--freeze", options.freeze, "Keep the float initializers whose names match these globs fixed (constants)")
      ->type_name("PATTERN");
  group->add_option("--loss", options.loss, "The model returns logits: train on their cross-entropy (cross_entropy)")
      ->check(CLI::IsMember({"cross_entropy"}));
  group->add_option("--labels", options.labels, "With --loss: the labels' graph input (made if the model has none)")
      ->default_val(options.labels);
}

bool is_onnx_file(const std::string& path) {
  return path.size() > 5 && path.compare(path.size() - 5, 5, ".onnx") == 0;
}

ModelFile load_model_file(const std::string& path, const onnx::ImportOptions& options) {
  if (!is_onnx_file(path)) return ModelFile{parse_file(path), {}};
  onnx::ImportedModel model = onnx::import_onnx(path, options);
  return ModelFile{std::move(model.graph), std::move(model.initial_values)};
}

std::vector<Tensor> random_inputs(const Graph& graph, uint64_t seed, double int_high) {
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < graph.inputs.size(); ++i) {
    const TensorType& type = graph.type(graph.inputs[i].value);
    const bool integer = is_integer(type.dtype);
    inputs.push_back(random_tensor(type, seed + i, integer ? 0.0 : -1.0, integer ? int_high : 1.0));
  }
  return inputs;
}

}  // namespace kiln::cli
