// The training session: the one place that turns a model (a forward graph and its starting
// values: a zoo model, IR text, an ONNX file, a captured PyTorch graph), the optimizer, the
// device/amp/shard options and a process group into a Trainer (trainer.h: the compiled step
// below it), and that owns what happens around the steps: the loop over a dataset with
// progress lines, evaluation, metrics (JSON lines, rank 0's), checkpoints (writing, resuming,
// a launcher's restart) and the wall-time breakdown. `kiln train` (job.h), `kiln bench`
// (bench.h), `kiln step` and the Python package are faces over it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "compile/training_graph.h"
#include "device/device_runtime.h"
#include "ir/graph.h"
#include "passes/pass.h"
#include "runtime/executor.h"
#include "support/stopwatch.h"
#include "tensor/tensor.h"

namespace kiln {
class ProcessGroup;
}

namespace kiln::train {

class Trainer;

// Draws a model's initial params, in graph order: whole, or with world > 1 (a zero3 rank) only
// rank `rank`'s shards (models::init_param_shards' layout). A draw that cannot shard returns
// them whole: the trainer takes a zero3 param either way.
using ParamDraw = std::function<std::vector<Tensor>(int world, int rank)>;

// A model to train: its forward graph (loss first among the outputs) and where its params and
// state start.
struct Model {
  Graph forward;
  std::vector<Tensor> params;                   // the forward's params, in graph order
  std::map<std::string, Tensor> initial_state;  // state starting elsewhere than 0 (BatchNorm's)
  // Instead of `params`, where they are drawn fresh (a zoo model from its seed): the session
  // draws them on another thread while the step compiles (tasks.h's zoo_param_draw).
  ParamDraw draw_params;
};
// A model whose params and state start from `values` by graph-input name (an ONNX file's
// initializers, a captured module's tensors); a param `values` lacks starts at zeros (a program
// parsed from a checkpoint gets its values from the checkpoint next).
Model model_from_values(Graph forward, const std::map<std::string, Tensor>& values);

struct SessionOptions {
  std::string device = "cpu";  // cpu | cuda (choose_device resolves "auto" before)
  // In a group: none | auto | dp | zero1 | zero2 | zero3 (choose_shard_mode); alone: none or auto.
  std::string shard = "none";
  OptimizerConfig optimizer;   // amp in it: off | bf16 | f16
  PassOptions passes;
  // Dialects, CUDA graphs, GEMM tuning, profiling; the device and communicator are the session's.
  ExecutorOptions executor;
  // What else every rank must agree on besides the compiled step (model name, batch, sizes),
  // checked in a group before the first step.
  std::string agreement;
  // Called once the shard mode is chosen, before the (slow) compile, so that a face can say
  // where it runs first.
  std::function<void(const std::string& shard, const std::string& note)> on_placed;
};

// What a dataset gives the loop.
struct Evaluation {
  std::string name;  // "accuracy", "perplexity", "loss"
  double value = 0;
  int64_t batches = 0;  // how many batches it ran
};
struct TrainingData {
  // The data inputs of step `step` (in graph order; in a group this rank's rows). Runs on the
  // loader thread, one step ahead.
  std::function<std::vector<Tensor>(int64_t step)> batch;
  // The held-out metric with the trainer's current params; empty: the loop does not evaluate.
  std::function<Evaluation(const Trainer&)> evaluate;
  std::string description;  // "mlp on Fashion-MNIST (60000 train / 10000 test images)"
  int64_t global_batch = 0;
  uint64_t seed = 0;        // of the data order (printed)
  int64_t items_per_step = 0;
  std::string item_name = "samples";  // "samples" or "tokens"
};

struct CheckpointOptions {
  std::string dir;           // "" = none; DIR/last.safetensors, in a group one file per rank
  bool consolidate = false;  // in a group, also DIR/consolidated.safetensors
  bool resume = false;       // from dir's newest checkpoint (written by any world size)
  // Written into every checkpoint; on resume "kiln.model" must match the checkpoint's.
  std::map<std::string, std::string> metadata;
};

struct LoopOptions {
  int64_t steps = 1000;   // the total, counted from step 0 (a resumed run does the rest)
  int64_t eval_every = 0;  // 0 = only at the end
  int64_t log_every = 50;  // plain log line interval (not on a terminal); on cuda also how
                           // often the loss is read back from the device
  // JSON lines appended here; "" = none. In a group rank 0 writes it; with metrics_all_ranks
  // every other rank R writes its own FILE.rank<R> too (their losses are the group's mean as
  // rank 0's, their evaluation and rates their own).
  std::string metrics_path;
  bool metrics_all_ranks = false;
  CheckpointOptions checkpoints;
  std::FILE* out = stdout;  // progress and summary (a rank other than 0: /dev/null)
  double setup_seconds = 0;  // the face's wall time before the session (device, data, model)
};

struct TrainResult {
  int64_t steps_done = 0;
  double final_loss = 0;
  std::vector<double> losses;  // every step's this run made, in order
  double eval_metric = 0;  // classifiers: test accuracy in [0, 1]; LMs: perplexity
  std::string eval_name;   // "accuracy", "perplexity" or "loss"
  std::string device, amp;  // what ran (after choose_device)
  int world_size = 1;
  std::string shard = "none";  // what ran (after choose_shard_mode)
  int64_t evaluations = 0;  // how many times the loop evaluated
  int64_t eval_batches = 0;  // batches the last evaluation ran
  // Where the wall time went (seconds): the whole run; before the session (device, data, model,
  // init); the trainer's construction (compile_step, upload) and a resumed checkpoint's load;
  // the run's start to the end of its first step; the steps (the loop without evaluation and
  // checkpoints); evaluation (its compile at first use included); saving checkpoints.
  double seconds = 0;
  double setup_seconds = 0, compile_seconds = 0, first_step_seconds = 0;
  double step_seconds = 0, eval_seconds = 0, checkpoint_seconds = 0;
  // Of compile_seconds, the time the compiled step waited for params drawn beside it (0 when the
  // draw finished first, or the params were given).
  double params_wait_seconds = 0;
  // Seconds per step after the warm-up (from the first progress point after the first steps, on
  // CUDA three: direct, GEMM tuning, capture); 0 when no progress point came after it.
  double steady_step_seconds = 0;
};

class TrainingSession {
 public:
  // Builds the trainer for `model` on options.device: the shard mode over `group` (null alone;
  // a group outlives the session), the pass options for the group and device, the model's own
  // state; in a group every rank checks that all compiled the same step. Throws kiln::Error.
  TrainingSession(Model model, SessionOptions options, ProcessGroup* group = nullptr);
  ~TrainingSession();

