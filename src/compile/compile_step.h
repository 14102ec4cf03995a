// compile_step: the one driver from a forward graph to a runnable step. Everything that runs a
// model goes through it (the trainer's step and evaluation, `kiln compile / run / bench`, the
// benchmark programs), so nothing runs an unoptimized graph by accident and no other place
// wires passes to an executor.
//
//   forward graph
//     -> the forward passes   composite ops recognized in decomposed forms (passes/pipeline.h
//                             forward_pipeline), before autodiff sees the graph
//     -> the step's program   training: mixed precision, loss scaling, autodiff, clipping and
//                             the optimizer update as one graph (compile/training_graph.h);
//                             forward: the graph as given, under mixed precision
//     -> the pass pipeline    simplification, fusion, remat, schedule (passes/pipeline.h)
//     -> an Executor          kernel selection, the memory plan, the arena (runtime/executor.h)
//
// The layer sits above passes/ and runtime/ and below train/: a CompiledStep knows nothing of
// data, schedules or checkpoints. Its inputs keep the forward graph's order (params, state and
// data where the forward had them; a training step appends its own state and the learning
// rate), so a forward step compiled from the same graph binds the training step's tensors
// (the trainer's evaluation shares its params that way).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "compile/training_graph.h"
#include "ir/graph.h"
#include "passes/pass.h"
#include "runtime/executor.h"

namespace kiln {

enum class StepKind {
  kTraining,  // forward, backward and optimizer update as one graph
  kForward,   // the graph as given, no autodiff: evaluation, `kiln run`, inference
};

struct CompileOptions {
  StepKind kind = StepKind::kTraining;
  // Training: the optimizer, clipping, loss scaling and the step's outputs. Both kinds: `amp`
  // and `amp_policy` (mixed precision, on the forward graph before anything else).
  OptimizerConfig optimizer;
  // Forward: only outputs[0] (a loss to evaluate) instead of every output of the graph. What
  // only the others needed is dropped, and a language model's logits (f32, 3.07 GiB for GPT-2 at
  // B=16) are an intermediate of the planned arena, whose bytes later values reuse, instead of
  // an output buffer of their own kept beside it.
  bool loss_only = false;
  // One rank's step of a data-parallel group (passes/sharding.h); the executor then needs the
  // group's communicator (executor.communicator).
  ShardingOptions sharding;
  // The pipeline's options; `target` is ignored (the pipeline is built for executor.device).
  PassOptions passes;
  // The device, allowed dialects, CUDA stream and graphs, tuning.
  ExecutorOptions executor;
  // false: stop after the pipeline, no executor (`kiln compile`: a report, or the graph a GPU
  // run would get, on a machine without a GPU).
  bool bind_kernels = true;
  // CUDA: the caller allocates every graph input on the device after compiling (a trainer
  // uploads its params and state next): the executor's check that the step fits counts their
  // bytes too, so that an out-of-memory error names the whole need before anything is allocated.
  bool inputs_allocated_after = false;
};

struct CompiledStep {
  // The graph after the pipeline and the roles of its inputs and outputs.
  StepProgram program;
  size_t nodes_before_passes = 0;  // of the program as built, before the pipeline
  // One per pass of the forward pipeline (on the forward graph, before the program is built),
  // then one per pipeline pass, in order (--report).
  std::vector<PassRecord> forward_pass_records;
  std::vector<PassRecord> pass_records;
  std::unique_ptr<Executor> executor;    // null without bind_kernels
  // Where compilation's time went, in order (seconds): "forward passes", "training graph" or "forward graph",
  // "passes", then the executor's "kernel choice", "kernels prepared" and, on CUDA, "memory plan".
  std::vector<std::pair<std::string, double>> phase_seconds;
};

// Throws kiln::Error: a graph the step kind cannot take (training needs a scalar loss first and
// a param), a pass that fails, a node without a kernel on the device, a step that does not fit.
CompiledStep compile_step(const Graph& forward, const CompileOptions& options);

}  // namespace kiln
