// The Trainer owns a compiled training step and the tensors it updates: step(batch) -> loss,
// with params and optimizer state updated in place by the graph's updates. It also evaluates
// the forward graph with the current params, and saves/loads exact checkpoints.
//
// It reaches its device (ExecutorOptions::device) only through a DeviceRuntime
// (device/device_runtime.h), the same way on every device: params and state are uploaded once
// at construction and stay on the device (the graph's updates rewrite them there). Each step
// copies the batch and the learning rate in asynchronously (DeviceUploader: pinned staging,
// double-buffered on CUDA), runs the step (on CUDA a replayed CUDA graph from the third step
// on) and enqueues an asynchronous copy of the loss into pinned host memory; step() returns
// without waiting for the device. take_losses() reads the losses of the steps since the last
// call (it waits for the last step), so a caller that reads every N steps lets the host run
// ahead of the device in between. Evaluation runs a forward step compiled by the same driver
// and with the same mixed precision as the training step (compile_step, StepKind::kForward: on
// CUDA fused, planned and replayed as a CUDA graph), reading the step's params in place and
// the batch from the step's own data buffers (stable pointers, so its runs replay a graph too);
// evaluate_batches() enqueues many batches and waits once. evaluate() and checkpoints copy to
// and from the host (they wait for the device). On the CPU the work is done when a call returns.
#pragma once

#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "device/communicator.h"
#include "device/device_runtime.h"
#include "compile/compile_step.h"
#include "passes/pass.h"
#include "runtime/executor.h"

namespace kiln::train {

class Trainer {
 public:
  // `params` are the forward graph's param inputs, in order.
  // The training graph goes through the default pass pipeline (passes/pipeline.h) with
  // `pass_options` before it is bound to kernels.
  // `params` and the data are host tensors on every device.
  // Throws kiln::Error (when the params, state and step do not fit in the device's memory,
  // naming the bytes needed and free).
  // `sharding`: this process is one rank of a data-parallel group (passes/sharding.h), whose
  // communicator is executor_options.communicator; `params` are the full initial values (the
  // same on every rank), of which a zero3 trainer keeps its shard. The data are this rank's
  // slice of the global batch.
  Trainer(const Graph& forward, OptimizerConfig config, std::vector<Tensor> params,
          ExecutorOptions executor_options = {}, PassOptions pass_options = {},
          ShardingOptions sharding = {});
  // The same with the params still being made on another thread (kiln bench draws a large
  // model's beside the compile): the step is compiled first, then `params` waited for (its
  // error rethrown) and uploaded. build_seconds() names the wait "params wait".
  Trainer(const Graph& forward, OptimizerConfig config, std::shared_future<std::vector<Tensor>> params,
          ExecutorOptions executor_options = {}, PassOptions pass_options = {},
          ShardingOptions sharding = {});
  ~Trainer();

