// The `kiln` command-line tool. Each subcommand is a thin layer over the library; errors are
// kiln::Error, printed as one line, with a non-zero exit.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "backends/cuda/device.h"
#ifdef KILN_HAVE_CUDA
#include "backends/cuda/nvrtc.h"
#endif
#include "ir/text.h"
#include "ir/verifier.h"
#include "models/models.h"
#include "passes/fusion/fusion.h"
#include "passes/pipeline.h"
#include "passes/remat.h"
#include "analysis/memory_plan.h"
#include "support/stopwatch.h"
#include "runtime/executor.h"
#include "support/error.h"
#include "train/job.h"
#include "train/optimizer.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "cannot open '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

kiln::Graph parse_file(const std::string& path) {
  try {
    return kiln::parse(read_file(path));
  } catch (const kiln::ParseError& e) {
    throw kiln::Error(path + ":" + e.what());
  }
}

std::vector<kiln::Tensor> random_inputs(const kiln::Graph& graph, uint64_t seed, double int_high) {
  std::vector<kiln::Tensor> inputs;
  for (size_t i = 0; i < graph.inputs.size(); ++i) {
    const kiln::TensorType& type = graph.type(graph.inputs[i].value);
    bool integer = kiln::is_integer(type.dtype);
    inputs.push_back(kiln::random_tensor(type, seed + i, integer ? 0.0 : -1.0, integer ? int_high : 1.0));
  }
  return inputs;
}

void print_outputs(const kiln::Graph& graph, const std::vector<kiln::Tensor>& outputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    const std::string& name = graph.value(graph.outputs[i]).name;
    fmt::print("  output {} {:<10} {}\n", i, name.empty() ? "" : "%" + name, kiln::summarize(outputs[i]));
  }
}


// `kiln compile --dump-kernels DIR`: one .cu file per fused node (node index and kind in the
// name) with the nvrtc dialect's generated source; codegen needs no GPU.
void dump_kernels(const kiln::Graph& graph, const std::string& dir) {
#ifdef KILN_HAVE_CUDA
  std::filesystem::create_directories(dir);
  int written = 0;
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    const kiln::Node& node = graph.nodes[i];
    if (node.op != kiln::Op::kFused || !node.body) continue;
    const kiln::FusedKind kind = kiln::fused_kind(node);
    const std::string path = fmt::format("{}/node{:04}_{}.cu", dir, i, kiln::fused_kind_name(kind));
    std::ofstream out(path, std::ios::binary);
    out << kiln::cuda::fused_kernel_listing(*node.body, kind);
    KILN_CHECK(out.good(), "cannot write '{}'", path);
    ++written;
  }
  fmt::print("wrote {} fused kernel sources to {}\n", written, dir);
#else
  (void)graph;
  kiln::fail("--dump-kernels {}: this build has no CUDA backend (configure with -DKILN_CUDA=ON)", dir);
#endif
}

constexpr const char* kLogitsChunkHelp =
    "Compute a language model's logits, loss and their gradients in row chunks of at most this size, e.g. 256MiB "
    "(default 2GiB; 0: all rows at once)";

// --logits-chunk's size: 0 (no chunks) or a memory size.
size_t parse_logits_chunk(const std::string& text) { return text == "0" ? 0 : kiln::parse_byte_size(text); }

