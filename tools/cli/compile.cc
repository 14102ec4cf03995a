// `kiln compile`: compile a model's step (a forward graph from the model zoo or an IR file) with
// compile_step up to the end of the pass pipeline, without binding kernels (so that `--device
// cuda` shows what a GPU run would compile on any machine); write its IR, its fused kernels'
// CUDA sources, or a report of the passes, the fusion groups and the memory plan.
#include <filesystem>
#include <fstream>

#include "backends/generated_source.h"
#include "compile/compile_step.h"
#include "compile/report.h"
#include "ir/text.h"
#include "models/models.h"
#include "ops/fused/kind.h"
#include "options.h"
#include "support/error.h"
#include "support/stopwatch.h"

namespace kiln::cli {
namespace {

struct CompileCommand {
  std::string file;  // a forward graph's IR text; empty: --model
  std::string model = "gpt2-tiny";
  int64_t batch = 8, seq = 0;
  models::ModelSizes sizes;
  bool forward_only = false;
  bool report = false;
  std::string output;
  std::string dump_kernels_dir;
  std::string shard = "none";
  int world_size = 2;
  CompileOptions compile;
  onnx::ImportOptions onnx;
};

// `--dump-kernels DIR`: one .cu file per fused node (node index and kind in the name) with the
// nvrtc dialect's generated source; codegen needs no GPU.
void dump_kernels(const Graph& graph, const std::string& dir) {
  KILN_CHECK(device_availability(Device::kCuda).built,
             "--dump-kernels {}: this build has no CUDA backend (configure with -DKILN_CUDA=ON)", dir);
  std::filesystem::create_directories(dir);
  int written = 0;
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    const Node& node = graph.nodes[i];
    if (node.op != Op::kFused || !node.body) continue;
    const FusedKind kind = fused_kind(node);
    const std::string path = fmt::format("{}/node{:04}_{}.cu", dir, i, fused_kind_name(kind));
    std::ofstream out(path, std::ios::binary);
    out << generated_kernel_source(Device::kCuda, *node.body, kind);
    KILN_CHECK(out.good(), "cannot write '{}'", path);
    ++written;
  }
  fmt::print("wrote {} fused kernel sources to {}\n", written, dir);
}

void compile(CompileCommand o) {
  const Stopwatch total;
  Stopwatch phase;
  models::ModelSizes sizes = o.sizes;
  if (o.seq > 0) sizes.seq = o.seq;
  const Graph forward = o.file.empty() ? models::by_name(o.model, o.batch, sizes) : load_model_file(o.file, o.onnx).graph;
  const double build_s = phase.lap();
  o.compile.kind = o.forward_only ? StepKind::kForward : StepKind::kTraining;
  KILN_CHECK(!o.compile.loss_only || o.forward_only, "--loss-only needs --forward-only (a training step returns the "
             "loss alone anyway)");
  o.compile.bind_kernels = false;
  o.compile.sharding = ShardingOptions{parse_shard_mode(o.shard), o.world_size};
  const CompiledStep step = compile_step(forward, o.compile);
  if (!o.dump_kernels_dir.empty()) dump_kernels(step.program.graph, o.dump_kernels_dir);
  if (o.output == "-") {
    fmt::print("{}", print(step.program.graph));
  } else if (!o.output.empty()) {
    std::ofstream out(o.output, std::ios::binary);
    out << print(step.program.graph);
    KILN_CHECK(out.good(), "cannot write '{}'", o.output);
  }
  if (o.report)
    fmt::print("{}", compile_report(o.file.empty() ? fmt::format("model {}", o.model)
                                                   : fmt::format("graph @{} ({})", forward.name, o.file),
                                    o.file.empty() ? "build forward" : is_onnx_file(o.file) ? "import" : "parse",
                                    forward, build_s, step, total.seconds()));
}

}  // namespace

void add_compile_command(CLI::App& app) {
  CLI::App* command = app.add_subcommand(
      "compile", "Compile a model's training step (or forward step) through the pass pipeline; write its IR or a report");
  auto o = std::make_shared<CompileCommand>();
  command->add_option("FILE", o->file,
                      "A forward graph's IR text file ('-': standard input) or an ONNX model (.onnx); default: --model");
  add_onnx_options(command, o->onnx);
  add_model_option(command, o->model, "gpt2-tiny");
  add_batch_options(command, o->batch, 8, o->seq);
  add_model_size_options(command, o->sizes);
  command->add_flag("--forward-only", o->forward_only,
                    "Compile the graph as given (an evaluation or inference step): no autodiff, no optimizer");
  command->add_flag("--loss-only", o->compile.loss_only,
                    "With --forward-only: the loss (the first output) alone, as the trainer's evaluation compiles it");
  add_optimizer_options(command, o->compile.optimizer);
  add_amp_option(command, o->compile.optimizer.amp, "Mixed precision: off | bf16 | f16 | fp8 (bf16, linear layers in FP8)");
  add_device_option(command, o->compile.executor.device,
                    "The device the pipeline prepares the step for: cpu | cuda (no GPU needed)", "--device,--target");
  add_pass_options(command, o->compile.passes);
  command->add_option("--shard", o->shard,
                      "One rank's step of a data-parallel group of --world-size ranks: none | dp | zero1 | zero2 | zero3 "
                      "(the collectives and shards the ranks of `kiln train --shard` run; no process group needed)")
      ->default_val("none");
  command->add_option("--world-size", o->world_size, "The number of ranks --shard compiles for")
      ->check(CLI::PositiveNumber)
      ->default_val(2);
  command->add_option("-o,--output", o->output, "Write the compiled step's IR text to FILE ('-': standard output)")
      ->type_name("FILE");
  command->add_flag("--report", o->report,
                    "Print each pass's time and node counts (recognize's on the forward graph first, with the "
                    "composite ops it found), the step's kernels and the composite ops among them, the fusion groups "
                    "(per fused node: kind, ops, bytes kept out of memory; and the total) and the memory plan");
  command->add_option("--dump-kernels", o->dump_kernels_dir,
                      "Write each fused node's generated CUDA source to DIR (one .cu file per node)")
      ->type_name("DIR");
  command->callback([o] { compile(*o); });
}

}  // namespace kiln::cli