  Trainer& trainer() { return *trainer_; }
  const Trainer& trainer() const { return *trainer_; }
  ProcessGroup* group() const { return group_; }  // null alone, or when "auto" chose no sharding
  const std::string& shard() const { return shard_; }            // the mode that runs
  const std::string& shard_note() const { return shard_note_; }  // which and why

  // Every tensor whole (shards gathered from every rank; every rank must call it), written by
  // rank 0; returns on every rank once the file is there, so that a group of any size, or one
  // process, can load it at once.
  void save_consolidated(const std::string& path, const std::map<std::string, std::string>& metadata) const;
  // A checkpoint of one file or of every rank's files (any world size and shard mode:
  // Trainer::load); returns its metadata.
  std::map<std::string, std::string> load(const std::vector<std::string>& paths);

  // Trains to loop.steps on `data` (from the trainer's steps_done(), which a resumed checkpoint
  // sets): prints the progress, evaluates every eval_every steps and at the end (then
  // checkpoints), appends metrics, and returns what ran and where the time went. Throws
  // kiln::Error on a non-finite loss (naming the step; the last good checkpoint is kept).
  TrainResult train(const TrainingData& data, const LoopOptions& loop);

 private:
  Stopwatch since_made_;
  SessionOptions options_;
  ProcessGroup* group_ = nullptr;
  std::string shard_ = "none", shard_note_;
  std::unique_ptr<DeviceRuntime> runtime_;
  std::unique_ptr<Trainer> trainer_;
  double build_seconds_ = 0;
  bool params_drawn_ = false;  // by Model::draw_params, beside the compile
};

// "1m05s", "2h03m", "42s"; "?" for a negative or non-finite time.
std::string format_duration(double seconds);

}  // namespace kiln::train
