// `kiln run FILE`: compile the graph as given (a forward step: mixed precision, the pass
// pipeline, kernel selection and the memory plan, as an evaluation would get) and run it once
// on random inputs; print a summary of each output.
#include "compile/compile_step.h"
#include "device/device_runtime.h"
#include "options.h"
#include "support/stopwatch.h"

namespace kiln::cli {
namespace {

struct RunOptions {
  std::string file;
  uint64_t seed = 0;
  double int_high = 2;
  std::string amp = "off";
  CompileOptions compile;
};

void run(RunOptions o) {
  const Graph graph = parse_file(o.file);
  o.compile.kind = StepKind::kForward;
  o.compile.optimizer.amp = o.amp;
  const std::unique_ptr<DeviceRuntime> runtime = device_runtime(o.compile.executor.device);
  Stopwatch watch;
  const CompiledStep step = compile_step(graph, o.compile);
  const double compile_s = watch.lap();
  std::vector<Tensor> inputs = random_inputs(graph, o.seed, o.int_high);
  for (Tensor& t : inputs) t = runtime->to_device(t);
  std::vector<Tensor> outputs = step.executor->run(inputs);
  step.executor->synchronize();
  for (Tensor& t : outputs) t = runtime->to_host(t);
  const double run_s = watch.lap();
  fmt::print("graph @{}: {} nodes ({} after the pipeline) on {}, compiled in {:.3f} s, ran in {:.3f} s\n", graph.name,
             graph.nodes.size(), step.program.graph.nodes.size(), device_name(o.compile.executor.device), compile_s,
             run_s);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const std::string& name = graph.value(graph.outputs[i]).name;
    fmt::print("  output {} {:<10} {}\n", i, name.empty() ? "" : "%" + name, summarize(outputs[i]));
  }
}

}  // namespace

void add_run_command(CLI::App& app) {
  CLI::App* command = app.add_subcommand(
      "run", "Compile an IR file as a forward step (no autodiff) and run it on random inputs; print output summaries");
  auto o = std::make_shared<RunOptions>();
  command->add_option("FILE", o->file, "IR text file ('-': standard input)")->required();
  command->add_option("--seed", o->seed, "Seed for the random inputs")->default_val(0);
  command->add_option("--int-high", o->int_high, "Integer inputs are drawn from [0, N)")->default_val(2);
  add_device_option(command, o->compile.executor.device, "cpu | cuda (cuda needs a build with the CUDA backend and a GPU)");
  add_amp_option(command, o->amp, "Mixed precision: off | bf16 | f16 | fp8 (bf16, linear layers in FP8)");
  add_dialects_option(command, o->compile.executor.dialects);
  add_pass_options(command, o->compile.passes);
  command->callback([o] { run(*o); });
}

}  // namespace kiln::cli