// `kiln compile`: build the model's training graph, run the pipeline, report.
void compile(const std::string& model, int64_t batch, int64_t seq, const std::string& optimizer,
             const std::vector<std::string>& print_after, const std::vector<std::string>& disabled,
             bool report, const std::string& memory_budget, const std::string& amp,
             const std::string& dump_kernels_dir, const std::string& target, const std::string& logits_chunk) {
  const kiln::Stopwatch total;
  kiln::Stopwatch phase;
  kiln::Graph forward = kiln::models::by_name(model, batch, seq);
  double build_s = phase.lap();
  kiln::train::OptimizerConfig config;
  config.name = optimizer;
  config.amp = amp;
  kiln::train::TrainingGraph program = kiln::train::build_training_graph(forward, config);
  double autodiff_s = phase.lap();
  kiln::PassOptions options;
  options.print_after = {print_after.begin(), print_after.end()};
  options.disabled = {disabled.begin(), disabled.end()};
  if (!memory_budget.empty()) options.memory_budget = kiln::parse_byte_size(memory_budget);
  if (!logits_chunk.empty()) options.logits_chunk_bytes = parse_logits_chunk(logits_chunk);
  // The pipeline differs per device (training-rewrites run only for the CPU): `--target cuda`
  // shows, and --dump-kernels writes, what a GPU run would compile.
  options.target = target == "cuda" ? kiln::Device::kCuda : kiln::Device::kCpu;
  kiln::Graph graph = program.graph;
  size_t nodes_before = graph.nodes.size();
  std::vector<kiln::PassRecord> records = kiln::default_pipeline(options).run(graph);
  if (!dump_kernels_dir.empty()) dump_kernels(graph, dump_kernels_dir);
  if (!report) return;
  int64_t param_count = 0;
  for (int i : program.param_inputs) param_count += graph.type(graph.inputs[i].value).numel();
  fmt::print("model {}: {} forward nodes, {} parameters; training graph {} nodes\n", model,
             forward.nodes.size(), param_count, nodes_before);
  fmt::print("  {:<22} {:>9} {:>8} {:>8}\n", "step", "ms", "nodes", "changed");
  fmt::print("  {:<22} {:>9.2f} {:>8}\n", "build forward", 1e3 * build_s, forward.nodes.size());
  fmt::print("  {:<22} {:>9.2f} {:>8}\n", "autodiff + optimizer", 1e3 * autodiff_s, nodes_before);
  for (const kiln::PassRecord& r : records)
    fmt::print("  {:<22} {:>9} {:>8} {:>8}\n", r.name, r.ran ? fmt::format("{:.2f}", 1e3 * r.seconds) : "disabled",
               r.nodes_after, r.changed ? "yes" : "no");
  // The fusion groups: one line per fused node, then the total.
  std::vector<kiln::fusion::FusedNodeReport> fused = kiln::fusion::report(graph);
  int64_t kept_bytes = 0;
  fmt::print("  fusion: {} fused node{}\n", fused.size(), fused.size() == 1 ? "" : "s");
  for (const kiln::fusion::FusedNodeReport& f : fused) {
    kept_bytes += f.bytes_kept;
    fmt::print("    node {:<5} {:<14} {:>10.3f} MiB kept  {}\n", f.node, f.kind,
               f.bytes_kept / double(1 << 20), fmt::join(f.ops, " "));
  }
  fmt::print("  fusion total: {:.3f} MiB kept out of memory\n", kept_bytes / double(1 << 20));
  kiln::MemoryPlan plan = kiln::plan_memory(graph);
  int64_t input_bytes = 0;
  for (const kiln::GraphInput& in : graph.inputs) input_bytes += static_cast<int64_t>(graph.type(in.value).bytes());
  // MiB below a GiB, so small models show their numbers.
  auto size = [](double bytes) {
    return bytes < double(1 << 30) ? fmt::format("{:.2f} MiB", bytes / double(1 << 20))
                                   : fmt::format("{:.3f} GiB", bytes / double(1 << 30));
  };
  fmt::print("  memory: inputs (params, state, batch) {}; intermediates planned {}"
             " (lower bound {}, one buffer each {})\n",
             size(input_bytes), size(plan.arena_bytes), size(plan.live_peak_bytes), size(plan.naive_bytes));
  fmt::print("  total {:.3f} s\n", total.seconds());
}

}  // namespace

// OpenMP threads spin after each parallel loop by default, taking the cores that the next
// kernel's (pthread) OpenBLAS threads need: measured 2-10x slower steps on loaded or many-core
// hosts (bench/NOTES.md). libgomp reads OMP_WAIT_POLICY when it loads, before main, so the CLI
// sets it and re-executes itself once; an explicit user setting is left alone.
void ensure_passive_openmp_waiting(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "passive", 0);
  execv("/proc/self/exe", argv);  // only returns on failure: then run as we are
}

