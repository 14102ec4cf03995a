// What the `kiln` subcommands share: the option groups that several of them take (model,
// device, mixed precision, kernel dialects, the pass pipeline's options), each defined once so
// that a flag means the same and says the same in every --help, and reading IR files.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "compile/training_graph.h"
#include "frontend/onnx/onnx_import.h"
#include "ir/graph.h"
#include "models/models.h"
#include "passes/pass.h"
#include "tensor/tensor.h"

namespace kiln::cli {

// Each subcommand, in its own file: adds itself to `app` with its options and a callback that
// runs it (after parsing; errors are kiln::Error, which main prints as one line).
void add_version_command(CLI::App& app);
void add_check_command(CLI::App& app);
void add_run_command(CLI::App& app);
void add_opt_command(CLI::App& app);
void add_compile_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_launch_command(CLI::App& app);
void add_step_command(CLI::App& app);
void add_hf_commands(CLI::App& app);  // export-hf, import-hf

// Thrown by a command that ends with an exit code of its own (kiln launch: its failed rank's),
// having said why already: main returns the code and prints nothing.
struct ExitCode {
  int code;
};

// --model NAME: the model zoo's models (models/models.h).
void add_model_option(CLI::App* command, std::string& model, const std::string& default_model);
// --layers, --d-model, --heads, --kv-heads, --hidden, --vocab (and llama*'s --rope-theta,
// --rms-eps): a language model's sizes overriding its named config's (models::ModelSizes; --seq
// is each command's own).
void add_model_size_options(CLI::App* command, models::ModelSizes& sizes);
// --batch (default `default_batch`) and --seq: the batch size (under kiln launch: the global
// batch) and a language model's sequence length (0: its config's).
void add_batch_options(CLI::App* command, int64_t& batch, int64_t default_batch, int64_t& seq);
// The optimizer, from the registry (ops/optimizer/optimizers.h): --optimizer NAME, --lr, one flag
// per hyperparameter of any optimizer (--weight-decay, --momentum, --nesterov, --beta1, ...;
// unset: the chosen optimizer's default, which --help lists per optimizer) and
// --no-decay-biases-norms-embeddings.
void add_optimizer_options(CLI::App* command, OptimizerConfig& config);
// --shard: the data-parallel mode under kiln launch (train/placement.h choose_shard_mode).
void add_shard_option(CLI::App* command, std::string& shard);
// --device cpu|cuda under `names` (CLI11's "--device,--target" for aliases), with the command's
// own help (what the device is for: running, or only preparing the graph).
void add_device_option(CLI::App* command, Device& device, const std::string& help,
                       const std::string& names = "--device");
// --device auto|cpu|cuda as a name, for the commands that train (train::choose_device resolves
// "auto": CUDA when present, else the CPU).
void add_device_choice_option(CLI::App* command, std::string& device, const std::string& help);
// --amp off|bf16|f16, and auto (bf16 where the device has it) where `with_auto`.
void add_amp_option(CLI::App* command, std::string& amp, const std::string& help, bool with_auto = false);
// --fp8-every-linear (every linear layer in FP8, not only where it is faster) and --fp8-grad (the
// gradients' format), both meaning something under --amp fp8 only.
void add_fp8_options(CLI::App* command, OptimizerConfig& optimizer);
// --dialects a,b: the kernel dialects kernel selection may choose from.
void add_dialects_option(CLI::App* command, std::vector<std::string>& dialects);
// The pipeline's options, as one group: --disable-pass, --print-after, --memory-budget,
// --logits-chunk.
void add_pass_options(CLI::App* command, PassOptions& passes);

// The IR text of PATH ('-': standard input), parsed and verified; errors name the file.
Graph parse_file(const std::string& path);

// The ONNX front end's options for a MODEL.onnx: --shape NAME=D0,D1,... (repeatable), --freeze
// PATTERN, --loss cross_entropy, --labels NAME.
void add_onnx_options(CLI::App* command, onnx::ImportOptions& options);
bool is_onnx_file(const std::string& path);
// A model file: IR text (.kir, '-') or an ONNX model (.onnx, imported with `onnx`), with the
// initial values of its params and state where the file holds them (ONNX's initializers).
struct ModelFile {
  Graph graph;
  std::map<std::string, Tensor> initial_values;
};
ModelFile load_model_file(const std::string& path, const onnx::ImportOptions& onnx);
// Random inputs in graph-input order: floats uniform in [-1, 1), integers in [0, int_high).
std::vector<Tensor> random_inputs(const Graph& graph, uint64_t seed, double int_high);

}  // namespace kiln::cli
