#include "compile/compile_step.h"

#include "ir/verifier.h"
#include "ops/transfer.h"
#include "passes/pipeline.h"
#include "support/error.h"
#include "support/stopwatch.h"

namespace kiln {
namespace {

// The forward step's program: the graph as given, its inputs' roles read off the graph.
StepProgram forward_program(const Graph& forward, const OptimizerConfig& config, bool loss_only,
                            const ShardingOptions& sharding) {
  KILN_CHECK(!loss_only || !forward.outputs.empty(), "graph '{}' has no outputs (the loss must be the first)",
             forward.name);
  StepProgram out;
  out.graph = forward;
  if (loss_only) out.graph.outputs.resize(1);  // dead-code drops what only the others needed
  apply_mixed_precision(out.graph, config);
  shard_forward_step(out.graph, sharding);
  for (size_t i = 0; i < forward.inputs.size(); ++i) {
    const int index = static_cast<int>(i);
    switch (forward.inputs[i].role) {
      case Role::kParam: out.param_inputs.push_back(index); break;
      case Role::kData: out.data_inputs.push_back(index); break;
      default: out.state_inputs.push_back(index); break;
    }
  }
  return out;
}

}  // namespace

CompiledStep compile_step(const Graph& forward, const CompileOptions& options) {
  CompiledStep step;
  Stopwatch phase;
  const bool training = options.kind == StepKind::kTraining;
  PassOptions passes = options.passes;
  passes.target = options.executor.device;
  // Passes keep graph inputs in place, so the forward's input indices stay valid in the program.
  Graph recognized = forward;
  step.forward_pass_records = forward_pipeline(passes).run(recognized);
  step.phase_seconds.emplace_back("forward passes", phase.lap());
  step.program = training ? build_training_graph(recognized, options.optimizer, options.sharding)
                          : forward_program(recognized, options.optimizer, options.loss_only, options.sharding);
  step.phase_seconds.emplace_back(training ? "training graph" : "forward graph", phase.lap());

  step.nodes_before_passes = step.program.graph.nodes.size();
  step.pass_records = default_pipeline(std::move(passes)).run(step.program.graph);
  step.phase_seconds.emplace_back("passes", phase.lap());
  if (!options.bind_kernels) return step;

  ExecutorOptions executor = options.executor;
  if (options.inputs_allocated_after) {
    // Offloaded state stays in host memory (ops/transfer.h): not counted against the device.
    const Graph& g = step.program.graph;
    const std::vector<bool> on_host = host_resident_inputs(g);
    for (size_t i = 0; i < g.inputs.size(); ++i)
      if (!on_host[i]) executor.device_bytes_to_come += aligned_bytes(g.type(g.inputs[i].value).bytes());
  }
  step.executor = std::make_unique<Executor>(step.program.graph, executor);
  const Executor::BuildTimes& t = step.executor->build_times();
  step.phase_seconds.emplace_back("kernel choice", t.select_s);
  step.phase_seconds.emplace_back("kernels prepared", t.prepare_s);
  step.phase_seconds.emplace_back("memory plan", t.setup_s);
  return step;
}

}  // namespace kiln