int main(int argc, char** argv) {
  ensure_passive_openmp_waiting(argv);
  CLI::App app{"kiln: a deep-learning training compiler", "kiln"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("kiln ") + KILN_VERSION);
  app.footer(
      "Environment:\n"
      "  KILN_CACHE_DIR        where compiled kernels are cached across runs (default\n"
      "                        $XDG_CACHE_HOME/kiln or ~/.cache/kiln; 'off' disables the cache)\n"
      "  KILN_GEMM_AUTOTUNE=1  time cuBLASLt's candidate algorithms per GEMM at first use,\n"
      "                        the first step included (default: an executor's second run\n"
      "                        tunes them; bench --no-gemm-tuning keeps the heuristic's first)\n"
      "  KILN_GEMM_CANDIDATES=N  how many candidates tuning times (default 8)\n"
      "  KILN_MIXED_BIAS_GEMM=1  a 16-bit bias on an f32 GEMM output in the cuBLASLt call\n"
      "                        (x + f32(y W + b) with no LayerNorm after it; default: a\n"
      "                        generated epilogue. GPT-2's residual projections take their\n"
      "                        LayerNorm into that epilogue and do not use it)\n"
      "  KILN_CUDNN_SDPA_IMPL=unified|composite  cuDNN's attention forward implementation\n"
      "                        (default: cuDNN's choice)\n"
      "  KILN_CUDNN_PLAN_FORWARD=i, KILN_CUDNN_PLAN_BACKWARD=i  build cuDNN's attention\n"
      "                        execution plan i (default: the heuristic's first; for measuring)\n"
      "  KILN_CLASSIFIER_ROW_PATH=reread  the fused classifier reads each row twice instead of\n"
      "                        keeping it in shared memory (default; for measuring)");

  app.add_subcommand("version", "Print the version");

  auto* check = app.add_subcommand("check", "Parse and verify an IR file; print its normalized text");
  std::string check_file;
  check->add_option("FILE", check_file, "IR text file")->required();

  auto* run = app.add_subcommand("run", "Run an IR file on random inputs on the CPU; print output summaries");
  std::string run_file;
  uint64_t seed = 0;
  double int_high = 2;
  std::vector<std::string> dialects;
  run->add_option("FILE", run_file, "IR text file")->required();
  run->add_option("--seed", seed, "Seed for the random inputs")->default_val(0);
  run->add_option("--int-high", int_high, "Integer inputs are drawn from [0, N)")->default_val(2);
  run->add_option("--dialects", dialects, "Allowed kernel dialects (default: all)")->delimiter(',');


  auto* compile_cmd = app.add_subcommand("compile", "Build a model's training graph, run the pass pipeline, report");
  std::string compile_model = "gpt2-tiny", compile_optimizer = "adamw";
  int64_t compile_batch = 8, compile_seq = 0;
  std::vector<std::string> print_after, disabled_passes;
  bool compile_report = false;
  compile_cmd->add_option("--model", compile_model, "mlp | cnn | gpt2-tiny | gpt2 | gpt2-medium")
      ->check(CLI::IsMember({"mlp", "cnn", "gpt2-tiny", "gpt2", "gpt2-medium"}))->default_val("gpt2-tiny");
  compile_cmd->add_option("--batch", compile_batch, "Batch size")->default_val(8);
  compile_cmd->add_option("--seq", compile_seq, "Sequence length for gpt2* (default: the config's)");
  compile_cmd->add_option("--optimizer", compile_optimizer, "adamw | sgd")->check(CLI::IsMember({"adamw", "sgd"}))->default_val("adamw");
  compile_cmd->add_option("--print-after", print_after, "Print the IR after these passes (or 'all')")->delimiter(',');
  compile_cmd->add_option("--disable-pass", disabled_passes, "Skip these passes")->delimiter(',');
  compile_cmd->add_flag("--report", compile_report, "Print each pass's time and node counts, the fusion groups (per fused node: kind, ops, bytes kept out of memory; and the total) and the memory plan");
  std::string dump_kernels_dir;
  compile_cmd->add_option("--dump-kernels", dump_kernels_dir,
                          "Write each fused node's generated CUDA source to DIR (one .cu file per node)");
  std::string compile_amp = "off";
  compile_cmd->add_option("--amp", compile_amp, "Mixed precision: off | bf16 | f16")
      ->check(CLI::IsMember({"off", "bf16", "f16"}));
  std::string compile_budget;
  compile_cmd->add_option("--memory-budget", compile_budget,
                          "Recompute activations so the step's planned arena fits, e.g. 512MiB, 2GiB, bytes");
  std::string compile_logits_chunk;
  compile_cmd->add_option("--logits-chunk", compile_logits_chunk,
                          kLogitsChunkHelp);
  std::string compile_target = "cpu";
  compile_cmd->add_option("--target", compile_target,
                          "The device the pipeline prepares the graph for: cpu | cuda (no GPU needed)")
      ->check(CLI::IsMember({"cpu", "cuda"}))->default_val("cpu");

  auto* train = app.add_subcommand("train", "Train a model on the CPU or a CUDA GPU, printing progress");
  kiln::train::JobOptions job;
  train->add_option("--model", job.model, "mlp | cnn | gpt2-tiny | gpt2 | gpt2-medium")
      ->check(CLI::IsMember({"mlp", "cnn", "gpt2-tiny", "gpt2", "gpt2-medium"}))->default_val("mlp");
  train->add_option("--data", job.data,
                    "fashion-mnist (mlp, cnn) or a text / .tok file (gpt2*); default: fashion-mnist, or a GPL text for gpt2*");
  train->add_option("--data-dir", job.data_dir, "Fashion-MNIST directory (default: Debian's dataset-fashion-mnist)");
  train->add_option("--steps", job.steps, "Total training steps")->default_val(3000);
  train->add_option("--batch", job.batch, "Batch size")->default_val(64);
  train->add_option("--seq", job.seq, "Sequence length for gpt2* (default: the config's)");
  train->add_option("--lr", job.optimizer.lr, "Peak learning rate")->default_val(1e-3);
  train->add_option("--optimizer", job.optimizer.name, "adamw | sgd")->check(CLI::IsMember({"adamw", "sgd"}))->default_val("adamw");
  train->add_option("--weight-decay", job.optimizer.weight_decay, "Decoupled (adamw) or L2 (sgd) weight decay")->default_val(0.0);
  train->add_option("--momentum", job.optimizer.momentum, "SGD momentum")->default_val(0.9);
  train->add_flag("--nesterov", job.optimizer.nesterov, "SGD with Nesterov momentum");
  train->add_option("--grad-clip", job.optimizer.grad_clip, "Clip the global gradient norm to this (0 = off)")->default_val(0.0);
  train->add_option("--warmup", job.optimizer.warmup_steps, "Linear warmup steps")->default_val(0);
  train->add_option("--decay-steps", job.optimizer.decay_steps,
                    "Cosine decay to 0.1 x lr by this step (0 = constant lr; -1 = --steps)")->default_val(-1);
  train->add_option("--amp", job.optimizer.amp, "Mixed precision: off | bf16 | f16 (f16 with dynamic loss scaling)")
      ->check(CLI::IsMember({"off", "bf16", "f16"}))->default_val("off");
  train->add_option("--seed", job.seed, "Seed for init and data order")->default_val(0);
  train->add_option("--device", job.device, "cpu | cuda (cuda needs a build with the CUDA backend and a GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))->default_val("cpu");
  train->add_option("--checkpoint-dir", job.checkpoint_dir, "Write DIR/last.safetensors at each evaluation");
  train->add_flag("--resume", job.resume, "Continue from --checkpoint-dir's last checkpoint");
  train->add_option("--eval-every", job.eval_every, "Evaluate (and checkpoint) every N steps (0 = at the end)")->default_val(500);
  train->add_option("--log-every", job.log_every, "Log line interval when not on a terminal")->default_val(100);
  train->add_option("--metrics", job.metrics_path, "Append metrics as JSON lines to FILE");
  std::string train_budget;
  train->add_option("--memory-budget", train_budget,
                    "Recompute activations so the step's planned arena fits, e.g. 512MiB, 2GiB, bytes");

  std::string train_logits_chunk;
  train->add_option("--logits-chunk", train_logits_chunk,
                    kLogitsChunkHelp);

  auto* bench = app.add_subcommand("bench", "Time training steps of a model on random data: ms/step, tokens/s, MFU, memory");
  kiln::train::BenchOptions bench_options;
  double bench_peak_tflops = 0;
  bench->add_option("--model", bench_options.model, "mlp | cnn | gpt2-tiny | gpt2 | gpt2-medium")
      ->check(CLI::IsMember({"mlp", "cnn", "gpt2-tiny", "gpt2", "gpt2-medium"}))->default_val("gpt2");
  bench->add_option("--batch", bench_options.batch, "Batch size")->default_val(32);
  bench->add_option("--seq", bench_options.seq, "Sequence length for gpt2* (default: the config's)");
  bench->add_option("--amp", bench_options.amp, "Mixed precision: off | bf16 | f16")
      ->check(CLI::IsMember({"off", "bf16", "f16"}))->default_val("bf16");
  bench->add_option("--device", bench_options.device, "cuda | cpu")->check(CLI::IsMember({"cpu", "cuda"}))->default_val("cuda");
  bench->add_option("--steps", bench_options.steps, "Timed steps")->default_val(20);
  bench->add_option("--warmup", bench_options.warmup, "Untimed steps first")->default_val(5);
  bench->add_option("--peak-tflops", bench_peak_tflops, "The device's peak TFLOP/s for MFU (default: known GPUs' dense bf16/tf32 peak)");
  bench->add_flag("--no-gemm-tuning", [&](int64_t) { bench_options.tune_gemms = false; },
                  "Keep cuBLASLt's first-choice algorithms (by default the second step times the candidates of "
                  "every product and keeps the fastest)");
  bench->add_flag("--no-cuda-graphs", [&](int64_t) { bench_options.cuda_graphs = false; },
                  "Launch every kernel each step instead of replaying a captured CUDA graph");
  bench->add_flag("--json", bench_options.json, "Also print the numbers as one JSON line, last");
  bench->add_option("--disable-pass", bench_options.disabled_passes, "Skip these passes of the default pipeline")->delimiter(',');
  std::string bench_budget;
  bench->add_option("--memory-budget", bench_budget,
                    "Recompute activations so the step's planned arena fits, e.g. 12GiB (a larger batch "
                    "in the same memory)");
  std::string bench_logits_chunk;
  bench->add_option("--logits-chunk", bench_logits_chunk,
                    kLogitsChunkHelp);
  bench->add_option("--profile", bench_options.profile_path,
                    "After the timed steps, profile one step (CUDA events around every kernel): print a "
                    "per-kernel table and write a Chrome trace-event JSON to this file");
  bench->add_option("--timeline", bench_options.timeline_path,
                    "After the timed steps, trace graph-replayed steps as the GPU ran them (CUPTI): print "
                    "each step's span, busy and idle time, its largest gaps and a per-node table, and "
                    "write a Chrome trace-event JSON of them to this file");
  bench->add_option("--timeline-steps", bench_options.timeline_steps, "Steps --timeline traces (default 10)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (app.got_subcommand("version")) {
      fmt::print("kiln {}\n", KILN_VERSION);
      fmt::print("cuda backend: {}\n", kiln::cuda::built_with_cuda()
                                          ? fmt::format("built; {} device(s); {}", kiln::cuda::device_count(), kiln::cuda::describe_device(0))
                                          : std::string("not built"));
    } else if (app.got_subcommand(check)) {
      fmt::print("{}", kiln::print(parse_file(check_file)));
    } else if (app.got_subcommand(run)) {
      kiln::Graph graph = parse_file(run_file);
      kiln::Executor executor(graph, kiln::ExecutorOptions{kiln::Device::kCpu, dialects});
      const kiln::Stopwatch watch;
      std::vector<kiln::Tensor> outputs = executor.run(random_inputs(graph, seed, int_high));
      fmt::print("graph @{}: {} nodes, ran in {:.3f} s\n", graph.name, graph.nodes.size(), watch.seconds());
      print_outputs(graph, outputs);
    } else if (app.got_subcommand(compile_cmd)) {
      compile(compile_model, compile_batch, compile_seq, compile_optimizer, print_after, disabled_passes, compile_report,
              compile_budget, compile_amp, dump_kernels_dir, compile_target, compile_logits_chunk);
    } else if (app.got_subcommand(train)) {
      if (job.optimizer.decay_steps < 0) job.optimizer.decay_steps = job.steps;
      if (!train_budget.empty()) job.optimizer.memory_budget = kiln::parse_byte_size(train_budget);
      if (!train_logits_chunk.empty()) job.optimizer.logits_chunk_bytes = parse_logits_chunk(train_logits_chunk);
      kiln::train::run_training_job(job);
    } else if (app.got_subcommand(bench)) {
      bench_options.peak_flops = bench_peak_tflops * 1e12;
      if (!bench_budget.empty()) bench_options.memory_budget = kiln::parse_byte_size(bench_budget);
      if (!bench_logits_chunk.empty()) bench_options.logits_chunk_bytes = parse_logits_chunk(bench_logits_chunk);
      kiln::train::run_benchmark(bench_options);
    }
  } catch (const kiln::Error& e) {
    std::cerr << "kiln: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "kiln: internal error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
