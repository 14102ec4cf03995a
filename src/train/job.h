// A training job: what `kiln train` runs. Picks the model and data, builds the trainer, runs
// the loop with a data-prefetch thread, prints progress, appends metrics as JSON lines, evaluates,
// checkpoints, resumes, and stops cleanly on a non-finite loss. Kept in the library (not the CLI)
// so tests can run small jobs.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "train/optimizer.h"

namespace kiln::train {

struct JobOptions {
  std::string model = "mlp";          // mlp | cnn | gpt2-tiny | gpt2 | gpt2-medium
  std::string data = "";             // fashion-mnist (classifiers) | a text or .tok file (LMs); "" = the model's default
  std::string data_dir = "";          // Fashion-MNIST directory; "" = the Debian package's
  int64_t steps = 1000;
  int64_t batch = 64;
  int64_t seq = 0;                    // LM sequence length; 0 = the config's
  OptimizerConfig optimizer;
  uint64_t seed = 0;
  std::string device = "cpu";
  std::string checkpoint_dir = "";    // "" = no checkpoints
  bool resume = false;                // continue from checkpoint_dir/last.safetensors
  int64_t eval_every = 0;             // 0 = only at the end
  int64_t log_every = 50;             // plain log line interval (not on a terminal)
  std::string metrics_path = "";      // JSON lines appended here; "" = none
  int64_t eval_batches = 0;           // LM eval batches; 0 = 10. Classifiers use the whole test set.
  std::FILE* out = stdout;            // progress and summary
};

struct JobResult {
  int64_t steps_done = 0;
  double final_loss = 0;
  double eval_metric = 0;  // classifiers: test accuracy in [0, 1]; LMs: perplexity
  std::string eval_name;   // "accuracy" or "perplexity"
  double seconds = 0;
};

// Throws kiln::Error on bad options, missing data, a shape that does not fit, or a non-finite
// loss (the message names the step; the last good checkpoint is kept).
JobResult run_training_job(const JobOptions& options);

}  // namespace kiln::train