  // One training step on the forward's data inputs (in order; host tensors, or tensors of the
  // trainer's device: on the CPU the step reads them where they are, on a GPU they are copied
  // on the device into the step's own input buffers, which its CUDA graph replays); returns the
  // loss (all the forward's outputs, loss first, with OptimizerConfig::keep_forward_outputs),
  // computed before the update. Advances steps_done(). On a GPU the outputs are device tensors
  // that the next step overwrites, and may not be computed yet (read the loss with
  // take_losses()).
  std::vector<Tensor> step(const std::vector<Tensor>& data);
  // The losses (outputs[0]) of the steps since the last call, oldest first; waits for the
  // device.
  std::vector<double> take_losses();
  // The forward graph with the current params (no update), on data as step() takes it; returns every output
  // of the forward, as host tensors on every device. Under amp the forward runs in the step's
  // precision (the f32 master params are cast in the graph, as the step casts them).
  std::vector<Tensor> evaluate(const std::vector<Tensor>& data) const;
  // evaluate() without the wait and the host copies: the forward's outputs on the trainer's
  // device, enqueued on its stream. On a GPU they are the forward step's own buffers, which its
  // next run overwrites (copy them on the stream before); on the CPU fresh tensors, done when
  // this returns.
  std::vector<Tensor> evaluate_on_device(const std::vector<Tensor>& data) const;
  // Output `output` of the forward on `count` batches (batch(i): the data tensors of batch i, on
  // the host), as host tensors, one per batch. The batches are enqueued back to back, each
  // output copied into pinned host memory on the stream, and read after one wait at the end, so
  // the host makes batch i + 1 while the device runs batch i. Output 0 (the loss) runs a step
  // compiled for the loss alone, which stores no other output (a language model's logits).
  std::vector<Tensor> evaluate_batches(int64_t count, const std::function<std::vector<Tensor>(int64_t)>& batch,
                                       int output = 0) const;
  // The forward step's executor, compiled on first use: every output, or the loss alone.
  const Executor& eval_executor(bool loss_only = false) const;
  // Seconds spent compiling the forward steps so far (their first use).
  double eval_compile_seconds() const { return eval_compile_s_; }
  // Waits for every step enqueued so far, then throws the first data error a kernel recorded
  // (a label or index out of range: DeviceRuntime::check_kernel_errors). take_losses() and
  // evaluate() do the same.
  void synchronize() const;
  Device device() const { return executor_options_.device; }
  // The runtime of device(): its memory counters, its name.
  const DeviceRuntime& runtime() const { return *runtime_; }
  // The step's executor (its memory plan, device bytes, CUDA graph counters).
  const Executor& step_executor() const { return *step_.executor; }
  // The compiled training step (its program, pass records and phases: compile/report.h).
  const CompiledStep& compiled_step() const { return step_; }

  int64_t steps_done() const { return steps_done_; }
  double current_lr() const { return learning_rate(config_, steps_done_); }
  const OptimizerConfig& config() const { return config_; }
  const StepProgram& program() const { return step_.program; }  // after the pipeline
  const std::vector<PassRecord>& pass_records() const { return step_.pass_records; }
  // Where construction's time went, in order: compile_step's phases ("training graph",
  // "passes", "kernel choice", "kernels prepared", "memory plan"), then "upload" (params and
  // state to the device).
  const std::vector<std::pair<std::string, double>>& build_seconds() const { return build_seconds_; }
  // Param and state tensors by graph-input name ("h0.attn.weight", "opt.m.wte", "opt.step"),
  // on the trainer's device (writing them changes the trainer's state).
  std::map<std::string, Tensor> named_tensors() const;
  std::vector<Tensor> params() const;
  // The same, copied to the host (waits for the device).
  std::map<std::string, Tensor> host_tensors() const;
  // Whether this rank holds only a shard of param or state `name` (zero1/2/3's optimizer state,
  // zero3's params too).
  bool holds_shard(const std::string& name) const { return sharded_.count(name) > 0; }
  // Param or state `name` at its full shape, where named_tensors() has it: the tensor itself
  // where this rank holds it whole, else a new device tensor gathered from every rank's shards
  // (every rank must call it for the same names in the same order; it waits for the gather).
  Tensor full_tensor(const std::string& name) const;
  // Copies `value` (the full shape; on the host or the trainer's device) into param or state
  // `name`: this rank's shard of it where it holds a shard. Waits for the copy (`value` may go
  // when it returns). Throws kiln::Error on an unknown name or another type.
  void assign(const std::string& name, const Tensor& value);
  // Before the first step: param or state `name` starts at host `value` (same type) instead of
  // what the constructor gave it (zeros for state): an imported model's own state, such as
  // BatchNorm's running statistics. Throws kiln::Error on an unknown name, another type, a
  // sharded tensor or a trainer that has stepped.
  void set_initial_value(const std::string& name, const Tensor& value);
  // Before the first step: param or state `name` lives in `storage` from now on (same type, on
  // the trainer's device), without a copy, and the steps update it there: for a caller that owns
  // the memory (the Python package trains a torch module's own tensors). Its current value
  // becomes the starting one. Throws as set_initial_value does.
  void adopt(const std::string& name, const Tensor& storage);
  // Bytes of params and state (what the trainer keeps on its device besides the executors').
  size_t param_and_state_bytes() const;

