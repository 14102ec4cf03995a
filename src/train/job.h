// A training job: what `kiln train` runs, in the library so that tests can run small jobs. It
// resolves --device/--amp auto, joins the launcher's group, makes the task (tasks.h: the model
// and its data), and trains it in a session (session.h: the loop, evaluation, metrics,
// checkpoints, resuming).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "compile/training_graph.h"
#include "passes/pass.h"
#include "train/placement.h"
#include "train/session.h"
#include "train/tasks.h"

namespace kiln::train {

// The task's options (model, data, batch, sizes, seed, eval batches) and the run's.
struct JobOptions : TaskOptions {
  int64_t steps = 1000;
  OptimizerConfig optimizer;
  PassOptions passes;                 // the pipeline's: memory budget, logits chunks, disabled passes
  std::string device = "cpu";         // cpu | cuda | auto (choose_device); optimizer.amp may be "auto" too
  // Under a launcher (kiln launch, torchrun: WORLD_SIZE set) this process is one rank of a
  // data-parallel group; `batch` is the global batch, of which each rank trains its rows.
  std::string shard = "auto";         // dp | zero1 | zero2 | zero3 | auto (choose_shard_mode)
  std::string init_from = "";         // params by name from this safetensors file (kiln import-hf's) instead of random
  std::string checkpoint_dir = "";    // "" = no checkpoints (in a group: one file per rank)
  bool consolidate = false;           // in a group, also write checkpoint_dir/consolidated.safetensors
  bool resume = false;                // continue from checkpoint_dir's newest checkpoint (any world size)
  int64_t eval_every = 0;             // 0 = only at the end
  int64_t log_every = 50;             // plain log line interval (not on a terminal); on cuda
                                      // also how often the loss is read back from the device
  std::string metrics_path = "";      // JSON lines appended here; "" = none. In a group rank 0's
  bool metrics_all_ranks = false;     // in a group, rank R > 0 also appends its own to METRICS.rank<R>
  std::FILE* out = stdout;            // progress and summary
};

using JobResult = TrainResult;

// Throws kiln::Error on bad options, missing data, a shape that does not fit, or a non-finite
// loss (the message names the step; the last good checkpoint is kept).
JobResult run_training_job(const JobOptions& options);

}  // namespace kiln::train