  // Checkpoint: every param and state tensor, the step count and `metadata`, in safetensors,
  // written atomically. In a group, each rank writes its own tensors (its shards, for the
  // sharded modes) with the world size, rank and shard mode in the metadata.
  void save(const std::string& path, std::map<std::string, std::string> metadata = {}) const;
  // Every param and state tensor at its full shape (shards gathered from every rank), written
  // by rank 0 alone; every rank must call it (it communicates). A single process writes what
  // save() writes. The params are plain tensors under their names, readable by any safetensors
  // reader; load() takes the file in a group of any size and mode.
  void save_consolidated(const std::string& path, std::map<std::string, std::string> metadata = {}) const;
  // Loads a checkpoint: one file (a single process's or a consolidated one), or every rank's
  // file of a group, in rank order (checkpoint/reshard.h), written at any world size and shard
  // mode: this rank takes its part of each tensor. Checks names, types and shapes before
  // touching anything. Returns the (first file's) metadata.
  std::map<std::string, std::string> load(const std::vector<std::string>& paths);
  std::map<std::string, std::string> load(const std::string& path) { return load(std::vector<std::string>{path}); }
  // `value` reduced over the group's ranks (the communicator, on the trainer's stream; every
  // rank must call it): a metric's sum, a peak's max. A single process returns `value`.
  double reduce_over_ranks(double value, ReduceOp op = ReduceOp::kSum) const;
  // A group's rank and size (0 and 1 for a single process).
  int rank() const;
  int world_size() const;
  const ShardingOptions& sharding() const { return sharding_; }

 private:
  // Graph input `i` (a param, state, data or lr buffer) where the step wants it, holding `host`'s
  // values (zeros when undefined): on the device, or pinned host memory for offloaded state.
  Tensor placed(size_t i, const Tensor& host) const;
  // A host copy of a param or state tensor, wherever it lives.
  Tensor host_copy(const Tensor& t) const;
  // The forward step's inputs for `data` (host or device tensors): the step's params and
  // state, and its data buffers, into which `data` is copied (on the stream, after the steps
  // that read them); on the CPU `data` itself.
  std::vector<Tensor> eval_inputs(const std::vector<Tensor>& data) const;
  // Copies `data` into the step's input buffers `buffers` on the stream: host tensors through
  // the uploader, tensors of the device on the device.
  void copy_in(const std::vector<Tensor>& data, const std::vector<Tensor>& buffers) const;
  // Checks data tensor `index` of a step's or evaluation's `data` (`what`) against the step.
  void check_data(const Tensor& data, size_t index, const char* what) const;

  // A param or state tensor's full type where this rank holds a shard of it (zero1/2's optimizer
  // state, zero3's params too), by name; absent: held whole.
  std::map<std::string, TensorType> sharded_;

  OptimizerConfig config_;
  ShardingOptions sharding_;
  Graph forward_;
  ExecutorOptions executor_options_;
  PassOptions pass_options_;
  // Declared before the executors, so they outlive them (the executors wait for the stream when
  // destroyed): one stream for steps, evaluation and copies.
  std::unique_ptr<DeviceRuntime> runtime_;
  std::unique_ptr<DeviceStream> stream_;
  CompiledStep step_;
  // The forward steps, compiled at first use: every output, and the loss alone.
  mutable std::unique_ptr<CompiledStep> eval_, loss_eval_;
  mutable double eval_compile_s_ = 0;
  mutable Tensor eval_slots_;  // pinned host memory evaluate_batches() copies outputs into
  // Training-graph inputs, on the device: params and state, and buffers for the data and lr that
  // each step's values are copied into.
  std::vector<Tensor> inputs_;
  int64_t steps_done_ = 0;
  std::vector<std::pair<std::string, double>> build_seconds_;
  std::vector<double> losses_;  // taken losses not yet returned by take_losses()
  // Staging for the batch and lr; pinned host slots the losses are copied into.
  std::unique_ptr<DeviceUploader> uploader_;
  Tensor loss_slots_;  // pinned, kLossSlots scalars of 8 bytes each
  Tensor loss_slot(int64_t k) const;
  TensorType loss_type_;
  int64_t pending_losses_ = 0;   // slots written since the last read
  static constexpr int64_t kLossSlots = 1024;
};

}  // namespace kiln::train
